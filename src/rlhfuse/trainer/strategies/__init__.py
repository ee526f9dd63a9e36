"""The training strategies, one package per family, each a bundle of its configuration section, layout,
training step, inference over its layout, checkpointer, export and its own configuration checks:

- `plain`: whole models on every rank; one process, or data parallelism over one process per generation instance;
- `fsdp`: the same launch with the models sharded over the processes (torch FSDP2);
- `pipelines`: the Actor and the Critic cut into pipeline stages (`fused`: two pipelines in opposite directions on
  the same ranks; `serial_1f1b`: one after the other).

`STRATEGIES` names each family's part class (config group `pipeline`); `strategy_class(name)` is what a name
chooses, a user's own builder (`package.module:function`) running under `RegisteredStrategy`. A user's own strategy
from Python is a subclass of one of these parts, passed as an object (`RLHFTrainer(strategy=...)`).
"""

from __future__ import annotations

from rlhfuse.core.registry import Registry
from rlhfuse.trainer.strategies.base import ExportTarget, RegisteredStrategy, StrategyPart
from rlhfuse.trainer.strategies.fsdp.part import FSDPStrategy
from rlhfuse.trainer.strategies.pipelines.part import FusedPipelineStrategy, PipelinePart, Serial1F1BStrategy
from rlhfuse.trainer.strategies.plain.part import DataParallelStrategy

STRATEGIES: Registry[type[StrategyPart]] = Registry(
    "strategy",
    "pipeline.name",
    {
        cls.name: cls
        for cls in (DataParallelStrategy, FSDPStrategy, FusedPipelineStrategy, Serial1F1BStrategy)
    },
)


def strategy_class(name: str) -> type[StrategyPart]:
    """The part class `pipeline=<name>` chooses (a name no registry knows: `RegisteredStrategy`, which validation
    reports when the name resolves to nothing)."""
    try:
        found = STRATEGIES.get(name)
    except KeyError:
        return RegisteredStrategy
    return found if isinstance(found, type) and issubclass(found, StrategyPart) else RegisteredStrategy


__all__ = [
    "STRATEGIES",
    "DataParallelStrategy",
    "ExportTarget",
    "FSDPStrategy",
    "FusedPipelineStrategy",
    "PipelinePart",
    "RegisteredStrategy",
    "Serial1F1BStrategy",
    "StrategyPart",
    "strategy_class",
]
