"""GAE: hand-derived examples, mask semantics, and the chunked matrix form against the reference loop.

Legend: B batch rows, T time (tokens).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfuse.algorithms import compute_gae, compute_gae_loop, compute_gae_matrix

GAE_IMPLEMENTATIONS = [
    pytest.param(compute_gae_loop, id="loop"),
    pytest.param(lambda *a: compute_gae_matrix(*a, chunk_size=2), id="matrix-chunk2"),
    pytest.param(compute_gae, id="dispatch"),
]


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


def test_masked_positions_may_hold_garbage():
    # Padding often holds uninitialised or inf values; they must not leak into valid tokens.
    rewards_BT = torch.tensor([[1.0, float("nan"), 1.0]])
    values_BT = torch.tensor([[0.0, float("inf"), 0.0]])
    mask_BT = torch.tensor([[1, 0, 1]])
    advantages_BT, returns_BT = compute_gae_matrix(rewards_BT, values_BT, mask_BT, 1.0, 1.0)
    # γ = λ = 1, V = 0: A_2 = 1, A_0 = 1 + A_2 = 2.
    torch.testing.assert_close(advantages_BT, torch.tensor([[2.0, 0.0, 1.0]]))
    torch.testing.assert_close(returns_BT, torch.tensor([[2.0, 0.0, 1.0]]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gamma": 1.5}, "gamma must lie in"),
        ({"lam": -0.1}, "lam must lie in"),
        ({"mask_BT": torch.ones(2, 4)}, "mask_BT shape"),
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
    for gae in (compute_gae_loop, compute_gae_matrix, compute_gae):
        with pytest.raises(ValueError, match=message):
            gae(**arguments)


@pytest.mark.parametrize("shape", [(3, 0), (0, 5)])
def test_empty_batch_or_sequence(shape):
    zeros_BT = torch.zeros(shape)
    for gae in (compute_gae_loop, compute_gae_matrix):
        advantages_BT, returns_BT = gae(zeros_BT, zeros_BT, zeros_BT.bool(), 0.9, 0.9)
        assert advantages_BT.shape == shape and returns_BT.shape == shape
