"""Dynamic sampling (issue 45): in rounds of the rollout (`DynamicSampling`) against inside one open rollout
(`StreamedDynamicSampling`, what a run in one process builds), side by side on the same trainer.

Workload: `experiment=arithmetic algorithm=dapo data.oversample=1` (16 prompts x 4 samples, rewards 0 / 1, no
reward model), its warm-started policy, weights fixed (no training between rollouts, so both settings face the
same policy). Settings: `arithmetic` as configured, `hot` at generator.temperature=1.5 (responses of spread
lengths, more groups that vary), `hot_2_instances` the same on `generator=engine generator.instances=2
migration=fixed migration.threshold=0.25` in one process (long-tail migration in both settings). Each round
runs both stages, in rotating order, on the same candidate prompts (the same starting batch and the same draw
order), at iteration numbers that differ per round (other sample streams). Per workload and setting, the median
over rounds of `rollout_s` (generation and inference of the whole dynamic-sampling rollout),
`generation_forwards` (forward calls of the generation instances' models: prefills and decode steps, what costs
about the same whatever the batch on a GPU), `rounds` (generations one after the other), `groups_sampled` and
`extra_tokens`; `<workload>.speedup` = rounds rollout_s / streamed rollout_s and `<workload>.forwards_ratio` =
streamed generation_forwards / rounds', paired per round.

`make bench BENCH=dynamic` (or `python -m benchmarks.run dynamic [--quick]`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rlhfuse.core.types import PromptBatch
from rlhfuse.data.collate import collate_prompts
from rlhfuse.trainer import build_trainer, compose_config
from rlhfuse.trainer.rollout import DynamicSampling, SerialRollout, StreamedDynamicSampling

BASE = ["experiment=arithmetic", "algorithm=dapo", "data.oversample=1", "logger=quiet"]
WORKLOADS = {
    "arithmetic": [],
    "hot": ["generator.temperature=1.5"],
    "hot_2_instances": [
        "generator.temperature=1.5", "generator=engine", "generator.instances=2", "generator.in_process=true",
        "migration=fixed", "migration.threshold=0.25",
    ],
}  # fmt: skip


class Draws:
    """The dataset's prompts in order from `start`, `count` at a time (each setting of a round from the same
    `start`)."""

    def __init__(self, prompts: list[Any], pad_token_id: int, start: int) -> None:
        self.prompts, self.pad, self.at = prompts, pad_token_id, start

    def __call__(self, count: int) -> PromptBatch:
        taken = [self.prompts[(self.at + k) % len(self.prompts)] for k in range(count)]
        self.at += count
        return collate_prompts(taken, self.pad)


def workload(name: str, extra: list[str], rounds: int, tmp: Path) -> dict[str, Any]:
    config = compose_config([*BASE, *extra])
    trainer = build_trainer(config, run_dir=tmp / name, log=lambda _: None)
    data, pad = config.data, trainer.pad_token_id
    prompts = list(trainer.prompts.prompts)
    width = max(len(p.token_ids) for p in prompts)
    serial = SerialRollout(trainer.generator, trainer.inferencer, pad_token_id=pad)

    def stage(setting: str, draw: Draws) -> Any:
        common = dict(oversample=data.oversample, draw=draw, limit=len(prompts), pad_token_id=pad)
        if setting == "rounds":
            return DynamicSampling(serial, data.prompts_per_iteration, **common)
        return StreamedDynamicSampling(
            serial, trainer.generator, trainer.inferencer, data.prompts_per_iteration,
            samples_per_prompt=data.samples_per_prompt, prompt_width=width, **common,
        )  # fmt: skip

    forwards = [0]

    def count(*_: Any) -> None:
        forwards[0] += 1

    for (
        model
    ) in trainer.generator.actor_copies():  # every prefill and decode step of the generation instances
        model.register_forward_pre_hook(count)
    settings = ("rounds", "streamed")
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in settings}
    for r in range(rounds):
        start = r * data.prompts_per_iteration * 3
        for setting in settings[r % 2 :] + settings[: r % 2]:
            draw = Draws(prompts, pad, start)
            first = draw(data.prompts_per_iteration)
            forwards[0] = 0
            t0 = time.perf_counter()
            experience, stats = stage(setting, draw).run(first, iteration=r + 1)
            seconds = time.perf_counter() - t0
            assert (
                stats.sampling is not None
                and len(experience) == data.prompts_per_iteration * data.samples_per_prompt
            )
            runs[setting].append(
                {
                    "rollout_s": seconds,
                    "generation_forwards": forwards[0],
                    "rounds": stats.sampling.rounds,
                    "groups_sampled": stats.sampling.groups_sampled,
                    "extra_tokens": stats.sampling.extra_tokens,
                }
            )
    figures: dict[str, Any] = {
        s: {k: statistics.median(run[k] for run in runs[s]) for k in runs[s][0]} for s in settings
    }
    figures["forwards_ratio"] = statistics.median(
        b["generation_forwards"] / a["generation_forwards"]
        for a, b in zip(runs["rounds"], runs["streamed"], strict=True)
    )
    figures["speedup"] = statistics.median(
        a["rollout_s"] / b["rollout_s"] for a, b in zip(runs["rounds"], runs["streamed"], strict=True)
    )
    rounds_, streamed = figures["rounds"], figures["streamed"]
    print(
        f"{name:>16}: rounds {rounds_['rollout_s'] * 1e3:6.1f} ms, {rounds_['generation_forwards']:.0f} forwards "
        f"({rounds_['rounds']:.0f} rounds, {rounds_['groups_sampled']:.0f} groups, {rounds_['extra_tokens']:.0f} "
        f"extra tokens) | streamed {streamed['rollout_s'] * 1e3:6.1f} ms, {streamed['generation_forwards']:.0f} "
        f"forwards ({streamed['groups_sampled']:.0f} groups, {streamed['extra_tokens']:.0f} extra tokens) | "
        f"time rounds / streamed {figures['speedup']:.2f}x, forwards streamed / rounds "
        f"{figures['forwards_ratio']:.2f}",
        flush=True,
    )
    return figures


def run(quick: bool = False) -> dict[str, Any]:
    """Figures per workload: `rounds` / `streamed` (medians of rollout_s, generation_forwards, rounds,
    groups_sampled, extra_tokens), `speedup` and `forwards_ratio` (paired per round)."""
    rounds = 4 if quick else 12
    print(f"dynamic sampling, DAPO on experiment=arithmetic (16 prompts x 4 samples, data.oversample=1), "
          f"median of {rounds} rounds per setting")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="rlhfuse-bench-dynamic-") as name:
        return {w: workload(w, extra, rounds, Path(name)) for w, extra in WORKLOADS.items()}
