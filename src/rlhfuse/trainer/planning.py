"""`plan=auto`: the execution-plan generator (`rlhfuse.planner.plan_for`) chooses the run's parallel layout.

Before any model is built, `apply_plan` describes the run to the planner (the Actor / Critic shapes, the world of
`distributed.nproc_per_node` devices of the run's kind, the workload of one iteration), then writes the chosen
plan into the configuration the run uses:

- `pipeline.actor_pp`, `pipeline.critic_pp`, `pipeline.microbatches` and the schedule (`pipeline=fused` or
  `pipeline=serial_1f1b`) when the world has more than one process; one process keeps `pipeline=plain`;
- or, when the planner finds sharded data parallelism the better plan (the models fit sharded but no pipeline
  layout the runtime runs fits, or it is predicted faster), `pipeline=fsdp` with its
  `pipeline.reshard_after_forward`, `generator.instances` = the world (one generation instance per process),
  `generator.tp=1` and `data.micro_batch_size` (unless a token budget, `data.micro_batch_tokens`, sets the
  micro-batches);
- `migration.threshold` (a fraction of the batch, `migration=fixed`, or `migration=auto` starting from it) or
  `migration=off` when `generator.instances > 1`.

- `pipeline.actor_tp`, `pipeline.critic_tp` and `generator.tp` when the planner chose tensor parallelism.

The planner may choose tp up to the devices of one node (`max_tp=gpus_per_node`), on `nodes` x `gpus_per_node` = WORLD_SIZE / LOCAL_WORLD_SIZE x LOCAL_WORLD_SIZE (torchrun) or 1 x
nproc_per_node. A choice the runtime cannot run (an Actor and Critic tp where the smaller does not divide the larger, a generation tp other than 1
or the training tp) raises a ValueError naming the key; nothing falls back.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhfuse.pipeline.colocation import Colocation
from rlhfuse.planner.api import plan_for
from rlhfuse.planner.lengths import PROMPTS, RESPONSES, LengthDistribution
from rlhfuse.planner.plan_search import Plan
from rlhfuse.planner.plan_simulator import Workload
from rlhfuse.planner.specs import DeviceProfile, ModelSpec, device_profile, gpu_preset
from rlhfuse.trainer.run_config import PLAN_MODES, RLHFConfig
from rlhfuse.trainer.strategies import strategy_class
from rlhfuse.trainer.strategies.pipelines.config import launched_world_size
from rlhfuse.trainer.topology import migration_entry

__all__ = ["PLAN_MODES", "AppliedPlan", "apply_plan", "plan_config", "workload_for"]


def device_preset(device: Any) -> tuple[str, str]:
    """The planner preset for a torch.device: `cpu` on CPU, `gpu_preset` of the CUDA device."""
    if getattr(device, "type", str(device)) != "cuda":
        return "cpu", "the run's device is the CPU"
    import torch

    index = device.index or 0
    props = torch.cuda.get_device_properties(index)
    return gpu_preset(torch.cuda.get_device_name(index), float(props.total_memory))


@dataclass(frozen=True)
class _Shape:
    spec: ModelSpec
    tied: bool


def model_shapes(cfg: RLHFConfig) -> tuple[_Shape, _Shape]:
    """Actor and Critic shapes from the configuration (the embedded tiny model) or the checkpoints' config.json."""
    m = cfg.model
    if m.sft_path is None and m.reward_path is None:
        from rlhfuse.data.synthetic import build_tokenizer

        spec = ModelSpec(
            name=f"tiny-{m.num_layers}L-{m.hidden_size}",
            layers=m.num_layers,
            hidden=m.hidden_size,
            heads=m.num_heads,
            ffn=m.intermediate_size,
            vocab=build_tokenizer().vocab_size,
            kv_heads=m.num_kv_heads,
        )
        return _Shape(spec, False), _Shape(spec, False)
    from rlhfuse.models.model_config import ModelConfig

    def read(path: str | None, key: str, name: str) -> _Shape:
        file = Path(path or "").expanduser() / "config.json"
        if path is None or not file.is_file():
            raise ValueError(f"plan=auto reads the model shapes from {key}/config.json: no file at {file}")
        config = ModelConfig.from_hf_dict(json.loads(file.read_text()))
        return _Shape(ModelSpec.from_config(config, name), bool(config.tie_word_embeddings))

    critic_key = "model.critic_path" if m.critic_path else "model.reward_path"
    return read(m.sft_path, "model.sft_path", "actor"), read(
        m.critic_path or m.reward_path, critic_key, "critic"
    )


