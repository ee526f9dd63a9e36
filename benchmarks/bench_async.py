"""Asynchronous RL's speed and what it trains on (issue 42): `rlhfuse-train` runs at async.max_staleness 0, 1 and
2 side by side, on one process (colocated: generation in a background thread beside inference and training).

Runs of `rlhfuse-train` (fresh processes, OMP_NUM_THREADS=1, the warm-start cache shared), the settings alternating
run by run so that load drifting over the benchmark biases none. Each setting runs twice:
- at equal work: learning rates of 1e-30, so no weight moves and every setting generates, infers and trains the
  same samples (a training run's response lengths follow its policy, and on the long-tail task they decide the
  iteration's cost: comparing them would compare trajectories, not the overlap). Over the steady iterations (the
  first is left out: nothing overlaps it): `iteration_s`, the median seconds per iteration (the trainer's, its
  waits included); `idle_fraction`, the median share of the iteration the trainer waits for generation
  (synchronous: the generation time; asynchronous: `async/wait_s` plus the weight sync's wait for the batch of
  the version it replaces); `speedup` = iteration_s at staleness 0 / iteration_s;
- learning (the configured rates): `staleness_mean` (the trained tokens' mean age in versions),
  `corrected_fraction` (the share of tokens the off-policy correction truncated: tis, the default once samples
  can be off-policy) and `reward_last` (`reward/mean` of the last iteration, the same count for every setting).

Workloads: `experiment=longtail` (PPO, the long-tail topic task) and, without --quick, the same task under
GRPO (critic-free: generation is a larger share). `make bench BENCH=async` (or `python -m benchmarks.run async
[--quick]`).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_runs import train

STALENESS = (0, 1, 2)
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
    timed: dict[int, list[list[dict[str, float]]]] = {k: [] for k in STALENESS}
    learned: dict[int, list[list[dict[str, float]]]] = {k: [] for k in STALENESS}
    for r in range(repeats):
        for k in STALENESS:
            args = (*overrides, f"iterations={iterations}", f"async.max_staleness={k}")
            timed[k].append(train((*args, *frozen), tmp / f"{name}-{k}-{r}-timed", tmp / "cache")[1])
            learned[k].append(train(args, tmp / f"{name}-{k}-{r}", tmp / "cache")[1])
    figures: dict[str, Any] = {}
    for k in STALENESS:
        steady, learning = _steady(timed[k]), _steady(learned[k])
        figures[f"staleness_{k}"] = {
            "iteration_s": statistics.median(row["time/iteration"] for row in steady),
            "idle_fraction": statistics.median(_idle(row) for row in steady),
            "staleness_mean": statistics.mean(row.get("async/staleness_mean", 0.0) for row in learning),
            "corrected_fraction": statistics.mean(
                row.get("off_policy/corrected_fraction", 0.0) for row in learning
            ),
            "reward_last": statistics.mean(run[-1]["reward/mean"] for run in learned[k]),
        }
    base = figures["staleness_0"]["iteration_s"]
    for k in STALENESS:
        figures[f"staleness_{k}"]["speedup"] = base / figures[f"staleness_{k}"]["iteration_s"]
    print(
        f"{name} ({' '.join(overrides)}), {iterations} iterations, {repeats} run(s) per setting, one process:"
    )
    print(
        "  staleness | equal work: s/iteration  speedup  trainer idle | learning: mean age  corrected  reward (last)"
    )
    for k in STALENESS:
        f = figures[f"staleness_{k}"]
        print(
            f"  {k:>9} | {f['iteration_s']:23.3f}  {f['speedup']:6.2f}x  {f['idle_fraction']:12.2f} | "
            f"{f['staleness_mean']:18.2f}  {f['corrected_fraction']:9.4f}  {f['reward_last']:13.3f}"
        )
    return figures


def run(quick: bool = False) -> dict[str, Any]:
    names = ["longtail"] if quick else list(WORKLOADS)
    with tempfile.TemporaryDirectory(prefix="rlhfuse-bench-async-") as folder:
        return {
            name: workload(Path(folder), name, WORKLOADS[name], 6 if quick else 10, 1 if quick else 2)
            for name in names
        }
