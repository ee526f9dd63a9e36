"""The algorithm configuration's policy-loss choices: the registry tables against their Literal types, each
choice reaching its pure function through the training step's loss, the configuration's own problems, and DAPO's
overlong shaping inside step 2."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from rlhfuse.algorithms import cispo_policy_loss, gspo_policy_loss, overlong_penalty, ppo_policy_loss
from rlhfuse.core import step_losses
from rlhfuse.core.advantages import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    AlgorithmConfig,
    LossAgg,
    compute_train_batch,
)
from rlhfuse.core.types import Experience, Rollout, TrainBatch


def test_every_choice_of_policy_loss_and_loss_agg_is_a_registry_entry():
    hints = typing.get_type_hints(AlgorithmConfig)
    assert set(typing.get_args(hints["policy_loss"])) == set(POLICY_LOSSES)
    assert set(typing.get_args(LossAgg)) == set(LOSS_AGGREGATIONS)


def _micro(seed: int = 0, B: int = 3, P: int = 2, R: int = 4, V: int = 11) -> tuple[torch.Tensor, TrainBatch]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)
    ids = torch.randint(1, V, (B, P + R), generator=g)
    logits = torch.randn(B, P + R, V, generator=g, dtype=torch.float64)
    old = torch.log_softmax(logits[:, P - 1 : -1], -1).gather(-1, ids[:, P:, None])[..., 0]
    old = old + 0.4 * torch.randn(B, R, generator=g, dtype=torch.float64)
    advantages = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, R) * mask
    batch = TrainBatch(ids, torch.ones_like(ids), mask, old, torch.zeros(B, R), advantages, torch.zeros(B, R))
    return logits, batch


@pytest.mark.parametrize(
    ("config", "pure"),
    [
        (AlgorithmConfig(), lambda lp, b: ppo_policy_loss(lp, b.old_logprobs_BR, b.advantages_BR, b.response_mask_BR)),
        (
            AlgorithmConfig(clip_eps_high=0.28, dual_clip=3.0, loss_agg="seq-mean-token-sum"),
            lambda lp, b: ppo_policy_loss(
                lp, b.old_logprobs_BR, b.advantages_BR, b.response_mask_BR, clip_eps_high=0.28, dual_clip=3.0,
                reduction="sequence_sum", constant_length=1,
            ),
        ),
        (
            AlgorithmConfig(ratio_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4, loss_agg="seq-mean-token-mean"),
            lambda lp, b: gspo_policy_loss(lp, b.old_logprobs_BR, b.advantages_BR, b.response_mask_BR),
        ),
        (
            AlgorithmConfig(policy_loss="cispo", clip_eps_low=1.0, clip_eps_high=5.0, loss_agg="seq-mean-token-sum-norm", loss_constant_length=6),
            lambda lp, b: cispo_policy_loss(
                lp, b.old_logprobs_BR, b.advantages_BR, b.response_mask_BR, clip_eps=1.0, clip_eps_high=5.0,
                reduction="sequence_sum", constant_length=6,
            ),
        ),
    ],
    ids=["ppo", "dapo-dual-seq-sum", "gspo", "cispo-norm"],
)  # fmt: skip
def test_the_training_step_computes_the_chosen_pure_loss(config, pure):
    logits, batch = _micro()
    loss, stats = step_losses.actor_loss(logits, batch, config)
    logprobs = torch.log_softmax(logits[:, 1:-1], -1).gather(-1, batch.input_ids_BT[:, 2:, None])[..., 0]
    want, want_stats = pure(logprobs, batch)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(stats.policy_loss, want.double())
    for field in ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "approx_kl"):
        torch.testing.assert_close(getattr(stats, field), getattr(want_stats, field).double())
    host = stats.host()
    assert host.clip_fraction == pytest.approx(host.clip_fraction_low + host.clip_fraction_high)
    assert set(host.metrics()) == {  # the metric names of before; the split is logged by the trainer
        "loss/policy",
        "policy/clip_fraction",
        "policy/approx_kl",
        "policy/entropy",
        "loss/value",
    }


def test_configuration_problems_name_the_key():
    assert AlgorithmConfig().problems() == []
    problems = AlgorithmConfig(
        policy_loss="cispo", dual_clip=3.0, clip_eps_low=0.0, overlong_buffer=-1, overlong_penalty=-0.5
    ).problems()
    joined = "\n".join(problems)
    assert "algorithm.dual_clip=3.0: algorithm.policy_loss=cispo has no clipped surrogate" in joined
    assert "algorithm.clip_eps_low=0.0 must be > 0" in joined
    assert "algorithm.overlong_buffer=-1 must be >= 0" in joined
    assert "algorithm.overlong_penalty=-0.5 must be >= 0" in joined
    bad = AlgorithmConfig(policy_loss="grpo", ratio_level="seq", loss_agg="mean")  # type: ignore[arg-type]
    joined = "\n".join(bad.problems())
    for key in ("algorithm.policy_loss='grpo'", "algorithm.ratio_level='seq'", "algorithm.loss_agg='mean'"):
        assert key in joined


def test_loss_agg_reaches_reduce_loss_as_it_did_before():
    # the old loss_reduction values are the aggregations' reductions: Dr. GRPO's keeps its constant length
    assert AlgorithmConfig().loss_reduction == "token" and AlgorithmConfig().constant_length is None
    dr = AlgorithmConfig(loss_agg="seq-mean-token-sum-norm", loss_constant_length=48)
    assert (dr.loss_reduction, dr.constant_length) == ("sequence_sum", 48)
    plain_sum = AlgorithmConfig(loss_agg="seq-mean-token-sum", loss_constant_length=48)
    assert (plain_sum.loss_reduction, plain_sum.constant_length) == ("sequence_sum", 1)
    assert AlgorithmConfig(loss_agg="seq-mean-token-mean").loss_reduction == "sequence"


def _experience(lengths: list[int], scores: list[float], groups: list[int], width: int = 8) -> Experience:
    B = len(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    rollout = Rollout(
        prompt_ids_BP=torch.ones(B, 1, dtype=torch.long),
        prompt_mask_BP=torch.ones(B, 1, dtype=torch.long),
        response_ids_BR=torch.ones(B, width, dtype=torch.long),
        response_mask_BR=mask,
        prompt_index_B=torch.tensor(groups),
        sample_index_B=torch.arange(B),
        finished_B=torch.ones(B, dtype=torch.bool),
    )
    zeros = torch.zeros(B, width)
    return Experience(rollout, zeros, zeros, zeros, torch.tensor(scores))


def test_overlong_shaping_enters_the_advantages_and_is_counted():
    # L_max = 8, buffer 0.25 -> 2 tokens: lengths 4, 7, 8 lose 0, 0.5, 1 of their score
    exp = _experience([4, 7, 8, 2], [1.0, 1.0, 1.0, 0.0], [0, 0, 0, 0])
    plain = AlgorithmConfig(name="grpo", kl_coef=0.0, std_norm=False)
    shaped = dataclasses.replace(plain, overlong_buffer=0.25)
    batch, stats = compute_train_batch(exp, shaped, max_new_tokens=8)
    outcome = torch.tensor([1.0, 0.5, 0.0, 0.0])
    assert outcome.tolist() == pytest.approx(
        (exp.scores_B + overlong_penalty(exp.rollout.response_lengths_B, 8, 2)).tolist()
    )
    # Dr. GRPO's mean-centred outcome, on each row's tokens
    assert batch.advantages_BR[:, 0].tolist() == pytest.approx((outcome - outcome.mean()).tolist())
    assert stats["reward/overlong_fraction"] == pytest.approx(2 / 4)
    assert stats["reward/mean"] == pytest.approx(0.75)  # the reward stage's scores, before shaping
    _, unshaped = compute_train_batch(exp, plain)
    assert "reward/overlong_fraction" not in unshaped
    with pytest.raises(ValueError, match=r"needs compute_train_batch\(max_new_tokens=\.\.\.\)"):
        compute_train_batch(exp, shaped)


def test_the_losses_and_the_shaping_keep_to_the_batch_device():
    """On the stand-in device (`rlhfuse.testing.standin`: a CPU tensor mixed in raises, as on a GPU) every policy
    loss and the overlong shaping give the CPU's numbers."""
    from rlhfuse.testing.standin import standin_device

    device = standin_device()
    logits, batch = _micro(seed=3)
    configs = [
        AlgorithmConfig(clip_eps_high=0.28, dual_clip=3.0),
        AlgorithmConfig(ratio_level="sequence", loss_agg="seq-mean-token-sum"),
        AlgorithmConfig(
            policy_loss="cispo", clip_eps_low=1.0, clip_eps_high=5.0, loss_agg="seq-mean-token-mean"
        ),
    ]
    for config in configs:
        want = step_losses.actor_loss(logits, batch, config)[1].host()
        got = step_losses.actor_loss(logits.to(device), batch.to(device), config)[1].host()
        assert got == pytest.approx(want), config
    exp = _experience([4, 7, 8, 2], [1.0, 1.0, 1.0, 0.0], [0, 0, 1, 1])
    shaped = AlgorithmConfig(name="grpo", overlong_buffer=2)
    want_batch, want_stats = compute_train_batch(exp, shaped, max_new_tokens=8)
    got_batch, got_stats = compute_train_batch(exp.to(device), shaped, max_new_tokens=8)
    assert got_batch.advantages_BR.device == device
    torch.testing.assert_close(got_batch.advantages_BR.cpu(), want_batch.advantages_BR)
    assert got_stats == pytest.approx(want_stats)
