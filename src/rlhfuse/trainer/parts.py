"""The parts a run is composed of, as objects: the training strategy, the generator (with its migration policy) and
the inferencer. Each is a public class with typed keyword arguments whose defaults are those of its `conf/` group
option, so `FusedPipelineStrategy()` is `pipeline=fused` and `EngineGeneration(instances=2)` is
`generator=engine generator.instances=2`.

A part does three things, and the trainer asks it, never which part it is:
- `configure(config)`: writes its settings into the run's one configuration, which is then validated as a whole
  (every cross-component rule, one error listing every problem) before anything is built;
- `build(ctx)`: makes the component the loop calls (a `Strategy`, `Generator`, `Inferencer`) from the built
  models, through the same builders `rlhfuse-train` uses (`rlhfuse.trainer.components`);
- a strategy is a whole bundle (`rlhfuse.trainer.strategies`, one package per family): it also answers its
  layout, its own checks, how inference runs over its layout, how it resumes and how the Actor is exported.

The strategy parts live with their families and are re-exported here beside the generator and inferencer parts.

`Parts.from_config(config)` makes the parts a configuration describes: the command line builds the same objects a
script passes. A user's own subclass overrides `build` (to wrap or replace what it returns) and runs as it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from rlhfuse.core.inference import InferencerConfig, RewardChoice
from rlhfuse.core.protocols import Generator, Inferencer
from rlhfuse.core.sampling import SamplingConfig
from rlhfuse.generation.generation_config import EngineOptions, VLLMOptions
from rlhfuse.trainer.strategies import (
    STRATEGIES,
    DataParallelStrategy,
    ExportTarget,
    FSDPStrategy,
    FusedPipelineStrategy,
    PipelinePart,
    RegisteredStrategy,
    Serial1F1BStrategy,
    StrategyPart,
    strategy_class,
)
from rlhfuse.trainer.strategies.base import own_fields, read_fields

if TYPE_CHECKING:
    from rlhfuse.trainer.components import BuildContext
    from rlhfuse.trainer.run_config import MigrationConfig, RLHFConfig


# ---------------------------------------------------------------------------------------------- migration
@dataclass(frozen=True, kw_only=True)
class MigrationPart:
    """A migration policy of a multi-instance generator (config group `migration`)."""

    name: ClassVar[str]

    def configure(self, config: RLHFConfig) -> RLHFConfig:
        migration = dataclasses.replace(config.migration, name=self.name, **own_fields(self))
        return dataclasses.replace(config, migration=migration)

    @classmethod
    def from_config(cls, config: RLHFConfig) -> MigrationPart:
        return cls(**read_fields(cls, config.migration))


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
        generator = dataclasses.replace(config.generator, name=self.name, **own_fields(self))
        return dataclasses.replace(config, generator=generator)

    @classmethod
    def from_config(cls, config: RLHFConfig) -> GeneratorPart:
        return cls(**read_fields(cls, config.generator))

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
        own = own_fields(self)
        migration: MigrationPart = own.pop("migration")
        generator = dataclasses.replace(config.generator, name=self.name, **own)
        return migration.configure(dataclasses.replace(config, generator=generator))

    @classmethod
    def from_config(cls, config: RLHFConfig) -> GeneratorPart:
        own = read_fields(cls, config.generator, skip=frozenset({"migration"}))
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
        inferencer = InferencerConfig(name=self.name, **own_fields(self))
        return dataclasses.replace(config, inferencer=inferencer)

    @classmethod
    def from_config(cls, config: RLHFConfig) -> InferencerPart:
        return cls(**read_fields(cls, config.inferencer))

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
        own = own_fields(self)
        own.pop("registered")
        return dataclasses.replace(config, inferencer=InferencerConfig(name=self.registered, **own))

    @classmethod
    def from_config(cls, config: RLHFConfig) -> InferencerPart:
        own = read_fields(cls, config.inferencer, skip=frozenset({"registered"}))
        return cls(registered=config.inferencer.name, **own)


# ---------------------------------------------------------------------------------------------- the registry
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
    [*(STRATEGIES.get(n) for n in STRATEGIES.names()), *GENERATOR_PARTS.values(), *INFERENCER_PARTS.values()]
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
            strategy_class(s).from_config(config),
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


__all__ = [
    "AutoMigration",
    "DataParallelStrategy",
    "EngineGeneration",
    "ExportTarget",
    "FSDPStrategy",
    "FixedMigration",
    "FusedPipelineStrategy",
    "GeneratorPart",
    "InferencerPart",
    "InstanceGeneratorPart",
    "MigrationPart",
    "ModelInference",
    "NoMigrationPolicy",
    "Parts",
    "PipelineInference",
    "PipelinePart",
    "RegisteredGenerator",
    "RegisteredInferencer",
    "RegisteredStrategy",
    "SamplingGeneration",
    "Serial1F1BStrategy",
    "StrategyPart",
    "VLLMGeneration",
]
