"""The components `build_trainer` composes, chosen by name: one builder per registered name of the config groups
generator, inferencer and migration, gathered in the registry table at the end of this module (the training
strategies, group `pipeline`, are part classes of their own families: `rlhfuse.trainer.strategies.STRATEGIES`).

A builder takes the `BuildContext` (validated config, loaded models, Fabric, optimizer step count) and returns the
component. Your own builder can be named as `package.module:function` in your config (`rlhfuse.core.registry`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhfuse.agents.agent_config import trajectory_tokens
from rlhfuse.core.protocols import FabricLike
from rlhfuse.core.registry import Registry
from rlhfuse.core.rewards import RewardSet
from rlhfuse.data.prompts import Prompt
from rlhfuse.generation.batched import InstanceGenerator, SamplingGenerator
from rlhfuse.generation.generator import EngineGenerator, EnginePool, InstanceSetup
from rlhfuse.generation.migration import FixedThreshold, NoMigration
from rlhfuse.generation.tuning import AutoThreshold
from rlhfuse.trainer.models import Models
from rlhfuse.trainer.rules import no_problems, vllm_problems
from rlhfuse.trainer.run_config import RLHFConfig
from rlhfuse.trainer.strategies import STRATEGIES
from rlhfuse.trainer.strategies.pipelines.part import pipeline_inferencer
from rlhfuse.trainer.strategies.plain.inference import ModelInferencer
from rlhfuse.trainer.topology import (
    GeneratorEntry,
    InferencerEntry,
    MigrationEntry,
    Topology,
    migration_entry,
)


@dataclass
class BuildContext:
    config: RLHFConfig
    topology: Topology
    models: Models
    fabric: FabricLike
    total_steps: int
    strategy: Any = None  # set once built: the pipeline inferencer runs on the strategy's layout
    # the dataset rows' fields by prompt id (what a reward function reads besides the text, e.g. `answer`)
    rows: Sequence[Mapping[str, Any]] = field(default_factory=list)
    # the rule-based rewards (inferencer.reward_fn / reward_weights), built once; None without any
    rewards: RewardSet | None = None
    # every prompt by id, training and held-out (what a multi-turn episode continues: agent.env)
    prompts: Mapping[int, Prompt] = field(default_factory=dict)


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
    if not ctx.topology.instance_per_process and ctx.topology.world > 1:
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
    agent, prompt_len = ctx.config.agent, ctx.config.data.max_prompt_length
    if agent.env is not None:  # a multi-turn episode's prompt is its whole conversation so far
        max_new = ctx.config.generator.sampling.max_new_tokens
        prompt_len += trajectory_tokens(agent.max_response_tokens, agent.max_turns, max_new)
    pool = VLLMPool(
        actor,
        ctx.config.generator,
        max_prompt_len=prompt_len,
        seed=ctx.config.seed,
        device=next(actor.parameters()).device,
        batch_invariant=ctx.config.exact,
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
        "sampling": GeneratorEntry(sampling_generator, instances=False, partial=True, opens=True),
        "engine": GeneratorEntry(
            engine_generator, instances=True, problems=no_problems, partial=True, opens=True
        ),
        "vllm": GeneratorEntry(
            vllm_generator,
            instances=True,
            problems=vllm_problems,
            own_tensor_parallel=True,
            runs_ahead=False,  # its engine is driven from the thread that built it
            opens=True,
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
MIGRATION_POLICIES: Registry[MigrationEntry] = Registry(
    "migration policy",
    "migration.name",
    {
        "off": MigrationEntry(migration_off, moves=False),
        "fixed": MigrationEntry(fixed_threshold, moves=True),
        "auto": MigrationEntry(auto_threshold, moves=True, tuned=True),
    },
)

__all__ = ["GENERATORS", "INFERENCERS", "MIGRATION_POLICIES", "STRATEGIES", "BuildContext"]
