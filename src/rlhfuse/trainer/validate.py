"""`validate`: every problem of a configuration in one error, before anything is built.

Each component's config lists its own problems (`problems()`, next to its code); this module gathers them and
adds the rules that span several components (batch sizes against lengths, models against data, migration
against instances, registered names, the distributed layout, the attention backend, the vLLM backend).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import torch

from rlhfuse._resources import read_json
from rlhfuse.core.advantages import ALGORITHMS, algorithm_of
from rlhfuse.core.config_checks import need
from rlhfuse.core.inference import reward_choices
from rlhfuse.core.optim import generation_dtype, resolve_precision
from rlhfuse.models import ModelConfig
from rlhfuse.models.attention import packing_problem
from rlhfuse.models.lora import lora_problem
from rlhfuse.trainer.components import GENERATORS, INFERENCERS, MIGRATION_POLICIES
from rlhfuse.trainer.device_choice import device_problems, resolve_device
from rlhfuse.trainer.reward_functions import REWARD_FUNCTIONS
from rlhfuse.trainer.rules import uses_cuda
from rlhfuse.trainer.run_config import DerivedCounts, RLHFConfig, derived_counts
from rlhfuse.trainer.strategies import STRATEGIES
from rlhfuse.trainer.topology import (
    Topology,
    generator_entry,
    inferencer_entry,
    migration_entry,
    topology,
)


def validate(cfg: RLHFConfig, layout: Topology | None = None) -> DerivedCounts:
    """Check the whole configuration; raise one ValueError listing every problem and the override to change.
    `layout`: the run's topology as already derived (`compile_run`), else derived here."""
    raise_problems(cfg.problems() + cross_component_problems(cfg, layout))
    return derived_counts(cfg)


def raise_problems(problems: list[str]) -> None:
    """One ValueError listing every problem (none: nothing)."""
    if problems:
        raise ValueError(
            f"invalid configuration ({len(problems)} problem(s)):\n  - " + "\n  - ".join(problems)
        )


