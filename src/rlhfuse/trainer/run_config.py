"""The root configuration: one typed dataclass per plug point (each declared next to its code), composed by
Hydra from `conf/` and converted to these dataclasses once by the entry point. `validate` checks every
combination before anything is built (`rlhfuse.trainer.validate`) and raises one error listing every problem.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

from rlhfuse.agents.agent_config import AgentConfig
from rlhfuse.core.algorithm_config import AlgorithmConfig
from rlhfuse.core.checkpoint_config import CheckpointConfig
from rlhfuse.core.config_checks import choice_problems, keyed_field, need, positive
from rlhfuse.core.inference_config import InferencerConfig
from rlhfuse.data.data_config import DataConfig
from rlhfuse.generation.generation_config import GenerationConfig
from rlhfuse.planner.specs import DeviceProfile
from rlhfuse.trainer.async_config import AsyncConfig
from rlhfuse.trainer.evaluation_config import EvalConfig
from rlhfuse.trainer.logging import LoggerConfig
from rlhfuse.trainer.models_config import ModelsConfig
from rlhfuse.trainer.strategies.pipelines.config import DistributedConfig, PipelineConfig, PipelineRun

PlanMode = Literal["manual", "auto"]
PLAN_MODES = get_args(PlanMode)


@dataclass
class MigrationConfig:
    # Sample-migration policy of a multi-instance generator (inter-stage fusion): off = no migration (the only
    # policy the single-process generator supports) | fixed | auto.
    name: str = "off"
    # Rt (migration=fixed|auto): migrate the long tail when this many samples (>= 1) or this fraction of the
    # batch (< 1) remain unfinished; migration=auto starts from it and re-tunes Rt from observed lengths.
    threshold: float = 0.2
    # How the tail moves: kv (send each sample's KV cache), reprefill (recompute prompt + generated tokens at the
    # destination) or auto (the cheaper by estimate: KV bytes / link_bytes_per_s vs measured prefill time).
    mechanism: Literal["kv", "reprefill", "auto"] = "auto"
    # BSmax: decode batch size that saturates one instance; destinations m >= Rt / bs_max.
    bs_max: int = 32
    # Bandwidth assumed for KV transfer in the mechanism's cost estimate, bytes per second.
    link_bytes_per_s: float = 1.0e9

    def problems(self) -> list[str]:
        problems = choice_problems(self, "migration")
        need(
            problems,
            self.threshold > 0,
            f"migration.threshold={self.threshold} must be > 0 (a count >= 1 or a fraction < 1)",
        )
        positive(problems, "migration.bs_max", self.bs_max)
        positive(problems, "migration.link_bytes_per_s", self.link_bytes_per_s)
        return problems


@dataclass
class RLHFConfig:
    model: ModelsConfig = field(default_factory=ModelsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # The generator's schema: SamplingConfig plus the engine's fields (generator=engine).
    generator: GenerationConfig = field(default_factory=GenerationConfig)
    inferencer: InferencerConfig = field(default_factory=InferencerConfig)
    # The training strategy (Hydra group `pipeline`): plain = no pipeline (one process, or data-parallel over one
    # process per generation instance: rlhfuse.trainer.strategies.plain.launch); fused / serial_1f1b =
    # Actor and Critic pipelines on the same ranks (rlhfuse.runtime), with distributed.nproc_per_node processes.
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    # Multi-process launch (pipeline=fused / serial_1f1b; with pipeline=plain it follows generator.instances).
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # Periodic evaluation on held-out prompts (rlhfuse.trainer.evaluation).
    eval: EvalConfig = field(default_factory=EvalConfig)
    # Asynchronous RL (key `async`): generation ahead of training within a staleness bound
    # (rlhfuse.trainer.asynchronous; docs/async.md).
    asynchronous: AsyncConfig = keyed_field(AsyncConfig, "async")
    # Multi-turn episodes (rlhfuse.agents; docs/agents.md): agent.env names the environment class; null = one
    # response per sample.
    agent: AgentConfig = field(default_factory=AgentConfig)
    # PPO iterations (each: generate, infer, train, sync).
    iterations: int = 60
    # Seeds model init, the prompt order, per-sample sampling streams and mini-batch shuffles.
    seed: int = 0
    # Exact rollouts (docs/models.md, "Exact (batch-invariant) forward"): every model's forward gives each row
    # the same bits whatever else is in its batch (model.attention_backend=exact), so the sampler's log-probs
    # equal the trainer's bit for bit, through batching, chunked prefill and migration; with generator=vllm,
    # vLLM's batch-invariant mode (CUDA).
    exact: bool = False
    # auto (cuda if available, else cpu) | cpu | cuda | cuda:N.
    device: str = "auto"
    # Output folder (metrics.jsonl, checkpoints, exported actor). null = Hydra's run directory.
    run_dir: str | None = None
    # never | auto (continue from the latest checkpoint in run_dir, fresh start if none) | <checkpoint folder>.
    resume: str = "never"
    # Name of the experiment preset, for display.
    experiment: str = "default"
    # manual = use the configured layout as is; auto = before any model is built, the execution-plan generator
    # (rlhfuse.planner.plan_for) picks pipeline.actor_pp / critic_pp / microbatches and fused vs serial for
    # distributed.nproc_per_node processes, and migration.threshold when generator.instances > 1
    # (rlhfuse.trainer.planning; docs/configuration.md).
    plan: PlanMode = "manual"
    # plan=auto prices plans with this device file (written by `rlhfuse-plan calibrate --from gpu_check.json`:
    # the GPU's achieved rates fitted to `make gpu-check`) in place of the preset matching the run's device.
    plan_device: str | None = None

    def problems(self) -> list[str]:
        """Every component's own problems, then the run's keys (rules across components: `validate`)."""
        problems: list[str] = []
        for part in (
            self.model,
            self.data,
            self.generator,
            self.inferencer,
            self.pipeline,
            self.distributed,
            self.migration,
            self.algorithm,
            self.logger,
            self.checkpoint,
            self.eval,
            self.asynchronous,
            self.agent,
        ):
            problems += part.problems()
        problems += choice_problems(self, "")
        positive(problems, "iterations", self.iterations)
        need(
            problems,
            re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
            f"device={self.device!r} must be auto, cpu, cuda or cuda:N",
        )
        if self.plan_device is not None:
            need(
                problems,
                self.plan == "auto",
                f"plan_device={self.plan_device} is read by plan=auto only: set plan=auto",
            )
            try:
                DeviceProfile.load(self.plan_device)
            except ValueError as err:
                problems.append(f"plan_device: {err}")
        return problems

    def pipeline_run(self) -> PipelineRun:
        """What the pipeline runtime reads of this configuration (`validate_runtime`, `check_resume`)."""
        from rlhfuse.core.advantages import ALGORITHMS, uses_critic  # the registry of torch functions

        a = self.algorithm
        critic = a.name not in ALGORITHMS or uses_critic(
            a
        )  # unknown: assumed so (`AlgorithmConfig` names it)
        return PipelineRun(
            pipeline=self.pipeline,
            nproc_per_node=self.distributed.nproc_per_node,
            mini_batch_size=self.data.mini_batch_size,
            micro_batch_size=self.data.micro_batch_size,
            critic=critic,
            num_layers=self.model.num_layers if self.model.sft_path is None else None,
        )


@dataclass(frozen=True)
class DerivedCounts:
    samples_per_iteration: int
    mini_batches_per_iteration: int
    optimizer_steps_per_iteration: int
    grad_accumulation_steps: int
    total_optimizer_steps: int

    def describe(self) -> str:
        return (
            f"{self.samples_per_iteration} samples/iteration -> {self.mini_batches_per_iteration} mini-batches x "
            f"PPO epochs = {self.optimizer_steps_per_iteration} optimizer steps/iteration "
            f"({self.total_optimizer_steps} in all), {self.grad_accumulation_steps} gradient-accumulation "
            "micro-batches per step"
        )


def derived_counts(cfg: RLHFConfig) -> DerivedCounts:
    d = cfg.data
    samples = d.prompts_per_iteration * d.samples_per_prompt
    minis = samples // d.mini_batch_size if d.mini_batch_size > 0 else 0
    per_iteration = minis * cfg.algorithm.ppo_epochs
    if d.micro_batch_tokens > 0:
        accumulation = -1  # depends on lengths: packed up to the token budget
    else:
        accumulation = d.mini_batch_size // d.micro_batch_size if d.micro_batch_size > 0 else 0
    return DerivedCounts(samples, minis, per_iteration, accumulation, per_iteration * cfg.iterations)


def resolve_components(cfg: RLHFConfig, *, log: Callable[[str], None] = print) -> RLHFConfig:
    """The component choices a layout implies, applied before validation and printed with their rule (never a
    silent swap); every other choice is taken as given and validated.

    - exact=true with model.attention_backend=sdpa -> exact;
    - a generator without instances (generator=sampling) with generator.instances > 1 -> generator=engine;
    - the training strategy's own rules (`StrategyPart.resolve`; under the pipelines: inferencer=models ->
      pipeline, the same forward passes over the training layout, unless each rank is one generation instance
      inferring its own samples; a critic-free algorithm's Actor-only pipeline printed);
    - algorithm.loss_agg=seq-mean-token-sum-norm with algorithm.loss_constant_length=0 -> the constant length
      is generator.max_new_tokens (the documented meaning of 0);
    - algorithm.off_policy_correction=auto -> tis with async.max_staleness > 0 (printed), none otherwise.
    """
    from rlhfuse.trainer.topology import generator_entry, topology

    if cfg.exact and cfg.model.attention_backend == "sdpa":
        log(
            "rlhfuse: model.attention_backend=sdpa -> exact (rule: exact=true computes every model's forward "
            "batch-invariantly)"
        )
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_backend="exact"))
    g = cfg.generator
    if g.instances > 1 and not generator_entry(g.name).instances:
        log(
            f"rlhfuse: generator={g.name} -> engine (rule: generator.instances={g.instances} > 1 needs the "
            "engine's instances; set generator=engine to choose it yourself)"
        )
        g = dataclasses.replace(g, name="engine")
    resolved = dataclasses.replace(cfg, generator=g)
    layout = topology(resolved)
    resolved = layout.strategy.resolve(resolved, layout, log)
    a = resolved.algorithm
    if a.off_policy_correction == "auto":
        ahead = resolved.asynchronous.max_staleness
        if ahead > 0:
            log(
                "rlhfuse: algorithm.off_policy_correction=auto -> tis (rule: async.max_staleness="
                f"{ahead} trains samples up to {ahead} version(s) old, weighted by their truncated importance "
                "ratio; set algorithm.off_policy_correction=none, token_mask or sequence_mask to choose)"
            )
        a = dataclasses.replace(a, off_policy_correction="tis" if ahead > 0 else "none")
    if a.loss_reduction == "sequence_sum" and a.constant_length is None:
        length = g.sampling.max_new_tokens
        log(
            f"rlhfuse: algorithm.loss_constant_length=0 -> {length} (rule: loss_agg={a.loss_agg} divides every "
            "sequence's token sum by generator.max_new_tokens unless algorithm.loss_constant_length is set)"
        )
        a = dataclasses.replace(a, loss_constant_length=length)
    return dataclasses.replace(resolved, algorithm=a)
