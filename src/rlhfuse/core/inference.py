"""Inference-stage helpers shared by the single-process and the pipelined inferencers: reading Actor/Ref
log-probs, Critic values and reward scores off a model's output, and combining model and rule-based scores.

Legend: B samples, T tokens (prompt + response), R response tokens, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from rlhfuse.algorithms import logprobs_from_logits
from rlhfuse.core.config_checks import need, non_negative
from rlhfuse.core.rewards import Decoder, RewardSet, reward_samples
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
    # Rule-based (verifiable) rewards added to (or replacing) the reward model: one or a list of registered names
    # (exact_match, numeric_match, math_verify, answer_format, topic_fraction, length_penalty), your own
    # 'package.module:function' (imported from the current directory first, then PYTHONPATH) or, in the Python
    # API, the function itself; each takes a list of rlhfuse.core.rewards.RewardSample (prompt, response text
    # and ids, finished, the dataset row's fields) and returns one float per sample. Each function's mean is
    # logged as reward/<name>/mean.
    reward_fn: RewardChoice | list[RewardChoice] | None = None
    # One weight per reward function, in order (null = 1 each); the score adds the weighted functions.
    reward_weights: list[float] | None = None
    # Score given to responses cut at generator.max_new_tokens without EOS. auto = -5 in place of the reward
    # model's reading only (rule rewards score truncated responses themselves: RewardSample.finished); a number =
    # the whole score of a truncated response; null = no replacement. What it replaced is logged as
    # reward/truncated_fraction. A reward model trained on finished responses reads garbage at a non-EOS last
    # token, which a policy learns to exploit by never stopping; like TRL's missing_eos_penalty, but a fixed score
    # cannot be out-bid.
    truncated_score: float | Literal["auto"] | None = "auto"
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
        choices = reward_choices(self.reward_fn)
        for choice in choices:
            need(
                problems,
                callable(choice) or (isinstance(choice, str) and bool(choice)),
                f"inferencer.reward_fn holds {choice!r}: give a reward function's registered name, "
                "'package.module:function', or (in the Python API) the function itself",
            )
        if self.reward_weights is not None:
            weights = list(self.reward_weights)
            need(
                problems,
                len(weights) == len(choices),
                f"inferencer.reward_weights has {len(weights)} weights for {len(choices)} reward functions "
                "(inferencer.reward_fn): give one weight per function, in order, or null for 1 each",
            )
            need(
                problems,
                all(isinstance(w, int | float) and math.isfinite(w) for w in weights),
                f"inferencer.reward_weights={weights} must be finite numbers",
            )
        t = self.truncated_score
        need(
            problems,
            t is None or t == "auto" or (isinstance(t, int | float) and math.isfinite(t)),
            f"inferencer.truncated_score={t!r} must be auto, a finite number or null",
        )
        return problems

    def weights(self) -> tuple[float, ...]:
        """One weight per reward function (1 each unless `reward_weights` is set)."""
        if self.reward_weights is None:
            return (1.0,) * len(reward_choices(self.reward_fn))
        return tuple(float(w) for w in self.reward_weights)

    def replaces_truncated(self) -> bool:
        """Whether some score of a truncated response is replaced (`truncated_score`, with the reward model for
        auto)."""
        if self.truncated_score == "auto":
            return self.use_reward_model
        return self.truncated_score is not None


RewardChoice = str | Callable[..., Any]
"""A reward function as `inferencer.reward_fn` names it: a registered name, 'package.module:function', or (in the
Python API) the function itself."""

TRUNCATED_RM_SCORE = -5.0
"""The reward-model score a truncated response gets under inferencer.truncated_score=auto."""


def reward_choices(value: RewardChoice | Sequence[RewardChoice] | None) -> tuple[RewardChoice, ...]:
    """`inferencer.reward_fn` as a tuple of choices (none, one, or the list's)."""
    if value is None:
        return ()
    if isinstance(value, str) or callable(value):
        return (value,)
    return tuple(value)


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
    `config.truncated_score` for responses cut without EOS (auto: in place of the reward-model score only)."""
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
    return Scores(scores_B, rules_BK)
