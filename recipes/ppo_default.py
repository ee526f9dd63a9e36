"""The default PPO recipe, as a script: compose the shipped config, build the trainer, fit.

    python recipes/ppo_default.py                      # same job as `rlhfuse-train`
    python recipes/ppo_default.py algorithm.kl_coef=0.1 iterations=20 run_dir=runs/kl01

Steps: (0) compose + validate the config (errors name the override to fix); (1) warm start: SFT actor and
Bradley–Terry reward model on the embedded topic task, cached in ~/.cache/rlhfuse; (2) PPO with RLHFTrainer;
(3) the trained actor is exported to <run_dir>/actor_hf as a Hugging Face checkpoint.
"""

from __future__ import annotations

import sys
import time

from rlhfuse.trainer import Callback, build_trainer, compose_config


class PrintBest(Callback):
    """A user callback: a `rlhfuse.trainer.Callback` overriding the hooks it needs."""

    def __init__(self) -> None:
        self.best = float("-inf")

    def on_iteration_end(self, trainer, iteration, metrics):
        self.best = max(self.best, metrics["reward/mean"])

    def on_fit_end(self, trainer):
        print(f"best mean reward: {self.best:+.3f}")


def main(overrides: list[str]) -> list[dict[str, float]]:
    config = compose_config(overrides)
    config.run_dir = config.run_dir or f"outputs/recipe-{time.strftime('%Y%m%d-%H%M%S')}"
    trainer = build_trainer(config, callbacks=[PrintBest()])
    history = trainer.fit()
    first, last = history[0], history[-1]
    print(
        f"reward {first['reward/mean']:+.3f} -> {last['reward/mean']:+.3f}, "
        f"task score {first.get('task/score', float('nan')):.3f} -> {last.get('task/score', float('nan')):.3f}; "
        f"metrics: {config.run_dir}/metrics.jsonl, actor: {config.run_dir}/actor_hf"
    )
    return history


if __name__ == "__main__":
    main(sys.argv[1:])
