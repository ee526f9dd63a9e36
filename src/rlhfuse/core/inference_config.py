"""`inferencer.*`: how samples are scored and their log-probs and values computed (`rlhfuse.core.inference`
computes them). No torch, so that the command line composes the configuration without it."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rlhfuse.core.config_checks import need, non_negative


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


def reward_choices(value: RewardChoice | Sequence[RewardChoice] | None) -> tuple[RewardChoice, ...]:
    """`inferencer.reward_fn` as a tuple of choices (none, one, or the list's)."""
    if value is None:
        return ()
    if isinstance(value, str) or callable(value):
        return (value,)
    return tuple(value)
