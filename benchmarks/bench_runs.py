"""Whole training runs, as a user starts them (`python -m benchmarks.run runs [--quick]`): the figures the README
quotes for `make train` and `experiment=arithmetic`.

- `default`: the default job (`rlhfuse-train`, no overrides: PPO, 60 iterations on the embedded topic task). Its
  warm start (SFT actor and reward model) is timed first into an empty cache folder (`RLHFUSE_CACHE`), then the
  run itself with that cache; a first run on a fresh machine takes both. Figures of iterations 1 and 60:
  `reward/mean`, `task/score` (the hidden topic rule), response lengths p50 / p99 / max.
- `arithmetic`: `rlhfuse-train experiment=arithmetic eval.every=5` (GRPO, 200 iterations, no reward model): the
  training samples' accuracy (`task/accuracy`) of the first and last iterations, the held-out greedy accuracy
  (`eval/accuracy`) first, last and best, and the median seconds per iteration.
- without --quick also the policy-loss comparison of docs/algorithms.md: `experiment=arithmetic eval.every=5` under
  `algorithm=grpo|dapo` with and without `data.oversample=1`, seeds 0, 1 and 2.

Each run is a `python -m rlhfuse.trainer.train_command` process with OMP_NUM_THREADS=1; its metrics are read from
its `metrics.jsonl`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ALGORITHMS = {
    "grpo": ("algorithm=grpo",),
    "dapo_oversample": ("algorithm=dapo", "data.oversample=1"),
    "grpo_oversample": ("algorithm=grpo", "data.oversample=1"),
    "dapo": ("algorithm=dapo",),
}


def train(
    overrides: Sequence[str],
    run_dir: Path,
    cache: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> tuple[float, list[dict[str, float]]]:
    """Wall seconds of one `rlhfuse-train` process (one thread) and its metrics, one row per iteration; `cache`:
    the warm starts' folder (RLHFUSE_CACHE; None: the default); `env`: more of its environment (e.g. PYTHONPATH
    naming another checkout's src)."""
    cmd = [sys.executable, "-m", "rlhfuse.trainer.train_command", *overrides, "logger=quiet",
           f"hydra.run.dir={run_dir}"]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        **({"RLHFUSE_CACHE": str(cache)} if cache else {}),
        **(env or {}),
    }
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return seconds, [row for row in rows if "iteration" in row]


def _warm_start_s(overrides: list[str], cache: Path) -> float:
    """Seconds of the job's warm start (SFT actor and reward model) into the empty folder `cache`."""
    code = (
        "import sys, time\n"
        "from rlhfuse.data.synthetic import SyntheticTask\n"
        "from rlhfuse.trainer import compose_config\n"
        "from rlhfuse.trainer.warmstart import warm_start\n"
        "cfg = compose_config(sys.argv[1:])\n"
        "task = SyntheticTask(seed=cfg.seed, max_new_tokens=cfg.generator.sampling.max_new_tokens,\n"
        "    length_median=cfg.data.length_median, length_sigma=cfg.data.length_sigma,\n"
        "    phrase_length=cfg.data.phrase_length)\n"
        "start = time.perf_counter()\n"
        "warm_start(cfg.model, task, seed=cfg.seed, log=lambda _: None)\n"
        "print(time.perf_counter() - start)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLHFUSE_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", code, *overrides], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"warm start failed:\n{done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def _iteration(row: dict[str, float], keys: tuple[str, ...]) -> dict[str, float]:
    return {key: row[key] for key in keys}


def default_job(tmp: Path) -> dict[str, Any]:
    cache = tmp / "cache-default"
    warm = _warm_start_s([], cache)
    wall, rows = train([], tmp / "default", cache)
    keys = ("reward/mean", "task/score", "response_length/p50", "response_length/p99", "response_length/max")
    first, last = rows[0], rows[-1]
    print(f"default job: warm start {warm:.1f} s (empty cache), then the run {wall:.1f} s ({len(rows)} iterations); "
          f"first run {warm + wall:.1f} s")  # fmt: skip
    for row in (first, last):
        print(f"  iteration {int(row['iteration'])}: " + ", ".join(f"{k} {row[k]:.3g}" for k in keys))
    lengths = ("response_length/p50", "response_length/p99", "response_length/max")
    return {
        "warm_start_s": warm, "run_s": wall, "first_run_s": warm + wall, "iterations": len(rows),
        "first": _iteration(first, keys), "last": _iteration(last, keys),
        "trajectory": {f"i{int(r['iteration'])}": _iteration(r, keys) for r in rows if r["iteration"] % 10 == 0},
        "means": {
            "reward_first5": statistics.fmean(r["reward/mean"] for r in rows[:5]),
            "reward_last10": statistics.fmean(r["reward/mean"] for r in rows[-10:]),
            "task_first5": statistics.fmean(r["task/score"] for r in rows[:5]),
            "task_last10": statistics.fmean(r["task/score"] for r in rows[-10:]),
            "clipped_fraction": statistics.fmean(r["response_length/clipped_fraction"] for r in rows),
        },
        "median_over_iterations": {k: statistics.median(r[k] for r in rows) for k in lengths},
    }  # fmt: skip


