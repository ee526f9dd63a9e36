"""Critic-free advantages and the sequence_sum reduction against hand-derived values."""

import math

import pytest
import torch

from rlhfuse.algorithms import (
    discounted_returns,
    grpo_advantages,
    ppo_policy_loss,
    reduce_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_to_tokens,
    zero_std_fraction,
)


def test_grpo_normalises_within_each_group():
    # group 7: scores 1, 0 -> mean 0.5, unbiased std sqrt(0.5); group 3: equal scores -> std 0 -> 0
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([7, 7, 3, 3])
    a = grpo_advantages(scores, groups, eps=0.0 + 1e-6)
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert a.tolist() == pytest.approx([expected, -expected, 0.0, 0.0], abs=1e-6)


def test_grpo_three_samples_and_interleaved_groups():
    # group 0: 1, 2, 3 (mean 2, unbiased std 1); group 1: 4, 8 (mean 6, std 2*sqrt(2)), rows interleaved
    scores = torch.tensor([1.0, 4.0, 2.0, 8.0, 3.0])
    groups = torch.tensor([0, 1, 0, 1, 0])
    a = grpo_advantages(scores, groups, eps=0.0)
    s = 2 * math.sqrt(2)
    assert a.tolist() == pytest.approx([-1.0, -2 / s, 0.0, 2 / s, 1.0], abs=1e-6)


def test_dr_grpo_only_centres():
    a = grpo_advantages(torch.tensor([1.0, 0.0, 3.0]), torch.tensor([1, 1, 1]), std_norm=False)
    assert a.tolist() == pytest.approx([-1 / 3, -4 / 3, 5 / 3], abs=1e-6)


def test_grpo_lone_sample_gets_zero():
    a = grpo_advantages(torch.tensor([5.0, 1.0, 2.0]), torch.tensor([9, 1, 1]))
    assert a[0] == 0.0 and a[1] < 0 < a[2]


def test_rloo_leave_one_out():
    # 1 - (2+3)/2 = -1.5; 2 - (1+3)/2 = 0; 3 - (1+2)/2 = 1.5; group 2: 10 - 0 = 10, 0 - 10 = -10
    scores = torch.tensor([1.0, 2.0, 3.0, 10.0, 0.0])
    groups = torch.tensor([4, 4, 4, 2, 2])
    assert rloo_advantages(scores, groups).tolist() == pytest.approx([-1.5, 0.0, 1.5, 10.0, -10.0])


def test_rloo_needs_two_samples_per_group():
    with pytest.raises(ValueError, match=">= 2 samples per group"):
        rloo_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]))


def test_group_functions_check_shapes():
    with pytest.raises(ValueError, match="1-D shape"):
        grpo_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def test_discounted_returns_skip_masked_tokens():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [1.0, 9.0, 3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    # row 0: 1 + .5*2 + .25*3 = 2.75, 2 + .5*3 = 3.5, 3; row 1 skips the hole: 1 + .5*3 = 2.5, 0, 3
    assert discounted_returns(rewards, mask, 0.5).tolist() == [[2.75, 3.5, 3.0], [2.5, 0.0, 3.0]]


def test_reinforce_pp_normalises_returns_over_the_batch():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    advantages, returns = reinforce_pp_advantages(rewards, torch.ones(2, 2), gamma=1.0)
    assert returns.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    # mean 0.5, unbiased variance 4 * 0.25 / 3 = 1/3
    z = 0.5 / math.sqrt(1 / 3)
    assert advantages.flatten().tolist() == pytest.approx([z, z, -z, -z], abs=1e-6)


def test_sequence_to_tokens_fills_valid_tokens_only():
    out = sequence_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    assert out.tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]


def test_reductions_by_hand():
    per_token = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), 0.0]])
    valid = torch.tensor([[True, True, False], [True, False, False]])
    assert float(reduce_loss(per_token, valid, "token")) == pytest.approx(2.0)  # 6 / 3 tokens
    assert float(reduce_loss(per_token, valid, "sequence")) == pytest.approx(2.25)  # (1.5 + 3) / 2
    # (3 + 3) / (L=4 * 2 rows): every row divided by the same constant, however long it is
    assert float(reduce_loss(per_token, valid, "sequence_sum", 4)) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="constant_length > 0"):
        reduce_loss(per_token, valid, "sequence_sum")


def test_policy_loss_sequence_sum_on_policy():
    # ratio 1: L_t = -A_t; rows sum to -(2*1) and -(1*(-3)) = 3 -> (-2 + 3) / (5 * 2) = 0.1
    lp = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, _ = ppo_policy_loss(lp, lp, adv, mask, reduction="sequence_sum", constant_length=5)
    assert float(loss) == pytest.approx(0.1)


def test_group_advantages_are_centred_in_every_group():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(24, generator=g, dtype=torch.float64)
    groups = torch.randint(0, 5, (24,), generator=g) * 7  # any labels, interleaved, groups of any size >= 2
    groups[:10] = torch.arange(5).repeat(2) * 7  # every label at least twice
    for a in (grpo_advantages(scores, groups), grpo_advantages(scores, groups, std_norm=False)):
        assert a.dtype == torch.float64
        for label in groups.unique():
            assert float(a[groups == label].sum()) == pytest.approx(0.0, abs=1e-9)
    a = rloo_advantages(scores, groups)
    for label in groups.unique():
        n = int((groups == label).sum())
        centred = scores[groups == label] - scores[groups == label].mean()
        assert a[groups == label].tolist() == pytest.approx((n / (n - 1) * centred).tolist())


def test_zero_std_fraction_counts_groups_whose_samples_all_scored_alike():
    scores_B = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    group_B = torch.tensor([7, 7, 3, 3, 9, 9])
    assert zero_std_fraction(scores_B, group_B) == pytest.approx(2 / 3)
    assert zero_std_fraction(torch.tensor([0.0, 1.0]), torch.tensor([1, 1])) == 0.0
