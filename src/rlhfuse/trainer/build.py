"""From a validated `RLHFConfig` to a ready `RLHFTrainer`: data first (bad prompts fail before any model is
built), then models (warm start if needed), then the components chosen by name from the registries."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhfuse.core.advantages import uses_critic
from rlhfuse.core.checkpoint import check_fresh_start
from rlhfuse.core.config_checks import need
from rlhfuse.core.optim import generation_dtype, resolve_precision
from rlhfuse.core.protocols import (
    Callback,
    FabricLike,
    FusingGenerator,
    Generator,
    Inferencer,
    Logger,
    OpeningGenerator,
    RolloutStage,
    SplitInferencer,
    Strategy,
)
from rlhfuse.core.rewards import RewardSet
from rlhfuse.data.arithmetic import ARITHMETIC_TASKS
from rlhfuse.data.feed import PromptFeed
from rlhfuse.data.prompts import (
    ROW_SOURCES,
    Prompt,
    PromptLoader,
    completion_rows,
    dataset_label,
    dataset_rows,
    load_prompts,
    uses_chat_template,
)
from rlhfuse.data.synthetic import SyntheticTask
from rlhfuse.data.tokenizer import Tokenizer
from rlhfuse.generation.transport import PointToPoint
from rlhfuse.models import cast_copy
from rlhfuse.runtime.launch import Watchdog, distributed_fabric
from rlhfuse.runtime.local import LocalFabric
from rlhfuse.trainer.async_config import AsyncConfig
from rlhfuse.trainer.asynchronous import AsyncRollout, generation_device
from rlhfuse.trainer.callbacks import (
    MemoryMetrics,
    RewardMetrics,
    SampleTable,
    TaskScore,
)
from rlhfuse.trainer.components import BuildContext
from rlhfuse.trainer.device_choice import claim_device, resolve_device
from rlhfuse.trainer.evaluation import Evaluator, held_out_prompts
from rlhfuse.trainer.logging import JsonlLogger, RichProgress, build_loggers, table_sinks
from rlhfuse.trainer.models import Models, load_models, load_tokenizer
from rlhfuse.trainer.parts import ExportTarget, Parts, StrategyPart
from rlhfuse.trainer.resume import check_resume_config, config_record
from rlhfuse.trainer.reward_functions import reward_set, rule_reward, verifier_index
from rlhfuse.trainer.rollout import FusedRollout, SerialRollout, training_rollout
from rlhfuse.trainer.run_config import RLHFConfig
from rlhfuse.trainer.spec import compile_run, with_stop_tokens
from rlhfuse.trainer.split import Control, GenerationService, SplitRollout
from rlhfuse.trainer.topology import Topology
from rlhfuse.trainer.trainer import Assembled, RLHFTrainer
from rlhfuse.trainer.validate import check_context, raise_problems
from rlhfuse.trainer.warmstart import WarmStartTask, warm_start


def split_channels(ctx: BuildContext, generator: Generator, peer: int) -> tuple[PointToPoint, Control]:
    """The split placement's link and control channel (on both of its ranks): groups of the training rank (0 in
    them) and the generation rank (1), the link on the device its collectives run on, both bounded by
    distributed.timeout_s; `peer`: the other rank's rank in them."""
    from rlhfuse.generation.transport import collective_device

    layout = ctx.topology
    ranks, timeout_s = [0, layout.world - 1], ctx.config.distributed.timeout_s
    group = layout.groups.group(("async", "split"), ranks, timeout_s=timeout_s)
    control = layout.groups.control(("async", "split"), [ranks], timeout_s=timeout_s)
    return PointToPoint(collective_device(group, generation_device(generator)), group), Control(
        control, peer, timeout_s=timeout_s
    )


def frozen_inferencer(config: AsyncConfig, inferencer: Inferencer) -> SplitInferencer | None:
    """The inferencer whose frozen models score batches on the generation rank (async.frozen_inference=
    generation_ranks), or None; an inferencer that cannot is refused with the fix."""
    if config.frozen_inference != "generation_ranks":
        return None
    if not isinstance(inferencer, SplitInferencer):
        raise TypeError(
            "async.frozen_inference=generation_ranks needs an inferencer with infer_frozen and infer_live "
            f"(SplitInferencer, as inferencer=models' ModelInferencer), not {type(inferencer).__name__}: set "
            "async.frozen_inference=training_ranks"
        )
    return inferencer


