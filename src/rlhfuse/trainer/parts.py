"""The parts a run is composed of, as objects: the training strategy, the generator (with its migration policy) and
the inferencer. Each is a public class with typed keyword arguments whose defaults are those of its `conf/` group
option, so `FusedPipelineStrategy()` is `pipeline=fused` and `EngineGeneration(instances=2)` is
`generator=engine generator.instances=2`.

A part does three things, and the trainer asks it, never which part it is:
- `configure(config)`: writes its settings into the run's one configuration, which is then validated as a whole
  (every cross-component rule, one error listing every problem) before anything is built;
- `build(ctx)`: makes the component the loop calls (a `Strategy`, `Generator`, `Inferencer`) from the built
  models, through the same builders `rlhfuse-train` uses (`rlhfuse.trainer.components`);
- a strategy also says how inference runs over its layout (`inference`) and how the trained Actor is exported
  (`export`), the two things that differ between strategy families beyond the training step.

`Parts.from_config(config)` makes the parts a configuration describes: the command line builds the same objects a
script passes. A user's own subclass overrides `build` (to wrap or replace what it returns) and runs as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from rlhfuse.core.inference import InferencerConfig, RewardChoice
from rlhfuse.core.optim import OptimConfig
from rlhfuse.core.protocols import Callback, Generator, Inferencer, Strategy
from rlhfuse.core.sampling import SamplingConfig
from rlhfuse.generation.generation_config import EngineOptions, VLLMOptions

if TYPE_CHECKING:
    from rlhfuse.trainer.components import BuildContext
    from rlhfuse.trainer.models import Models
    from rlhfuse.trainer.run_config import MigrationConfig, RLHFConfig
    from rlhfuse.trainer.topology import Topology


def _own_fields(part: Any) -> dict[str, Any]:
    return {f.name: getattr(part, f.name) for f in dataclasses.fields(part)}


def _read_fields(cls: type, section: Any, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """`cls`'s fields read from a configuration section of the same keys."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(cls) if f.name not in skip}


@dataclass(frozen=True)
class ExportTarget:
    """What a strategy's export needs besides its built strategy: the models, the folder, whether this rank writes
    and whether the trained Actor's stages are spread over the ranks."""

    config: RLHFConfig
    models: Models
    strategy: Any
    path: Path
    rank0: bool
    sharded_stages: bool
    weight_shards: int


# ---------------------------------------------------------------------------------------------- strategies
@dataclass(frozen=True, kw_only=True)
class StrategyPart:
    """A training strategy (config group `pipeline`): its `pipeline.*` keys as fields, the optimizer's among them."""

    name: ClassVar[str]
    optim: OptimConfig = field(default_factory=OptimConfig)

    def configure(self, config: RLHFConfig) -> RLHFConfig:
        own = _own_fields(self)
        pipeline = dataclasses.replace(config.pipeline, name=self.name, **own)
        return dataclasses.replace(config, pipeline=pipeline)

    @classmethod
    def from_config(cls, config: RLHFConfig) -> StrategyPart:
        return cls(**_read_fields(cls, config.pipeline))

    def build(self, ctx: BuildContext) -> Strategy:
        from rlhfuse.trainer.topology import strategy_entry

        return strategy_entry(ctx.config.pipeline.name).build(ctx)  # type: ignore[no-any-return]

    def check_resume(self, config: RLHFConfig, layout: Topology, checkpoint_dir: Path, run_dir: Path) -> None:
        """Before anything is built: refuse a checkpoint this strategy cannot resume (its files are checked as they
        load by default)."""

    def stages_held(
        self, config: RLHFConfig, layout: Topology, rank: int
    ) -> dict[str, tuple[int, set[int]]] | None:
        """role -> (stages, the stages this rank holds) when each rank builds only its stages of the models; None
        (whole models on every rank, the default)."""
        return None

    def load_device(self, device: torch.device) -> torch.device:
        """Where the models are read before this strategy takes them: the rank's device by default."""
        return device

    def inference(self, inferencer: Inferencer, strategy: Any) -> Inferencer:
        """The inferencer as it runs over this strategy's layout (as built, by default)."""
        return inferencer

    def export(self, target: ExportTarget) -> Callback | None:
        """checkpoint.export_hf's callback: the whole trained Actor (or its LoRA adapter) written by rank 0 as a
        Hugging Face checkpoint at the end of `fit`; None on a rank with no part in it."""
        if not target.rank0:
            return None
        from rlhfuse.trainer.callbacks import ExportActor

        models = target.models
        if target.config.model.lora.enabled:
            return _adapter_export(target, models.actor.state_dict, write=True)
        return ExportActor(models.actor, models.tokenizer, target.path)