def cross_component_problems(cfg: RLHFConfig, layout: Topology | None = None) -> list[str]:
    problems: list[str] = []
    d, g, m, i = cfg.data, cfg.generator, cfg.model, cfg.inferencer
    need(
        problems,
        i.use_reward_model or i.reward_fn is not None or cfg.agent.env is not None,
        "no reward: inferencer.use_reward_model=false and no inferencer.reward_fn; enable one of them (or an "
        "environment's rewards: agent.env)",
    )
    longest = d.max_prompt_length + g.sampling.max_new_tokens
    need(
        problems,
        d.micro_batch_tokens == 0 or d.micro_batch_tokens >= longest,
        f"data.micro_batch_tokens={d.micro_batch_tokens} cannot hold one full sample of "
        f"data.max_prompt_length+generator.max_new_tokens={longest} tokens: raise it to >= {longest} or set 0",
    )
    if m.sft_path is None and m.reward_path is None:
        need(
            problems,
            d.source not in ("file", "guess"),
            "no model.sft_path/model.reward_path: the embedded model is warm-started on an embedded task, which "
            f"needs data.source=synthetic, arithmetic or calculator, not {d.source} (data.source=guess is played by a "
            "chat model: experiment=guess_smollm2); give model.sft_path and model.reward_path to train on your "
            "own prompts, or start from a run's exported Actor with a reward function: model.name=hf "
            "model.sft_path=<run_dir>/actor_hf algorithm=grpo inferencer.use_reward_model=false "
            "inferencer.reward_fn=<module:function> (docs/configuration.md, 'Your own prompts')",
        )
    else:
        # a checkpoint for each model the run uses: the reward model (unless the score is a rule alone) and the
        # Critic's start (for an algorithm with a Critic: model.critic_path, else the reward model)
        critic = cfg.algorithm.name in ALGORITHMS and algorithm_of(cfg.algorithm).uses_critic
        need(
            problems,
            m.sft_path is None
            or m.reward_path is not None
            or (not i.use_reward_model and (not critic or m.critic_path is not None))
            or (i.use_reward_model and m.critic_path is not None),
            m.paths_problem(),
        )
        need(
            problems,
            m.reward_path is not None or not i.use_reward_model,
            "inferencer.use_reward_model=true needs model.reward_path: set it or inferencer.use_reward_model=false",
        )
    if cfg.migration.name in MIGRATION_POLICIES and migration_entry(cfg.migration.name).moves:
        need(
            problems,
            g.instances > 1,
            f"migration={cfg.migration.name} moves samples between generation instances but generator.instances="
            f"{g.instances}: set generator.instances=2 (or more) or migration=off",
        )
    for choice in reward_choices(i.reward_fn):
        if isinstance(choice, str):
            need(problems, choice in REWARD_FUNCTIONS, REWARD_FUNCTIONS.unknown_message(choice))
    problems += algorithm_problems(cfg)
    for registry, value in (
        (GENERATORS, g.name),
        (INFERENCERS, i.name),
        (STRATEGIES, cfg.pipeline.name),
        (MIGRATION_POLICIES, cfg.migration.name),
    ):
        need(problems, value in registry, registry.unknown_message(value))
    layout = layout or topology(cfg)
    problems += device_problems(cfg.device, layout.world)
    model, where = _model_shape(cfg, problems)
    if model is not None:  # the longest prompt is known once the data is read (`check_context`); >= 1 token
        problems += _context_problems(cfg, model, where, 1) + _kv_memory_problems(cfg, model)
        problems += tensor_parallel_problems(cfg, model, where)
    coef = cfg.pipeline.optim.router_aux_loss_coef
    if coef > 0 and model is not None and not model.num_experts:
        problems.append(
            f"pipeline.router_aux_loss_coef={coef}: the Actor ({where}) has no mixture-of-experts layers, so "
            "there is no load to balance: set pipeline.router_aux_loss_coef=0"
        )
    problems += generation_tp_problems(cfg, layout)
    problems += attention_problems(cfg)
    if cfg.exact:
        problems += exact_problems(cfg)
    problems += lora_problems(cfg, model, where)
    if cfg.asynchronous.enabled or cfg.asynchronous.split:
        problems += async_problems(cfg, layout)
    if cfg.agent.env is not None:
        problems += agent_problems(cfg)
    # resolved configs only (`resolve_components`: inferencer=models stays under a pipeline strategy only when each
    # rank is one generation instance inferring its own samples)
    over_stages = cfg.inferencer.name in INFERENCERS and inferencer_entry(cfg.inferencer.name).over_stages
    if layout.fused_rollout and over_stages:
        problems.append(
            f"inferencer.name=pipeline with generator.instances={cfg.generator.instances} (one generation instance "
            "per rank, each inferring its own samples as they finish): the pipeline inferencer runs every rank "
            "on the same rows, so it would infer one rank's samples only; set inferencer.name=models, or "
            "generator.instances=1 (inference over the training layout)"
        )
    # the chosen components' own rules: the generator's (`rlhfuse.trainer.rules`), the strategy's launch, layout
    # and stage rules (`StrategyPart.problems`)
    if g.name in GENERATORS:
        problems += generator_entry(g.name).problems(cfg, layout, model)
    if cfg.pipeline.name in STRATEGIES:
        problems += layout.strategy.problems(cfg, layout, model)
    return problems


def async_problems(cfg: RLHFConfig, layout: Topology) -> list[str]:
    """async.max_staleness > 0 or async.generation_ranks > 0: generation runs ahead in a background thread of one
    process (colocated), or on a rank of its own beside one training rank (split), on a generator that may run
    there, and the iteration's prompts are drawn ahead (no dynamic sampling's extra draws)."""
    problems: list[str] = []
    a = cfg.asynchronous
    k = a.max_staleness
    if a.split:
        need(
            problems,
            layout.training_world == 1 and layout.strategy.whole_models and layout.pipeline_run is None,
            f"async.generation_ranks={a.generation_ranks} splits the world into one training rank and "
            f"{a.generation_ranks} generation rank, but this layout has {layout.world} processes with "
            f"pipeline={cfg.pipeline.name}: set distributed.nproc_per_node={1 + a.generation_ranks} (or torchrun "
            "--nproc-per-node to it), generator.instances=1 and pipeline=plain (several training ranks beside "
            "generation ranks are not built yet)",
        )
    else:
        need(
            problems,
            layout.world == 1,
            f"async.max_staleness={k} runs generation ahead in a background thread of one process, but this "
            f"layout has {layout.world} processes: set generator.instances=1 and distributed.nproc_per_node=1, or "
            "async.generation_ranks=1 (a generation rank beside one training rank), or async.max_staleness=0",
        )
    key = "async.generation_ranks" if a.split else "async.max_staleness"
    where = f"{key}={a.generation_ranks if a.split else k}"
    need(
        problems,
        cfg.data.oversample == 0,
        f"{where} draws each iteration's prompts ahead, and data.oversample={cfg.data.oversample} draws extra "
        f"ones within an iteration: set data.oversample=0 or {key}=0",
    )
    g = cfg.generator
    if g.name in GENERATORS:
        need(
            problems,
            generator_entry(g.name).runs_ahead,
            f"{where} generates apart from training (a thread, or a rank whose Actor copy the sync pushes), which "
            f"generator={g.name} does not: set generator=engine or sampling",
        )
        need(
            problems,
            not a.partial_rollout or generator_entry(g.name).partial,
            f"async.partial_rollout=true continues samples under new weights between decode steps, which "
            f"generator={g.name} does not do: set generator=sampling or engine, or async.partial_rollout=false",
        )
    return problems


