"""What every training strategy answers: `StrategyPart`, the base of the strategy families (`plain`, `fsdp`,
`pipelines`), and the helpers their parts share.

A strategy part is one bundle: its `pipeline.*` keys as typed fields, how many processes it launches and how many
generation instances they hold (`world`, `instances`), whether each rank keeps whole models, its layout, its own
configuration checks (`problems`), the rules it applies to the other choices (`resolve`), the component it builds
(`build`), how inference runs over its layout (`inference`), how it resumes and how it exports the trained Actor.
The trainer and the topology ask it these; they never ask which strategy it is.

The defaults here are those of a strategy that keeps whole models on every rank with one process per generation
instance (the data-parallel launch of `pipeline=plain`), which is also what a user's own strategy builder
(`pipeline.name=package.module:builder`, `RegisteredStrategy`) runs under.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from rlhfuse.core.optim_config import OptimConfig
from rlhfuse.core.protocols import Callback, Inferencer, Strategy

if TYPE_CHECKING:
    import torch

    from rlhfuse.models import ModelConfig
    from rlhfuse.trainer.components import BuildContext
    from rlhfuse.trainer.models import Models
    from rlhfuse.trainer.run_config import RLHFConfig
    from rlhfuse.trainer.strategies.pipelines.config import PipelineRun
    from rlhfuse.trainer.topology import Topology


def own_fields(part: Any) -> dict[str, Any]:
    """A part's fields by name (what `configure` writes into its configuration section)."""
    return {f.name: getattr(part, f.name) for f in dataclasses.fields(part)}


def read_fields(cls: type, section: Any, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
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


@dataclass(frozen=True, kw_only=True)
class StrategyPart:
    """A training strategy (config group `pipeline`): its `pipeline.*` keys as fields, the optimizer's among them."""

    name: ClassVar[str]
    fuses_training: ClassVar[bool] = False
    """It trains the Actor and the Critic as two pipelines in opposite directions on the same devices."""
    reshardable: ClassVar[bool] = False
    """Its checkpoints load on another world size (the resume may change distributed.nproc_per_node)."""
    whole_models: ClassVar[bool] = True
    """Each rank's models compute alone (none is sharded into collective forwards), so generation instances that
    are the processes can infer their own samples as they finish (inter-stage fusion across processes)."""
    instance_per_process: ClassVar[bool] = True
    """Its launch is one process per generation instance (its world follows generator.instances)."""

    optim: OptimConfig = field(default_factory=OptimConfig)

    # ------------------------------------------------------------------ the configuration
    def configure(self, config: RLHFConfig) -> RLHFConfig:
        pipeline = dataclasses.replace(config.pipeline, name=self.name, **own_fields(self))
        return dataclasses.replace(config, pipeline=pipeline)

    @classmethod
    def from_config(cls, config: RLHFConfig) -> StrategyPart:
        return cls(**read_fields(cls, config.pipeline))

    # ------------------------------------------------------------------ the layout (asked before any part exists)
    @classmethod
    def world(cls, cfg: RLHFConfig) -> int:
        """The processes it runs on: one per generation instance (or torchrun's WORLD_SIZE)."""
        from rlhfuse.trainer.strategies.plain.launch import plain_world_size

        return plain_world_size(cfg)

    @classmethod
    def instances(cls, cfg: RLHFConfig, world: int, drives_instances: bool) -> int:
        """Generation instances of a generator that drives them (`drives_instances`) or not."""
        return int(cfg.generator.instances)

    @classmethod
    def pipeline_run(cls, cfg: RLHFConfig) -> PipelineRun | None:
        """What a pipeline runtime reads of the configuration; None: no pipeline stages."""
        return None

    @classmethod
    def collective_models(cls) -> bool:
        """Its models need a process group even in one process (sharded over a group of one)."""
        return not cls.whole_models

    # ------------------------------------------------------------------ its own checks and rules
    @classmethod
    def problems(cls, cfg: RLHFConfig, layout: Topology, model: ModelConfig | None) -> list[str]:
        """Its rules against the whole configuration, the topology and the Actor's shape (None when unknown)."""
        from rlhfuse.trainer.rules import replica_problems

        return replica_problems(cfg, layout, model)

    @classmethod
    def launch_problems(cls, cfg: RLHFConfig) -> list[str]:
        """Its launch and layout rules alone (what `plan=auto` checks a planned configuration against)."""
        from rlhfuse.trainer.strategies.plain.launch import validate_plain_launch

        return validate_plain_launch(cfg)

    @classmethod
    def resolve(cls, cfg: RLHFConfig, layout: Topology, log: Callable[[str], None]) -> RLHFConfig:
        """The choices its layout implies for the other components, applied and printed with their rule (never
        a silent swap): none by default."""
        return cfg

    # ------------------------------------------------------------------ what it builds and does
    def build(self, ctx: BuildContext) -> Strategy:
        raise NotImplementedError(f"{type(self).__name__} builds no strategy: override build(ctx)")

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
            return adapter_export(target, models.actor.state_dict, write=True)
        return ExportActor(models.actor, models.tokenizer, target.path)


def adapter_export(
    target: ExportTarget, whole: Callable[[], Mapping[str, torch.Tensor]], *, write: bool
) -> Callback:
    """The LoRA adapter export of an Actor whose whole state `whole` gives."""
    from rlhfuse.trainer.callbacks import ExportAdapter

    m = target.models
    lora = target.config.model.lora
    return ExportAdapter(whole, m.actor.config, lora, m.tokenizer, target.path, base=m.sft_path, write=write)


@dataclass(frozen=True, kw_only=True)
class RegisteredStrategy(StrategyPart):
    """A strategy registered by name only (a configuration's `pipeline.name=package.module:builder`): the
    builder's component on the data-parallel launch (whole models, one process per generation instance)."""

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

    def build(self, ctx: BuildContext) -> Strategy:
        from rlhfuse.trainer.strategies import STRATEGIES

        # an import path resolves to the user's builder, not to a part class
        builder: Callable[[BuildContext], Strategy] = STRATEGIES.get(self.registered)  # type: ignore[assignment]
        return builder(ctx)