def _adapter_export(
    target: ExportTarget, whole: Callable[[], Mapping[str, torch.Tensor]], *, write: bool
) -> Callback:
    from rlhfuse.trainer.callbacks import ExportAdapter

    m = target.models
    lora = target.config.model.lora
    return ExportAdapter(whole, m.actor.config, lora, m.tokenizer, target.path, base=m.sft_path, write=write)


@dataclass(frozen=True, kw_only=True)
class DataParallelStrategy(StrategyPart):
    """`pipeline=plain`: whole models on every rank; one process, or data parallelism over one process per
    generation instance (`generator.instances`)."""

    name: ClassVar[str] = "plain"


@dataclass(frozen=True, kw_only=True)
class FSDPStrategy(StrategyPart):
    """`pipeline=fsdp`: the four models, gradients and optimizer states sharded over the processes (torch FSDP2);
    each rank infers its share of the rollout with the sharded models."""

    name: ClassVar[str] = "fsdp"
    cpu_offload: bool = False
    reshard_after_forward: bool = True

    def load_device(self, device: torch.device) -> torch.device:
        """Host memory: each unit moves to the device as it is sharded, so no model is ever whole there."""
        return torch.device("cpu")

    def inference(self, inferencer: Inferencer, strategy: Any) -> Inferencer:
        from rlhfuse.trainer.fsdp_strategy import RowInferencer, ShardedInference

        if not isinstance(inferencer, RowInferencer):  # it splits the rollout by rows and runs them itself
            raise TypeError(
                f"FSDPStrategy infers with the sharded models row by row (`RowInferencer`: groups, infer_rows, "
                f"actor); the inferencer built, a {type(inferencer).__name__}, has not these: return one that has "
                "(ModelInference's build does)"
            )
        return ShardedInference(inferencer, strategy.group)

    def export(self, target: ExportTarget) -> Callback | None:
        from rlhfuse.distributed.fsdp import full_state
        from rlhfuse.trainer.callbacks import ExportShardedActor

        strategy = target.strategy

        def whole() -> Mapping[str, torch.Tensor]:  # collective: every rank gathers, rank 0 writes
            return full_state(strategy.actor)

        if target.config.model.lora.enabled:
            return _adapter_export(target, whole, write=target.rank0)
        return ExportShardedActor(
            whole, strategy.actor.config, target.models.tokenizer, target.path, write=target.rank0
        )


@dataclass(frozen=True, kw_only=True)
class PipelinePart(StrategyPart):
    """The Actor and Critic cut into pipeline stages over `processes` ranks (`distributed.nproc_per_node`)."""

    processes: int = 2
    actor_pp: int = 2
    critic_pp: int = 2
    actor_tp: int = 1
    critic_tp: int = 1
    microbatches: int = 4
    search_budget_s: float = 2.0
    balance: bool = True
    prefetch: int = 1

    def configure(self, config: RLHFConfig) -> RLHFConfig:
        own = _own_fields(self)
        processes = own.pop("processes")
        pipeline = dataclasses.replace(config.pipeline, name=self.name, **own)
        launch = dataclasses.replace(config.distributed, nproc_per_node=processes)
        return dataclasses.replace(config, pipeline=pipeline, distributed=launch)

    @classmethod
    def from_config(cls, config: RLHFConfig) -> StrategyPart:
        own = _read_fields(cls, config.pipeline, skip=frozenset({"processes"}))
        return cls(processes=config.distributed.nproc_per_node, **own)

    def check_resume(self, config: RLHFConfig, layout: Topology, checkpoint_dir: Path, run_dir: Path) -> None:
        """A sharded checkpoint saved under another pipeline layout is refused, naming every mismatch."""
        from rlhfuse.runtime.sharded_checkpoint import check_resume

        check_resume(config.pipeline_run(), config.resume, checkpoint_dir, run_dir, layout.stages)

    def stages_held(
        self, config: RLHFConfig, layout: Topology, rank: int
    ) -> dict[str, tuple[int, set[int]]] | None:
        """With the pipeline inferencer each rank materialises only its stages of the four models (Ref placed like
        the Actor, Reward like the Critic); with whole models per rank (each rank a generation instance inferring
        its own samples), None."""
        from rlhfuse.trainer.topology import inferencer_entry

        if not inferencer_entry(config.inferencer.name).over_stages:
            return None
        stages = layout.stages
        held = stages.held_stages(rank)  # critic-free: the critic slot places only the Reward
        actor, critic = (stages.stages("actor"), held["actor"]), (stages.stages("critic"), held["critic"])
        return {"actor": actor, "ref": actor, "critic": critic, "reward": critic}

    def export(self, target: ExportTarget) -> Callback | None:
        """The whole Actor reassembled from the stages (and tensor-parallel shards) by every rank, written by rank
        0, whatever the generator; an Actor each rank holds whole is written as it is."""
        from rlhfuse.trainer.callbacks import ExportShardedActor

        if not target.sharded_stages and target.weight_shards == 1:
            return super().export(target)
        strategy = target.strategy

        def whole() -> Mapping[str, torch.Tensor]:  # collective: every rank reassembles, rank 0 writes
            return strategy.shards.full_state("actor")  # type: ignore[no-any-return]

        if target.config.model.lora.enabled and target.weight_shards == 1:
            return _adapter_export(target, whole, write=target.rank0)
        actor_config = strategy.models["actor"].config
        return ExportShardedActor(
            whole, actor_config, target.models.tokenizer, target.path, write=target.rank0
        )


