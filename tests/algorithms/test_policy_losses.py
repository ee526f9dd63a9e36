"""DAPO, GSPO and CISPO against their papers' formulas, written out here sequence by sequence on random tensors:
values, gradients (autograd of the direct form), masking (padding holding garbage) and the clip fractions by
side; DAPO's overlong penalty and dynamic-sampling filter by hand.

Legend: B batch rows, T time (tokens), n_b the valid tokens of row b.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhfuse.algorithms import (
    cispo_policy_loss,
    gspo_policy_loss,
    overlong_penalty,
    ppo_policy_loss,
    reduce_loss,
    sequence_log_ratio,
    varied_groups,
)

LENGTHS = [5, 1, 7, 3, 0, 6]  # valid tokens per row; row 4 is empty
T = 7


def _batch(seed: int, spread: float = 0.3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT) in float64, right-padded rows of `LENGTHS`, the
    log-ratios drawn with standard deviation `spread`; padding holds large finite garbage."""
    g = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    mask_BT = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    old_BT = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.1
    logprobs_BT = old_BT + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    advantages_BT = torch.randn(B, T, generator=g, dtype=torch.float64)
    garbage = mask_BT == 0
    logprobs_BT[garbage], old_BT[garbage], advantages_BT[garbage] = 50.0, -60.0, 1e6
    return logprobs_BT, old_BT, advantages_BT, mask_BT


def _rows(x_BT: torch.Tensor) -> list[torch.Tensor]:
    """Each row's valid tokens (the direct forms never look at padding)."""
    return [x_BT[b, :n] for b, n in enumerate(LENGTHS)]


def _aggregate(per_row: list[torch.Tensor], agg: str, length: int = 4) -> torch.Tensor:
    """The four aggregations of per-token losses, written out (an empty row is no sequence for the means of
    means, and one of B rows for the sums over sequences, as `reduce_loss` does)."""
    if agg == "token-mean":
        return torch.cat(per_row).sum() / sum(len(r) for r in per_row)
    if agg == "seq-mean-token-mean":
        means = [r.mean() for r in per_row if len(r)]
        return torch.stack(means).sum() / len(means)
    if agg == "seq-mean-token-sum":
        return torch.stack([r.sum() for r in per_row]).sum() / len(per_row)
    if agg == "seq-mean-token-sum-norm":
        return torch.stack([r.sum() / length for r in per_row]).sum() / len(per_row)
    raise AssertionError(agg)


REDUCTIONS = {
    "token-mean": ("token", None),
    "seq-mean-token-mean": ("sequence", None),
    "seq-mean-token-sum": ("sequence_sum", 1),
    "seq-mean-token-sum-norm": ("sequence_sum", 4),
}


def _dapo_direct(logprobs_BT, old_BT, advantages_BT, eps_low, eps_high, agg):
    """DAPO eq. 8 (negated): min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A) per token, aggregated."""
    per_row = []
    for lp, old, adv in zip(_rows(logprobs_BT), _rows(old_BT), _rows(advantages_BT), strict=True):
        r = torch.exp(lp - old)
        per_row.append(-torch.minimum(r * adv, torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv))
    return _aggregate(per_row, agg)


def _gspo_direct(logprobs_BT, old_BT, advantages_B, eps_low, eps_high):
    """GSPO §4 (negated), at sequence level: s_b = exp(mean_t log r_t), (1/B')·Σ_b −min(s_b·A_b, clip(s_b)·A_b)
    over the B' non-empty rows."""
    terms = []
    for lp, old, adv in zip(_rows(logprobs_BT), _rows(old_BT), advantages_B, strict=True):
        if not len(lp):
            continue
        s = torch.exp((lp - old).mean())
        terms.append(-torch.minimum(s * adv, torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv))
    return torch.stack(terms).mean()