def agent_problems(cfg: RLHFConfig) -> list[str]:
    """agent.env: the environment class loads (one line naming agent.env otherwise), and the episodes run where
    the agent loop is built: synchronously (any number of processes: rank 0 runs the environments)."""
    from rlhfuse.agents.environment import AgentEnvError, load_environment

    problems: list[str] = []
    try:
        load_environment(cfg.agent.env)  # type: ignore[arg-type]
    except (AgentEnvError, KeyError) as err:
        problems.append(str(err).strip("'\""))
    need(
        problems,
        not cfg.asynchronous.enabled and not cfg.asynchronous.split,
        f"agent.env with async.max_staleness={cfg.asynchronous.max_staleness} and async.generation_ranks="
        f"{cfg.asynchronous.generation_ranks}: multi-turn episodes run synchronously, in the training process, "
        "for now; set async.max_staleness=0 and async.generation_ranks=0",
    )
    return problems


def tensor_parallel_problems(cfg: RLHFConfig, model: ModelConfig, where: str) -> list[str]:
    """pipeline.actor_tp / critic_tp / generator.tp against the model's heads, kv heads and intermediate size
    (`rlhfuse.runtime.tensor_parallel.tp_problems`: each with the arithmetic and the key to change)."""
    from rlhfuse.runtime.tensor_parallel import tp_problems

    problems: list[str] = []
    m = cfg.model
    critic = model
    if m.sft_path is None and m.reward_intermediate_size:  # the embedded Critic's own size
        critic = dataclasses.replace(model, intermediate_size=m.reward_intermediate_size)
    keys = [
        ("pipeline.actor_tp", cfg.pipeline.actor_tp, model),
        ("pipeline.critic_tp", cfg.pipeline.critic_tp, critic),
        ("generator.tp", cfg.generator.tp, model),
    ]
    for key, tp, shape in keys:
        if tp <= 1:
            continue
        problems += [f"{p} ({where})" for p in tp_problems(shape, tp, key)]
        if model.tie_word_embeddings:
            problems.append(
                f"{key}={tp}: {where} ties its embedding and LM head, which are not split tensor-parallel: "
                f"untie them or set {key}=1"
            )
    return problems


# model.attention_backend -> (module its extra provides, what it is)
_ATTENTION_EXTRAS = {
    "flash": ("flash_attn", "flash-attn"),
    "te": ("transformer_engine", "Transformer Engine"),
}


def attention_problems(cfg: RLHFConfig) -> list[str]:
    """model.attention_backend against the machine, the precision and packing: flash and te need their extra
    installed and a CUDA device; flash computes in fp16 / bf16 only, so it needs a bf16 precision."""
    backend = cfg.model.attention_backend
    if backend not in _ATTENTION_EXTRAS:
        return []  # sdpa runs everywhere (an unknown name is ModelsConfig's own problem)
    module, what = _ATTENTION_EXTRAS[backend]
    key = f"model.attention_backend={backend}"
    problems: list[str] = []
    if importlib.util.find_spec(module) is None:
        problems.append(
            f"{key} needs {what}, which is not installed: `pip install 'rlhfuse[gpu]'` on a CUDA machine, or set "
            "model.attention_backend=sdpa"
        )
    cuda = uses_cuda(cfg)
    if not cuda:
        problems.append(
            f"{key} runs on CUDA only, but this run's device is the CPU (device={cfg.device}): set "
            "model.attention_backend=sdpa, or device=cuda on a CUDA machine"
        )
    precision = resolve_precision(cfg.pipeline.optim.precision, "cuda" if cuda else "cpu")
    if backend == "flash" and cuda and generation_dtype(precision) != torch.bfloat16:
        problems.append(
            f"{key} computes in fp16 / bf16 only, but pipeline.precision={cfg.pipeline.optim.precision} computes in "
            "fp32: set pipeline.precision=bf16-mixed (or bf16-true), or model.attention_backend=sdpa"
        )
    if cfg.data.packing and (packed := packing_problem(backend)) is not None:
        problems.append(f"model.{packed}")
    return problems