@dataclass(frozen=True, kw_only=True)
class FusedPipelineStrategy(PipelinePart):
    """`pipeline=fused`: Actor and Critic trained as two pipelines in opposite directions on the same ranks, with
    a searched schedule that fills each other's bubbles (intra-stage fusion)."""

    name: ClassVar[str] = "fused"


@dataclass(frozen=True, kw_only=True)
class Serial1F1BStrategy(PipelinePart):
    """`pipeline=serial_1f1b`: the Actor's and the Critic's 1F1B pipelines one after the other (the baseline)."""

    name: ClassVar[str] = "serial_1f1b"


@dataclass(frozen=True, kw_only=True)
class RegisteredStrategy(StrategyPart):
    """A strategy registered by name only (a configuration's `pipeline.name=package.module:builder`)."""

    registered: str = "plain"

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.registered

    def configure(self, config: RLHFConfig) -> RLHFConfig:
        pipeline = dataclasses.replace(config.pipeline, name=self.registered, optim=self.optim)
        return dataclasses.replace(config, pipeline=pipeline)

    @classmethod
    def from_config(cls, config: RLHFConfig) -> StrategyPart:
        return cls(registered=config.pipeline.name, optim=config.pipeline.optim)


# ---------------------------------------------------------------------------------------------- migration
@dataclass(frozen=True, kw_only=True)
class MigrationPart:
    """A migration policy of a multi-instance generator (config group `migration`)."""

    name: ClassVar[str]

    def configure(self, config: RLHFConfig) -> RLHFConfig:
        migration = dataclasses.replace(config.migration, name=self.name, **_own_fields(self))
        return dataclasses.replace(config, migration=migration)

    @classmethod
    def from_config(cls, config: RLHFConfig) -> MigrationPart:
        return cls(**_read_fields(cls, config.migration))


@dataclass(frozen=True, kw_only=True)
class NoMigrationPolicy(MigrationPart):
    """`migration=off`: every sample finishes where it started (the serial baseline)."""

    name: ClassVar[str] = "off"


@dataclass(frozen=True, kw_only=True)
class FixedMigration(MigrationPart):
    """`migration=fixed`: the long tail migrates to few instances once `threshold` samples (>= 1) or this fraction
    (< 1) remain; the freed instances start inference."""

    name: ClassVar[str] = "fixed"
    threshold: float = 0.2
    mechanism: Literal["kv", "reprefill", "auto"] = "auto"
    bs_max: int = 32
    link_bytes_per_s: float = 1.0e9


@dataclass(frozen=True, kw_only=True)
class AutoMigration(FixedMigration):
    """`migration=auto`: `FixedMigration` whose threshold is re-tuned from measured costs (off where it does not
    pay)."""

    name: ClassVar[str] = "auto"


