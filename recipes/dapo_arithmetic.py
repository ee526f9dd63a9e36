"""DAPO on the embedded arithmetic task, as a script: all four of its parts on the tiny warm-started model.

    python recipes/dapo_arithmetic.py                          # 200 iterations of experiment=arithmetic
    python recipes/dapo_arithmetic.py iterations=50 seed=1 run_dir=runs/dapo
    python recipes/dapo_arithmetic.py generator=engine generator.instances=2 migration=auto   # 2 processes

DAPO (Yu et al. 2025, arXiv 2503.14476) is GRPO with (1) a decoupled clip range (clip-higher: 1 - 0.2 .. 1 + 0.28),
(2) the loss averaged over every token of the batch, (3) a soft penalty on responses that reach into the last fifth
of generator.max_new_tokens and (4) dynamic sampling: a prompt whose samples all scored alike trains nothing under a
group baseline, so its group is dropped and further prompts are generated in its place until the batch holds
data.prompts_per_iteration groups whose rewards differ. (1)-(3) are `algorithm=dapo`, (4) is `data.oversample` (1
here: each round generates only the groups still missing, so a dropped group costs its own tokens alone).
Held-out accuracy (greedy answers to the held-out problems) is logged every 10 iterations as eval/accuracy;
`python recipes/dapo_arithmetic.py algorithm=grpo data.oversample=0` is the GRPO run to compare with
(docs/algorithms.md, "Policy losses"). A policy that ends up scoring every prompt's samples alike leaves dynamic
sampling nothing to keep: the iteration then stops with an error naming data.oversample.
"""

from __future__ import annotations

import sys
import time

from rlhfuse.trainer import build_trainer, compose_config

DAPO = ["experiment=arithmetic", "algorithm=dapo", "data.oversample=1", "eval.every=10"]


def main(overrides: list[str], base: list[str] = DAPO) -> list[dict[str, float]]:
    """The run of `base` + `overrides` (command-line overrides), with its held-out accuracy and what dynamic
    sampling dropped printed at the end."""
    config = compose_config([*base, *overrides])
    config.run_dir = config.run_dir or f"outputs/dapo-{time.strftime('%Y%m%d-%H%M%S')}"
    history = build_trainer(config).fit()
    evaluated = [row for row in history if "eval/accuracy" in row]
    dropped = sum(row.get("rollout/groups_dropped", 0.0) for row in history)
    extra = sum(row.get("rollout/extra_tokens", 0.0) for row in history)
    accuracy = " -> ".join(f"{row['eval/accuracy']:.3f}" for row in evaluated[:: max(len(evaluated) // 4, 1)])
    print(
        f"held-out accuracy {accuracy or 'not evaluated'}; dynamic sampling dropped {dropped:.0f} groups "
        f"({extra:.0f} extra generated tokens); metrics: {config.run_dir}/metrics.jsonl"
    )
    return history


if __name__ == "__main__":
    main(sys.argv[1:])