def workload_for(cfg: RLHFConfig) -> Workload:
    """One iteration: prompts x samples per prompt, the mini-batch, max new tokens. Response lengths: the
    synthetic task's law (data.length_median / length_sigma) or the planner's LMSYS-Chat-1M default; prompts:
    log-normal, median min(128, max_prompt_length / 2), sigma 0.6, capped at data.max_prompt_length."""
    d = cfg.data
    responses = LengthDistribution(d.length_median, d.length_sigma) if d.source == "synthetic" else RESPONSES
    prompts = LengthDistribution(min(PROMPTS.median, max(1.0, d.max_prompt_length / 2)), PROMPTS.sigma)
    return Workload(
        global_batch=d.prompts_per_iteration * d.samples_per_prompt,
        mini_batch=d.mini_batch_size,
        max_len=cfg.generator.sampling.max_new_tokens,
        responses=responses,
        prompts=prompts,
        prompt_cap=d.max_prompt_length,
        seed=cfg.seed,
    )


def world_shape(cfg: RLHFConfig) -> tuple[int, int]:
    """(nodes, devices per node) of the run: torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE, else 1 x nproc_per_node."""
    from rlhfuse.distributed import launched_local_world

    world = launched_world_size(max(cfg.distributed.nproc_per_node, 1))
    local = launched_local_world()
    if local is not None and world % local == 0:
        return world // local, local
    return 1, world


@dataclass(frozen=True)
class AppliedPlan:
    """The planner's plan for this run, what was applied, and the configuration that results."""

    plan: Plan
    migration_plan: Plan | None
    """The plan whose Rt was applied (on generator.instances devices), when generator.instances > 1."""
    device: str
    device_reason: str
    applied: tuple[tuple[str, Any], ...]
    config: RLHFConfig

    def table(self) -> list[str]:
        """The plan table (`Plan.layout_rows()`), the predicted breakdown and the overrides applied."""
        p = self.plan
        c = p.cluster
        w = p.workload
        lines = [
            f"plan=auto: {c.nodes} x {c.gpus_per_node} {c.device.name} ({self.device_reason}); "
            f"{p.models.name}; {w.global_batch} samples/iteration, mini-batch {w.mini_batch}, "
            f"max {w.max_len} new tokens"
        ]
        width = max(len(task) for task, _ in p.layout_rows())
        lines += [f"  {task:<{width}}  {layout}" for task, layout in p.layout_rows()]
        b = p.breakdown
        lines.append(
            f"  predicted iteration: generation {b.generation:.4g} s, exposed inference {b.inference:.4g} s, "
            f"training {b.training:.4g} s, others {b.others:.4g} s, total {b.total:.4g} s "
            f"({p.throughput:.4g} samples/s)"
        )
        mp = self.migration_plan
        if mp is not None and mp is not p:
            rt = "off" if mp.rt_fraction is None else f"Rt={mp.rt_fraction:.0%}"
            lines.append(
                f"  migration planned on generator.instances={mp.cluster.gpus} instances: {rt}, "
                f"predicted generation + inference {mp.breakdown.gen_inf:.4g} s"
            )
        if c.gpus == 1:
            lines.append("  one process: pipeline=plain (the planner's training layouts are pp=1, dp=1)")
        applied = " ".join(f"{k}={_fmt(v)}" for k, v in self.applied)
        lines.append("  applied: " + (applied or "nothing to change"))
        if p.train.mode == "fsdp":
            lines.append(
                "  pipeline=fsdp: one generation instance per process, the four models sharded over all of them, "
                "inference after generation (migration off)"
            )
        else:
            lines.append(
                "  not applied (rlhfuse.runtime replicates them on every rank): generation and inference layouts, "
                "per-model micro-batch sizes"
            )
        return lines


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()  # as an override writes it
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def memory_facts(cfg: RLHFConfig, device: str) -> dict[str, Any]:
    """What the run's devices hold, for the planner's memory model (`rlhfuse.planner.memory`): the precision
    (auto: bf16-mixed on a GPU, 32-true on the CPU; both keep fp32 weights), whether the Ref and Reward are kept
    in host memory (`inferencer.offload_frozen`); the generation copy is bf16 under both bf16 precisions."""
    precision = cfg.pipeline.optim.precision
    if precision == "auto":
        precision = "32-true" if device == "cpu" else "bf16-mixed"
    return {"precision": precision, "offload_frozen": bool(cfg.inferencer.offload_frozen)}