def rollout_stage(
    ctx: BuildContext, generator: Any, inferencer: Any, feed: PromptFeed
) -> SerialRollout | FusedRollout | AsyncRollout | SplitRollout:
    """Step 1's form, chosen once: generation on a rank of its own with the split placement (`SplitRollout`, the
    jobs' prompts drawn from `feed`), generation ahead of training in a thread beside it when async is on
    (`AsyncRollout`, the same), fused generation + inference when each rank is one generation instance
    (`Topology.fused_rollout`), the serial stage otherwise."""
    cfg = ctx.config
    if cfg.asynchronous.split:
        return SplitRollout(
            generator,
            inferencer,
            feed,
            *split_channels(ctx, generator, peer=1),
            peer=1,
            max_staleness=cfg.asynchronous.max_staleness,
            last_iteration=cfg.iterations,
            pad_token_id=ctx.models.tokenizer.pad_id,
            partial_rollout=cfg.asynchronous.partial_rollout,
        )
    if cfg.asynchronous.enabled:
        return AsyncRollout(
            generator,
            inferencer,
            feed,
            max_staleness=cfg.asynchronous.max_staleness,
            last_iteration=cfg.iterations,
            pad_token_id=ctx.models.tokenizer.pad_id,
            partial_rollout=cfg.asynchronous.partial_rollout,
            stall_timeout_s=cfg.distributed.timeout_s,
        )
    if ctx.topology.fused_rollout:
        assert isinstance(generator, FusingGenerator), type(generator)
        return FusedRollout(generator, inferencer)
    return SerialRollout(generator, inferencer, pad_token_id=ctx.models.tokenizer.pad_id)


def embedded_task(config: RLHFConfig) -> WarmStartTask:
    """The embedded task of `data.source` (its tokenizer, and the warm start's data when no model is given):
    an arithmetic task for data=arithmetic or calculator, the synthetic topic task otherwise."""
    d = config.data
    max_new = config.generator.sampling.max_new_tokens
    if d.source in ARITHMETIC_TASKS:
        task = ARITHMETIC_TASKS[d.source]
        return task(seed=config.seed, max_operand=d.max_operand, max_new_tokens=max_new)
    return SyntheticTask(
        seed=config.seed,
        max_new_tokens=max_new,
        length_median=d.length_median,
        length_sigma=d.length_sigma,
        phrase_length=d.phrase_length,
    )


def make_fabric(config: RLHFConfig, layout: Topology, device: torch.device) -> FabricLike:
    """Lightning Fabric, launched, for a run with a process group; a `LocalFabric` for a run of one process (no
    launcher, no group: Lightning's import, seconds, would buy it nothing)."""
    precision = resolve_precision(config.pipeline.optim.precision, device.type)
    if precision == "bf16-true":
        # the models themselves hold bf16 weights (`cast_models`) and compute in them: no autocast, and
        # MasterWeightAdamW keeps fp32 masters (Fabric's own bf16-true would keep bf16 optimizer states)
        precision = "32-true"
    if layout.process_group:  # several processes, or models sharded over a group (of one rank too)
        return distributed_fabric(
            nproc_per_node=layout.world,
            backend=config.distributed.backend,
            timeout_s=config.distributed.timeout_s,
            device_type=device.type,
            precision=precision,
        )
    return LocalFabric(device, precision)  # type: ignore[arg-type]  # it refuses a precision it cannot run


