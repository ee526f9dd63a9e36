"""A multi-turn episode's response holds environment and tool tokens the model did not generate
(`Rollout.trainable_mask_BR` 0 there): they stay in the context (attention) but carry no loss, no KL and no
advantage, and the environment's episode reward is added to the inferencer's score (issue 43)."""

from __future__ import annotations

import dataclasses

import torch

from rlhfuse.core import step_losses
from rlhfuse.core.advantages import AlgorithmConfig, compute_train_batch
from rlhfuse.core.inference import final_scores
from rlhfuse.core.inference_config import InferencerConfig
from rlhfuse.core.types import Experience, Rollout

# two samples, 6 response tokens: sample 0 = model [0, 1], environment [2, 3], model [4]; sample 1 all model's
RESPONSE = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
TRAINABLE = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 1, 1]])


def _experience(algorithm: str, seed: int = 0) -> Experience:
    g = torch.Generator().manual_seed(seed)
    rollout = Rollout(
        prompt_ids_BP=torch.ones(2, 2, dtype=torch.long),
        prompt_mask_BP=torch.ones(2, 2, dtype=torch.long),
        response_ids_BR=torch.randint(1, 9, (2, 6), generator=g) * RESPONSE,
        response_mask_BR=RESPONSE,
        prompt_index_B=torch.tensor([0, 0]),
        sample_index_B=torch.tensor([0, 1]),
        finished_B=torch.tensor([True, True]),
        trainable_mask_BR=TRAINABLE,
        env_reward_B=torch.tensor([1.5, -0.5]),
    )
    logprobs, ref, values = (-torch.rand(2, 6, generator=g) for _ in range(3))
    return Experience(rollout, logprobs, ref, values, torch.tensor([0.0, 1.0]))


def test_environment_tokens_carry_no_loss_kl_or_advantage() -> None:
    for algorithm in ("ppo", "grpo"):  # GAE over the model's tokens, and one advantage per sequence
        config = AlgorithmConfig(name=algorithm)
        exp = _experience(algorithm)
        batch, stats = compute_train_batch(exp, config)
        assert torch.equal(
            batch.response_mask_BR, TRAINABLE.float()
        )  # the loss mask: the model's tokens only
        assert torch.equal(batch.attention_mask_BT[:, 2:], RESPONSE)  # the context: every response token
        env = TRAINABLE == 0
        assert (batch.advantages_BR[env] == 0).all() and (batch.returns_BR[env] == 0).all(), algorithm
        # the KL statistics do not change with the environment tokens' log-probs
        moved = dataclasses.replace(
            exp, ref_logprobs_BR=torch.where(env, exp.ref_logprobs_BR - 5, exp.ref_logprobs_BR)
        )
        assert compute_train_batch(moved, config)[1]["kl/mean"] == stats["kl/mean"], algorithm
        # the policy loss's gradient reaches no environment token
        logits = torch.randn(2, 8, 16, requires_grad=True)
        loss, _ = step_losses.actor_loss(logits, batch, config)
        loss.backward()
        assert logits.grad is not None
        env_positions = logits.grad[:, 1:-1][
            env
        ]  # the logits that predict response token r sit at position P-1+r
        assert (env_positions == 0).all(), algorithm
        assert logits.grad[:, 1:-1][TRAINABLE.bool()].abs().sum() > 0


def test_the_episode_reward_is_added_to_the_score_and_rows_select_and_concatenate() -> None:
    exp = _experience("ppo")
    scores = final_scores(InferencerConfig(), exp.rollout, torch.tensor([0.25, 0.5]), None, None)  # type: ignore[arg-type]
    assert torch.allclose(scores.total_B, torch.tensor([1.75, 0.0]))
    both = Rollout.cat([exp.rollout, exp.rollout.select(torch.tensor([1]))], pad_id=0)
    assert both.trainable_mask_BR is not None and both.env_reward_B is not None
    assert torch.equal(both.trainable_mask_BR[2], TRAINABLE[1]) and both.env_reward_B.tolist() == [
        1.5,
        -0.5,
        -0.5,
    ]
    assert torch.equal(exp.rollout.responses_cut(5).loss_mask_BR, TRAINABLE[:, :5])