def arithmetic(
    tmp: Path, cache: Path, name: str, overrides: tuple[str, ...], seed: int = 0
) -> dict[str, Any]:
    wall, rows = train(
        ["experiment=arithmetic", "eval.every=5", f"seed={seed}", *overrides], tmp / f"{name}-{seed}", cache
    )
    evaluated = [row["eval/accuracy"] for row in rows if "eval/accuracy" in row]
    figures = {
        "run_s": wall,
        "iterations": len(rows),
        "iteration_s": statistics.median(row["time/iteration"] for row in rows),
        "train_accuracy": {"first": rows[0]["task/accuracy"], "last": rows[-1]["task/accuracy"]},
        "eval_accuracy": {"first": evaluated[0], "last": evaluated[-1], "best": max(evaluated)},
        "eval_curve": [
            [int(row["iteration"]), row["eval/accuracy"]] for row in rows if "eval/accuracy" in row
        ],
        "entropy_last": rows[-1].get("policy/entropy"),
        # generated response tokens, those of dynamic sampling's dropped groups included
        "generated_tokens_k": sum(
            row["response_length/mean"] * row["throughput/samples_per_s"] * row["time/iteration"]
            + row.get("rollout/extra_tokens", 0.0)
            for row in rows
        )
        / 1000,
    }
    print(f"experiment=arithmetic {' '.join(overrides)} seed {seed}: {len(rows)} iterations in {wall:.1f} s "
          f"(median {figures['iteration_s']:.3f} s each); training accuracy {figures['train_accuracy']['first']:.3f} "
          f"-> {figures['train_accuracy']['last']:.3f}; held-out accuracy {evaluated[0]:.3f} -> {evaluated[-1]:.3f} "
          f"(best {max(evaluated):.3f})", flush=True)  # fmt: skip
    return figures


def run(quick: bool = False) -> dict[str, Any]:
    """Figures: `default` (warm_start_s, run_s, first_run_s, first / last iteration's metrics) and `arithmetic`
    (run_s, iteration_s, train_accuracy and eval_accuracy first / last (/ best)); without --quick
    `algorithms.{grpo,dapo,grpo_oversample,dapo_oversample}.seed{0,1,2}` (the same figures)."""
    with tempfile.TemporaryDirectory(prefix="rlhfuse-bench-runs-") as name:
        tmp = Path(name)
        figures: dict[str, Any] = {"default": default_job(tmp)}
        cache = tmp / "cache-arithmetic"
        figures["arithmetic"] = arithmetic(tmp, cache, "arithmetic", ())
        if not quick:
            figures["algorithms"] = {
                algorithm: {
                    f"seed{seed}": _attempt(tmp, cache, algorithm, overrides, seed) for seed in (0, 1, 2)
                }
                for algorithm, overrides in ALGORITHMS.items()
            }
            for seed in (0, 1, 2):  # the first evaluation at or above GRPO's final accuracy (None: never)
                final = figures["algorithms"]["grpo"][f"seed{seed}"].get("eval_accuracy", {}).get("last")
                for runs in figures["algorithms"].values():
                    got = runs[f"seed{seed}"]
                    curve = got.get("eval_curve", [])
                    got["reaches_grpo_final"] = next(
                        (it for it, acc in curve if final is not None and acc >= final), None
                    )
    return figures


def _attempt(tmp: Path, cache: Path, name: str, overrides: tuple[str, ...], seed: int) -> dict[str, Any]:
    """`arithmetic`, or the run's last line where it stopped (dynamic sampling can stop a run: DynamicSamplingError)."""
    try:
        return arithmetic(tmp, cache, name, overrides, seed)
    except RuntimeError as exc:
        print(f"  {name} seed {seed} failed: {str(exc).strip().splitlines()[-1]}", flush=True)
        return {"failed": str(exc).strip().splitlines()[-1]}