def allow_tf32(device: torch.device) -> None:
    """On CUDA, fp32 matmuls and cuDNN convolutions run on TF32 tensor cores (fp32 range, 10-bit mantissa: what
    the fp32 parts of bf16-mixed, the fp32 log-prob reductions and 32-true runs want on Ampere and later); other
    devices are left alone, so CPU numerics do not change. The legacy `allow_tf32` flags, which Lightning reads
    too (mixing them with `fp32_precision` makes torch raise)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def prepare_generation_copy(models: Models, dtype: torch.dtype) -> None:
    """The full Actor the generators copy (`Models.for_generation`) in the generation dtype (`generation_dtype`:
    bf16 under bf16-mixed and bf16-true), so the generator's copy and its KV cache are too: the sharded Actor's
    generation copy is cast in place; a whole trained Actor of another dtype gets a cast copy (the trained
    weights stay as they are). Weight sync casts on load (`load_state_dict` copies into the copy's dtype)."""
    if models.generation is not None:
        models.generation.to(dtype)
    elif next(models.actor.parameters()).dtype != dtype:
        models.generation = cast_copy(models.actor, dtype)


def cast_models(models: Models, dtype: torch.dtype) -> None:
    """precision=bf16-true: every model's weights in `dtype`, the generation copy of a sharded Actor included
    (generation, inference and training compute in it; the optimizers keep fp32 masters of the trained ones)."""
    for model in (models.actor, models.ref, models.critic, models.reward, models.generation):
        if model is not None:
            model.to(dtype)


def with_datasets(config: RLHFConfig, train_dataset: Any, eval_dataset: Any) -> RLHFConfig:
    """`config` with the Python API's datasets as its prompt sources: data.source=file, and data.path (eval.path)
    the dataset's label (`dataset_label`: its size and a hash of its rows, what run.json records and a resume
    compares). A dataset given beside a configured source of the same prompts is an error naming both."""
    if train_dataset is None and eval_dataset is None:
        return config
    problems: list[str] = []
    data, held = config.data, config.eval
    if train_dataset is not None:
        dataset_rows(train_dataset)  # not a datasets.Dataset: one line saying what to pass
        need(
            problems,
            data.path is None and data.source not in ROW_SOURCES,
            f"build_trainer(train_dataset=...) and data.source={data.source}"
            + (f" data.path={data.path}" if data.path else "")
            + " both give the training prompts: leave data.path unset (data.source=file or synthetic)",
        )
        data = dataclasses.replace(data, source="file", path=dataset_label(train_dataset))
    if eval_dataset is not None:
        dataset_rows(eval_dataset)
        need(
            problems,
            held.path is None and held.split_fraction == 0,
            f"build_trainer(eval_dataset=...) and eval.path={held.path} eval.split_fraction={held.split_fraction} "
            "both give the held-out prompts: leave eval.path unset and eval.split_fraction=0",
        )
        held = dataclasses.replace(held, path=dataset_label(eval_dataset))
    raise_problems(problems)
    return dataclasses.replace(config, data=data, eval=held)


@dataclass(frozen=True)
class RunData:
    """What the data phase gives the rest of the build: the configuration with the tokenizer's stop ids, the
    tokenizer, the training prompts' loader and the held-out prompts, every prompt's dataset row (by prompt id)
    and the rule-based rewards (checked against those rows)."""

    config: RLHFConfig
    tokenizer: Tokenizer
    loader: PromptLoader
    held_out: list[Prompt]
    rows: list[Mapping[str, Any]]
    rewards: RewardSet | None


@dataclass(frozen=True)
class Components:
    """The plug points of one run, built in this order from its parts (`build_components`)."""

    strategy: Strategy
    generator: Generator
    inferencer: Inferencer
    rollout: RolloutStage
    serving: GenerationService | None = None
    """On the split placement's generation rank, what it runs instead of the iterations."""


def build_trainer(
    config: RLHFConfig,
    *,
    run_dir: str | Path | None = None,
    callbacks: Sequence[Callback] | None = None,
    log: Callable[[str], None] = print,
    train_dataset: Any = None,
    eval_dataset: Any = None,
) -> RLHFTrainer:
    """The trainer `config` describes, everything built and checked (`fit()` runs it): the parts its sections
    name (`RLHFTrainer.from_config`, the objects a script would pass), set up. `train_dataset` and
    `eval_dataset` (`datasets.Dataset`s, TRL's names) give the training and held-out prompts in place of
    `data.path` and `eval.path`."""
    trainer = RLHFTrainer.from_config(config, callbacks=callbacks or [], run_dir=run_dir, log=log)
    return trainer.setup(train_dataset=train_dataset, eval_dataset=eval_dataset)


def assemble(
    config: RLHFConfig,
    parts: Parts,
    *,
    run_dir: str | Path | None,
    callbacks: list[Callback],
    loggers: list[Logger] | None,
    log: Callable[[str], None],
    train_dataset: Any = None,
    eval_dataset: Any = None,
) -> Assembled:
    """The run `config` (with the parts' settings written in) describes, built from `parts`.

    The build in order: the run spec (every configuration problem at once), the run folder (a resume that may
    not continue fails here), the data (bad prompts and rows fail before any model is built), the device and
    process group, the models, the components (strategy, generator, inferencer, rollout stage), the callbacks.
    `loggers`: None for the configured ones (`logger.backends`), else these beside metrics.jsonl."""
    spec = compile_run(with_datasets(config, train_dataset, eval_dataset), log=log)
    config, layout = spec.config, spec.topology
    parts = parts.resolved(config)
    assert parts.strategy is not None, "resolved"
    run_dir, record = prepare_run_folder(config, parts.strategy, layout, run_dir, log)
    log(f"rlhfuse: {spec.counts.describe()}")
    data = load_data(config, train_dataset, eval_dataset, log)
    config = data.config

    device = resolve_device(config.device)  # this rank's: cuda:LOCAL_RANK under torchrun
    claim_device(device)  # before the process group: NCCL, Triton launches and current_device() follow it
    allow_tf32(device)
    fabric = make_fabric(config, layout, device)
    if fabric.world_size > 1:
        device = fabric.device  # Fabric's rank device: cuda:LOCAL_RANK too (or the CPU)
    if layout.process_group:
        layout.groups.cpu()  # the world's control group (gloo) made here, on every rank, not first in mid-run
    shard = parts.strategy.stages_held(config, layout, fabric.global_rank)
    models = build_models(config, parts.strategy.load_device(device), device, shard, log)
    fabric.seed_everything(config.seed, verbose=False)

    ctx = BuildContext(
        config,
        layout,
        models,
        fabric,
        spec.counts.total_optimizer_steps,
        rows=data.rows,
        rewards=data.rewards,
        prompts={p.id: p for p in (*data.loader.prompts, *data.held_out)},
    )
    feed = PromptFeed(data.loader, models.tokenizer.pad_id)
    built = build_components(ctx, parts, feed)
    rank0 = fabric.is_global_zero  # only rank 0 logs, shows progress and exports
    export = None
    if config.checkpoint.export_hf:
        target = ExportTarget(
            config, models, built.strategy, run_dir / "actor_hf", rank0, bool(shard), layout.weight_shards
        )
        export = parts.strategy.export(target)
    models.generation = None  # the generator holds its own copy now
    run_loggers = run_loggers_for(config, run_dir, loggers) if rank0 else []
    # the watchdog keeps the last step for its dead-rank message
    extra = [c for c in (export, Watchdog.current if fabric.world_size > 1 else None) if c is not None]
    all_callbacks = [
        *run_callbacks(
            config,
            models,
            built,
            data,
            run_dir,
            run_loggers,
            extra,
            rank0=rank0,
            collective=layout.training_world > 1,
        ),
        *callbacks,
    ]
    for logger in run_loggers:
        try:
            logger.log_hyperparams(dataclasses.asdict(config))
        except NotImplementedError:  # Fabric's CSVLogger keeps no hyperparameters
            pass
    return Assembled(
        config,
        generator=built.generator,
        inferencer=built.inferencer,
        strategy=built.strategy,
        rollout=training_rollout(
            built.rollout,
            config.data,
            data.loader,
            models.tokenizer.pad_id,
            opening=opening_of(built, layout, config),
        ),
        prompts=data.loader,
        pad_token_id=models.tokenizer.pad_id,
        run_dir=run_dir,
        callbacks=all_callbacks,
        loggers=run_loggers,
        fabric=fabric,
        record=record,
        feed=feed,
        serving=built.serving,
    )


def opening_of(
    built: Any, layout: Topology, config: RLHFConfig
) -> tuple[OpeningGenerator, Inferencer] | None:
    """The generator whose rollout stays open, and the inferencer, where dynamic sampling (data.oversample) runs
    inside the rollout (`Topology.open_rollout`); None: it is off, or runs in rounds (also with agent.env: the
    episodes run over the open rollout themselves)."""
    if config.data.oversample == 0 or not layout.open_rollout or config.agent.env is not None:
        return None
    assert isinstance(built.generator, OpeningGenerator), type(built.generator)
    return built.generator, built.inferencer


def run_loggers_for(config: RLHFConfig, run_dir: Path, given: list[Logger] | None) -> list[Logger]:
    """The configured loggers (`logger.backends`); a script's own list replaces them, metrics.jsonl kept (a resume
    cuts it back and the run's summary reads it)."""
    if given is None:
        return build_loggers(config.logger, run_dir)
    jsonl = [] if any(isinstance(g, JsonlLogger) for g in given) else [JsonlLogger(run_dir / "metrics.jsonl")]
    return [*jsonl, *given]


def prepare_run_folder(
    config: RLHFConfig,
    strategy: StrategyPart,
    layout: Topology,
    run_dir: str | Path | None,
    log: Callable[[str], None],
) -> tuple[Path, dict[str, Any]]:
    """The run folder, made; a fresh start over old checkpoints, a resume that changes what may not change or
    has nothing left to train, and a checkpoint the strategy cannot resume (another pipeline layout) fail here,
    before anything is built. Returns the folder and the configuration record run.json keeps (as validated)."""
    folder = Path(run_dir or config.run_dir or "outputs/rlhfuse")
    folder.mkdir(parents=True, exist_ok=True)
    log(f"rlhfuse: experiment {config.experiment!r}, run directory {folder}")
    checkpoint_dir = folder / config.checkpoint.dir
    check_fresh_start(checkpoint_dir, config.resume, config.checkpoint.overwrite)
    record = config_record(config)  # as validated (the tokenizer's stop ids are added later)
    check_resume_config(config, folder, checkpoint_dir, record)
    strategy.check_resume(config, layout, checkpoint_dir, folder)
    return folder, record


def load_data(
    config: RLHFConfig, train_dataset: Any, eval_dataset: Any, log: Callable[[str], None]
) -> RunData:
    """Data before models: the tokenizer (the embedded task's, or the SFT model's), the prompts (malformed or
    over-long ones fail here), the held-out split, and the rows the reward functions read (checked now)."""
    m = config.model
    if m.sft_path is None and m.reward_path is None:  # the warm start's models: the embedded task's tokenizer
        tokenizer = embedded_task(config).tokenizer()
    else:
        assert m.sft_path is not None
        tokenizer = load_tokenizer(m.tokenizer_path, m.sft_path)
    config = with_stop_tokens(config, tokenizer)
    if uses_chat_template(config.data, tokenizer):
        log(f"rlhfuse: prompts rendered with the chat template of {tokenizer.template_source}")
    prompts = load_prompts(config.data, tokenizer, seed=config.seed, dataset=train_dataset)
    prompts, held_out = held_out_prompts(
        config.eval, config.data, tokenizer, prompts, seed=config.seed, dataset=eval_dataset
    )
    check_context(config, max(len(p.token_ids) for p in [*prompts, *held_out]))
    # by prompt id: the dataset's position (a held-out file's prompts are numbered after the training ones)
    rows = [p.fields for p in sorted([*prompts, *held_out], key=lambda p: p.id)]
    answered = completion_rows(rows)
    if answered:
        log(
            f"rlhfuse: {answered} of {len(rows)} `messages` rows end with an assistant turn: it is left out of the "
            "prompt and kept as the row's `completion` field (what reward functions see)"
        )
    rewards = reward_set(config.inferencer)  # imports the user's functions: a failure names what was tried
    if rewards is not None:
        rewards.check_rows(rows, config.data.path or f"data.source={config.data.source}")
    loader = PromptLoader(prompts, config.data.prompts_per_iteration, seed=config.seed)
    return RunData(config, tokenizer, loader, held_out, rows, rewards)


def build_models(
    config: RLHFConfig,
    load_device: torch.device,
    device: torch.device,
    shard: Any,
    log: Callable[[str], None],
) -> Models:
    """The run's models: the embedded task's warm-started SFT Actor and reward model when no model is given, else
    the checkpoints, read onto `load_device` (the strategy's: pipeline=fsdp reads them into host memory and moves
    each unit to `device` as it is sharded, so no model is ever whole on the device); a Critic only for the
    algorithms that use one; cast for bf16-true; the generation copy in the generator's dtype."""
    m = config.model
    reward_path: str | None
    if m.sft_path is None and m.reward_path is None:
        sft, reward = warm_start(m, embedded_task(config), seed=config.seed, log=log)
        sft_path, reward_path = str(sft), str(reward)
    else:
        assert m.sft_path is not None
        sft_path, reward_path = m.sft_path, m.reward_path
    models = load_models(
        m,
        sft_path=sft_path,
        reward_path=reward_path,
        device=load_device,
        critic=uses_critic(config.algorithm),  # critic-free algorithms load, train and save no Critic
        reward=config.inferencer.use_reward_model,
        shard=shard,
        seed=config.seed,
    )
    if config.pipeline.optim.precision == "bf16-true":
        cast_models(models, torch.bfloat16)
    prepare_generation_copy(
        models, generation_dtype(resolve_precision(config.pipeline.optim.precision, device.type))
    )
    return models


def agent_episodes(ctx: BuildContext, generator: Generator) -> Generator:
    """With agent.env, the generator whose samples are multi-turn episodes of that environment, each turn decoded
    by `generator`: at their own pace over one open rollout where its instances are all in this process
    (`OpenAgentGenerator`, `Topology.open_rollout`), else turn by turn, all at once (`AgentGenerator`);
    `generator` itself otherwise."""
    agent = ctx.config.agent
    if agent.env is None:
        return generator
    from rlhfuse.agents.generator import AgentGenerator, OpenAgentGenerator

    kind = AgentGenerator
    if ctx.topology.open_rollout:
        assert isinstance(generator, OpeningGenerator), type(generator)
        kind = OpenAgentGenerator
    return kind(
        generator,
        agent.env,
        ctx.models.tokenizer,
        ctx.prompts,
        sampling=ctx.config.generator.sampling,
        samples_per_prompt=ctx.config.data.samples_per_prompt,
        max_turns=agent.max_turns,
        tool_timeout_s=agent.tool_timeout_s,
        max_response_tokens=agent.max_response_tokens,
    )


def build_components(ctx: BuildContext, parts: Parts, feed: PromptFeed) -> Components:
    """The strategy first (it may shard or place the models the generator copies and the inferencer runs),
    then the generator, the inferencer (as it runs over the strategy's layout: under pipeline=fsdp each rank
    infers its share with the sharded models, in lockstep) and the rollout stage that joins them (an
    asynchronous one hands out its gated generator: `AsyncRollout.generator`)."""
    assert parts.strategy is not None and parts.generator is not None and parts.inferencer is not None, parts
    strategy = ctx.strategy = parts.strategy.build(ctx)
    generator = agent_episodes(ctx, parts.generator.build(ctx))
    inferencer = parts.strategy.inference(parts.inferencer.build(ctx), strategy)
    frozen = frozen_inferencer(ctx.config.asynchronous, inferencer)  # checked on every rank
    if ctx.topology.generation_rank:  # the split placement's generation rank: it serves the training rank
        a = ctx.config.asynchronous
        service = GenerationService(
            generator,
            *split_channels(ctx, generator, peer=0),
            peer=0,
            max_staleness=a.max_staleness,
            partial_rollout=a.partial_rollout,
            frozen=frozen,
        )
        pad = ctx.models.tokenizer.pad_id
        return Components(
            strategy, generator, inferencer, SerialRollout(generator, inferencer, pad_token_id=pad), service
        )
    stage = rollout_stage(ctx, generator, inferencer, feed)
    # the generator the stage drives, as the rest of the run holds it (an asynchronous stage's gates its syncs)
    return Components(strategy, stage.generator, inferencer, stage)


def run_callbacks(
    config: RLHFConfig,
    models: Models,
    parts: Components,
    data: RunData,
    run_dir: Path,
    loggers: list[Any],
    extra: list[Callback],
    *,
    rank0: bool,
    collective: bool,
) -> list[Callback]:
    """The run's own callbacks, in the order they are called: progress, reward and task metrics, `extra` (the
    export, the watchdog), the sample table, held-out evaluation, memory metrics last."""
    names = data.rewards.names if data.rewards is not None else ()
    out: list[Callback] = [
        RichProgress(
            config.iterations,
            enabled=config.logger.progress and rank0,
            print_every=config.logger.print_every if rank0 else 0,
        ),
        RewardMetrics(names, config.inferencer.replaces_truncated()),
    ]
    if config.data.source == "synthetic":
        out.append(TaskScore(rule_reward("topic_fraction", "task/score"), models.tokenizer))
    elif config.data.source == "arithmetic":  # the share of right answers, whatever reward the run optimises
        rule = rule_reward("numeric_match", "task/accuracy")
        out.append(TaskScore(rule, models.tokenizer, key="task/accuracy", rows=data.rows))
    out.extend(extra)
    if config.logger.log_samples_every > 0 and rank0:
        out.append(
            SampleTable(
                run_dir / "samples.jsonl",
                models.tokenizer,
                every=config.logger.log_samples_every,
                count=config.logger.log_samples_count,
                sinks=table_sinks(config.logger, loggers),
            )
        )
    if config.eval.every > 0:  # every rank: the evaluation rollout may be collective
        out.append(
            Evaluator(
                config.eval,
                data.held_out,
                parts.rollout,
                generator=config.generator.sampling,
                pad_token_id=models.tokenizer.pad_id,
                batch_prompts=config.data.prompts_per_iteration,
                names=names,
                verifier=verifier_index(config.inferencer),
            )
        )
    strategy, generator = parts.strategy, parts.generator
    out.append(
        MemoryMetrics(
            lambda: [models.actor, models.ref, models.critic, models.reward, *generator.actor_copies()],
            lambda: list(strategy.optimizers_in_use()),
            collective=collective,
        )
    )
    return out