# ---------------------------------------------------------------------------------------------- generators
@dataclass(frozen=True, kw_only=True)
class GeneratorPart:
    """A generator (config group `generator`): the sampling settings and its own keys as fields."""

    name: ClassVar[str]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def configure(self, config: RLHFConfig) -> RLHFConfig:
        generator = dataclasses.replace(config.generator, name=self.name, **_own_fields(self))
        return dataclasses.replace(config, generator=generator)

    @classmethod
    def from_config(cls, config: RLHFConfig) -> GeneratorPart:
        return cls(**_read_fields(cls, config.generator))

    def build(self, ctx: BuildContext) -> Generator:
        from rlhfuse.trainer.topology import generator_entry

        return generator_entry(ctx.config.generator.name).build(ctx)  # type: ignore[no-any-return]


@dataclass(frozen=True, kw_only=True)
class SamplingGeneration(GeneratorPart):
    """`generator=sampling`: batched sampling from a whole Actor copy (under a pipeline strategy, world / `tp`
    tensor-parallel instances, each decoding its own share)."""

    name: ClassVar[str] = "sampling"
    tp: int = 1


@dataclass(frozen=True, kw_only=True)
class InstanceGeneratorPart(GeneratorPart):
    """A generator that drives `instances` generation instances with a migration policy between them."""

    instances: int = 1
    tp: int = 1
    in_process: bool = False
    migration: MigrationPart = field(default_factory=NoMigrationPolicy)

    def configure(self, config: RLHFConfig) -> RLHFConfig:
        own = _own_fields(self)
        migration: MigrationPart = own.pop("migration")
        generator = dataclasses.replace(config.generator, name=self.name, **own)
        return migration.configure(dataclasses.replace(config, generator=generator))

    @classmethod
    def from_config(cls, config: RLHFConfig) -> GeneratorPart:
        own = _read_fields(cls, config.generator, skip=frozenset({"migration"}))
        return cls(migration=migration_part(config), **own)


@dataclass(frozen=True, kw_only=True)
class EngineGeneration(InstanceGeneratorPart):
    """`generator=engine`: rlhfuse's continuous-batching engine (block KV cache, prefix sharing, speculative
    decoding of the tail), one instance per process (or all in this one with `in_process`)."""

    name: ClassVar[str] = "engine"
    engine: EngineOptions = field(default_factory=EngineOptions)


@dataclass(frozen=True, kw_only=True)
class VLLMGeneration(InstanceGeneratorPart):
    """`generator=vllm`: vLLM engines (the `vllm` extra), one per instance over `tp` ranks with vLLM's own tensor
    parallelism; migration by re-prefill."""

    name: ClassVar[str] = "vllm"
    engine: EngineOptions = field(default_factory=EngineOptions)
    vllm: VLLMOptions = field(default_factory=VLLMOptions)


@dataclass(frozen=True, kw_only=True)
class RegisteredGenerator(GeneratorPart):
    """A generator registered by name only (`generator.name=package.module:builder`)."""

    registered: str = "sampling"

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.registered

    def configure(self, config: RLHFConfig) -> RLHFConfig:
        generator = dataclasses.replace(config.generator, name=self.registered, sampling=self.sampling)
        return dataclasses.replace(config, generator=generator)

    @classmethod
    def from_config(cls, config: RLHFConfig) -> GeneratorPart:
        return cls(registered=config.generator.name, sampling=config.generator.sampling)


# ---------------------------------------------------------------------------------------------- inferencers
@dataclass(frozen=True, kw_only=True)
class InferencerPart:
    """An inferencer (config group `inferencer`): the reward settings as fields."""

    name: ClassVar[str]
    micro_batch_size: int = 0
    use_reward_model: bool = True
    reward_fn: RewardChoice | list[RewardChoice] | None = None
    reward_weights: list[float] | None = None
    truncated_score: float | Literal["auto"] | None = "auto"
    offload_frozen: bool = False

    def configure(self, config: RLHFConfig) -> RLHFConfig:
        inferencer = InferencerConfig(name=self.name, **_own_fields(self))
        return dataclasses.replace(config, inferencer=inferencer)

    @classmethod
    def from_config(cls, config: RLHFConfig) -> InferencerPart:
        return cls(**_read_fields(cls, config.inferencer))

    def build(self, ctx: BuildContext) -> Inferencer:
        from rlhfuse.trainer.topology import inferencer_entry

        return inferencer_entry(ctx.config.inferencer.name).build(ctx)  # type: ignore[no-any-return]


@dataclass(frozen=True, kw_only=True)
class ModelInference(InferencerPart):
    """`inferencer=models`: each rank runs the Actor / Ref / Critic / Reward forward passes of its own samples with
    whole models."""

    name: ClassVar[str] = "models"


