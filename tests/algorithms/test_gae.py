"""GAE: hand-derived examples, mask semantics, and the fast paths (numba, scan, matrix) against the reference loop.

Legend: B batch rows, T time (tokens).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfuse.algorithms import compute_gae, compute_gae_loop, compute_gae_matrix
from rlhfuse.algorithms.gae import (
    STEPS_MAX_TOKENS,
    compute_gae_numba,
    compute_gae_scan,
    compute_gae_steps,
    numba_available,
)

needs_numba = pytest.mark.skipif(not numba_available(), reason="numba is not installed")

GAE_IMPLEMENTATIONS = [
    pytest.param(compute_gae_loop, id="loop"),
    pytest.param(lambda *a: compute_gae_matrix(*a, chunk_size=2), id="matrix-chunk2"),
    pytest.param(compute_gae_scan, id="scan"),
    pytest.param(lambda *a: compute_gae_scan(*a, chunk_size=2), id="scan-chunk2"),
    pytest.param(compute_gae_numba, id="numba", marks=needs_numba),
    pytest.param(compute_gae_steps, id="steps"),
    pytest.param(compute_gae, id="dispatch"),
]


EVERY_GAE = (
    compute_gae_loop,
    compute_gae_matrix,
    compute_gae_scan,
    compute_gae_numba,
    compute_gae_steps,
    compute_gae,
)
"""Every implementation and the dispatch, each with its defaults: the input checks and empty shapes hold for all."""


@pytest.mark.parametrize("gae", GAE_IMPLEMENTATIONS)
def test_three_token_example_by_hand(gae):
    # γ = 0.9, λ = 0.5, γλ = 0.45; r = [0, 0, 1], V = [0.5, 0.4, 0.3], all valid.
    # δ2 = 1 − 0.3 = 0.7 (last token: no bootstrap)
    # δ1 = 0 + 0.9·0.3 − 0.4 = −0.13
    # δ0 = 0 + 0.9·0.4 − 0.5 = −0.14
    # A2 = 0.7;  A1 = −0.13 + 0.45·0.7 = 0.185;  A0 = −0.14 + 0.45·0.185 = −0.05675
    # R = A + V = [0.44325, 0.585, 1.0]
    rewards_BT = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values_BT = torch.tensor([[0.5, 0.4, 0.3]], dtype=torch.float64)
    mask_BT = torch.ones(1, 3)
    advantages_BT, returns_BT = gae(rewards_BT, values_BT, mask_BT, 0.9, 0.5)
    torch.testing.assert_close(advantages_BT, torch.tensor([[-0.05675, 0.185, 0.7]], dtype=torch.float64))
    torch.testing.assert_close(returns_BT, torch.tensor([[0.44325, 0.585, 1.0]], dtype=torch.float64))


@pytest.mark.parametrize("gae", GAE_IMPLEMENTATIONS)
def test_interior_hole_is_skipped_and_its_reward_ignored(gae):
    # mask = [1, 0, 1]: the middle token (e.g. tool output) has V = 9 and r = 5, both must be ignored.
    # Valid tokens a (t=0) and b (t=2); γ = 0.9, γλ = 0.45.
    # δ_b = 1 − 0.3 = 0.7;  δ_a = 0 + 0.9·V_b − 0.5 = 0.27 − 0.5 = −0.23   (V_next(a) = V_b, not the hole's 9)
    # A_b = 0.7;  A_a = −0.23 + 0.45·0.7 = 0.085;  A_hole = 0
    # R = [0.085 + 0.5, 0, 0.7 + 0.3] = [0.585, 0, 1.0]
    rewards_BT = torch.tensor([[0.0, 5.0, 1.0]], dtype=torch.float64)
    values_BT = torch.tensor([[0.5, 9.0, 0.3]], dtype=torch.float64)
    mask_BT = torch.tensor([[True, False, True]])
    advantages_BT, returns_BT = gae(rewards_BT, values_BT, mask_BT, 0.9, 0.5)
    torch.testing.assert_close(advantages_BT, torch.tensor([[0.085, 0.0, 0.7]], dtype=torch.float64))
    torch.testing.assert_close(returns_BT, torch.tensor([[0.585, 0.0, 1.0]], dtype=torch.float64))


@pytest.mark.parametrize("gae", GAE_IMPLEMENTATIONS)
def test_left_and_right_padding_and_empty_row(gae):
    # Row 0: right padding, row 1: left padding of the same 2-token response, row 2: nothing valid.
    # Both responses: r = [0, 2], V = [1, 1], γ = λ = 1: δ1 = 2 − 1 = 1, δ0 = 0 + 1 − 1 = 0, A = [1, 1].
    rewards_BT = torch.tensor([[0.0, 2.0, 7.0], [7.0, 0.0, 2.0], [1.0, 1.0, 1.0]])
    values_BT = torch.tensor([[1.0, 1.0, 3.0], [3.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    mask_BT = torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 0]])
    advantages_BT, returns_BT = gae(rewards_BT, values_BT, mask_BT, 1.0, 1.0)
    torch.testing.assert_close(
        advantages_BT, torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    )
    torch.testing.assert_close(returns_BT, torch.tensor([[2.0, 2.0, 0.0], [0.0, 2.0, 2.0], [0.0, 0.0, 0.0]]))


@st.composite
def gae_problems(draw):
    B = draw(st.integers(1, 5))
    T = draw(st.integers(1, 70))
    chunk_size = draw(st.integers(1, max(1, T - 1)))  # smaller than T whenever T > 1: chunking is exercised
    seed = draw(st.integers(0, 2**31 - 1))
    keep_prob = draw(st.sampled_from([0.0, 0.3, 0.7, 0.9, 1.0]))
    empty_row = draw(st.booleans())
    gamma = draw(st.floats(0.0, 1.0))
    lam = draw(st.floats(0.0, 1.0))
    generator = torch.Generator().manual_seed(seed)
    rewards_BT = torch.randn(B, T, generator=generator, dtype=torch.float64)
    values_BT = torch.randn(B, T, generator=generator, dtype=torch.float64)
    mask_BT = torch.rand(B, T, generator=generator) < keep_prob
    if empty_row:
        mask_BT[torch.randint(B, (1,), generator=generator)] = False
    return rewards_BT, values_BT, mask_BT, gamma, lam, chunk_size


@settings(max_examples=80, deadline=None)
@given(gae_problems())
def test_matrix_form_matches_loop(problem):
    rewards_BT, values_BT, mask_BT, gamma, lam, chunk_size = problem
    expected_advantages_BT, expected_returns_BT = compute_gae_loop(rewards_BT, values_BT, mask_BT, gamma, lam)
    advantages_BT, returns_BT = compute_gae_matrix(
        rewards_BT, values_BT, mask_BT, gamma, lam, chunk_size=chunk_size
    )
    torch.testing.assert_close(advantages_BT, expected_advantages_BT, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(returns_BT, expected_returns_BT, rtol=1e-5, atol=1e-5)
    assert bool((advantages_BT[~mask_BT] == 0).all()) and bool((returns_BT[~mask_BT] == 0).all())


@settings(max_examples=40, deadline=None)
@given(gae_problems())
def test_float32_matrix_form_matches_float64_loop(problem):
    rewards_BT, values_BT, mask_BT, gamma, lam, chunk_size = problem
    expected_BT, expected_returns_BT = compute_gae_loop(rewards_BT, values_BT, mask_BT, gamma, lam)
    advantages_BT, returns_BT = compute_gae_matrix(
        rewards_BT.float(), values_BT.float(), mask_BT, gamma, lam, chunk_size=chunk_size
    )
    assert advantages_BT.dtype == torch.float32
    torch.testing.assert_close(advantages_BT.double(), expected_BT, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(returns_BT.double(), expected_returns_BT, rtol=1e-5, atol=1e-5)


def test_float32_matches_float64_loop():
    generator = torch.Generator().manual_seed(0)
    rewards_BT = torch.randn(3, 300, generator=generator)
    values_BT = torch.randn(3, 300, generator=generator)
    mask_BT = torch.rand(3, 300, generator=generator) < 0.9
    expected_BT, _ = compute_gae_loop(rewards_BT.double(), values_BT.double(), mask_BT, 0.99, 0.95)
    advantages_BT, _ = compute_gae_matrix(rewards_BT, values_BT, mask_BT, 0.99, 0.95, chunk_size=64)
    assert advantages_BT.dtype == torch.float32
    torch.testing.assert_close(advantages_BT.double(), expected_BT, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gae", GAE_IMPLEMENTATIONS)
def test_masked_positions_may_hold_garbage(gae):
    # Padding often holds uninitialised or inf values; they must not leak into valid tokens.
    rewards_BT = torch.tensor([[1.0, float("nan"), 1.0]])
    values_BT = torch.tensor([[0.0, float("inf"), 0.0]])
    mask_BT = torch.tensor([[1, 0, 1]])
    advantages_BT, returns_BT = gae(rewards_BT, values_BT, mask_BT, 1.0, 1.0)
    # γ = λ = 1, V = 0: A_2 = 1, A_0 = 1 + A_2 = 2.
    torch.testing.assert_close(advantages_BT, torch.tensor([[2.0, 0.0, 1.0]]))
    torch.testing.assert_close(returns_BT, torch.tensor([[2.0, 0.0, 1.0]]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gamma": 1.5}, "gamma must lie in"),
        ({"lam": -0.1}, "lam must lie in"),
        ({"mask_BT": torch.ones(2, 4)}, "mask_BT shape"),
        (
            {"rewards_BT": torch.zeros(()), "values_BT": torch.zeros(()), "mask_BT": torch.ones(())},
            "must be 2-D",
        ),
    ],
)
def test_invalid_inputs_name_the_problem(kwargs, message):
    arguments = {
        "rewards_BT": torch.zeros(2, 3),
        "values_BT": torch.zeros(2, 3),
        "mask_BT": torch.ones(2, 3),
        "gamma": 0.9,
        "lam": 0.9,
    } | kwargs
    for gae in EVERY_GAE:
        with pytest.raises(ValueError, match=message):
            gae(**arguments)


@pytest.mark.parametrize("shape", [(3, 0), (0, 5)])
def test_empty_batch_or_sequence(shape):
    zeros_BT = torch.zeros(shape)
    for gae in EVERY_GAE:
        advantages_BT, returns_BT = gae(zeros_BT, zeros_BT, zeros_BT.bool(), 0.9, 0.9)
        assert advantages_BT.shape == shape and returns_BT.shape == shape


# --- The fast paths: reverse-compacted cumulative sum (`compute_gae_scan`) and the compiled loop (numba). ---

FAST_PATHS = [
    pytest.param("scan", id="scan"),
    pytest.param("numba", id="numba", marks=needs_numba),
]


def _fast_gae(method, rewards_BT, values_BT, mask_BT, gamma, lam, chunk_size):
    if method == "scan":
        return compute_gae_scan(rewards_BT, values_BT, mask_BT, gamma, lam, chunk_size=chunk_size)
    return compute_gae_numba(rewards_BT, values_BT, mask_BT, gamma, lam)


@st.composite
def fast_gae_problems(draw, max_T=70):
    """Like `gae_problems`, plus γλ ∈ {0, 1} exactly, tiny and near-1 products, and any chunk cap (or none)."""
    rewards_BT, values_BT, mask_BT, gamma, lam, chunk_size = draw(gae_problems())
    if max_T > 70:  # long rows: redraw the tensors at a length where the scan must chain chunks
        T = draw(st.integers(71, max_T))
        generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        B = rewards_BT.shape[0]
        rewards_BT = torch.randn(B, T, generator=generator, dtype=torch.float64)
        values_BT = torch.randn(B, T, generator=generator, dtype=torch.float64)
        mask_BT = torch.rand(B, T, generator=generator) < draw(st.sampled_from([0.3, 0.9, 1.0]))
        chunk_size = draw(st.integers(1, T))
    gamma, lam = draw(
        st.sampled_from(
            [
                (gamma, lam),
                (1.0, 1.0),  # γλ = 1: plain suffix sums
                (gamma, 0.0),  # γλ = 0: A = δ
                (0.0, lam),  # γ = 0: A = r − V
                (1.0, lam),
                (0.99, 0.95),
                (0.5, 0.5),  # chunks of ~415 tokens without a cap
                (1e-3, 1.0),
                (1e-150, 1.0),  # chunks of 1 token without a cap
            ]
        )
    )
    chunk_size = draw(st.sampled_from([None, chunk_size]))
    return rewards_BT, values_BT, mask_BT, gamma, lam, chunk_size


def _garbage_at_masked(rewards_BT, values_BT, mask_BT):
    rewards_BT = rewards_BT.masked_fill(~mask_BT, float("nan"))
    values_BT = values_BT.masked_fill(~mask_BT, float("-inf"))
    return rewards_BT, values_BT


@pytest.mark.parametrize("method", FAST_PATHS)
@settings(max_examples=120, deadline=None)
@given(problem=fast_gae_problems())
def test_fast_path_matches_loop_float64(method, problem):
    rewards_BT, values_BT, mask_BT, gamma, lam, chunk_size = problem
    expected_BT, expected_returns_BT = compute_gae_loop(rewards_BT, values_BT, mask_BT, gamma, lam)
    advantages_BT, returns_BT = _fast_gae(
        method, *_garbage_at_masked(rewards_BT, values_BT, mask_BT), mask_BT, gamma, lam, chunk_size
    )
    assert advantages_BT.dtype == returns_BT.dtype == torch.float64
    torch.testing.assert_close(advantages_BT, expected_BT, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(returns_BT, expected_returns_BT, rtol=1e-10, atol=1e-10)
    assert bool((advantages_BT[~mask_BT] == 0).all()) and bool((returns_BT[~mask_BT] == 0).all())


@pytest.mark.parametrize("method", FAST_PATHS)
@settings(max_examples=60, deadline=None)
@given(problem=fast_gae_problems())
def test_fast_path_float32_matches_float64_loop(method, problem):
    rewards_BT, values_BT, mask_BT, gamma, lam, chunk_size = problem
    expected_BT, expected_returns_BT = compute_gae_loop(rewards_BT, values_BT, mask_BT, gamma, lam)
    advantages_BT, returns_BT = _fast_gae(
        method, rewards_BT.float(), values_BT.float(), mask_BT, gamma, lam, chunk_size
    )
    assert advantages_BT.dtype == returns_BT.dtype == torch.float32
    torch.testing.assert_close(advantages_BT.double(), expected_BT, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(returns_BT.double(), expected_returns_BT, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", FAST_PATHS)
@settings(max_examples=25, deadline=None)
@given(problem=fast_gae_problems(max_T=3000))
def test_fast_path_long_rows_match_loop(method, problem):
    # Long rows: without a cap the scan chains chunks for γλ ≤ 0.5, and for any γλ with a drawn cap.
    rewards_BT, values_BT, mask_BT, gamma, lam, chunk_size = problem
    expected_BT, expected_returns_BT = compute_gae_loop(rewards_BT, values_BT, mask_BT, gamma, lam)
    advantages_BT, returns_BT = _fast_gae(method, rewards_BT, values_BT, mask_BT, gamma, lam, chunk_size)
    torch.testing.assert_close(advantages_BT, expected_BT, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(returns_BT, expected_returns_BT, rtol=1e-9, atol=1e-9)
    advantages32_BT, _ = _fast_gae(
        method, rewards_BT.float(), values_BT.float(), mask_BT, gamma, lam, chunk_size
    )
    torch.testing.assert_close(advantages32_BT.double(), expected_BT, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("gamma", "lam"), [(0.99, 0.95), (1.0, 1.0), (0.5, 0.9), (1e-200, 1.0)])
def test_scan_chains_chunks_without_a_cap(gamma, lam):
    # T = 12000 > one chunk for γλ = 0.9405 (~9400 columns), 0.45 (~720) and 1e-200 (1): chaining without a cap.
    generator = torch.Generator().manual_seed(1)
    rewards_BT = torch.randn(2, 12_000, generator=generator, dtype=torch.float64)
    values_BT = torch.randn(2, 12_000, generator=generator, dtype=torch.float64)
    mask_BT = torch.rand(2, 12_000, generator=generator) < 0.8
    expected_BT, _ = compute_gae_loop(rewards_BT, values_BT, mask_BT, gamma, lam)
    advantages_BT, _ = compute_gae_scan(rewards_BT, values_BT, mask_BT, gamma, lam)
    torch.testing.assert_close(advantages_BT, expected_BT, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("method", FAST_PATHS)
def test_fast_path_handles_non_contiguous_low_precision_and_int_masks(method):
    generator = torch.Generator().manual_seed(2)
    rewards_TB = torch.randn(40, 3, generator=generator)
    values_TB = torch.randn(40, 3, generator=generator)
    mask_TB = (torch.rand(40, 3, generator=generator) < 0.8).int()
    expected_BT, _ = compute_gae_loop(rewards_TB.T, values_TB.T, mask_TB.T, 0.99, 0.95)
    advantages_BT, _ = _fast_gae(method, rewards_TB.T, values_TB.T, mask_TB.T, 0.99, 0.95, 8)
    torch.testing.assert_close(advantages_BT, expected_BT, rtol=1e-5, atol=1e-5)
    advantages_bf16_BT, returns_bf16_BT = _fast_gae(
        method, rewards_TB.T, values_TB.T.bfloat16(), mask_TB.T, 0.99, 0.95, None
    )
    assert advantages_bf16_BT.dtype == returns_bf16_BT.dtype == torch.bfloat16


def test_dispatch_picks_steps_then_numba_on_cpu_and_the_scan_under_autograd(monkeypatch):
    import rlhfuse.algorithms.gae as gae_module

    calls = []
    for name in ("compute_gae_numba", "compute_gae_steps", "compute_gae_scan", "compute_gae_matrix"):
        real = getattr(gae_module, name)
        monkeypatch.setattr(
            gae_module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
        )
    long = STEPS_MAX_TOKENS + 1
    rewards_BT, values_BT, mask_BT = torch.randn(2, long), torch.randn(2, long), torch.ones(2, long)
    compute_gae(rewards_BT, values_BT, mask_BT, 0.9, 0.9)
    assert calls == (["compute_gae_numba"] if numba_available() else ["compute_gae_scan"])
    calls.clear()
    compute_gae(rewards_BT[:, :STEPS_MAX_TOKENS], values_BT[:, :STEPS_MAX_TOKENS], mask_BT[:, :-1], 0.9, 0.9)
    assert calls == ["compute_gae_steps"]
    calls.clear()
    compute_gae(rewards_BT, values_BT.requires_grad_(), mask_BT, 0.9, 0.9)
    assert calls == ["compute_gae_scan"]
    calls.clear()
    compute_gae(rewards_BT, values_BT, mask_BT, 0.9, 0.9, method="matrix", chunk_size=2)
    assert calls == ["compute_gae_matrix"]
    with pytest.raises(ValueError, match="method must be one of"):
        compute_gae(rewards_BT, values_BT, mask_BT, 0.9, 0.9, method="fastest")


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_steps_give_the_numba_kernels_bits_without_numba(dtype):
    """compute_gae_steps is numba's recursion run as batched fp64 steps: the same bits for every mask, γλ and
    dtype (fp32 rows where numba rounds once from fp64; the twin: the fp32 loop, which accumulates in fp32,
    does not give them)."""
    generator = torch.Generator().manual_seed(0)
    differs = 0
    for B, T in ((1, 1), (3, 7), (5, 64), (9, 130)):
        rewards_BT, values_BT = (torch.randn(B, T, generator=generator).to(dtype) * 3 for _ in range(2))
        mask_BT = torch.rand(B, T, generator=generator) < 0.8
        rewards_BT, values_BT = _garbage_at_masked(rewards_BT, values_BT, mask_BT)
        for gamma, lam in ((0.99, 0.95), (1.0, 1.0), (0.9, 0.0), (0.5, 0.5)):
            expected = compute_gae_numba(rewards_BT, values_BT, mask_BT, gamma, lam)
            got = compute_gae_steps(rewards_BT, values_BT, mask_BT, gamma, lam)
            assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True)), (B, T, gamma, lam)
            assert got[0].dtype == dtype
            if dtype == torch.float32:
                loop = compute_gae_loop(rewards_BT, values_BT, mask_BT, gamma, lam)
                differs += not torch.equal(loop[0], expected[0])
    assert dtype != torch.float32 or differs > 0


def test_scan_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        compute_gae_scan(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), 0.9, 0.9, chunk_size=0)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_scan_row_blocks_match_one_block(monkeypatch, requires_grad):
    import rlhfuse.algorithms.gae as gae_module

    generator = torch.Generator().manual_seed(3)
    rewards_BT = torch.randn(7, 30, generator=generator, dtype=torch.float64)
    values_BT = torch.randn(7, 30, generator=generator, dtype=torch.float64, requires_grad=requires_grad)
    mask_BT = torch.rand(7, 30, generator=generator) < 0.8
    expected_BT, expected_returns_BT = compute_gae_loop(rewards_BT, values_BT, mask_BT, 0.9, 0.8)
    monkeypatch.setattr(gae_module, "_SCAN_BLOCK_ELEMENTS", 2 * 31)  # blocks of 2 rows, the last one 1 row
    advantages_BT, returns_BT = compute_gae_scan(rewards_BT, values_BT, mask_BT, 0.9, 0.8)
    torch.testing.assert_close(advantages_BT, expected_BT, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(returns_BT, expected_returns_BT, rtol=1e-10, atol=1e-10)
    if requires_grad:  # differentiable like the loop
        (gradient_BT,) = torch.autograd.grad((advantages_BT.sum() + returns_BT.square().sum()), values_BT)
        (expected_gradient_BT,) = torch.autograd.grad(
            (expected_BT.sum() + expected_returns_BT.square().sum()), values_BT
        )
        torch.testing.assert_close(gradient_BT, expected_gradient_BT, rtol=1e-10, atol=1e-10)


def test_scan_weights_stay_finite_for_any_float32_input():
    # γλ = 0.9405 over 9000 tokens: one chunk, weights up to ~10^239; fp32 rewards near the fp32 maximum.
    generator = torch.Generator().manual_seed(4)
    rewards_BT = torch.randn(2, 9000, generator=generator) * 1e37
    values_BT = torch.randn(2, 9000, generator=generator) * 1e37
    mask_BT = torch.rand(2, 9000, generator=generator) < 0.9
    expected_BT, _ = compute_gae_loop(rewards_BT.double(), values_BT.double(), mask_BT, 0.99, 0.95)
    advantages_BT, _ = compute_gae_scan(rewards_BT, values_BT, mask_BT, 0.99, 0.95)
    assert bool(torch.isfinite(advantages_BT).all())
    torch.testing.assert_close(advantages_BT.double() / 1e37, expected_BT / 1e37, rtol=1e-5, atol=1e-5)
