"""`plan_for`: the one call the trainer's `plan=auto` makes."""

from __future__ import annotations

from typing import Any

from rlhfuse.planner.cost import CostModel
from rlhfuse.planner.plan_search import Plan, search_plan
from rlhfuse.planner.plan_simulator import RLHFModels, Workload
from rlhfuse.planner.specs import DEFAULT_EFFICIENCY, DeviceSpec, Efficiency, ModelSpec, cluster, model


def as_model_spec(m: str | ModelSpec | Any, name: str | None = None) -> ModelSpec:
    """A preset name (`13b`), a ModelSpec, or anything shaped like `rlhfuse.models.ModelConfig`."""
    if isinstance(m, ModelSpec):
        return m
    if isinstance(m, str):
        return model(m)
    return ModelSpec.from_config(m, name)


def plan_for(
    actor: str | ModelSpec | Any,
    critic: str | ModelSpec | Any,
    *,
    device: str | DeviceSpec = "h100",
    nodes: int = 1,
    gpus_per_node: int = 8,
    workload: Workload | None = None,
    fused: bool = True,
    eff: Efficiency = DEFAULT_EFFICIENCY,
    even_pp: bool = True,
    max_tp: int | None = None,
    activation_checkpointing: str = "none",
    precision: str = "bf16-true",
    offload_frozen: bool = True,
    runtime: bool = False,
    fsdp: bool = False,
) -> Plan:
    """The least-iteration-time execution plan for an Actor / Critic pair on a cluster.

    `plan.layout_rows()` / `plan.to_dict()` give per task (dp, pp, tp), the training schedule (fused or serial)
    and the migration threshold (`plan.rt_fraction`); `plan.breakdown` the predicted iteration. `max_tp` caps
    tensor parallelism (generation, inference groups and training) for a runtime that cannot run more;
    `activation_checkpointing` (none | full | selective) sets the activation memory a training micro-batch keeps;
    `precision` and `offload_frozen` what each device holds (`rlhfuse.planner.memory`: the
    defaults are the paper's bf16 training with Ref / Reward in host memory; the trainer passes the run's);
    `runtime=True` (the trainer's) only plans that `rlhfuse.runtime` runs: one tp for both trained models, nested
    pipelines (any generation tp: the runtime reshards to it); `fsdp=True` also plans pipeline=fsdp (sharded data
    parallelism over every device, `search.search_fsdp`), chosen where its iteration is the shortest or where no
    pipeline layout fits.
    """
    spec = cluster(device, nodes, gpus_per_node, max_tp)
    models = RLHFModels(as_model_spec(actor, "actor"), as_model_spec(critic, "critic"))
    cost = CostModel(
        spec,
        eff,
        activation_checkpointing=activation_checkpointing,
        precision=precision,
        offload_frozen=offload_frozen,
    )
    return search_plan(
        cost, models, workload or Workload(), fused=fused, even_pp=even_pp, runtime=runtime, fsdp=fsdp
    )
