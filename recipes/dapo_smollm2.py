"""DAPO on a real pretrained model: SmolLM2-135M-Instruct (converted offline by `make real-model`) on the embedded
arithmetic task, the recipe of `recipes/dapo_arithmetic.py` around `experiment=smollm2_arith`.

    make real-model && python recipes/dapo_smollm2.py           # 20 iterations (more than ten minutes on a CPU)
    python recipes/dapo_smollm2.py iterations=4 run_dir=runs/dapo-smollm2
    python recipes/dapo_smollm2.py algorithm=grpo data.oversample=0    # the experiment's own GRPO, to compare

The experiment's settings for a pretrained policy stay (a learning rate of 1e-6 with warm-up, the KL to the Ref
model as a loss term, one pass over each rollout, sampling at temperature 0.7); DAPO adds its clip-higher range,
the token-mean loss, the overlong penalty over the last fifth of the 32 new tokens and dynamic sampling
(`data.oversample=1`: groups of 4 samples that all scored alike are dropped and replaced). Held-out greedy
accuracy is logged every 5 iterations (eval/accuracy).
"""

from __future__ import annotations

import sys

from dapo_arithmetic import main  # this folder is the script's: the same recipe around another experiment

DAPO_SMOLLM2 = [
    "experiment=smollm2_arith",
    "algorithm=dapo",
    "data.oversample=1",
    "eval.every=5",
    "eval.split_fraction=0.1",
]

if __name__ == "__main__":
    main(sys.argv[1:], base=DAPO_SMOLLM2)