def exact_problems(cfg: RLHFConfig) -> list[str]:
    """exact=true: every model batch-invariant (model.attention_backend=exact), whole models (tensor-parallel
    shards compute their own linears), and no LoRA (the trainer's W x + B A x is not the generator's merged W')."""
    problems = []
    if cfg.model.attention_backend != "exact":
        problems.append(
            f"exact=true computes attention with model.attention_backend=exact, but model.attention_backend="
            f"{cfg.model.attention_backend}: drop model.attention_backend (or set it to exact), or set exact=false"
        )
    for key, tp in (
        ("pipeline.actor_tp", cfg.pipeline.actor_tp),
        ("pipeline.critic_tp", cfg.pipeline.critic_tp),
        ("generator.tp", cfg.generator.tp),
    ):
        if tp > 1:
            problems.append(
                f"exact=true with {key}={tp}: tensor-parallel shards compute their own linears, which are not "
                f"batch-invariant: set {key}=1, or exact=false"
            )
    if cfg.model.lora.enabled:
        problems.append(
            "exact=true with model.lora: the trainer computes W x + B A x while the generator runs the merged "
            "weights, which round differently: train without LoRA, or set exact=false"
        )
    return problems


def generation_tp_problems(cfg: RLHFConfig, layout: Topology) -> list[str]:
    """generator.tp: each generation instance spans generator.tp ranks, so the ranks must be exactly the
    instances' (vLLM: generator.instances engines of generator.tp ranks each) or a multiple of generator.tp
    (rlhfuse's tensor-parallel instances under the pipeline strategies: world / generator.tp of them)."""
    g, problems = cfg.generator, list[str]()
    if g.tp < 1:
        return [f"generator.tp={g.tp} must be >= 1"]
    if g.tp == 1:
        return problems
    entry = generator_entry(g.name) if g.name in GENERATORS else None
    if entry is not None and entry.own_tensor_parallel:
        need = g.instances * g.tp
        # a launch of one process per instance: the strategy's own launch rule says it
        if not layout.instance_per_process and layout.world != need:
            problems.append(
                f"generator={g.name} with generator.tp={g.tp}: each of generator.instances={g.instances} engines "
                f"spans generator.tp ranks, so the job needs {need} processes but has {layout.world}: set "
                f"distributed.nproc_per_node={need}, or generator.instances={max(layout.world // g.tp, 1)}"
            )
        return problems
    world = g.instances if layout.instance_per_process else layout.world
    if world % g.tp:
        problems.append(
            f"generator.tp={g.tp} does not divide the world size {world} ({world} % {g.tp} = {world % g.tp}; "
            f"generation instances = world size / generator.tp): set generator.tp to a divisor of {world}"
        )
    if entry is not None and entry.instances:
        problems.append(
            f"generator.tp={g.tp}: generator={g.name}'s instances are one rank each (tensor-parallel instances "
            "are generator=sampling's under the pipeline strategies, and vLLM's engines): set generator=sampling, "
            "generator=vllm or generator.tp=1"
        )
    return problems


def algorithm_problems(cfg: RLHFConfig) -> list[str]:
    """The algorithm against the data: group baselines need several samples per prompt. (A critic-free
    algorithm under the pipeline strategies runs the Actor's pipeline alone: `resolve_components` says so.)"""
    a, problems = cfg.algorithm, list[str]()
    if a.name not in ALGORITHMS:
        return problems  # AlgorithmConfig.problems names the unknown algorithm
    algorithm = algorithm_of(a)
    n = cfg.data.samples_per_prompt
    need(
        problems,
        n >= algorithm.min_samples_per_prompt,
        f"algorithm={a.name} baselines each sample against the other samples of its prompt, which needs "
        f"data.samples_per_prompt >= {algorithm.min_samples_per_prompt} (got data.samples_per_prompt={n}): set "
        f"data.samples_per_prompt={max(algorithm.min_samples_per_prompt, 4)} (and data.mini_batch_size to divide "
        "data.prompts_per_iteration*data.samples_per_prompt), or algorithm=ppo / reinforce_pp",
    )
    limit = cfg.generator.sampling.max_new_tokens
    need(
        problems,
        a.overlong_tokens(limit) <= limit,
        f"algorithm.overlong_buffer={a.overlong_buffer} tokens exceeds generator.max_new_tokens={limit}: every "
        f"response would be penalised: set algorithm.overlong_buffer to at most {limit} (or a fraction < 1 of it)",
    )
    return problems


# the embedded model's positions (`rlhfuse.trainer.warmstart`): prompts up to this long, plus max_new_tokens
EMBEDDED_PROMPT_POSITIONS = 64 + 16


