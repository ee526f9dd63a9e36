"""`eval.*`: periodic evaluation on held-out prompts (`rlhfuse.trainer.evaluation` runs it). No torch, so that
the command line composes the configuration without it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlhfuse.core.config_checks import need, non_negative, positive


@dataclass
class EvalConfig:
    # Held-out prompts: a local file or save_to_disk folder in data.path's formats (read with the same
    # prompt_key, prompt_template and chat template), or null to hold out eval.split_fraction of the training
    # prompts instead (the Python API: build_trainer(eval_dataset=...)).
    path: str | None = None
    # Fraction of the training prompts held out for evaluation (seeded by `seed`; training never sees them).
    split_fraction: float = 0.0
    # Evaluate every N iterations (0 = never). Each evaluation is one rollout over the held-out prompts.
    every: int = 0
    # Responses generated per held-out prompt.
    samples_per_prompt: int = 1
    # Sampling temperature of evaluation (0 = greedy); top_k, top_p and max_new_tokens are the generator's.
    temperature: float = 0.0
    # Evaluate on at most this many held-out prompts (0 = all), the same ones every time.
    max_prompts: int = 0
    # Also evaluate the policy before the first iteration (verl's val_before_train): a row of metrics logged as
    # iteration 0 (not on a resumed run). Needs eval.every > 0 (the held-out prompts).
    before_training: bool = False

    def problems(self) -> list[str]:
        problems: list[str] = []
        non_negative(problems, "eval.every", self.every, "0 = never")
        positive(problems, "eval.samples_per_prompt", self.samples_per_prompt)
        non_negative(problems, "eval.max_prompts", self.max_prompts, "0 = all")
        need(
            problems,
            math.isfinite(self.temperature) and self.temperature >= 0,
            f"eval.temperature={self.temperature} must be >= 0 (0 = greedy)",
        )
        need(
            problems,
            0.0 <= self.split_fraction < 1.0,
            f"eval.split_fraction={self.split_fraction} must be in [0, 1) (0 = no split)",
        )
        need(
            problems,
            not (self.path is not None and self.split_fraction > 0),
            f"eval.path={self.path!r} and eval.split_fraction={self.split_fraction} both choose the held-out "
            "prompts: set one of them",
        )
        need(
            problems,
            not self.before_training or self.every > 0,
            "eval.before_training=true evaluates with the periodic evaluation's prompts: set eval.every > 0",
        )
        need(
            problems,
            self.every == 0 or self.path is not None or self.split_fraction > 0,
            f"eval.every={self.every} has no held-out prompts: set eval.path=<prompt file> or "
            "eval.split_fraction (e.g. 0.1), or eval.every=0",
        )
        return problems
