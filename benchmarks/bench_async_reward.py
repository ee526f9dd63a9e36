"""Does asynchronous RL learn as well as the synchronous run (issue 42's reward band)? `rlhfuse-train
experiment=longtail` learning (the configured rates) for a fixed number of iterations, over several seeds, at:
- `staleness_0`: the synchronous run;
- `staleness_1`: one version of staleness (the colocated placement; the split placement trains the same samples
  bit for bit, tests/trainer/test_trainer_split.py);
- `split_staleness_1_partial`: the split placement with partial rollouts (2 processes), the setting whose speed
  `make bench BENCH=async` measures against the synchronous run.

Each seed is its own warm start (SFT Actor and Reward model, in the default cache: RLHFUSE_CACHE or
~/.cache/rlhfuse) and its own prompts, so each seed is a pair: the settings at one seed train the same models on
the same prompts and differ only in what staleness does to them.

Figures, per setting:
- `final.seed_N`: the mean `reward/mean` over the last `window` iterations of seed N's run (one iteration's reward
  is a mean over 64 samples, too noisy alone);
- `final_mean`: their mean over the seeds; `paired_diff_mean` / `paired_diff_min`: the mean and the smallest of the
  per-seed differences from the synchronous run (the same seed's `final`);
- `curve`: the mean over the seeds of `reward/mean` at every iteration.
- `band`: the synchronous run's reward band, the lowest and highest `final` over its seeds; `in_band` is 1 when the
  setting's `final_mean` is at least the band's low end.

`make bench BENCH=async_reward` (or `python -m benchmarks.run async_reward [--quick]`): --quick runs 3 seeds x 30
iterations, the full mode 5 seeds x 40.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_async import SPLIT
from benchmarks.bench_runs import train

SETTINGS: dict[str, tuple[str, ...]] = {
    "staleness_0": ("async.max_staleness=0",),
    "staleness_1": ("async.max_staleness=1",),
    "split_staleness_1_partial": ("async.max_staleness=1", "async.partial_rollout=true", *SPLIT),
}
WINDOW = 5


def _final(rows: list[dict[str, float]]) -> float:
    return statistics.mean(row["reward/mean"] for row in rows[-WINDOW:])


def run(quick: bool = False) -> dict[str, Any]:
    seeds, iterations = (3, 30) if quick else (5, 40)
    curves: dict[str, list[list[float]]] = {key: [] for key in SETTINGS}
    finals: dict[str, list[float]] = {key: [] for key in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="rlhfuse-bench-async-reward-") as folder:
        for seed in range(seeds):
            for key, setting in SETTINGS.items():
                args = ("experiment=longtail", f"iterations={iterations}", f"seed={seed}", *setting)
                rows = train(args, Path(folder) / f"{key}-{seed}")[1]
                curves[key].append([row["reward/mean"] for row in rows])
                finals[key].append(_final(rows))
                print(f"  seed {seed} {key:<26} final reward {finals[key][-1]:7.3f}", flush=True)
    sync = finals["staleness_0"]
    band = [min(sync), max(sync)]
    figures: dict[str, Any] = {"seeds": seeds, "iterations": iterations, "window": WINDOW, "band": band}
    for key in SETTINGS:
        diffs = [mine - theirs for mine, theirs in zip(finals[key], sync, strict=True)]
        final_mean = statistics.mean(finals[key])
        figures[key] = {
            "final": {f"seed_{seed}": value for seed, value in enumerate(finals[key])},
            "final_mean": final_mean,
            "paired_diff_mean": statistics.mean(diffs),
            "paired_diff_min": min(diffs),
            "in_band": int(final_mean >= band[0]),
            "curve": [statistics.mean(step) for step in zip(*curves[key], strict=True)],
        }
    print(
        f"longtail, {seeds} seeds x {iterations} iterations; final = mean reward/mean over the last {WINDOW} "
        f"iterations; synchronous band [{band[0]:.3f}, {band[1]:.3f}]:"
    )
    marks = [*range(0, iterations, 5), iterations - 1]
    print(
        f"  setting                    | final (mean)  paired diff (mean, min)  in band | reward at iteration "
        f"{', '.join(str(m + 1) for m in marks)}"
    )
    for key in SETTINGS:
        f = figures[key]
        curve = " ".join(f"{f['curve'][m]:6.3f}" for m in marks)
        print(
            f"  {key:<26} | {f['final_mean']:12.3f}  {f['paired_diff_mean']:+10.3f} {f['paired_diff_min']:+12.3f}"
            f"  {'yes' if f['in_band'] else 'no':>7} | {curve}"
        )
    return figures
