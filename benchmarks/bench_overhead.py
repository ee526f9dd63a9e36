"""Seconds per phase of a steady PPO iteration, this tree against a baseline checkout (issue 46: the framework
overhead of the training step and inference on a tiny workload).

Both trees run the same command line, `python -m rlhfuse.trainer.train_command iterations=6` (the default job, or
OVERHEAD_ARGS: more hydra overrides, e.g. a workload of your own), in fresh
interpreters alternating A B A B ..., so that load drifting over the run biases neither. Each run's figure is the
median over its steady iterations (2..6) of time/generation, time/inference, time/training and time/iteration;
the table gives the median over the runs of each tree and the ratio this / baseline.

BASELINE: the `src` folder of the checkout to compare with; by default a `git worktree` of HEAD~1 made (and
removed) in a temporary folder. `make bench BENCH=overhead` (or `python -m benchmarks.run overhead [--quick]`).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("generation", "inference", "training", "iteration")
ITERATIONS = 6
STEADY = slice(1, None)
"""Iterations 2..6: the first pays for warm-up (allocator, lazy imports, first weight sync)."""


@contextmanager
def baseline_src() -> Iterator[Path]:
    """BASELINE's src folder, or that of a temporary `git worktree` of HEAD~1."""
    if os.environ.get("BASELINE"):
        yield Path(os.environ["BASELINE"])
        return
    with tempfile.TemporaryDirectory() as folder:
        tree = Path(folder) / "baseline"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), "HEAD~1"],
            check=True,
            capture_output=True,
        )
        try:
            yield tree / "src"
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def one_run(src: Path, folder: Path, extra: list[str]) -> dict[str, float]:
    """One training run on the sources under `src`: the median seconds of each phase over its steady iterations."""
    env = dict(
        os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1"
    )
    command = [sys.executable, "-m", "rlhfuse.trainer.train_command", f"iterations={ITERATIONS}"]
    subprocess.run(
        [*command, *extra, f"hydra.run.dir={folder}"],
        env=env,
        cwd=folder.parent,
        check=True,
        capture_output=True,
    )
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()][STEADY]
    return {phase: statistics.median(row[f"time/{phase}"] for row in rows) for phase in PHASES}


def run(quick: bool = False) -> dict[str, Any]:
    rounds = 2 if quick else 4
    extra = shlex.split(os.environ.get("OVERHEAD_ARGS", ""))
    runs: dict[str, list[dict[str, float]]] = {"this": [], "baseline": []}
    with baseline_src() as base, tempfile.TemporaryDirectory() as scratch:
        trees = {"this": ROOT / "src", "baseline": base}
        for r in range(rounds):
            for name, src in trees.items():
                runs[name].append(one_run(src, Path(scratch) / f"{name}{r}", extra))
    medians = {
        name: {phase: round(statistics.median(run[phase] for run in done), 4) for phase in PHASES}
        for name, done in runs.items()
    }
    ratio = {phase: round(medians["this"][phase] / medians["baseline"][phase], 3) for phase in PHASES}
    print(
        f"{rounds} runs each, alternating; steady iterations 2..{ITERATIONS}; load {os.getloadavg()[0]:.1f}"
    )
    print(f"  {'phase':12s} {'this s':>8s} {'baseline s':>11s} {'ratio':>7s}")
    for phase in PHASES:
        this, was = medians["this"][phase], medians["baseline"][phase]
        print(f"  {phase:12s} {this:8.3f} {was:11.3f} {ratio[phase]:7.3f}")
    return {"seconds": medians, "ratio": ratio, "rounds": rounds, "args": extra, "runs": runs}


if __name__ == "__main__":
    run(quick="--quick" in sys.argv)
