"""The guessing game on a real pretrained model: SmolLM2-135M-Instruct (converted offline by `make real-model`)
guesses a number from 1 to 100 over up to 6 turns, each guess answered "Higher." or "Lower.", rewarded 1 when it
finds the number (`experiment=guess_smollm2`: `data.source=guess`, `agent.env=guess`, GRPO).

    make real-model && python recipes/guess_smollm2.py          # 20 iterations (tens of minutes on a CPU)
    python recipes/guess_smollm2.py iterations=4 run_dir=runs/guess-smollm2

The held-out games (16, greedy) are played before the first iteration and every 5 (eval/reward/mean: the share
won); agent/turns_mean and agent/truncated say how the episodes end. docs/agents.md gives a measured run: a 135M
model plays this game badly, and a few iterations do not change that much.
"""

from __future__ import annotations

import sys

from calculator_arithmetic import (
    main,
)  # this folder is the script's: the same recipe around another experiment

GUESS_SMOLLM2 = ["experiment=guess_smollm2", "eval.every=5", "eval.before_training=true"]

if __name__ == "__main__":
    main(sys.argv[1:], base=GUESS_SMOLLM2)
