"""Inference-stage helpers shared by the single-process and the pipelined inferencers: reading Actor/Ref
log-probs, Critic values and reward scores off a model's output, and combining model and rule-based scores.

Legend: B samples, T tokens (prompt + response), R response tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlhfuse.algorithms import logprobs_from_logits
from rlhfuse.core.config import need, non_negative
from rlhfuse.core.rewards import Decoder, RuleReward, reward_samples
from rlhfuse.core.types import Rollout
from rlhfuse.models import Transformer
from rlhfuse.models.packing import packed_forward, packed_last_token


@dataclass
class InferencerConfig:
    # Registered inferencer name: models (Actor, Ref, Reward, Critic forward passes in this process).
    name: str = "models"
    # Samples per forward pass (0 = all samples of the iteration at once; under pipeline=fused / serial_1f1b,
    # samples per pipeline micro-batch, 0 = the training layout's micro-batch count).
    micro_batch_size: int = 0
    # Score samples with the reward model (model.reward_path or the warm-started one).
    use_reward_model: bool = True
    # Rule-based (verifiable) reward added to (or replacing) the reward model: a registered name (exact_match,
    # numeric_match, answer_format, topic_fraction, length_penalty) or your own 'package.module:function' taking
    # a list of rlhfuse.core.rewards.RewardSample (prompt, response text and ids, finished, the dataset row's
    # fields) -> one float per sample.
    reward_fn: str | None = None
    # Weight of the rule-based reward in the score.
    reward_fn_weight: float = 1.0
    # Score given to responses cut at generator.max_new_tokens without EOS (null = score them like the others).
    # A reward model trained on finished responses reads garbage at a non-EOS last token, which a policy learns
    # to exploit by never stopping; like TRL's missing_eos_penalty, but a fixed score cannot be out-bid.
    truncated_score: float | None = -5.0
    # Keep the Ref and Reward weights in host memory between inference stages and swap them onto the device for
    # inference, prefetched when the generation tail starts (rlhfuse.trainer.offload). A no-op on CPU.
    offload_frozen: bool = False

    def problems(self) -> list[str]:
        problems: list[str] = []
        non_negative(problems, "inferencer.micro_batch_size", self.micro_batch_size, "0 = all")
        need(
            problems,
            self.use_reward_model or self.reward_fn is not None,
            "no reward: inferencer.use_reward_model=false and no inferencer.reward_fn; enable one of them",
        )
        return problems


def logprobs_from_output(logits_BTV: Tensor, rollout: Rollout, temperature: float) -> Tensor:
    """Log-probs [B, R] of the response tokens from a language model's logits [B, T, V] (float32)."""
    prompt_len = rollout.prompt_ids_BP.shape[1]
    logits_BRV = logits_BTV[:, prompt_len - 1 : -1].float()
    return logprobs_from_logits(logits_BRV, rollout.response_ids_BR, temperature=temperature)


def values_from_output(values_BT: Tensor, rollout: Rollout) -> Tensor:
    """Critic values [B, R] from a value model's output [B, T]: V of the state before each response token."""
    prompt_len = rollout.prompt_ids_BP.shape[1]
    return values_BT[:, prompt_len - 1 : -1].float()


def scores_from_output(values_BT: Tensor, rollout: Rollout) -> Tensor:
    """Reward-model score [B] read at each sample's last valid token of a value model's output [B, T]."""
    last_B = rollout.prompt_ids_BP.shape[1] + rollout.response_lengths_B - 1
    return values_BT[torch.arange(len(rollout), device=values_BT.device), last_B].float()


def response_logprobs(
    model: Transformer, rollout: Rollout, temperature: float, *, packing: bool = False
) -> Tensor:
    """Log-probs [B, R] of the response tokens under `model` (float32); packing=True runs the model on the
    packed real tokens (`rlhfuse.models.packing`) and the LM head on the response-predicting ones only."""
    if not packing:
        logits_BTV = model(rollout.input_ids_BT, attention_mask_BT=rollout.attention_mask_BT)
        return logprobs_from_output(logits_BTV, rollout, temperature)
    logits_BRV = _response_window(model, rollout).float()
    return logprobs_from_logits(logits_BRV, rollout.response_ids_BR, temperature=temperature)


def response_values(critic: Transformer, rollout: Rollout, *, packing: bool = False) -> Tensor:
    """Critic values [B, R]: V of the state before each response token (float32)."""
    if not packing:
        values_BT = critic(rollout.input_ids_BT, attention_mask_BT=rollout.attention_mask_BT)
        return values_from_output(values_BT, rollout)
    return _response_window(critic, rollout).float()


def sequence_scores(reward_model: Transformer, rollout: Rollout, *, packing: bool = False) -> Tensor:
    """Reward-model score [B] read at each sample's last valid token."""
    if not packing:
        values_BT = reward_model(rollout.input_ids_BT, attention_mask_BT=rollout.attention_mask_BT)
        return scores_from_output(values_BT, rollout)
    return packed_last_token(reward_model, rollout.input_ids_BT, rollout.attention_mask_BT).float()


def _response_window(model: Transformer, rollout: Rollout) -> Tensor:
    """The model's outputs at positions [P - 1, T - 1), packed: those predicting / valuing the R response tokens."""
    prompt_len, width = (
        rollout.prompt_ids_BP.shape[1],
        rollout.prompt_ids_BP.shape[1] + rollout.response_ids_BR.shape[1],
    )
    return packed_forward(
        model, rollout.input_ids_BT, rollout.attention_mask_BT, start=prompt_len - 1, stop=width - 1
    )


def rule_scores(
    reward_fn: RuleReward, tokenizer: Decoder, rollout: Rollout, rows: Sequence[Mapping[str, Any]] = ()
) -> Tensor:
    """The rule-based reward [B] of each sample (float32), from its record (decoded prompt and response, ids,
    finished flag, the dataset row `rows[prompt id]`)."""
    return reward_fn(reward_samples(rollout, tokenizer, rows))


def final_scores(
    config: InferencerConfig,
    rollout: Rollout,
    model_scores_B: Tensor | None,
    reward_fn: RuleReward | None,
    tokenizer: Decoder,
    rows: Sequence[Mapping[str, Any]] = (),
) -> Tensor:
    """The sequence score [B]: reward-model score (if any) + weighted rule reward (if any), with
    `config.truncated_score` for responses cut without EOS."""
    device = rollout.finished_B.device
    scores_B = torch.zeros(len(rollout), device=device)
    if model_scores_B is not None:
        scores_B = scores_B + model_scores_B.to(device)
    if reward_fn is not None:
        rule_B = rule_scores(reward_fn, tokenizer, rollout, rows).to(device)
        scores_B = scores_B + config.reward_fn_weight * rule_B
    if config.truncated_score is not None:
        scores_B = torch.where(
            rollout.finished_B, scores_B, torch.full_like(scores_B, config.truncated_score)
        )
    return scores_B
