"""Callbacks shipped with the trainer: a task-score metric and the Hugging Face export of the trained Actor."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlhfuse.core.rewards import RuleReward, reward_samples
from rlhfuse.core.types import Experience
from rlhfuse.data.tokenizer import Tokenizer
from rlhfuse.models import Transformer, save_pretrained


class TaskScore:
    """Logs `task/score` (or `key`): the mean of a rule (the synthetic task's hidden topic rule, the arithmetic
    task's numeric match) over the rollout, whatever reward the run optimises; the honest measure of whether RLHF
    improved the policy."""

    def __init__(
        self,
        rule: RuleReward,
        tokenizer: Tokenizer,
        key: str = "task/score",
        rows: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        self.rule, self.tokenizer, self.key, self.rows = rule, tokenizer, key, rows

    def on_rollout_end(self, trainer: Any, experience: Experience, metrics: dict[str, float]) -> None:
        scores_B = self.rule(reward_samples(experience.rollout, self.tokenizer, self.rows))
        metrics[self.key] = float(scores_B.sum()) / max(1, len(scores_B))


class ExportActor:
    """At the end of `fit`, write the trained Actor (and tokenizer.json) as a Hugging Face checkpoint."""

    def __init__(self, actor: Transformer, tokenizer: Tokenizer, path: str | Path) -> None:
        self.actor, self.tokenizer, self.path = actor, tokenizer, Path(path)

    def on_fit_end(self, trainer: Any) -> None:
        save_pretrained(self.actor, self.path)
        self.tokenizer.save(self.path)
