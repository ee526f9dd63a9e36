"""Periodic evaluation on held-out prompts (`eval.*`): every `eval.every` iterations the current policy
generates for prompts it never trains on — greedy by default (`eval.temperature=0`) — through the run's own
rollout stage (the same generator, layout and inferencer), and the same reward functions score the responses.

Logged with the iteration's metrics: `eval/reward/mean` (the score training would use: reward model plus the
weighted rule rewards), `eval/reward/<name>/mean` per reward function, `eval/accuracy` (the mean of the first
verifier among them: exact_match, numeric_match, math_verify) and `eval/response_length/mean`.

The held-out prompts are a file (`eval.path`, read like `data.path`) or a seeded fraction of the training
prompts (`eval.split_fraction`), which training then never sees.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch

from rlhfuse.core.protocols import Callback, RolloutStage
from rlhfuse.core.sampling import Sampling, SamplingConfig
from rlhfuse.data.collate import collate_prompts
from rlhfuse.data.data_config import DataConfig
from rlhfuse.data.prompts import Prompt, load_prompts
from rlhfuse.data.tokenizer import Tokenizer
from rlhfuse.trainer.evaluation_config import EvalConfig as EvalConfig  # importable from here too


def split_prompts(prompts: Sequence[Prompt], fraction: float, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(training, held out): a seeded `fraction` of the prompts (at least one when fraction > 0) held out, both
    parts in dataset order; ids are kept (the rows reward functions read stay indexed by id)."""
    if fraction <= 0:
        return list(prompts), []
    count = max(1, round(fraction * len(prompts)))
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed * 7_919 + 1)).tolist()
    held = set(order[:count])
    return (
        [p for i, p in enumerate(prompts) if i not in held],
        [p for i, p in enumerate(prompts) if i in held],
    )


def renumbered(prompts: Sequence[Prompt], first_id: int) -> list[Prompt]:
    """The prompts with ids first_id, first_id + 1, ...: held-out prompts from their own file, numbered after
    the training prompts (their rows are appended to the training rows)."""
    return [dataclasses.replace(p, id=first_id + i) for i, p in enumerate(prompts)]


def held_out_prompts(
    config: EvalConfig,
    data: DataConfig,
    tokenizer: Tokenizer,
    prompts: Sequence[Prompt],
    *,
    seed: int,
    dataset: Any = None,
) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts, held-out prompts): `eval.split_fraction` of `prompts` held out, or `eval.path` (or
    the Python API's `dataset`, which `eval.path` then labels) read like `data.path` and numbered after them;
    neither: all prompts train, none are held out."""
    if config.path is not None:
        file = dataclasses.replace(data, source="file", path=config.path)
        held = load_prompts(file, tokenizer, seed=seed, dataset=dataset)
        return list(prompts), renumbered(held, len(prompts))
    return split_prompts(prompts, config.split_fraction, seed)


class Evaluator(Callback):
    """Runs the evaluation every `config.every` iterations, after the weight sync, and adds its metrics to the
    iteration's row before logging (`on_metrics`; every rank calls it: the rollout stage may be collective).

    `batch_prompts`: prompts per evaluation rollout (the training batch's); `names`: the reward functions'
    metric names, in `Experience.rule_scores_BK` column order; `verifier`: the column whose mean is the
    accuracy (None: no accuracy)."""

    def __init__(
        self,
        config: EvalConfig,
        prompts: Sequence[Prompt],
        rollout: RolloutStage,
        *,
        generator: SamplingConfig,
        pad_token_id: int,
        batch_prompts: int,
        names: Sequence[str] = (),
        verifier: int | None = None,
    ) -> None:
        if not prompts:
            raise ValueError(
                "eval: no held-out prompts (eval.path is empty, or eval.split_fraction held none)"
            )
        self.config, self.rollout = config, rollout
        self.prompts = list(prompts[: config.max_prompts] if config.max_prompts > 0 else prompts)
        self.sampling = Sampling(
            dataclasses.replace(generator, temperature=config.temperature), config.samples_per_prompt
        )
        self.pad_token_id, self.batch_prompts = pad_token_id, batch_prompts
        self.names, self.verifier = tuple(names), verifier

    def due(self, iteration: int) -> bool:
        return self.config.every > 0 and iteration % self.config.every == 0

    def on_fit_start(self, trainer: Any) -> None:
        """eval.before_training: the policy as it starts, evaluated and logged as iteration 0 (a fresh run)."""
        if self.config.before_training and trainer.iteration == 0:
            trainer.record_metrics({"iteration": 0, **self.evaluate(0)}, step=0)

    def on_metrics(self, trainer: Any, metrics: dict[str, float]) -> None:
        iteration = int(metrics["iteration"])
        if self.due(iteration):
            metrics.update(self.evaluate(iteration))

    @torch.no_grad()
    def evaluate(self, iteration: int) -> dict[str, float]:
        """One evaluation of the current policy over the held-out prompts: its metrics."""
        start = time.perf_counter()
        scores, rules, lengths = [], [], []
        for first in range(0, len(self.prompts), self.batch_prompts):
            batch = collate_prompts(self.prompts[first : first + self.batch_prompts], self.pad_token_id)
            experience, _ = self.rollout.run(batch, iteration, sampling=self.sampling)
            scores.append(experience.scores_B.float().cpu())
            lengths.append(experience.rollout.response_lengths_B.float().cpu())
            if experience.rule_scores_BK is not None:
                rules.append(experience.rule_scores_BK.float().cpu())
        scores_B, lengths_B = torch.cat(scores), torch.cat(lengths)
        out = {
            "eval/reward/mean": float(scores_B.mean()),
            "eval/response_length/mean": float(lengths_B.mean()),
        }
        if self.names:
            rules_BK = torch.cat(rules)
            for name, mean in zip(self.names, rules_BK.mean(dim=0).tolist(), strict=True):
                out[f"eval/reward/{name}/mean"] = mean
            if self.verifier is not None:
                out["eval/accuracy"] = float(rules_BK[:, self.verifier].mean())
        out["time/eval"] = time.perf_counter() - start
        return out