@dataclass(frozen=True, kw_only=True)
class PipelineInference(InferencerPart):
    """`inferencer=pipeline`: the same forward passes as forward-only pipelines over the training strategy's
    stages (what a pipeline strategy takes)."""

    name: ClassVar[str] = "pipeline"


@dataclass(frozen=True, kw_only=True)
class RegisteredInferencer(InferencerPart):
    """An inferencer registered by name only (`inferencer.name=package.module:builder`)."""

    registered: str = "models"

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.registered

    def configure(self, config: RLHFConfig) -> RLHFConfig:
        own = _own_fields(self)
        own.pop("registered")
        return dataclasses.replace(config, inferencer=InferencerConfig(name=self.registered, **own))

    @classmethod
    def from_config(cls, config: RLHFConfig) -> InferencerPart:
        own = _read_fields(cls, config.inferencer, skip=frozenset({"registered"}))
        return cls(registered=config.inferencer.name, **own)


# ---------------------------------------------------------------------------------------------- the registry
STRATEGY_PARTS: dict[str, type[StrategyPart]] = {
    cls.name: cls for cls in (DataParallelStrategy, FSDPStrategy, FusedPipelineStrategy, Serial1F1BStrategy)
}
GENERATOR_PARTS: dict[str, type[GeneratorPart]] = {
    cls.name: cls for cls in (SamplingGeneration, EngineGeneration, VLLMGeneration)
}
INFERENCER_PARTS: dict[str, type[InferencerPart]] = {
    cls.name: cls for cls in (ModelInference, PipelineInference)
}
MIGRATION_PARTS: dict[str, type[MigrationPart]] = {
    cls.name: cls for cls in (NoMigrationPolicy, FixedMigration, AutoMigration)
}


_SHIPPED: frozenset[type] = frozenset(
    [*STRATEGY_PARTS.values(), *GENERATOR_PARTS.values(), *INFERENCER_PARTS.values()]
)


def migration_part(config: RLHFConfig) -> MigrationPart:
    cls = MIGRATION_PARTS.get(config.migration.name)
    if cls is None:  # a user's own policy builder, named in the configuration: kept as configured
        return _ConfiguredMigration(section=config.migration)
    return cls.from_config(config)


@dataclass(frozen=True)
class _ConfiguredMigration(MigrationPart):
    """A migration policy registered by name only: its section as configured."""

    section: MigrationConfig

    @property
    def name(self) -> str:  # type: ignore[override]
        return str(self.section.name)

    def configure(self, config: RLHFConfig) -> RLHFConfig:
        return dataclasses.replace(config, migration=self.section)


@dataclass(frozen=True)
class Parts:
    """The run's parts; None where the configuration's choice is taken (`resolve` after validation)."""

    strategy: StrategyPart | None = None
    generator: GeneratorPart | None = None
    inferencer: InferencerPart | None = None

    @classmethod
    def from_config(cls, config: RLHFConfig) -> Parts:
        """The parts `config` describes (a name no part class knows: the registered builder, as configured)."""
        s, g, i = config.pipeline.name, config.generator.name, config.inferencer.name
        return cls(
            STRATEGY_PARTS.get(s, RegisteredStrategy).from_config(config),
            GENERATOR_PARTS.get(g, RegisteredGenerator).from_config(config),
            INFERENCER_PARTS.get(i, RegisteredInferencer).from_config(config),
        )

    def configure(self, config: RLHFConfig) -> RLHFConfig:
        for part in (self.strategy, self.generator, self.inferencer):
            if part is not None:
                config = part.configure(config)
        return config

    def resolved(self, config: RLHFConfig) -> Parts:
        """The parts of the validated `config`: a given part whose choice the rules kept, else the part the
        configuration now names (a rule's swap is printed by `resolve_components`, never silent)."""
        chosen = Parts.from_config(config)

        def keep(given: Any, made: Any) -> Any:
            if given is None:
                return made
            if given.name == made.name:
                return given
            if type(given) not in _SHIPPED:
                # a user's own part would be dropped by the rule: say so rather than run without it
                raise ValueError(
                    f"{type(given).__name__} ({given.name}) is replaced by {made.name} under this layout (the rule "
                    f"printed above): derive it from {type(made).__name__} instead"
                )
            return made

        return Parts(
            keep(self.strategy, chosen.strategy),
            keep(self.generator, chosen.generator),
            keep(self.inferencer, chosen.inferencer),
        )
