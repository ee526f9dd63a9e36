"""The calculator tool learned by RL (issue 43): `experiment=calculator` (recipes/calculator_arithmetic.py) as a user
starts it, `rlhfuse-train experiment=calculator eval.every=5 eval.before_training=true seed=S`, for seeds 0, 1 and
2 (--quick: seed 0).

The tiny model is warm-started to call `calc(expression)` on a quarter of its examples and to answer directly,
right ~30% of the time, on the rest; each sample is an episode of up to 2 turns rewarded 1 for a right final
answer. Per seed: the held-out greedy accuracy (`eval/reward/mean`: the environment's reward is 1 exactly for a
right answer) before the first iteration and after the last, its curve, the first evaluation at 0.95 or more,
the share of episodes calling the tool (`agent/tool_calls`) and the training reward in the first and last
iterations, the run's seconds (its warm start included: each seed's is trained into an empty cache folder).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_runs import train

TARGET = 0.95
"""The held-out accuracy whose first evaluation is reported (`reaches`)."""


def calculator(tmp: Path, seed: int) -> dict[str, Any]:
    wall, rows = train(
        ["experiment=calculator", "eval.every=5", "eval.before_training=true", f"seed={seed}"],
        tmp / f"calculator-{seed}",
        tmp / "cache",
    )
    curve = [[int(row["iteration"]), row["eval/reward/mean"]] for row in rows if "eval/reward/mean" in row]
    trained = [row for row in rows if "agent/tool_calls" in row]
    figures = {
        "run_s": wall,
        "iterations": len(trained),
        "eval_accuracy": {"before": curve[0][1], "after": curve[-1][1], "best": max(a for _, a in curve)},
        "eval_curve": curve,
        "reaches": next((it for it, accuracy in curve if accuracy >= TARGET), None),
        "tool_calls": {"first": trained[0]["agent/tool_calls"], "last": trained[-1]["agent/tool_calls"]},
        "reward": {"first": trained[0]["reward/mean"], "last": trained[-1]["reward/mean"]},
        "iteration_s": statistics.median(row["time/iteration"] for row in trained),
    }
    print(f"experiment=calculator seed {seed}: held-out accuracy {curve[0][1]:.3f} before -> {curve[-1][1]:.3f} "
          f"after {len(trained)} iterations (curve {' '.join(f'{a:.2f}' for _, a in curve)}); episodes calling "
          f"the tool {figures['tool_calls']['first']:.2f} -> {figures['tool_calls']['last']:.2f}; training reward "
          f"{figures['reward']['first']:.3f} -> {figures['reward']['last']:.3f}; {wall:.0f} s with the warm start",
          flush=True)  # fmt: skip
    return figures


def run(quick: bool = False) -> dict[str, Any]:
    """Figures per seed (`seed0`, ...): run_s, iterations, eval_accuracy.{before,after,best}, eval_curve,
    reaches (the first evaluation at TARGET or above; None: never), tool_calls and reward {first,last},
    iteration_s (median)."""
    with tempfile.TemporaryDirectory(prefix="rlhfuse-bench-calculator-") as name:
        return {f"seed{seed}": calculator(Path(name), seed) for seed in ((0,) if quick else (0, 1, 2))}
