"""Callbacks shipped with the trainer: a task-score metric and the Hugging Face export of the trained Actor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhfuse.core.registry import RewardFn
from rlhfuse.core.types import Experience
from rlhfuse.data.tokenizer import Tokenizer
from rlhfuse.models import Transformer, save_pretrained


class TaskScore:
    """Logs `task/score`: the mean of a rule (e.g. the synthetic task's hidden topic rule) over the rollout,
    whatever reward the run optimises; the honest measure of whether RLHF improved the policy."""

    def __init__(self, rule: RewardFn, tokenizer: Tokenizer, key: str = "task/score") -> None:
        self.rule, self.tokenizer, self.key = rule, tokenizer, key

    def on_rollout_end(self, trainer: Any, experience: Experience, metrics: dict[str, float]) -> None:
        rollout = experience.rollout
        prompts = [self.tokenizer.decode(ids.tolist()) for ids in rollout.prompt_ids_BP]
        responses = [
            self.tokenizer.decode(ids[: int(n)].tolist())
            for ids, n in zip(rollout.response_ids_BR, rollout.response_lengths_B)
        ]
        scores = self.rule(prompts, responses)
        metrics[self.key] = sum(scores) / max(1, len(scores))


class ExportActor:
    """At the end of `fit`, write the trained Actor (and tokenizer.json) as a Hugging Face checkpoint."""

    def __init__(self, actor: Transformer, tokenizer: Tokenizer, path: str | Path) -> None:
        self.actor, self.tokenizer, self.path = actor, tokenizer, Path(path)

    def on_fit_end(self, trainer: Any) -> None:
        save_pretrained(self.actor, self.path)
        self.tokenizer.save(self.path)