def lora_problems(cfg: RLHFConfig, model: ModelConfig | None, where: str) -> list[str]:
    """model.lora against the Actor's shape (plain, fsdp and the pipeline strategies train the adapters; the
    pipelines' own LoRA rules are theirs: `PipelinePart.problems`)."""
    if not cfg.model.lora.enabled or model is None or (problem := lora_problem(model)) is None:
        return []
    return [f"{problem} ({where})"]


def _model_shape(cfg: RLHFConfig, problems: list[str]) -> tuple[ModelConfig | None, str]:
    """The Actor's shape before any model is built: from the config (the embedded model) or the SFT checkpoint's
    config.json (None when it is missing: loading names the file). Also says where it came from."""
    m = cfg.model
    if m.sft_path is None:
        positions = EMBEDDED_PROMPT_POSITIONS + cfg.generator.sampling.max_new_tokens
        shape = ModelConfig(
            architecture=m.architecture,
            sliding_window=m.sliding_window,
            hidden_size=m.hidden_size,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            intermediate_size=m.intermediate_size,
            max_position_embeddings=positions,
        )
        return shape, "the embedded model"
    config_file = Path(m.sft_path).expanduser() / "config.json"
    if not config_file.is_file():
        return None, ""
    try:
        return ModelConfig.from_hf_dict(read_json(config_file, ValueError)), str(config_file)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        problems.append(f"model.sft_path: {err}")
        return None, ""


def check_context(cfg: RLHFConfig, longest_prompt: int) -> None:
    """Once the prompts are tokenized: the longest one plus generator.max_new_tokens must fit the model's
    positions (ValueError naming both and the fix)."""
    problems: list[str] = []
    model, where = _model_shape(cfg, problems)
    if model is not None:
        problems += _context_problems(cfg, model, where, longest_prompt)
    if problems:
        raise ValueError("; ".join(problems))


def _context_problems(cfg: RLHFConfig, model: ModelConfig, where: str, prompt: int) -> list[str]:
    """Prompt (`prompt` tokens) + response must fit the model's positions."""
    new = cfg.generator.sampling.max_new_tokens
    limit = model.max_position_embeddings
    if prompt + new <= limit:
        return []
    if prompt <= 1:
        return [
            f"generator.max_new_tokens={new} exceeds max_position_embeddings={limit} of {where}: set "
            f"generator.max_new_tokens<={limit - 1} (and leave room for the prompt)"
        ]
    room = limit - prompt
    fix = f"lower generator.max_new_tokens to <= {room}, or" if room > 0 else "lower"
    return [
        f"the longest prompt ({prompt} tokens) + generator.max_new_tokens={new} = {prompt + new} tokens exceed "
        f"max_position_embeddings={limit} of {where}: {fix} data.max_prompt_length with data.truncate=left "
        "(keeps each prompt's end)"
    ]


def _kv_memory_problems(cfg: RLHFConfig, model: ModelConfig) -> list[str]:
    """The generator's KV cache for one rollout must fit in half of this machine's memory (host or device)."""
    d, g = cfg.data, cfg.generator
    samples = d.prompts_per_iteration * d.samples_per_prompt
    rows = min([n for n in (g.engine.num_slots, g.sampling.max_batch_size) if n > 0] or [samples])
    cuda = uses_cuda(cfg)
    precision = resolve_precision(cfg.pipeline.optim.precision, "cuda" if cuda else "cpu")
    dtype_bytes = generation_dtype(precision).itemsize  # the cache is in the generation copy's dtype
    per_token = 2 * model.num_layers * model.num_kv_heads * model.resolved_head_dim * dtype_bytes
    tokens = d.max_prompt_length + g.sampling.max_new_tokens
    need_bytes = rows * tokens * per_token
    memory = _memory_bytes(cfg.device if cuda else "cpu")
    if memory is None or need_bytes <= memory // 2:
        return []
    fits = memory // 2 // (rows * per_token) - d.max_prompt_length
    return [
        f"generator.max_new_tokens={g.sampling.max_new_tokens}: the KV cache of {rows} samples x {tokens} tokens "
        f"needs {need_bytes / 2**30:.1f} GiB, more than half of this machine's {memory / 2**30:.1f} GiB "
        f"{'device' if cuda else 'host'} memory: lower generator.max_new_tokens (<= {max(fits, 0)} fits), or "
        "decode fewer samples at once (generator.max_batch_size / generator.num_slots)"
    ]


def _memory_bytes(device: str) -> int | None:
    """Memory of `device=<device>` as this rank resolves it (its own GPU under torchrun), or the host's."""
    try:
        if device != "cpu":
            return int(torch.cuda.get_device_properties(resolve_device(device)).total_memory)
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, RuntimeError, AttributeError, AssertionError):  # torch without CUDA asserts
        return None
