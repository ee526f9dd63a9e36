"""Off-policy corrections (`rlhfuse.algorithms.off_policy`, algorithm.off_policy_correction): each one's weights
and kept tokens from the ratio π_old / π_sampler; a weight on the advantage is that weight on the token's loss
(gradient included) for every registered policy loss; no gap = no change, bit for bit; the training batch
carries the sampler's log-probs only when a correction reads them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhfuse.algorithms.off_policy import OFF_POLICY_CORRECTIONS, Bounds, correct
from rlhfuse.core import step_losses as losses
from rlhfuse.core.advantages import POLICY_LOSSES, AlgorithmConfig, compute_train_batch
from rlhfuse.core.types import Experience, Rollout, TrainBatch

BOUNDS = Bounds(cap=2.0, low=0.5, high=2.0)
# token ratios π_old / π_sampler of two responses; row 0's geometric mean is 1, row 1's is 4 (out of bounds)
RATIOS = torch.tensor([[0.25, 1.0, 4.0], [4.0, 4.0, 4.0]], dtype=torch.float64)
MASK = torch.ones(2, 3)


def _weights(name: str) -> tuple[list[list[float]], list[list[bool]], float, float]:
    weight, keep, mean, changed = correct(name, RATIOS.log(), torch.zeros_like(RATIOS), MASK, BOUNDS)
    return weight.flatten().tolist(), keep.tolist(), float(mean), float(changed)


def test_each_correction_weights_and_keeps_tokens_by_its_rule():
    assert _weights("none") == ([1.0] * 6, [[True] * 3] * 2, 1.0, 0.0)
    weight, keep, mean, changed = _weights("tis")  # truncated at the cap, nothing left out
    assert weight == pytest.approx([0.25, 1.0, 2.0, 2.0, 2.0, 2.0]) and all(map(all, keep))
    assert mean == pytest.approx(9.25 / 6) and changed == pytest.approx(4 / 6)
    weight, keep, mean, changed = _weights("token_mask")  # IcePop: out of [0.5, 2] leaves the loss
    assert keep == [[False, True, False], [False, False, False]] and weight[1] == pytest.approx(1.0)
    assert mean == pytest.approx(1 / 6) and changed == pytest.approx(5 / 6)
    weight, keep, mean, changed = _weights("sequence_mask")  # row 1's geometric mean 4 > 2: the whole row
    assert keep == [[True] * 3, [False] * 3] and weight == [1.0] * 3 + [0.0] * 3
    assert changed == pytest.approx(0.5)
    assert sorted(OFF_POLICY_CORRECTIONS) == ["auto", "none", "sequence_mask", "tis", "token_mask"]


@pytest.mark.parametrize(
    "config",
    [
        AlgorithmConfig(),
        AlgorithmConfig(dual_clip=3.0),
        AlgorithmConfig(policy_loss="cispo", clip_eps_high=5.0),
    ],
    ids=["ppo", "ppo-dual-clip", "cispo"],
)
def test_a_weight_on_the_advantage_is_that_weight_on_the_tokens_loss(config: AlgorithmConfig):
    """token-mean: loss(w A) == mean_t w_t L_t(A), and the same gradient (each L_t from a one-token call)."""
    g = torch.Generator().manual_seed(0)
    new = torch.randn(3, 4, generator=g, dtype=torch.float64) * 0.3
    old = new.detach() + torch.randn(3, 4, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(3, 4, generator=g, dtype=torch.float64)
    w = torch.rand(3, 4, generator=g, dtype=torch.float64) * 2
    mask = torch.ones(3, 4)
    loss = POLICY_LOSSES[config.policy_loss].loss

    weighted_new = new.clone().requires_grad_(True)
    weighted, _ = loss(weighted_new, old, adv * w, mask, config)
    weighted.backward()
    each_new = new.clone().requires_grad_(True)
    per_token = [
        loss(each_new[b : b + 1, t : t + 1], old[b : b + 1, t : t + 1], adv[b : b + 1, t : t + 1],
             mask[:1, :1], config)[0] * w[b, t]
        for b in range(3) for t in range(4)
    ]  # fmt: skip
    (sum(per_token) / 12).backward()
    torch.testing.assert_close(weighted, sum(per_token).detach() / 12)
    torch.testing.assert_close(weighted_new.grad, each_new.grad)


def _batch(behaviour: torch.Tensor | None) -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 16, (2, 5), generator=g)
    return TrainBatch(
        input_ids_BT=ids, attention_mask_BT=torch.ones(2, 5, dtype=torch.long), response_mask_BR=torch.ones(2, 3),
        old_logprobs_BR=-torch.rand(2, 3, generator=g), old_values_BR=torch.zeros(2, 3),
        advantages_BR=torch.randn(2, 3, generator=g), returns_BR=torch.zeros(2, 3), behaviour_logprobs_BR=behaviour,
    )  # fmt: skip


@pytest.mark.parametrize("name", ["tis", "token_mask", "sequence_mask"])
def test_no_gap_between_sampler_and_trainer_changes_nothing_bit_for_bit(name: str):
    logits = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
    plain = _batch(None)
    corrected = _batch(plain.old_logprobs_BR.clone())
    config = AlgorithmConfig(off_policy_correction=name)
    got, got_stats = losses.response_actor_loss(logits, corrected, config, 1.0)
    want, want_stats = losses.response_actor_loss(logits, plain, AlgorithmConfig(), 1.0)
    assert torch.equal(got, want)
    assert float(got_stats.is_weight_mean) == 1.0 and float(got_stats.corrected_fraction) == 0.0
    assert float(want_stats.is_weight_mean) == 0.0  # no correction: not measured


def test_the_training_batch_carries_the_sampler_logprobs_only_for_a_correction():
    mask = torch.ones(2, 3, dtype=torch.long)
    rollout = Rollout(
        torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
        mask, torch.arange(2), torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool),
        sampler_logprobs_BR=torch.full((2, 3), -1.0),
    )  # fmt: skip
    experience = Experience(rollout, torch.full((2, 3), -1.0), torch.full((2, 3), -1.0), torch.zeros(2, 3),
                            torch.tensor([1.0, 0.0]))  # fmt: skip
    batch, _ = compute_train_batch(experience, AlgorithmConfig(off_policy_correction="tis"))
    assert torch.equal(batch.behaviour_logprobs_BR, rollout.sampler_logprobs_BR)
    assert compute_train_batch(experience, AlgorithmConfig())[0].behaviour_logprobs_BR is None
    unrecorded = dataclasses.replace(
        experience, rollout=dataclasses.replace(rollout, sampler_logprobs_BR=None)
    )
    with pytest.raises(
        ValueError, match=r"algorithm\.off_policy_correction=tis needs the sampler's log-probs"
    ):
        compute_train_batch(unrecorded, AlgorithmConfig(off_policy_correction="tis"))


def test_bounds_that_do_not_bracket_one_are_refused_naming_the_keys():
    problems = AlgorithmConfig(off_policy_correction="token_mask", is_low=1.5, is_cap=0.5).problems()
    assert any("algorithm.is_low=1.5" in p and "must bracket 1" in p for p in problems), problems
    assert any("algorithm.is_cap=0.5" in p for p in problems), problems
