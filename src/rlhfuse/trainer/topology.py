"""The run's topology, derived once from the configuration: how the training strategy lays the models out over
the processes, how many processes and generation instances there are, and so whether the rollout fuses
inference into generation. Every "is this a pipeline strategy / how many processes / does the rollout fuse"
is asked of a `Topology`, and what a component can do of its registry entry (`StrategyEntry`,
`GeneratorEntry`), never of a component's name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rlhfuse.runtime.pipeline_config import PipelineRun, launched_world_size
from rlhfuse.trainer.data_parallel import plain_world_size
from rlhfuse.trainer.rules import not_speculating, replica_problems

if TYPE_CHECKING:
    from rlhfuse.runtime.layout import ParallelLayout
    from rlhfuse.trainer.run_config import RLHFConfig

StrategyKind = Literal["replicas", "sharded", "pipelines"]
"""How a training strategy lays the models out: `replicas` (whole models on every rank: one process, or data
parallel over one process per generation instance), `sharded` (the same processes, the models sharded over
them), `pipelines` (the Actor and Critic cut into pipeline stages over `distributed.nproc_per_node` processes)."""


Rules = Callable[["RLHFConfig", "Topology", Any], list[str]]
"""A component's own rules against the whole configuration, the topology and the Actor's shape (a `ModelConfig`,
None when unknown): `rlhfuse.trainer.rules`."""


@dataclass(frozen=True)
class StrategyEntry:
    """A registered training strategy (`pipeline=<name>`): its builder, its layout, whether it fuses the Actor's
    and the Critic's training (two pipelines in opposite directions on the same devices), and its own rules."""

    build: Callable[[Any], Any]
    kind: StrategyKind
    fuses_training: bool = False
    problems: Rules = replica_problems


@dataclass(frozen=True)
class GeneratorEntry:
    """A registered generator (`generator=<name>`): its builder, whether it drives generation instances
    (several, migration between them, one per process, inference fused into the tail), and its own rules."""

    build: Callable[[Any], Any]
    instances: bool
    problems: Rules = not_speculating
    own_tensor_parallel: bool = False
    """Its instances span generator.tp ranks with the backend's own tensor parallelism (vLLM's), and a weight
    sync hands each rank whole tensors that the backend cuts itself (rlhfuse's tensor-parallel instances take
    their shard, resharded from the training layout)."""


@dataclass(frozen=True)
class InferencerEntry:
    """A registered inferencer (`inferencer=<name>`): its builder, and whether it runs the Ref / Reward / Critic
    forward passes over the training layout's pipeline stages (else each rank infers its own samples with whole
    models)."""

    build: Callable[[Any], Any]
    over_stages: bool = False


@dataclass(frozen=True)
class MigrationEntry:
    """A registered migration policy (`migration=<name>`): its builder, whether it moves samples between
    generation instances, and whether it tunes its threshold from measurements."""

    build: Callable[[Any], Any]
    moves: bool
    tuned: bool = False


def strategy_entry(name: str) -> StrategyEntry:
    """`pipeline=<name>`'s entry; a user's own builder (`package.module:function`) lays out replicas."""
    from rlhfuse.trainer.components import STRATEGIES

    found = STRATEGIES.get(name)
    return found if isinstance(found, StrategyEntry) else StrategyEntry(found, "replicas")


def generator_entry(name: str) -> GeneratorEntry:
    """`generator=<name>`'s entry; a user's own builder drives no instances."""
    from rlhfuse.trainer.components import GENERATORS

    found = GENERATORS.get(name)
    return found if isinstance(found, GeneratorEntry) else GeneratorEntry(found, instances=False)


def inferencer_entry(name: str) -> InferencerEntry:
    """`inferencer=<name>`'s entry; a user's own builder infers with whole models."""
    from rlhfuse.trainer.components import INFERENCERS

    found = INFERENCERS.get(name)
    return found if isinstance(found, InferencerEntry) else InferencerEntry(found)


def migration_entry(name: str) -> MigrationEntry:
    """`migration=<name>`'s entry; a user's own policy is taken to move samples with a threshold it sets."""
    from rlhfuse.trainer.components import MIGRATION_POLICIES

    found = MIGRATION_POLICIES.get(name)
    return found if isinstance(found, MigrationEntry) else MigrationEntry(found, moves=True)


@dataclass(frozen=True)
class Topology:
    """The processes of a run and what they are.

    `world`: processes (torchrun's WORLD_SIZE when launched by it). `instances`: generation instances (one per
    process under `replicas` / `sharded` unless `generator.in_process`; under `pipelines`, world /
    generator.tp tensor-parallel instances with generator=sampling, else `generator.instances`).
    `fused_rollout`: the processes are the instances of a generator with instances (one each, or generator.tp
    each for a backend with its own tensor parallelism), and the models they infer with are whole on each, so the
    rollout fuses inference into generation across processes (inter-stage fusion)."""

    strategy: StrategyKind
    world: int
    instances: int
    fused_rollout: bool
    weight_shards: int = 1
    """The tensor-parallel degree of what each rank's generator takes at a weight sync: generator.tp for
    rlhfuse's tensor-parallel instances (each rank its shard), 1 for whole tensors (a backend with its own
    tensor parallelism cuts them itself)."""

    pipeline_run: PipelineRun | None = field(default=None, compare=False)
    """What the pipeline runtime reads of the configuration (the pipeline strategies; None otherwise)."""

    @functools.cached_property
    def stages(self) -> ParallelLayout:
        """The pipeline strategies' layout, derived once for the whole start-up (validation, the resume check,
        the stages each rank builds, the strategy); ValueError when it cannot be laid out (validation names why)."""
        if self.pipeline_run is None:
            raise ValueError(f"a {self.strategy} strategy has no pipeline layout")
        return self.pipeline_run.layout()

    @property
    def pipelines(self) -> bool:
        return self.strategy == "pipelines"

    @property
    def sharded(self) -> bool:
        return self.strategy == "sharded"

    @property
    def process_group(self) -> bool:
        """Whether the run needs a process group: several processes, or models sharded over a group (of one)."""
        return self.world > 1 or self.sharded


def topology(cfg: RLHFConfig) -> Topology:
    """The topology `cfg` describes (a name no registry knows counts as replicas and no instances: validation
    reports it)."""
    from rlhfuse.trainer.components import GENERATORS, STRATEGIES

    kind = strategy_entry(cfg.pipeline.name).kind if cfg.pipeline.name in STRATEGIES else "replicas"
    g = cfg.generator
    if kind == "pipelines":
        world = launched_world_size(max(cfg.distributed.nproc_per_node, 1))
    else:
        world = plain_world_size(cfg)
    entry = generator_entry(g.name) if g.name in GENERATORS else None
    with_instances = entry is not None and entry.instances
    own_tp = entry is not None and entry.own_tensor_parallel
    instances = world // max(g.tp, 1) if kind == "pipelines" and not with_instances else g.instances
    # the instances over the processes (one rank each, or generator.tp each with the backend's own tensor
    # parallelism); sharded models make every forward collective: inference runs in lockstep after generation
    ranks = g.instances * (max(g.tp, 1) if own_tp else 1)
    fused = with_instances and g.instances > 1 and ranks == world and kind != "sharded"
    run = cfg.pipeline_run() if kind == "pipelines" else None
    return Topology(kind, world, instances, fused, 1 if own_tp else max(g.tp, 1), run)