def plan_config(cfg: RLHFConfig, device: str | DeviceProfile = "cpu", device_reason: str = "") -> AppliedPlan:
    """Run the planner for `cfg` on devices of preset `device` (or of a device file's profile) and return the
    configuration with its plan applied (the input is not modified). Raises ValueError naming the key when the
    plan cannot be applied."""
    profile = device_profile(device) if isinstance(device, str) else device
    kind = "cpu" if profile.device.dtype_bytes == 4 else "gpu"  # fp32 compute: precision=auto is 32-true
    actor, critic = model_shapes(cfg)
    workload = workload_for(cfg)
    nodes, per_node = world_shape(cfg)
    world = nodes * per_node

    def search(n: int, g: int, fsdp: bool = False) -> Plan:
        try:
            return plan_for(
                actor.spec,
                critic.spec,
                device=profile.device,
                eff=profile.eff,
                nodes=n,
                gpus_per_node=g,
                workload=workload,
                max_tp=g,
                activation_checkpointing=cfg.pipeline.optim.activation_checkpointing,
                # the runtime splits any layer count over any stage count (`rlhfuse.models.stage_ranges`:
                # stages differing by one layer), so uneven pipelines are plans it runs
                even_pp=False,
                runtime=True,
                fsdp=fsdp,
                **memory_facts(cfg, kind),
            )
        except ValueError as err:
            raise ValueError(
                f"plan=auto: the planner found no plan for {n} x {g} {profile.device.name} device(s) "
                f"(distributed.nproc_per_node={world}): {err}"
            ) from err

    plan = search(nodes, per_node, fsdp=world > 1)
    a, c = plan.train.actor, plan.train.critic
    applied: list[tuple[str, Any]] = []
    pipeline, data, generator = cfg.pipeline, cfg.data, cfg.generator
    if world == 1:
        plain = dataclasses.replace(pipeline, name="plain")
        if plain.name != pipeline.name:
            applied.append(("pipeline", plain.name))
        pipeline = plain
    elif plan.train.mode == "fsdp":
        # sharded data parallelism: one process per generation instance, each a whole Actor copy (tp 1)
        reshard = plan.train.reshard_after_forward
        pipeline = dataclasses.replace(pipeline, name="fsdp", reshard_after_forward=reshard)
        applied += [("pipeline", "fsdp"), ("pipeline.reshard_after_forward", reshard)]
        if (pipeline.actor_tp, pipeline.critic_tp) != (1, 1):
            pipeline = dataclasses.replace(pipeline, actor_tp=1, critic_tp=1)
            applied += [("pipeline.actor_tp", 1), ("pipeline.critic_tp", 1)]
        if generator.instances != world:
            generator = dataclasses.replace(generator, instances=world)
            applied.append(("generator.instances", world))
        if generator.tp != 1:
            generator = dataclasses.replace(generator, tp=1)
            applied.append(("generator.tp", 1))
        if data.micro_batch_tokens == 0 and data.micro_batch_size != a.micro_batch:
            data = dataclasses.replace(data, micro_batch_size=a.micro_batch)
            applied.append(("data.micro_batch_size", a.micro_batch))
    else:
        # the runtime's co-location rule (a smaller-tp model's consecutive stages merged onto the larger-tp groups)
        colocation = Colocation(a.pp, a.tp, c.pp, c.tp)
        big, small = (a, c) if colocation.larger == "actor" else (c, a)
        if (reason := colocation.problem()) is not None:
            key = "pipeline.actor_pp" if small is a else "pipeline.critic_pp"
            raise ValueError(
                f"plan=auto: the planner chose Actor pp={a.pp} tp={a.tp} and Critic pp={c.pp} tp={c.tp} "
                f"({plan.train.mode}); rlhfuse.runtime co-locates both on one layout where each model's pipeline "
                f"positions (pp * tp / max tp, merged stages) nest ({reason}), so {key}={small.pp} cannot be applied"
            )
        for key, lay, shape in (("pipeline.actor_pp", a, actor), ("pipeline.critic_pp", c, critic)):
            if shape.tied and lay.pp > 1:
                raise ValueError(
                    f"plan=auto: the planner chose {key}={lay.pp}, but that model ties its embedding and LM head "
                    "(tie_word_embeddings=true), which rlhfuse.runtime refuses with pp > 1: use plan=manual"
                )
        name = "fused" if plan.train.mode == "fused" else "serial_1f1b"
        micro = big.microbatches(workload.mini_batch)
        pipeline = dataclasses.replace(
            pipeline,
            name=name,
            actor_pp=a.pp,
            critic_pp=c.pp,
            actor_tp=a.tp,
            critic_tp=c.tp,
            microbatches=micro,
        )
        applied += [
            ("pipeline", name),
            ("pipeline.actor_pp", a.pp),
            ("pipeline.critic_pp", c.pp),
            ("pipeline.microbatches", micro),
        ]
        if max(a.tp, c.tp) > 1:  # unequal: the smaller-tp model's stages merged (`ParallelLayout.merge`)
            applied += [("pipeline.actor_tp", a.tp), ("pipeline.critic_tp", c.tp)]
    migration = cfg.migration
    migration_plan: Plan | None = None
    instances = generator.instances
    if instances > 1:
        migration_plan = plan if instances == world else search(1, instances)
        rt = migration_plan.rt_fraction
        if rt is None:
            migration = dataclasses.replace(migration, name="off")
            applied.append(("migration", "off"))
        else:
            if not 0 < rt < 1:
                raise ValueError(
                    f"plan=auto: the planner's Rt fraction {rt} is not in (0, 1), so migration.threshold "
                    "cannot be set to it"
                )
            name = migration.name if migration_entry(migration.name).tuned else "fixed"
            migration = dataclasses.replace(migration, name=name, threshold=float(rt))
            applied += [("migration", name), ("migration.threshold", float(rt))]
    if world > 1 and plan.gen_tp > 1 and plan.gen_tp != generator.tp:
        generator = dataclasses.replace(generator, tp=plan.gen_tp)
        applied.append(("generator.tp", plan.gen_tp))
    planned = dataclasses.replace(cfg, pipeline=pipeline, migration=migration, generator=generator, data=data)
    problems = _launch_problems(planned)
    if problems:
        raise ValueError(
            "plan=auto: the chosen plan ("
            + " ".join(f"{k}={_fmt(v)}" for k, v in applied)
            + ") cannot run:\n  - "
            + "\n  - ".join(problems)
        )
    return AppliedPlan(plan, migration_plan, profile.device.name, device_reason, tuple(applied), planned)


