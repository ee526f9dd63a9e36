"""Seconds per phase of a steady PPO iteration, this tree against a baseline checkout (issue 46: the framework
overhead of the training step and inference on a tiny workload).

The workload (`PPO_SHAPE`) is the tiny PPO one of the TRL 1.12 comparison, on the embedded task: a Llama-shaped
Actor of hidden 128, 4 layers, 4 heads / 2 kv heads (the Critic and Reward model alike), 64 prompts x 1 sample
per iteration, 48 new tokens at temperature 1, 2 PPO epochs over 2 mini-batches of 32, fp32, one thread.
OVERHEAD_ARGS replaces it (hydra overrides; `OVERHEAD_ARGS=" "` is the default job). Both trees run
`python -m rlhfuse.trainer.train_command iterations=6` with it in fresh interpreters alternating A B A B ..., so
that load drifting over the run biases neither. Each run's figure is the median over its steady iterations
(2..6) of time/generation, time/inference, time/training and time/iteration, and its whole process's wall seconds
(`process`) and start-up (`startup`: the process less its iterations); the table gives the median over the runs
of each tree and the ratio this / baseline. Start-up of commands: `rlhfuse-train --help`, `build_trainer` and `import`
of each top package's main module (`MODULES`) in fresh interpreters, best of several rounds, both trees
interleaved (`bench_startup.best_times`), each over `python -c pass` (`import torch` is one of them).

BASELINE: the `src` folder of the checkout to compare with; by default a `git worktree` of HEAD~1 made (and
removed) in a temporary folder. `make bench BENCH=overhead` (or `python -m benchmarks.run overhead [--quick]`).
"""

from __future__ import annotations

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

from benchmarks.bench_runs import train
from benchmarks.bench_startup import best_times

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("generation", "inference", "training", "iteration")
WHOLE = ("process", "startup")
"""A run's whole process (wall seconds, warm start cached) and its start-up: the process less all its
iterations (interpreter, imports, building the models and the components, the end)."""
ITERATIONS = 6
STEADY = slice(1, None)
"""Iterations 2..6: the first pays for warm-up (allocator, lazy imports, first weight sync)."""
PPO_SHAPE = (
    "model.hidden_size=128 model.intermediate_size=344 model.num_layers=4 model.num_heads=4 model.num_kv_heads=2 "
    "data.prompts_per_iteration=64 data.samples_per_prompt=1 data.mini_batch_size=32 data.micro_batch_size=32 "
    "generator.max_new_tokens=48 generator.temperature=1.0 algorithm.ppo_epochs=2 pipeline.precision=32-true "
    "pipeline.actor_lr=1e-5 pipeline.critic_lr=1e-5 pipeline.warmup_steps=0 pipeline.lr_schedule=constant"
)
# each top package's main module (the packages themselves import lazily: nothing until a name is used)
MODULES = {
    "core": "core.types", "models": "models.transformer", "algorithms": "algorithms.losses",
    "generation": "generation.engine", "runtime": "runtime.executor", "planner": "planner.plan_simulator",
    "trainer": "trainer.build",
}  # fmt: skip
STARTUP = {
    "pass": ["-c", "pass"],
    "torch": ["-c", "import torch"],
    "train_help": ["-m", "rlhfuse.trainer.train_command", "--help"],
    **{f"import_{p}": ["-c", f"import rlhfuse.{m}"] for p, m in MODULES.items()},
    "build_trainer": ["-c", "from rlhfuse.trainer import build_trainer"],
}


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
    """One training run on the sources under `src`: the median seconds of each phase over its steady iterations,
    the whole process's seconds and its start-up's (`WHOLE`)."""
    seconds, rows = train([f"iterations={ITERATIONS}", *extra], folder, env={"PYTHONPATH": str(src)})
    phases = {phase: statistics.median(row[f"time/{phase}"] for row in rows[STEADY]) for phase in PHASES}
    startup = seconds - sum(row["time/iteration"] for row in rows)
    return {**phases, "process": seconds, "startup": startup}


def run(quick: bool = False) -> dict[str, Any]:
    rounds = 2 if quick else 4
    extra = shlex.split(os.environ.get("OVERHEAD_ARGS", PPO_SHAPE))
    runs: dict[str, list[dict[str, float]]] = {"this": [], "baseline": []}
    with baseline_src() as base, tempfile.TemporaryDirectory() as scratch:
        trees = {"this": ROOT / "src", "baseline": base}
        for r in range(rounds):
            for name, src in trees.items():
                runs[name].append(one_run(src, Path(scratch) / f"{name}{r}", extra))
        startup = best_times(STARTUP, 3 if quick else 5, {name: str(src) for name, src in trees.items()})
    medians = {
        name: {phase: round(statistics.median(run[phase] for run in done), 4) for phase in (*PHASES, *WHOLE)}
        for name, done in runs.items()
    }
    ratio = {
        phase: round(medians["this"][phase] / medians["baseline"][phase], 3) for phase in (*PHASES, *WHOLE)
    }
    print(
        f"{rounds} runs each, alternating; steady iterations 2..{ITERATIONS}; load {os.getloadavg()[0]:.1f}"
    )
    print(f"  {'phase':14s} {'this s':>8s} {'baseline s':>11s} {'ratio':>7s}")
    for phase in (*PHASES, *WHOLE):
        this, was = medians["this"][phase], medians["baseline"][phase]
        print(f"  {phase:14s} {this:8.3f} {was:11.3f} {ratio[phase]:7.3f}")
    # each command over a bare interpreter (python -c pass), per tree
    over_pass = {
        tree: {k: round(v - times["pass"], 3) for k, v in times.items() if k != "pass"}
        for tree, times in startup.items()
    }
    print("  start-up and imports, seconds over `python -c pass` (best of fresh interpreters):")
    print(f"  {'command':18s} {'this s':>8s} {'baseline s':>11s}")
    for name in over_pass["this"]:
        print(f"  {name:18s} {over_pass['this'][name]:8.3f} {over_pass['baseline'][name]:11.3f}")
    return {"phase_s": medians, "ratio": ratio, "startup_over_pass_s": over_pass, "rounds": rounds,
            "args": extra, "runs": runs}  # fmt: skip


if __name__ == "__main__":
    run(quick="--quick" in sys.argv)
