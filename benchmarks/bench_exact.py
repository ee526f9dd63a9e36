"""What exact=true costs (issue 44): generation, inference and training time with the batch-invariant forward on
and off, side by side, and the sampler-trainer mismatch each leaves.

Runs of `rlhfuse-train` (fresh processes, the warm-start cache shared), the two sides alternating run by run so
that load drifting over the benchmark biases neither; per side the median over runs of each run's steady
iterations (the first is left out: it builds the engines). On the default job (one process), and without --quick
also on experiment=longtail with 2 generation instances and migration=fixed (two processes; minutes per run).

Figures per workload and side (`exact`, `sdpa`): `generation_s`, `inference_s`, `training_s`, `iteration_s`
(medians), `generation_s_per_token` (the median of generation seconds over the mean response length), `logprob_abs_diff` and `logprob_abs_diff_max` (the largest over the
runs' iterations); per workload `over_sdpa.{generation,inference,training,iteration}` (exact / sdpa) and
`over_sdpa.generation_per_token` (generation_s_per_token, exact / sdpa: the two sides sample different tokens,
so their responses, and the work of a phase, differ).

`make bench BENCH=exact` (or `python -m benchmarks.run exact [--quick]`).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_runs import train

PHASES = {"generation": "time/generation", "inference": "time/inference", "training": "time/training",
          "iteration": "time/iteration"}  # fmt: skip
WORKLOADS: dict[str, tuple[str, ...]] = {
    "default": ("iterations=4",),
    "longtail": ("experiment=longtail", "iterations=3", "generator=engine", "generator.instances=2",
                 "migration=fixed", "migration.threshold=0.25"),
}  # fmt: skip


def _run(tmp: Path, name: str, overrides: tuple[str, ...]) -> list[dict[str, float]]:
    return train(overrides, tmp / name, tmp / "cache")[1]


def workload(tmp: Path, name: str, overrides: tuple[str, ...], repeats: int) -> dict[str, Any]:
    rows: dict[str, list[list[dict[str, float]]]] = {"exact": [], "sdpa": []}
    for r in range(repeats):
        for side in rows:
            rows[side].append(_run(tmp, f"{name}-{side}-{r}", (*overrides, f"exact={side == 'exact'}")))
    figures: dict[str, Any] = {}
    for side, runs in rows.items():
        steady = [row for run in runs for row in run[1:]]
        figures[side] = {
            f"{phase}_s": statistics.median(r[key] for r in steady) for phase, key in PHASES.items()
        }
        # the two sides sample different tokens (the bits differ), so their responses differ in length: the
        # generation phase's time per token of the mean response compares like work
        figures[side]["generation_s_per_token"] = statistics.median(
            r["time/generation"] / r["response_length/mean"] for r in steady
        )
        figures[side]["logprob_abs_diff"] = statistics.median(r["rollout/logprob_abs_diff"] for r in steady)
        figures[side]["logprob_abs_diff_max"] = max(
            r["rollout/logprob_abs_diff_max"] for run in runs for r in run
        )
    figures["over_sdpa"] = {p: figures["exact"][f"{p}_s"] / figures["sdpa"][f"{p}_s"] for p in PHASES}
    figures["over_sdpa"]["generation_per_token"] = (
        figures["exact"]["generation_s_per_token"] / figures["sdpa"]["generation_s_per_token"]
    )
    print(f"{name} ({' '.join(overrides)}), {repeats} runs per side, median of the steady iterations:")
    for phase in PHASES:
        e, s = figures["exact"][f"{phase}_s"], figures["sdpa"][f"{phase}_s"]
        print(f"  {phase:>10}: exact {e:7.3f} s  sdpa {s:7.3f} s  exact / sdpa = {e / s:5.2f}x")
    per_token = figures["over_sdpa"]["generation_per_token"]
    print(f"  generation per token of the mean response: exact / sdpa = {per_token:5.2f}x")
    for side in rows:
        f = figures[side]
        print(
            f"  {side}: rollout/logprob_abs_diff {f['logprob_abs_diff']:.3g}, max {f['logprob_abs_diff_max']:.3g}"
        )
    return figures


def run(quick: bool = False) -> dict[str, Any]:
    names = ["default"] if quick else list(WORKLOADS)
    with tempfile.TemporaryDirectory(prefix="rlhfuse-bench-exact-") as folder:
        return {name: workload(Path(folder), name, WORKLOADS[name], 2 if quick else 3) for name in names}