def _launch_problems(cfg: RLHFConfig) -> list[str]:
    """The planned configuration against the launch: its strategy's launch and layout rules
    (`StrategyPart.launch_problems`)."""
    return strategy_class(cfg.pipeline.name).launch_problems(cfg)


def apply_plan(cfg: RLHFConfig, device: Any, log: Callable[[str], None] = print) -> RLHFConfig:
    """`plan=auto`: plan for the run's device kind, print the plan (rank 0 only), return the planned config."""
    d = cfg.data
    samples = d.prompts_per_iteration * d.samples_per_prompt
    if (
        d.mini_batch_size <= 0
        or samples <= 0
        or samples % d.mini_batch_size
        or cfg.generator.sampling.max_new_tokens < 1
    ):
        from rlhfuse.trainer.validate import validate

        validate(cfg)  # raises the usual message naming the batch-size keys
    if cfg.plan_device is not None:
        try:
            profile = DeviceProfile.load(cfg.plan_device)
        except ValueError as err:  # plan=auto runs before validate(): name the key as its problem does
            raise ValueError(f"plan_device: {err}") from None
        result = plan_config(cfg, profile, f"plan_device={cfg.plan_device}")
    else:
        result = plan_config(cfg, *device_preset(device))
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0) == 0:
        for line in result.table():
            log(f"rlhfuse: {line}" if line.startswith("plan=") else line)
    return result.config
