"""Asynchronous RL's speed and what it trains on (issue 42): `rlhfuse-train` runs at async.max_staleness 0, 1 and
2, side by side:
- colocated, one process (generation in a background thread beside inference and training), partial rollouts off
  and on (the workloads' generator=sampling, the one that continues samples under new weights);
- split, two processes (async.generation_ranks=1: rank 1 generates, rank 0 infers and trains), partial rollouts
  off and on; and at staleness 1 with partial rollouts, Ref and Reward scoring each batch on rank 1
  (async.frozen_inference=generation_ranks: rank 0 runs the Actor and the Critic only);
- and the synchronous run on two processes the long-tail experiment names (generator=engine
  generator.instances=2 migration=auto: inter-stage fusion, data-parallel training).

Runs of `rlhfuse-train` (fresh processes, OMP_NUM_THREADS=1, the warm-start cache shared), the settings alternating
run by run so that load drifting over the benchmark biases none. Each setting runs twice:
- at equal work: learning rates of 1e-30, so no weight moves and every setting generates, infers and trains the
  same samples (a training run's response lengths follow its policy, and on the long-tail task they decide the
  iteration's cost: comparing them would compare trajectories, not the overlap). Over the steady iterations (the
  first is left out: nothing overlaps it) of 2 runs: `iteration_s`, the mean seconds per iteration (the
  trainer's, its waits included: what iterations per second over a run is the inverse of; iterations' costs vary
  with their lengths, so a median would pick one iteration's); `idle_fraction`, the share of those seconds the
  trainer waits for generation (synchronous: the generation time; asynchronous: `async/wait_s` plus the weight
  sync's wait for the batches of the version it replaces); `speedup` = iteration_s at staleness 0 / iteration_s;
- learning (the configured rates), one run: `staleness_mean` (the trained tokens' mean age in versions),
  `corrected_fraction` (the share of tokens the off-policy correction truncated: tis, the default once samples
  can be off-policy) and `reward_last` (`reward/mean` of the last iteration, the same count for every setting).

Workloads: `experiment=longtail` (PPO, the long-tail topic task) and, without --quick, the same task under
GRPO (critic-free: generation is a larger share). Both modes run 10 iterations per run. `make bench BENCH=async`
(or `python -m benchmarks.run async [--quick]`).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_runs import train

SPLIT = ("async.generation_ranks=1", "distributed.nproc_per_node=2")
PARTIAL_1 = ("async.max_staleness=1", "async.partial_rollout=true")
# each setting's overrides, by the name its figures are kept under
SETTINGS: dict[str, tuple[str, ...]] = {
    "staleness_0": ("async.max_staleness=0",),
    "staleness_1": ("async.max_staleness=1",),
    "staleness_1_partial": ("async.max_staleness=1", "async.partial_rollout=true"),
    "staleness_2": ("async.max_staleness=2",),
    "staleness_2_partial": ("async.max_staleness=2", "async.partial_rollout=true"),
    "split_staleness_0": ("async.max_staleness=0", *SPLIT),
    "split_staleness_1": ("async.max_staleness=1", *SPLIT),
    "split_staleness_1_partial": (*PARTIAL_1, *SPLIT),
    "split_staleness_2": ("async.max_staleness=2", *SPLIT),
    "split_staleness_2_partial": ("async.max_staleness=2", "async.partial_rollout=true", *SPLIT),
    "split_staleness_1_partial_frozen": (*PARTIAL_1, "async.frozen_inference=generation_ranks", *SPLIT),
    "instances_2": ("generator=engine", "generator.instances=2", "migration=auto"),
}
WORKLOADS: dict[str, tuple[str, ...]] = {
    "longtail": ("experiment=longtail",),
    "longtail_grpo": ("experiment=longtail", "algorithm=grpo"),
}


def _idle(row: dict[str, float]) -> float:
    if "async/wait_s" in row:
        waited = row["async/wait_s"] + row["time/weight_sync"]
    else:
        waited = row["time/generation"]
    return waited / row["time/iteration"]


def _steady(runs: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    return [row for run in runs for row in run[1:]]


def workload(
    tmp: Path, name: str, overrides: tuple[str, ...], iterations: int, repeats: int
) -> dict[str, Any]:
    frozen = ("pipeline.actor_lr=1e-30", "pipeline.critic_lr=1e-30")
    timed: dict[str, list[list[dict[str, float]]]] = {key: [] for key in SETTINGS}
    learned: dict[str, list[list[dict[str, float]]]] = {key: [] for key in SETTINGS}
    for r in range(repeats):
        for key, setting in SETTINGS.items():
            args = (*overrides, f"iterations={iterations}", *setting)
            timed[key].append(train((*args, *frozen), tmp / f"{name}-{key}-{r}-timed", tmp / "cache")[1])
            if r == 0:  # one learning run per setting: its figures do not depend on the machine's speed
                learned[key].append(train(args, tmp / f"{name}-{key}-{r}", tmp / "cache")[1])
    figures: dict[str, Any] = {}
    for key in SETTINGS:
        steady, learning = _steady(timed[key]), _steady(learned[key])
        figures[key] = {
            "iteration_s": statistics.mean(row["time/iteration"] for row in steady),
            "idle_fraction": sum(_idle(row) * row["time/iteration"] for row in steady)
            / sum(row["time/iteration"] for row in steady),
            "staleness_mean": statistics.mean(row.get("async/staleness_mean", 0.0) for row in learning),
            "corrected_fraction": statistics.mean(
                row.get("off_policy/corrected_fraction", 0.0) for row in learning
            ),
            "reward_last": statistics.mean(run[-1]["reward/mean"] for run in learned[key]),
        }
    base = figures["staleness_0"]["iteration_s"]
    for key in SETTINGS:
        figures[key]["speedup"] = base / figures[key]["iteration_s"]
    print(f"{name} ({' '.join(overrides)}), {iterations} iterations, {repeats} run(s) per setting:")
    print(
        f"  {'setting':<33} | equal work: s/iteration  speedup  trainer idle | learning: mean age  corrected  "
        "reward (last)"
    )
    for key in SETTINGS:
        f = figures[key]
        print(
            f"  {key:<33} | {f['iteration_s']:23.3f}  {f['speedup']:6.2f}x  "
            f"{f['idle_fraction']:12.2f} | {f['staleness_mean']:18.2f}  {f['corrected_fraction']:9.4f}  "
            f"{f['reward_last']:13.3f}"
        )
    return figures


def run(quick: bool = False) -> dict[str, Any]:
    names = ["longtail"] if quick else list(WORKLOADS)
    with tempfile.TemporaryDirectory(prefix="rlhfuse-bench-async-") as folder:
        return {name: workload(Path(folder), name, WORKLOADS[name], 10, 2) for name in names}
