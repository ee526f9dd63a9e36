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
from rlhfuse.core.inference_config import InferencerConfig as InferencerConfig  # importable from here too
from rlhfuse.core.inference_config import RewardChoice as RewardChoice
from rlhfuse.core.inference_config import reward_choices as reward_choices
from rlhfuse.core.rewards import Decoder, RewardSet, reward_samples
from rlhfuse.core.types import Rollout
from rlhfuse.models import Transformer
from rlhfuse.models.packing import PackedSequences, pack_rows, packed_forward, packed_last_token, scatter_rows

TRUNCATED_RM_SCORE = -5.0
"""The reward-model score a truncated response gets under inferencer.truncated_score=auto."""


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
    model: Transformer,
    rollout: Rollout,
    temperature: float,
    *,
    packing: bool = False,
    packed: PackedSequences | None = None,
) -> Tensor:
    """Log-probs [B, R] of the response tokens under `model` (float32); packing=True runs the model on the
    packed real tokens (`rlhfuse.models.packing`), and the LM head and the log-softmax over the vocabulary on the
    M real response-predicting ones only (0 at padding), never on all B·R positions. `packed`: the rollout's
    packing (`packing_of`), made once for the models that infer it; None: packed here."""
    if not packing:
        logits_BTV = model(rollout.input_ids_BT, attention_mask_BT=rollout.attention_mask_BT)
        return logprobs_from_output(logits_BTV, rollout, temperature)
    prompt_len = rollout.prompt_ids_BP.shape[1]
    packed = packing_of(rollout) if packed is None else packed
    picked_M, dest_M, span = packed.window(prompt_len - 1, prompt_len + rollout.response_ids_BR.shape[1] - 1)
    logits_MV = model.packed_outputs(packed.pack(rollout.input_ids_BT), packed, picked_M).float()
    ids_M = rollout.response_ids_BR.reshape(-1)[dest_M]
    logprobs_M = logprobs_from_logits(logits_MV, ids_M, temperature=temperature)
    return scatter_rows(logprobs_M, dest_M, len(rollout), span)


def response_values(
    critic: Transformer, rollout: Rollout, *, packing: bool = False, packed: PackedSequences | None = None
) -> Tensor:
    """Critic values [B, R]: V of the state before each response token (float32); `packed` as
    `response_logprobs` takes it."""
    if not packing:
        values_BT = critic(rollout.input_ids_BT, attention_mask_BT=rollout.attention_mask_BT)
        return values_from_output(values_BT, rollout)
    return _response_window(critic, rollout, packed).float()


def sequence_scores(
    reward_model: Transformer,
    rollout: Rollout,
    *,
    packing: bool = False,
    packed: PackedSequences | None = None,
) -> Tensor:
    """Reward-model score [B] read at each sample's last valid token; `packed` as `response_logprobs` takes it."""
    if not packing:
        values_BT = reward_model(rollout.input_ids_BT, attention_mask_BT=rollout.attention_mask_BT)
        return scores_from_output(values_BT, rollout)
    return packed_last_token(reward_model, rollout.input_ids_BT, rollout.attention_mask_BT, packed).float()


def packing_of(rollout: Rollout) -> PackedSequences:
    """The packing of the rollout's real tokens, made once for every model that infers it (its host reads of the
    mask, once)."""
    return pack_rows(rollout.attention_mask_BT)


def _response_window(model: Transformer, rollout: Rollout, packed: PackedSequences | None) -> Tensor:
    """The model's outputs at positions [P - 1, T - 1), packed: those predicting / valuing the R response tokens."""
    prompt_len, width = (
        rollout.prompt_ids_BP.shape[1],
        rollout.prompt_ids_BP.shape[1] + rollout.response_ids_BR.shape[1],
    )
    return packed_forward(
        model,
        rollout.input_ids_BT,
        rollout.attention_mask_BT,
        start=prompt_len - 1,
        stop=width - 1,
        packed=packed,
    )


@dataclass(frozen=True)
class Scores:
    """What the reward stage gives each sample: total_B, float32 [B], the sequence score training uses; rules_BK,
    float32 [B, K], each rule-based reward function's own (unweighted) score, K = 0 without any."""

    total_B: Tensor
    rules_BK: Tensor


def final_scores(
    config: InferencerConfig,
    rollout: Rollout,
    model_scores_B: Tensor | None,
    rewards: RewardSet | None,
    tokenizer: Decoder,
    rows: Sequence[Mapping[str, Any]] = (),
) -> Scores:
    """The sequence score: reward-model score (if any) + the weighted rule rewards (if any), with
    `config.truncated_score` for responses cut without EOS (auto: in place of the reward-model score only), + the
    environment's episode reward (`Rollout.env_reward_B`, if any)."""
    device = rollout.finished_B.device
    finished_B = rollout.finished_B
    scores_B = torch.zeros(len(rollout), device=device)
    if model_scores_B is not None:
        model_B = model_scores_B.to(device).float()
        if config.truncated_score == "auto":
            model_B = torch.where(finished_B, model_B, torch.full_like(model_B, TRUNCATED_RM_SCORE))
        scores_B = scores_B + model_B
    rules_BK = torch.zeros(len(rollout), 0, device=device)
    if rewards is not None:
        rules_BK = rewards(reward_samples(rollout, tokenizer, rows)).to(device)
        scores_B = scores_B + rewards.combine(rules_BK)
    if isinstance(config.truncated_score, int | float):
        scores_B = torch.where(finished_B, scores_B, torch.full_like(scores_B, float(config.truncated_score)))
    if rollout.env_reward_B is not None:  # a multi-turn episode's environment rewards, added (rlhfuse.agents)
        scores_B = scores_B + rollout.env_reward_B.to(device).float()
    return Scores(scores_B, rules_BK)
