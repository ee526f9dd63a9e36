"""Start-up time of the command line and the library (issue 46): wall seconds of fresh interpreters, best of
several rounds, the commands interleaved round by round so that load drifting over the run biases none of them.

`import torch` is measured beside them: the figure that matters is each command against it (`over_torch`), since
torch alone takes most of `from rlhfuse.trainer import build_trainer`. The bytecode cache is on (a cache folder
under the temporary directory, warmed by an untimed round), as for an installed package.

`make bench BENCH=startup` (or `python -m benchmarks.run startup [--quick]`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import Any

COMMANDS = {
    "pass": ["-c", "pass"],
    "torch": ["-c", "import torch"],
    "lightning": ["-c", "import lightning"],
    "trainer_package": ["-c", "import rlhfuse.trainer"],
    "build_trainer": ["-c", "from rlhfuse.trainer import build_trainer"],
    "train_help": ["-m", "rlhfuse.trainer.train_command", "--help"],
    "train_cfg_job": ["-m", "rlhfuse.trainer.train_command", "--cfg", "job"],
}


def best_times(
    commands: dict[str, list[str]], rounds: int, trees: dict[str, str | None] | None = None
) -> dict[str, dict[str, float]]:
    """Per tree (a `src` folder put first on PYTHONPATH; None: the installed package) and command, the best wall
    seconds of `rounds` fresh interpreters, after an untimed round that writes the bytecode cache; the trees and
    commands interleaved round by round."""
    trees = trees or {"this": None}
    best = {tree: dict.fromkeys(commands, float("inf")) for tree in trees}
    with tempfile.TemporaryDirectory() as cwd:  # Hydra writes nothing for --help / --cfg; keep the repo clean
        base = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
        base.pop("PYTHONDONTWRITEBYTECODE", None)
        for r in range(rounds + 1):  # round 0 writes the bytecode cache
            for tree, src in trees.items():
                env = dict(base, PYTHONPYCACHEPREFIX=os.path.join(cwd, f"pycache-{tree}"))
                if src is not None:
                    env["PYTHONPATH"] = src
                for name, args in commands.items():
                    start = time.perf_counter()
                    subprocess.run([sys.executable, *args], env=env, cwd=cwd, check=True, capture_output=True)
                    if r:
                        best[tree][name] = min(best[tree][name], time.perf_counter() - start)
    return best


def run(quick: bool = False) -> dict[str, Any]:
    rounds = 3 if quick else 5
    best = best_times(COMMANDS, rounds)["this"]
    seconds = {k: round(v, 3) for k, v in best.items()}
    over_torch = {
        k: round(best[k] - best["torch"], 3) for k in ("build_trainer", "train_help", "train_cfg_job")
    }
    print(f"best of {rounds} rounds, load {os.getloadavg()[0]:.1f}")
    for name, value in seconds.items():
        print(f"  {name:16s} {value:6.2f} s")
    for name, value in over_torch.items():
        print(f"  {name:16s} {value:+6.2f} s against import torch")
    return {"best_s": seconds, "over_torch": over_torch, "rounds": rounds}


if __name__ == "__main__":
    run(quick="--quick" in sys.argv)