def _cispo_direct(logprobs_BT, old_BT, advantages_BT, eps_low, eps_high, agg):
    """MiniMax-M1 eqs. 4–5 (negated): −sg(clip(r, 1 − ε_low, 1 + ε_high))·A·log π per token, aggregated."""
    per_row = []
    for lp, old, adv in zip(_rows(logprobs_BT), _rows(old_BT), _rows(advantages_BT), strict=True):
        weight = torch.clamp(torch.exp(lp - old), 1 - eps_low, 1 + eps_high).detach()
        per_row.append(-weight * adv * lp)
    return _aggregate(per_row, agg)


def _value_and_grad(fn, logprobs_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logprobs_BT.clone().requires_grad_(True)
    loss = fn(x)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad


@pytest.mark.parametrize("agg", list(REDUCTIONS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dapo_decoupled_clip_equals_eq_8_with_every_aggregation(seed, agg):
    logprobs_BT, old_BT, advantages_BT, mask_BT = _batch(seed)
    # tokens on each side of the decoupled range: r = 1.25 with A > 0 lies inside [0.8, 1.28] (a symmetric 0.2
    # would clip it), r = 1.4 with A > 0 beyond the high bound, r = 0.7 with A < 0 beyond the low one
    for (b, t), ratio, advantage in (((0, 0), 1.25, 1.0), ((2, 1), 1.4, 0.5), ((3, 2), 0.7, -2.0)):
        logprobs_BT[b, t] = old_BT[b, t] + math.log(ratio)
        advantages_BT[b, t] = advantage
    reduction, length = REDUCTIONS[agg]

    def ours(x, high=0.28):
        return ppo_policy_loss(
            x, old_BT, advantages_BT, mask_BT, clip_eps=0.2, clip_eps_high=high, reduction=reduction,
            constant_length=length,
        )[0]  # fmt: skip

    def direct(x):
        return _dapo_direct(x, old_BT, advantages_BT, 0.2, 0.28, agg)

    got, got_grad = _value_and_grad(ours, logprobs_BT)
    want, want_grad = _value_and_grad(direct, logprobs_BT)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    assert not got_grad[mask_BT == 0].any()  # padding gets no gradient
    assert got_grad[0, 0] != 0 and got_grad[2, 1] == 0 and got_grad[3, 2] == 0
    _, symmetric_grad = _value_and_grad(lambda x: ours(x, high=None), logprobs_BT)
    assert symmetric_grad[0, 0] == 0  # what clip-higher changes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_token_form_equals_the_sequence_level_objective(seed):
    logprobs_BT, old_BT, _, mask_BT = _batch(seed, spread=1e-3)
    advantages_B = torch.randn(
        len(LENGTHS), generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    advantages_BT = advantages_B[:, None].expand(-1, T).clone()
    advantages_BT[mask_BT == 0] = float("nan")  # garbage: never read

    got, got_grad = _value_and_grad(
        lambda x: gspo_policy_loss(x, old_BT, advantages_BT, mask_BT)[0], logprobs_BT
    )
    want, want_grad = _value_and_grad(
        lambda x: _gspo_direct(x, old_BT, advantages_B, 3e-4, 4e-4), logprobs_BT
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-15)
    assert not got_grad[mask_BT == 0].any()
    # both sides of the narrow range occur, and some sequences are not clipped
    s_B = torch.stack([torch.exp((lp - old).mean()) for lp, old in zip(_rows(logprobs_BT), _rows(old_BT))
                       if len(lp)])  # fmt: skip
    inside = (s_B >= 1 - 3e-4) & (s_B <= 1 + 4e-4)
    assert inside.any() and not inside.all()


def test_gspo_sequence_ratio_is_the_geometric_mean_on_every_token_with_the_token_gradient():
    # row 0: token ratios 2 and 8 -> s = sqrt(16) = 4 on both tokens; row 1: one token of ratio 0.5
    old_BT = torch.zeros(2, 3, dtype=torch.float64)
    logprobs_BT = torch.log(torch.tensor([[2.0, 8.0, 1.0], [0.5, 1.0, 1.0]], dtype=torch.float64))
    mask_BT = torch.tensor([[1, 1, 0], [1, 0, 0]])
    x = logprobs_BT.clone().requires_grad_(True)
    log_s_BT = sequence_log_ratio(x, old_BT, mask_BT != 0)
    torch.testing.assert_close(
        torch.exp(log_s_BT)[mask_BT == 1], torch.tensor([4.0, 4.0, 0.5], dtype=torch.float64)
    )
    # d/dx_t of Σ_t m_t·s_bt = s_b·m_t: each token's gradient is its sequence's ratio (GSPO-token, §4.3)
    (grad,) = torch.autograd.grad((torch.exp(log_s_BT) * mask_BT).sum(), x)
    torch.testing.assert_close(grad, torch.tensor([[4.0, 4.0, 0.0], [0.5, 0.0, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("agg", list(REDUCTIONS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cispo_equals_eqs_4_5_with_every_aggregation(seed, agg):
    logprobs_BT, old_BT, advantages_BT, mask_BT = _batch(seed, spread=0.5)
    reduction, length = REDUCTIONS[agg]
    got, got_grad = _value_and_grad(
        lambda x: cispo_policy_loss(
            x, old_BT, advantages_BT, mask_BT, clip_eps=0.2, clip_eps_high=0.28, reduction=reduction,
            constant_length=length,
        )[0],
        logprobs_BT,
    )  # fmt: skip
    want, want_grad = _value_and_grad(
        lambda x: _cispo_direct(x, old_BT, advantages_BT, 0.2, 0.28, agg), logprobs_BT
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    assert not got_grad[mask_BT == 0].any()


def test_cispo_keeps_the_gradient_of_every_token_that_ppo_clips():
    # ratios 1.5 (A = +1) and 0.5 (A = −1) are clipped by PPO (ε = 0.2): zero gradient there. CISPO's gradient of
    # −sg(r̂)·A·log π is −r̂·A on each token (÷2 for the token mean): r̂ = 1.28 and 0.8.
    logprobs_BT = torch.log(torch.tensor([[1.5, 0.5]], dtype=torch.float64)).requires_grad_(True)
    old_BT, advantages_BT, mask_BT = (
        torch.zeros(1, 2, dtype=torch.float64),
        torch.tensor([[1.0, -1.0]]),
        torch.ones(1, 2),
    )
    ppo, _ = ppo_policy_loss(
        logprobs_BT, old_BT, advantages_BT.double(), mask_BT, clip_eps=0.2, clip_eps_high=0.28
    )
    (ppo_grad,) = torch.autograd.grad(ppo, logprobs_BT)
    assert not ppo_grad.any()
    cispo, stats = cispo_policy_loss(
        logprobs_BT, old_BT, advantages_BT.double(), mask_BT, clip_eps=0.2, clip_eps_high=0.28
    )
    (cispo_grad,) = torch.autograd.grad(cispo, logprobs_BT)
    torch.testing.assert_close(cispo_grad, torch.tensor([[-1.28, 0.8]], dtype=torch.float64) / 2)
    assert float(stats.clip_fraction_low) == float(stats.clip_fraction_high) == 0.5
    assert float(stats.clip_fraction) == 1.0


def test_clip_fractions_by_side_by_hand():
    # ε_low = 0.2, ε_high = 0.3. PPO clips r = 1.5 with A > 0 (high) and r = 0.5 with A < 0 (low); r = 1.25 with
    # A > 0 is inside [0.8, 1.3]; r = 0.5 with A > 0 and r = 1.5 with A < 0 are not clipped (the min keeps r·A).
    # CISPO clips the weight whatever A: low r = 0.5 (2 tokens), high r = 1.5 (2 tokens). The 6th token is padding.
    logprobs_BT = torch.log(torch.tensor([[1.5, 0.5, 1.25, 0.5, 1.5, 9.0]], dtype=torch.float64))
    old_BT = torch.zeros_like(logprobs_BT)
    advantages_BT = torch.tensor([[1.0, -1.0, 1.0, 1.0, -1.0, 3.0]], dtype=torch.float64)
    mask_BT = torch.tensor([[1, 1, 1, 1, 1, 0]])
    _, ppo = ppo_policy_loss(logprobs_BT, old_BT, advantages_BT, mask_BT, clip_eps=0.2, clip_eps_high=0.3)
    assert (float(ppo.clip_fraction_low), float(ppo.clip_fraction_high), float(ppo.clip_fraction)) == (
        pytest.approx(1 / 5),
        pytest.approx(1 / 5),
        pytest.approx(2 / 5),
    )
    _, cispo = cispo_policy_loss(logprobs_BT, old_BT, advantages_BT, mask_BT, clip_eps=0.2, clip_eps_high=0.3)
    assert float(cispo.clip_fraction_low) == pytest.approx(2 / 5)
    assert float(cispo.clip_fraction_high) == pytest.approx(2 / 5)


def test_nan_and_inf_padding_changes_neither_value_nor_gradient():
    logprobs_BT, old_BT, advantages_BT, mask_BT = _batch(3)
    dirty = [t.clone() for t in (logprobs_BT, old_BT, advantages_BT)]
    pad = mask_BT == 0
    dirty[0][pad], dirty[1][pad], dirty[2][pad] = float("nan"), float("inf"), float("nan")
    for fn in (gspo_policy_loss, cispo_policy_loss):
        clean, clean_grad = _value_and_grad(
            lambda x, fn=fn: fn(x, old_BT, advantages_BT, mask_BT)[0], logprobs_BT
        )
        got, got_grad = _value_and_grad(lambda x, fn=fn: fn(x, dirty[1], dirty[2], mask_BT)[0], dirty[0])
        torch.testing.assert_close(got, clean)
        torch.testing.assert_close(got_grad, clean_grad)
        assert torch.isfinite(got_grad).all()


def test_sequence_sum_reduction_is_dr_grpo_with_a_constant_length():
    # (1/B)·Σ_b (1/L)·Σ_t l_bt with L = 4: rows [1, 2] and [3] -> ((1 + 2)/4 + 3/4)/2 = 0.75; L = 1: 3
    per_token_BT = torch.tensor([[1.0, 2.0], [3.0, 99.0]])
    valid_BT = torch.tensor([[True, True], [True, False]])
    assert float(reduce_loss(per_token_BT, valid_BT, "sequence_sum", 4)) == pytest.approx(0.75)
    assert float(reduce_loss(per_token_BT, valid_BT, "sequence_sum", 1)) == pytest.approx(3.0)


def test_overlong_penalty_is_eq_13_by_hand():
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then (6 − |y|)/4, −1 at 10; −1 beyond (scaled by 0.5)
    lengths_B = torch.tensor([3, 6, 7, 8, 10, 11])
    got = overlong_penalty(lengths_B, 10, 4, penalty=0.5)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    # a buffer of 1.6 tokens (a fraction of the limit): the ramp starts after 8.4 tokens
    assert overlong_penalty(torch.tensor([8, 9, 10]), 10, 1.6).tolist() == pytest.approx([0.0, -0.375, -1.0])
    with pytest.raises(ValueError, match="overlong buffer must be in"):
        overlong_penalty(lengths_B, 10, 11)


def test_varied_groups_marks_the_groups_whose_scores_differ():
    # groups 7 (1, 0: varied), 3 (1, 1: all right), 5 (0, 0, 0: all wrong), 9 (0.5 once: one sample)
    scores_B = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.5])
    group_B = torch.tensor([7, 3, 5, 5, 5, 3, 7, 9])
    assert varied_groups(scores_B, group_B).tolist() == [True, False, False, False, False, False, True, False]
    assert math.isclose(float((~varied_groups(scores_B, group_B)).sum()), 6.0)
