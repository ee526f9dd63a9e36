"""The components `build_trainer` composes, chosen by name: one builder per registered name of each config group
(generator, inferencer, pipeline, migration), gathered in the registry table at the end of this module.

A builder takes the `BuildContext` (validated config, loaded models, Fabric, optimizer step count) and returns the
component. Your own builder can be named as `package.module:function` in your config (`rlhfuse.core.registry`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric import Fabric

from rlhfuse.core.registry import Registry
from rlhfuse.core.rewards import RewardSet
from rlhfuse.generation.batched import InstanceGenerator, SamplingGenerator
from rlhfuse.generation.generator import EngineGenerator, EnginePool, InstanceSetup
from rlhfuse.generation.migration import FixedThreshold, NoMigration
from rlhfuse.generation.tuning import AutoThreshold
from rlhfuse.models import Transformer, cast_copy
from rlhfuse.models.packing import check_packing
from rlhfuse.trainer.inferencer import ModelInferencer
from rlhfuse.trainer.models import Models
from rlhfuse.trainer.plain_strategy import PlainStrategy
from rlhfuse.trainer.rules import no_problems, pipeline_problems, sharded_problems, vllm_problems
from rlhfuse.trainer.run_config import RLHFConfig
from rlhfuse.trainer.topology import (
    GeneratorEntry,
    InferencerEntry,
    MigrationEntry,
    StrategyEntry,
    Topology,
    migration_entry,
)


@dataclass
class BuildContext:
    config: RLHFConfig
    topology: Topology
    models: Models
    fabric: Fabric
    total_steps: int
    strategy: Any = None  # set once built: the pipeline inferencer runs on the strategy's layout
    # the dataset rows' fields by prompt id (what a reward function reads besides the text, e.g. `answer`)
    rows: Sequence[Mapping[str, Any]] = field(default_factory=list)
    # the rule-based rewards (inferencer.reward_fn / reward_weights), built once; None without any
    rewards: RewardSet | None = None


def sampling_generator(ctx: BuildContext) -> SamplingGenerator | InstanceGenerator:
    """Under the pipeline strategies: world / generator.tp generation instances over consecutive ranks, each
    decoding its own share of the samples (`InstanceGenerator`; generator.tp = 1 included); one process: a
    whole Actor copy (`SamplingGenerator`)."""
    cfg = ctx.config
    args: dict[str, Any] = dict(
        eos_token_id=ctx.models.tokenizer.eos_id,
        pad_token_id=ctx.models.tokenizer.pad_id,
        samples_per_prompt=cfg.data.samples_per_prompt,
        seed=cfg.seed,
    )
    if ctx.topology.pipelines and ctx.topology.world > 1:
        return InstanceGenerator(
            ctx.models.for_generation(), cfg.generator.sampling, tp=cfg.generator.tp, **args
        )
    return SamplingGenerator(ctx.models.for_generation(), cfg.generator.sampling, **args)


def instance_setup(ctx: BuildContext) -> InstanceSetup:
    """What every multi-instance generator takes: token ids, samples per prompt, seed, migration policy."""
    mig = ctx.config.migration
    return InstanceSetup(
        eos_token_id=ctx.models.tokenizer.eos_id,
        pad_token_id=ctx.models.tokenizer.pad_id,
        samples_per_prompt=ctx.config.data.samples_per_prompt,
        seed=ctx.config.seed,
        policy=migration_entry(mig.name).build(ctx),
        bs_max=mig.bs_max,
    )


def engine_generator(ctx: BuildContext) -> EngineGenerator:
    mig = ctx.config.migration
    return EngineGenerator(
        EnginePool(ctx.models.for_generation(), ctx.config.generator.engine),
        ctx.config.generator,
        instance_setup(ctx),
        mechanism=mig.mechanism,
        link_bytes_per_s=mig.link_bytes_per_s,
    )


def vllm_generator(ctx: BuildContext) -> EngineGenerator:
    """The same generator over vLLM engines (`VLLMPool`): migration by re-prefill (vLLM exports no KV)."""
    from rlhfuse.generation.vllm_engine import VLLMPool  # vLLM is an optional extra

    actor = ctx.models.for_generation()
    lora = ctx.config.model.lora
    pool = VLLMPool(
        actor,
        ctx.config.generator,
        max_prompt_len=ctx.config.data.max_prompt_length,
        seed=ctx.config.seed,
        device=next(actor.parameters()).device,
        # a LoRA Actor's syncs send its merged projections only: the pool keeps the frozen rest to complete them
        frozen={k: v for k, v in actor.state_dict().items() if not lora.merges(k)} if lora.enabled else None,
    )
    return EngineGenerator(pool, ctx.config.generator, instance_setup(ctx), mechanism="reprefill")


def model_inferencer(ctx: BuildContext) -> ModelInferencer:
    cfg = ctx.config.inferencer
    return ModelInferencer(
        cfg,
        actor=ctx.models.actor,
        ref=ctx.models.ref,
        critic=ctx.models.critic,
        reward_model=ctx.models.reward if cfg.use_reward_model else None,
        rewards=ctx.rewards,
        tokenizer=ctx.models.tokenizer,
        temperature=ctx.config.generator.sampling.temperature,
        autocast=ctx.fabric.autocast,
        rows=ctx.rows,
        packing=ctx.config.data.packing,
        micro_batch_tokens=ctx.config.data.micro_batch_tokens,
    )


def pipeline_inferencer(ctx: BuildContext) -> Any:
    from rlhfuse.runtime.pipeline_inference import PipelineInferencer

    cfg, models = ctx.config.inferencer, ctx.models
    # validated: a pipeline strategy (its layout and tensor-parallel groups)
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
    )


def pack_stages(models: Iterable[Transformer], packing: bool) -> None:
    """data.packing under a pipeline strategy: the models' stages run packed sequences (`Stage`), the messages
    between stages keep the padded layout."""
    models = list(models)
    if packing:
        check_packing(models)
    for model in models:
        model.packing = packing


def plain_strategy(ctx: BuildContext) -> PlainStrategy:
    return PlainStrategy(
        ctx.models.actor,
        ctx.models.critic,
        ctx.config.pipeline.optim,
        ctx.config.algorithm,
        fabric=ctx.fabric,
        total_steps=ctx.total_steps,
        micro_batch_size=ctx.config.data.micro_batch_size,
        micro_batch_tokens=ctx.config.data.micro_batch_tokens,
        temperature=ctx.config.generator.sampling.temperature,
        group=dist.group.WORLD if ctx.fabric.world_size > 1 else None,  # data-parallel: one rank per instance
        packing=ctx.config.data.packing,
    )


def fsdp_strategy(ctx: BuildContext) -> Any:
    """pipeline=fsdp: `PlainStrategy`'s data parallelism over the sharded models (`rlhfuse.trainer.fsdp_strategy`). The
    generators copy a whole Actor (`Models.for_generation`), so one is kept aside before the Actor is sharded in
    place."""
    from rlhfuse.core.optim import generation_dtype, resolve_precision
    from rlhfuse.distributed.fsdp import ShardingPolicy
    from rlhfuse.trainer.fsdp_strategy import ShardedStrategy

    cfg, models = ctx.config, ctx.models
    device = ctx.fabric.device
    precision = resolve_precision(cfg.pipeline.optim.precision, device.type)
    if models.generation is None:
        models.generation = cast_copy(models.actor, generation_dtype(precision))
    models.generation.to(device)  # read into host memory (`build_trainer`), like the models sharded below
    policy = ShardingPolicy(
        # bf16-mixed: layers compute in bf16 (the shards, and the gradient reduction, stay fp32)
        param_dtype=torch.bfloat16 if precision == "bf16-mixed" else None,
        cpu_offload=cfg.pipeline.cpu_offload,
        reshard_after_forward=cfg.pipeline.reshard_after_forward,
    )
    frozen = [models.ref, models.reward if cfg.inferencer.use_reward_model else None]
    return ShardedStrategy(
        models.actor,
        models.critic,
        cfg.pipeline.optim,
        cfg.algorithm,
        frozen=frozen,
        policy=policy,
        fabric=ctx.fabric,
        total_steps=ctx.total_steps,
        micro_batch_size=cfg.data.micro_batch_size,
        micro_batch_tokens=cfg.data.micro_batch_tokens,
        temperature=cfg.generator.sampling.temperature,
        packing=cfg.data.packing,
        lora=cfg.model.lora if cfg.model.lora.enabled else None,
    )


def fused_strategy(ctx: BuildContext) -> Any:
    return _pipeline_strategy(ctx, "fused")


def serial_1f1b_strategy(ctx: BuildContext) -> Any:
    return _pipeline_strategy(ctx, "serial_1f1b")


def _pipeline_strategy(ctx: BuildContext, schedule: str) -> Any:
    from rlhfuse.runtime.pipeline_strategy import PipelineStrategy

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
        schedule=schedule,
        timeout_s=cfg.distributed.timeout_s,
        autocast=ctx.fabric.autocast,
        generation_tp=ctx.topology.weight_shards,
        layout=ctx.topology.stages,
    )
    # tp > 1: the strategy trains tensor-parallel shards of the models; the rest of the job (inference,
    # memory metrics) reads those, and the whole models it was given are dropped
    ctx.models.actor, ctx.models.critic = strategy.models["actor"], strategy.models.get("critic")
    return strategy


def migration_off(ctx: BuildContext) -> NoMigration:
    return NoMigration()


def fixed_threshold(ctx: BuildContext) -> FixedThreshold:
    return FixedThreshold(ctx.config.migration.threshold)


def auto_threshold(ctx: BuildContext) -> AutoThreshold:
    mig = ctx.config.migration
    return AutoThreshold(mig.threshold, instances=ctx.config.generator.instances, bs_max=mig.bs_max)


Builder = Callable[[BuildContext], Any]

# The registry table: every name a config group may choose, and the entry it selects (what it can do, and the
# builder that makes it: `rlhfuse.trainer.topology`).
GENERATORS: Registry[GeneratorEntry] = Registry(
    "generator",
    "generator.name",
    {
        "sampling": GeneratorEntry(sampling_generator, instances=False),
        "engine": GeneratorEntry(engine_generator, instances=True, problems=no_problems),
        "vllm": GeneratorEntry(
            vllm_generator, instances=True, problems=vllm_problems, own_tensor_parallel=True
        ),
    },
)
INFERENCERS: Registry[InferencerEntry] = Registry(
    "inferencer",
    "inferencer.name",
    {
        "models": InferencerEntry(model_inferencer),
        "pipeline": InferencerEntry(pipeline_inferencer, over_stages=True),
    },
)
STRATEGIES: Registry[StrategyEntry] = Registry(
    "strategy",
    "pipeline.name",
    {
        "plain": StrategyEntry(plain_strategy, "replicas"),
        "fsdp": StrategyEntry(fsdp_strategy, "sharded", problems=sharded_problems),
        "fused": StrategyEntry(fused_strategy, "pipelines", fuses_training=True, problems=pipeline_problems),
        "serial_1f1b": StrategyEntry(serial_1f1b_strategy, "pipelines", problems=pipeline_problems),
    },
)
MIGRATION_POLICIES: Registry[MigrationEntry] = Registry(
    "migration policy",
    "migration.name",
    {
        "off": MigrationEntry(migration_off, moves=False),
        "fixed": MigrationEntry(fixed_threshold, moves=True),
        "auto": MigrationEntry(auto_threshold, moves=True, tuned=True),
    },
)
