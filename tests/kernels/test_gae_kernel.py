"""Parity of the Triton GAE kernel (`kernels/gae.py`, run by the interpreter on CPU) with the PyTorch references.

Legend: B batch rows, T time (tokens).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfuse._resources import load_kernel_module
from rlhfuse.algorithms import compute_gae, compute_gae_loop


@pytest.fixture(scope="module")
def gae_kernel():
    return load_kernel_module("gae")


@pytest.mark.parametrize("block_t", [1, 2, 4])
def test_three_token_example_by_hand(gae_kernel, block_t):
    # Same arithmetic as tests/algorithms/test_gae.py: γ = 0.9, λ = 0.5 → A = [−0.05675, 0.185, 0.7].
    advantages_BT, returns_BT = gae_kernel.gae(
        torch.tensor([[0.0, 0.0, 1.0]]),
        torch.tensor([[0.5, 0.4, 0.3]]),
        torch.ones(1, 3),
        0.9,
        0.5,
        block_t=block_t,
    )
    torch.testing.assert_close(advantages_BT, torch.tensor([[-0.05675, 0.185, 0.7]]))
    torch.testing.assert_close(returns_BT, torch.tensor([[0.44325, 0.585, 1.0]]))


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 4),
    T=st.integers(1, 24),
    seed=st.integers(0, 2**31 - 1),
    keep_prob=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
    block_t=st.sampled_from([1, 4, 16, 256]),
)
def test_kernel_matches_loop_with_masks(gae_kernel, B, T, seed, keep_prob, gamma, lam, block_t):
    generator = torch.Generator().manual_seed(seed)
    rewards_BT = torch.randn(B, T, generator=generator)
    values_BT = torch.randn(B, T, generator=generator)
    mask_BT = torch.rand(B, T, generator=generator) < keep_prob
    mask_BT[0] = False if B > 1 else mask_BT[0]  # an all-masked row whenever there is room for one
    expected_advantages_BT, expected_returns_BT = compute_gae_loop(
        rewards_BT.double(), values_BT.double(), mask_BT, gamma, lam
    )
    advantages_BT, returns_BT = gae_kernel.gae(rewards_BT, values_BT, mask_BT, gamma, lam, block_t=block_t)
    assert advantages_BT.dtype == torch.float32
    torch.testing.assert_close(advantages_BT.double(), expected_advantages_BT, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(returns_BT.double(), expected_returns_BT, rtol=1e-5, atol=1e-5)


def test_interior_hole_across_tile_boundaries(gae_kernel):
    # mask [1, 0, 0, 1] with tiles of 2: the hole spans both tiles, so V_next(0) = V_3 and A_3 come from the
    # carry. γ = 0.9, γλ = 0.45, r = [0, 5, 5, 1], V = [0.5, 9, 9, 0.3] (hole values ignored):
    # A_3 = 1 − 0.3 = 0.7;  A_0 = (0 + 0.9·0.3 − 0.5) + 0.45·0.7 = −0.23 + 0.315 = 0.085
    advantages_BT, returns_BT = gae_kernel.gae(
        torch.tensor([[0.0, 5.0, 5.0, 1.0]]),
        torch.tensor([[0.5, 9.0, 9.0, 0.3]]),
        torch.tensor([[1, 0, 0, 1]]),
        0.9,
        0.5,
        block_t=2,
    )
    torch.testing.assert_close(advantages_BT, torch.tensor([[0.085, 0.0, 0.0, 0.7]]))
    torch.testing.assert_close(returns_BT, torch.tensor([[0.585, 0.0, 0.0, 1.0]]))


def test_kernel_handles_non_contiguous_and_bf16_inputs(gae_kernel):
    generator = torch.Generator().manual_seed(3)
    rewards_TB = torch.randn(9, 2, generator=generator)
    values_TB = torch.randn(9, 2, generator=generator)
    mask_TB = torch.rand(9, 2, generator=generator) < 0.7
    expected_BT, _ = compute_gae_loop(rewards_TB.T, values_TB.T, mask_TB.T, 0.99, 0.95)
    advantages_BT, _ = gae_kernel.gae(rewards_TB.T, values_TB.T, mask_TB.T, 0.99, 0.95, block_t=4)
    torch.testing.assert_close(advantages_BT, expected_BT)
    advantages_bf16_BT, _ = gae_kernel.gae(rewards_TB.T, values_TB.T.bfloat16(), mask_TB.T, 0.99, 0.95)
    assert advantages_bf16_BT.dtype == torch.bfloat16


def test_dispatch_forces_the_kernel_with_env_var(monkeypatch):
    import rlhfuse.algorithms.ops as ops

    loaded = []
    real_loader = ops.load_kernel_module

    def spy(name):
        loaded.append(name)
        return real_loader(name)

    monkeypatch.setattr(ops, "load_kernel_module", spy)
    rewards_BT, values_BT, mask_BT = torch.randn(2, 6), torch.randn(2, 6), torch.ones(2, 6)
    compute_gae(rewards_BT, values_BT, mask_BT, 0.9, 0.9)
    assert loaded == []  # CPU tensors, "auto": the PyTorch reference
    monkeypatch.setenv("RLHFUSE_FORCE_TRITON", "1")
    forced_BT, _ = compute_gae(rewards_BT, values_BT, mask_BT, 0.9, 0.9)
    assert loaded == ["gae"]
    torch.testing.assert_close(
        forced_BT, compute_gae(rewards_BT, values_BT, mask_BT, 0.9, 0.9, backend="torch")[0]
    )
    with pytest.raises(ValueError, match="backend must be one of"):
        compute_gae(rewards_BT, values_BT, mask_BT, 0.9, 0.9, backend="cuda")


def test_forcing_triton_on_cpu_without_the_interpreter_says_how_to_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    zeros_BT = torch.zeros(1, 2)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        compute_gae(zeros_BT, zeros_BT, zeros_BT, 0.9, 0.9, backend="triton")
