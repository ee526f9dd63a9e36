"""`pipeline=fused` and `pipeline=serial_1f1b` as parts: the Actor and the Critic cut into pipeline stages over
`distributed.nproc_per_node` processes (`config.PipelineRun`, the layout derived once), trained by
`training.PipelineStrategy`, inferring as forward-only pipelines over the same stages (`inference`, built by
`pipeline_inferencer` for `inferencer=pipeline`), saving per-rank stage shards (`checkpoint`), exporting the
Actor reassembled from its stages."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from rlhfuse.core.protocols import Callback
from rlhfuse.trainer.strategies.base import (
    ExportTarget,
    StrategyPart,
    adapter_export,
    own_fields,
    read_fields,
)

if TYPE_CHECKING:
    import torch

    from rlhfuse.models import ModelConfig, Transformer
    from rlhfuse.trainer.components import BuildContext
    from rlhfuse.trainer.run_config import RLHFConfig
    from rlhfuse.trainer.strategies.pipelines.config import PipelineRun
    from rlhfuse.trainer.strategies.pipelines.inference import PipelineInferencer
    from rlhfuse.trainer.strategies.pipelines.training import PipelineStrategy
    from rlhfuse.trainer.topology import Topology


@dataclass(frozen=True, kw_only=True)
class PipelinePart(StrategyPart):
    """The Actor and Critic cut into pipeline stages over `processes` ranks (`distributed.nproc_per_node`)."""

    instance_per_process: ClassVar[bool] = False

    processes: int = 2
    actor_pp: int = 2
    critic_pp: int = 2
    actor_tp: int = 1
    critic_tp: int = 1
    microbatches: int = 4
    search_budget_s: float = 2.0
    balance: bool = True
    prefetch: int = 1

    # ------------------------------------------------------------------ the configuration
    def configure(self, config: RLHFConfig) -> RLHFConfig:
        own = own_fields(self)
        processes = own.pop("processes")
        pipeline = dataclasses.replace(config.pipeline, name=self.name, **own)
        launch = dataclasses.replace(config.distributed, nproc_per_node=processes)
        return dataclasses.replace(config, pipeline=pipeline, distributed=launch)

    @classmethod
    def from_config(cls, config: RLHFConfig) -> StrategyPart:
        own = read_fields(cls, config.pipeline, skip=frozenset({"processes"}))
        return cls(processes=config.distributed.nproc_per_node, **own)

    # ------------------------------------------------------------------ the layout
    @classmethod
    def world(cls, cfg: RLHFConfig) -> int:
        """distributed.nproc_per_node processes (torchrun's WORLD_SIZE when launched by it)."""
        from rlhfuse.trainer.strategies.pipelines.config import launched_world_size

        return launched_world_size(max(cfg.distributed.nproc_per_node, 1))

    @classmethod
    def instances(cls, cfg: RLHFConfig, world: int, drives_instances: bool) -> int:
        """generator.instances of a generator that drives them; else world / generator.tp tensor-parallel
        instances over consecutive ranks."""
        g = cfg.generator
        return int(g.instances) if drives_instances else world // max(int(g.tp), 1)

    @classmethod
    def pipeline_run(cls, cfg: RLHFConfig) -> PipelineRun | None:
        return cfg.pipeline_run()

    # ------------------------------------------------------------------ its own checks and rules
    @classmethod
    def problems(cls, cfg: RLHFConfig, layout: Topology, model: ModelConfig | None) -> list[str]:
        """The launch and the layout (`validate_runtime`, over the run's one derived layout), what runs over the
        stages, and fsdp's keys at their defaults."""
        from rlhfuse.trainer.components import INFERENCERS
        from rlhfuse.trainer.rules import unsharded_problems
        from rlhfuse.trainer.strategies.pipelines.config import validate_runtime
        from rlhfuse.trainer.topology import inferencer_entry

        problems = validate_runtime(cfg.pipeline_run(), lambda: layout.stages)
        pipe, i = cfg.pipeline, cfg.inferencer
        coef = pipe.optim.router_aux_loss_coef
        if coef > 0:
            problems.append(
                f"pipeline.router_aux_loss_coef={coef}: the load-balancing loss is added under pipeline=plain and "
                f"fsdp only (pipeline={pipe.name}): use pipeline=plain or pipeline.router_aux_loss_coef=0"
            )
        over_stages = i.name in INFERENCERS and inferencer_entry(i.name).over_stages
        if max(pipe.actor_tp, pipe.critic_tp) > 1 and not over_stages:
            problems.append(
                f"pipeline.actor_tp={pipe.actor_tp} / critic_tp={pipe.critic_tp} shard every model "
                f"tensor-parallel, but inferencer={i.name} (each rank a generation instance inferring its own "
                "samples) needs whole models on every rank: use generator.instances=1 (inference then runs over "
                "the training layout, inferencer=pipeline) or pipeline.actor_tp=1 pipeline.critic_tp=1"
            )
        rank = cfg.model.lora.rank
        # the adapters ride on the Actor's stages; the Ref is those stages without them
        if cfg.model.lora.enabled:
            if pipe.actor_tp > 1:
                problems.append(
                    f"model.lora.rank={rank} with pipeline.actor_tp={pipe.actor_tp}: the adapters of "
                    "tensor-parallel shards of a projection have no PEFT layout: set pipeline.actor_tp=1 (pipeline "
                    "stages only), pipeline=fsdp, or model.lora.rank=0"
                )
            if not over_stages:
                problems.append(
                    f"model.lora.rank={rank} under pipeline={pipe.name} needs the pipeline inferencer (the "
                    f"Reference is the Actor's stages with the adapters off), not inferencer.name={i.name} (each "
                    "rank a generation instance inferring its own samples with whole models): set "
                    "generator.instances=1 (inference then runs over the training layout), or pipeline=plain"
                )
            if cfg.generator.tp > 1:
                problems.append(
                    f"model.lora.rank={rank} under pipeline={pipe.name} syncs merged projections to whole "
                    f"generation copies: set generator.tp=1 (not {cfg.generator.tp}), or pipeline=plain"
                )
        return problems + unsharded_problems(cfg, layout, model)

    @classmethod
    def launch_problems(cls, cfg: RLHFConfig) -> list[str]:
        from rlhfuse.trainer.strategies.pipelines.config import validate_runtime

        return validate_runtime(cfg.pipeline_run())

    @classmethod
    def resolve(cls, cfg: RLHFConfig, layout: Topology, log: Callable[[str], None]) -> RLHFConfig:
        """- inferencer=models -> inferencer=pipeline (the same forward passes over the training layout), unless
          each rank is one generation instance and infers its own samples (`Topology.fused_rollout`);
        - a critic-free algorithm is printed (`actor_only_message`): the pipeline trains the Actor alone."""
        from rlhfuse.core.advantages import ALGORITHMS, uses_critic
        from rlhfuse.trainer.components import INFERENCERS
        from rlhfuse.trainer.topology import inferencer_entry

        i = cfg.inferencer
        whole_models = i.name in INFERENCERS and not inferencer_entry(i.name).over_stages
        if whole_models and not layout.fused_rollout:
            log(
                f"rlhfuse: inferencer=models -> pipeline (rule: pipeline={cfg.pipeline.name} runs the Ref / Reward "
                "/ Critic forward passes over the training layout's stages)"
            )
            cfg = dataclasses.replace(cfg, inferencer=dataclasses.replace(i, name="pipeline"))
        a = cfg.algorithm
        if a.name in ALGORITHMS and not uses_critic(a):
            log(actor_only_message(cfg, cls.fuses_training))
        return cfg

    # ------------------------------------------------------------------ what it builds and does
    def build(self, ctx: BuildContext) -> PipelineStrategy:
        from rlhfuse.trainer.strategies.pipelines.training import PipelineStrategy

        cfg = ctx.config
        critic = ctx.models.critic  # None for a critic-free algorithm: the Actor's pipeline alone
        pack_stages([ctx.models.actor] + ([] if critic is None else [critic]), cfg.data.packing)
        strategy = PipelineStrategy(
            ctx.models.actor,
            critic,
            cfg.pipeline,
            cfg.algorithm,
            total_steps=ctx.total_steps,
            mini_batch_size=cfg.data.mini_batch_size,
            micro_batch_size=cfg.data.micro_batch_size,
            micro_batch_tokens=cfg.data.micro_batch_tokens,
            temperature=cfg.generator.sampling.temperature,
            schedule=self.name,
            timeout_s=cfg.distributed.timeout_s,
            autocast=ctx.fabric.autocast,
            generation_tp=ctx.topology.weight_shards,
            layout=ctx.topology.stages,
            groups=ctx.topology.groups,
        )
        # tp > 1: the strategy trains tensor-parallel shards of the models; the rest of the job (inference,
        # memory metrics) reads those, and the whole models it was given are dropped
        ctx.models.actor, ctx.models.critic = strategy.models["actor"], strategy.models.get("critic")
        return strategy

    def check_resume(self, config: RLHFConfig, layout: Topology, checkpoint_dir: Path, run_dir: Path) -> None:
        """A sharded checkpoint saved under another pipeline layout is refused, naming every mismatch."""
        from rlhfuse.trainer.strategies.pipelines.checkpoint import check_resume

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
            return adapter_export(target, whole, write=target.rank0)
        actor_config = strategy.models["actor"].config
        return ExportShardedActor(
            whole, actor_config, target.models.tokenizer, target.path, write=target.rank0
        )


@dataclass(frozen=True, kw_only=True)
class FusedPipelineStrategy(PipelinePart):
    """`pipeline=fused`: Actor and Critic trained as two pipelines in opposite directions on the same ranks, with
    a searched schedule that fills each other's bubbles (intra-stage fusion)."""

    name: ClassVar[str] = "fused"
    fuses_training: ClassVar[bool] = True


@dataclass(frozen=True, kw_only=True)
class Serial1F1BStrategy(PipelinePart):
    """`pipeline=serial_1f1b`: the Actor's and the Critic's 1F1B pipelines one after the other (the baseline)."""

    name: ClassVar[str] = "serial_1f1b"


def actor_only_message(cfg: RLHFConfig, fuses_training: bool) -> str:
    """What a pipeline strategy runs with a critic-free algorithm (the plan's own note, with the keys)."""
    from rlhfuse.runtime.plan import ACTOR_ONLY_NOTE, ACTOR_ONLY_RUN

    p, a = cfg.pipeline, cfg.algorithm.name
    what = ACTOR_ONLY_NOTE if fuses_training else f"no Critic, {ACTOR_ONLY_RUN}"
    return (
        f"rlhfuse: pipeline={p.name} with algorithm={a}: {what} (pipeline.actor_pp={p.actor_pp}); "
        f"pipeline.critic_pp={p.critic_pp} is unused (a Reward model, when used, runs on the Actor's stages in "
        "reverse)"
    )


def pipeline_inferencer(ctx: BuildContext) -> PipelineInferencer:
    """`inferencer=pipeline`: the Ref / Reward / Critic forward passes as forward-only pipelines over the pipeline
    strategy's stages (validated: a pipeline strategy, its layout and tensor-parallel groups)."""
    from rlhfuse.trainer.strategies.pipelines.inference import PipelineInferencer

    cfg, models = ctx.config.inferencer, ctx.models
    # the Ref and the Reward sharded like the trained models they are placed as (the Actor, the Critic)
    models.ref = ctx.strategy.tp_shard(models.ref, "actor")
    if models.reward is not None:
        models.reward = ctx.strategy.tp_shard(models.reward, "critic")
    named = {"actor": models.actor, "ref": models.ref}
    if models.critic is not None:  # none for a critic-free algorithm
        named["critic"] = models.critic
    if cfg.use_reward_model:
        assert models.reward is not None, "loaded: inferencer.use_reward_model=true"
        named["reward"] = models.reward
    pack_stages(named.values(), ctx.config.data.packing)
    return PipelineInferencer(
        cfg,
        ctx.strategy.layout,
        named,
        rewards=ctx.rewards,
        tokenizer=models.tokenizer,
        temperature=ctx.config.generator.sampling.temperature,
        timeout_s=ctx.config.distributed.timeout_s,
        prefetch=ctx.config.pipeline.prefetch,
        autocast=ctx.fabric.autocast,
        rows=ctx.rows,
        groups=ctx.topology.groups,
    )


def pack_stages(models: Iterable[Transformer], packing: bool) -> None:
    """data.packing under a pipeline strategy: the models' stages run packed sequences (`Stage`), the messages
    between stages keep the padded layout."""
    from rlhfuse.models.packing import check_packing

    models = list(models)
    if packing:
        check_packing(models)
    for model in models:
        model.packing = packing
