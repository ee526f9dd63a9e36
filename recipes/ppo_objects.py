"""PPO composed of objects, no configuration strings: both fusions of the paper on 2 processes.

    python recipes/ppo_objects.py                       # 20 iterations, stops early once the task score is reached
    python recipes/ppo_objects.py --iterations 4 --run-dir runs/objects

- intra-stage fusion: `FusedPipelineStrategy` trains the Actor and the Critic as two 2-stage pipelines in opposite
  directions over the 2 processes;
- inter-stage fusion: `EngineGeneration` runs one generation instance per process and migrates the long tail to one
  of them once `threshold` samples are left, the freed instance starting inference at once;
- a callback that stops the run (`trainer.should_stop`) once the hidden task score reaches a target; the run
  still writes its checkpoint and its `actor_hf/` export as at a normal end.

Each part takes typed keyword arguments (defaults: the `conf/` group options), so this is the same run as
`rlhfuse-train pipeline=fused distributed.nproc_per_node=2 generator=engine generator.instances=2 migration=fixed
migration.threshold=16 iterations=20` plus the callback.
"""

from __future__ import annotations

import argparse

from rlhfuse.trainer import (
    Callback,
    DataConfig,
    EngineGeneration,
    FixedMigration,
    FusedPipelineStrategy,
    ModelInference,
    RLHFTrainer,
)


class StopAtScore(Callback):
    """Stops the run once the task score (`task/score`, the share of on-topic words) reaches `target`."""

    def __init__(self, target: float) -> None:
        self.target = target

    def on_iteration_end(self, trainer, iteration, metrics):
        if metrics.get("task/score", 0.0) >= self.target:
            trainer.should_stop = True


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--target-score", type=float, default=0.45)
    parser.add_argument("--run-dir", default="outputs/ppo-objects")
    args = parser.parse_args(argv)

    trainer = RLHFTrainer(
        strategy=FusedPipelineStrategy(processes=2, actor_pp=2, critic_pp=2, microbatches=2),
        generator=EngineGeneration(instances=2, migration=FixedMigration(threshold=16)),
        inferencer=ModelInference(),
        data=DataConfig(
            prompts_per_iteration=16, samples_per_prompt=4, mini_batch_size=32, micro_batch_size=16
        ),
        callbacks=[StopAtScore(args.target_score)],
        iterations=args.iterations,
        run_dir=args.run_dir,
    )
    history = trainer.fit()  # the embedded tiny model, warm-started once and cached in ~/.cache/rlhfuse
    if history and trainer.fabric.global_rank == 0:
        first, last = history[0], history[-1]
        print(
            f"task score {first['task/score']:.3f} -> {last['task/score']:.3f} in {len(history)} iterations"
        )
    return history


if __name__ == "__main__":
    main()
