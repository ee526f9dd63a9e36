"""The run's topology, derived once from the configuration: how many processes the training strategy runs on and
how many generation instances they hold, its pipeline layout, and so whether the rollout fuses inference into
generation. The strategy's part class answers each of these (`rlhfuse.trainer.strategies`), and what a generator,
an inferencer or a migration policy can do is asked of its registry entry (`GeneratorEntry`, ...), never of a
component's name or kind.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlhfuse.trainer.rules import not_speculating
from rlhfuse.trainer.strategies import StrategyPart, strategy_class
from rlhfuse.trainer.strategies.pipelines.config import PipelineRun

if TYPE_CHECKING:
    from rlhfuse.distributed import WorldGroups
    from rlhfuse.runtime.layout import ParallelLayout
    from rlhfuse.trainer.run_config import RLHFConfig


Rules = Callable[["RLHFConfig", "Topology", Any], list[str]]
"""A component's own rules against the whole configuration, the topology and the Actor's shape (a `ModelConfig`,
None when unknown): `rlhfuse.trainer.rules`."""


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
    runs_ahead: bool = True
    """It may generate in a background thread beside training (asynchronous RL, async.max_staleness > 0): its
    generation and weight loads run on any thread, one at a time."""
    partial: bool = False
    """Its samples may continue under new weights between two decode steps (`generate_partial`, async
    partial rollouts)."""
    opens: bool = False
    """Its rollout can stay open while it decodes, prompts joining (`open_rollout`): with its instances all in one
    process, dynamic sampling runs inside the rollout and a multi-turn agent's episodes at their own pace
    (`Topology.open_rollout`)."""


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

    `strategy`: the training strategy's part class, which answers the layout. `world`: processes (torchrun's
    WORLD_SIZE when launched by it). `instances`: generation instances (one per process when the strategy's launch
    is one process per instance, unless `generator.in_process`; under the pipelines, world / generator.tp
    tensor-parallel instances with generator=sampling, else `generator.instances`).
    `fused_rollout`: the processes are the instances of a generator with instances (one each, or generator.tp
    each for a backend with its own tensor parallelism), and the models they infer with are whole on each, so the
    rollout fuses inference into generation across processes (inter-stage fusion)."""

    strategy: type[StrategyPart] = field(compare=False)
    world: int
    instances: int
    fused_rollout: bool
    weight_shards: int = 1
    """The tensor-parallel degree of what each rank's generator takes at a weight sync: generator.tp for
    rlhfuse's tensor-parallel instances (each rank its shard), 1 for whole tensors (a backend with its own
    tensor parallelism cuts them itself)."""

    pipeline_run: PipelineRun | None = field(default=None, compare=False)
    """What the pipeline runtime reads of the configuration (the pipeline strategies; None otherwise)."""
    open_rollout: bool = False
    """The generator's rollout can stay open while it decodes (its instances all in this one process): dynamic
    sampling (`data.oversample`) runs inside the rollout (`rlhfuse.trainer.rollout.StreamedDynamicSampling`),
    else in rounds of it, and a multi-turn agent's episodes run at their own pace
    (`rlhfuse.agents.generator.OpenAgentGenerator`), else turn by turn, all at once."""
    generation_ranks: int = 0
    """The split placement's generation ranks (`async.generation_ranks`), the last of the world: they generate for
    the training ranks and take no part in training (`rlhfuse.trainer.split`)."""

    @property
    def training_world(self) -> int:
        """The processes that train (the world less the split placement's generation ranks)."""
        return self.world - self.generation_ranks

    @property
    def generation_rank(self) -> bool:
        """Whether this process is one of the split placement's generation ranks."""
        from rlhfuse.distributed import rank

        return self.generation_ranks > 0 and rank() >= self.training_world

    @property
    def training_group(self) -> Any:
        """The group the training ranks' collectives (gradients, metrics) run over: the world's, None when one
        process trains (the split placement's generation ranks are in no training collective)."""
        return self.groups.world if self.training_world > 1 else None

    @functools.cached_property
    def stages(self) -> ParallelLayout:
        """The pipeline strategies' layout, derived once for the whole start-up (validation, the resume check,
        the stages each rank builds, the strategy); ValueError when it cannot be laid out (validation names why)."""
        if self.pipeline_run is None:
            raise ValueError(f"pipeline={self.strategy.__name__} has no pipeline layout")
        return self.pipeline_run.layout()

    @property
    def groups(self) -> WorldGroups:
        """The one owner of the run's process groups (`rlhfuse.distributed.WorldGroups`), which each component asks
        for its groups by name: the pipelines' stage and point-to-point groups, the generation instances', the
        data-parallel world."""
        from rlhfuse.distributed import WorldGroups

        return WorldGroups.current()

    @property
    def instance_per_process(self) -> bool:
        """The strategy launches one process per generation instance (its world follows generator.instances)."""
        return self.strategy.instance_per_process

    @property
    def process_group(self) -> bool:
        """Whether the run needs a process group: several processes, or models sharded over a group (of one)."""
        return self.world > 1 or self.strategy.collective_models()


def topology(cfg: RLHFConfig) -> Topology:
    """The topology `cfg` describes, as its strategy answers it (a name no registry knows runs under
    `RegisteredStrategy` and drives no instances: validation reports it)."""
    from rlhfuse.trainer.components import GENERATORS

    strategy = strategy_class(cfg.pipeline.name)
    g = cfg.generator
    world = strategy.world(cfg)
    entry = generator_entry(g.name) if g.name in GENERATORS else None
    with_instances = entry is not None and entry.instances
    own_tp = entry is not None and entry.own_tensor_parallel
    instances = strategy.instances(cfg, world, with_instances)
    # the instances over the processes (one rank each, or generator.tp each with the backend's own tensor
    # parallelism); sharded models make every forward collective: inference runs in lockstep after generation
    ranks = g.instances * (max(g.tp, 1) if own_tp else 1)
    split = cfg.asynchronous.generation_ranks
    # (the split placement's instances are all on its generation rank: none infers beside the training rank)
    fused = with_instances and g.instances > 1 and ranks == world and strategy.whole_models and not split
    weight_shards = 1 if own_tp else max(g.tp, 1)
    opens = entry is not None and entry.opens and world == 1
    return Topology(
        strategy,
        world,
        instances,
        fused,
        weight_shards,
        strategy.pipeline_run(cfg),
        opens,
        generation_ranks=split,
    )
