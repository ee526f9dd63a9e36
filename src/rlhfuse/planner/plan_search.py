"""Execution-plan search (docs/paper.md §4): per task, candidate (dp, pp, tp) pruned by Megatron-LM's guidelines, then
exhaustive over what remains, keeping the plan with the least simulated iteration time.

Pruning (Narayanan et al. 2021, "Efficient large-scale language model training on GPU clusters using
Megatron-LM", takeaways 1-3): tensor parallelism stays inside a node and divides the attention heads; pipeline
parallelism divides the layers; tp x pp divides the devices (the rest is dp); a mini-batch splits evenly into
dp x micro-batch; every device's memory holds what the task needs. The search runs stage by stage: the
training layout fixes the training states that stay resident (hence the KV memory left for generation), then
the generation layout, the inference layout and, for RLHFuse, the migration threshold Rt are searched.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from rlhfuse.pipeline.colocation import Colocation
from rlhfuse.planner.cost import CostModel
from rlhfuse.planner.migration_decision import MigrationDecision
from rlhfuse.planner.plan_simulator import (
    KV_READ_SLACK,
    GenInfResult,
    RLHFModels,
    Samples,
    TrainLayout,
    TrainResult,
    Unmigrated,
    Workload,
    activation_peak,
    free_kv_bytes,
    fsdp_rollout,
    fsdp_training,
    fsdp_weight_sync_time,
    fused_bound,
    fused_training,
    gen_inf_serial,
    generate_unmigrated,
    inference_tps,
    model_step_time,
    rt_sweep,
    serial_training,
    train_state_bytes,
)
from rlhfuse.planner.specs import ClusterSpec, ModelSpec

MICRO_BATCHES = (1, 2, 4, 8)
FUSED_GREEDY_TOP_K = 4
"""Fused layouts (best lower bounds first) whose greedy schedule is built; the rest are ranked by bound only."""


@dataclass
class PruneStats:
    """How many candidates each guideline removed, and how many remain (for reports and tests)."""

    removed: Counter[str] = field(default_factory=Counter)
    kept: int = 0


def tp_candidates(model: ModelSpec, cluster: ClusterSpec, stats: PruneStats | None = None) -> list[int]:
    """Powers of two up to the node size that divide the node, the heads and the kv heads."""
    out = []
    t = 1
    while t <= max(cluster.gpus_per_node, 1) * 2:
        if t > cluster.gpus_per_node or cluster.gpus_per_node % t:
            if stats is not None:
                stats.removed["tp crosses a node"] += 1
        elif cluster.max_tp is not None and t > cluster.max_tp:
            if stats is not None:
                stats.removed["tp above the runtime's max_tp"] += 1
        elif model.heads % t or model.n_kv_heads % t:
            if stats is not None:
                stats.removed["tp does not divide heads"] += 1
        else:
            out.append(t)
        t *= 2
    return out


def node_group_sizes(cluster: ClusterSpec) -> list[int]:
    """Device-group sizes inside one node: the powers of two dividing gpus_per_node (at most max_tp if set)."""
    limit = cluster.gpus_per_node if cluster.max_tp is None else min(cluster.gpus_per_node, cluster.max_tp)
    return [g for g in (2**k for k in range(8)) if g <= limit and cluster.gpus_per_node % g == 0]


def train_layouts(
    cost: CostModel,
    model: ModelSpec,
    head: str,
    workload: Workload,
    seq: float,
    stats: PruneStats | None = None,
    *,
    even_pp: bool = True,
) -> list[TrainLayout]:
    """Every (tp, pp, dp, micro-batch) of one model that the guidelines allow (memory: this model alone).

    `even_pp=False` also admits pipelines whose stages differ by one layer (the paper runs LLaMA-33B's 60
    layers on 8 stages); the busiest stage then sets the time and memory (`cost.stage_fraction`)."""
    stats = stats if stats is not None else PruneStats()
    devices = cost.cluster.gpus
    out = []
    for tp in tp_candidates(model, cost.cluster, stats):
        for pp in range(1, model.layers + 1):
            if even_pp and model.layers % pp:
                stats.removed["pp does not divide layers"] += 1
                continue
            if devices % (tp * pp):
                stats.removed["tp x pp does not divide devices"] += 1
                continue
            dp = devices // (tp * pp)
            for b in MICRO_BATCHES:
                if workload.mini_batch % (dp * b):
                    stats.removed["mini-batch does not split into dp x micro-batch"] += 1
                    continue
                lay = TrainLayout(tp, pp, dp, b)
                need = cost.train_state_bytes(model, head, tp, pp) + activation_peak(
                    cost, model, lay, workload.mini_batch, seq
                )
                if need > cost.usable_memory():
                    stats.removed["memory"] += 1
                    continue
                out.append(lay)
    stats.kept += len(out)
    return out


def resident_train_bytes(
    cost: CostModel, models: RLHFModels, a: TrainLayout, c: TrainLayout, *, merged: bool = False
) -> float:
    """What stays on the busiest device of a training layout outside training (`CostModel.rank_memory`): both
    trained models' weights, master copies and optimizer states, and the Ref / Reward unless offloaded (the
    gradients are freed after each optimizer step; the generation copy is counted by `free_kv_bytes`).
    `merged`: placed as the runtime places unequal tp (`TrainResult.merged`)."""
    return cost.rank_memory(models.actor, models.critic, (a.tp, a.pp), (c.tp, c.pp), merged=merged).resident


TRAIN_FRONTIER = 4
"""Training plans carried into the generation search: the fastest, then each faster one that leaves more
memory free for generation (a Pareto frontier over training time and resident training states)."""


def search_training(
    cost: CostModel,
    models: RLHFModels,
    workload: Workload,
    seq: float,
    *,
    fused: bool,
    stats: PruneStats | None = None,
    even_pp: bool = True,
    runtime: bool = False,
) -> list[TrainResult]:
    """Training plans on the (time, resident memory) frontier, fastest first.

    Serial: each model on all devices with its own layout, one after the other (1F1B). With `fused`, also every
    co-locatable pair as a fused pipeline: all are bounded, the best few by bound get a greedy schedule, whose
    makespan is the time used (RLHFuse falls back to serial where fusion does not pay). Each result's `bound`
    is the best fused lower bound among layouts with no more resident memory (for the report's bound column).
    `runtime=True` keeps only pairs `rlhfuse.runtime` runs (it co-locates both on one layout for either
    schedule: `rlhfuse.pipeline.colocation`, the rule of `rlhfuse.runtime.ParallelLayout`): equal tp, or a smaller
    tp dividing the larger with the smaller-tp model's pp a multiple of their ratio; the larger number of merged
    stages a multiple of the smaller; the larger model's micro-batches a multiple of the other's replicas; an
    Actor with tied embeddings at pp = 1. Each refusal is counted under "runtime: <the rule>". Its pairs are costed as the runtime runs them
    (`merged=True`: the smaller-tp model's consecutive stages merged onto one larger-tp group, their time and
    memory per rank those of the sub-stages, `fused_problem`).
    """
    stats = stats if stats is not None else PruneStats()
    mb = workload.mini_batch
    la = train_layouts(cost, models.actor, "lm", workload, seq, stats, even_pp=even_pp)
    lc = train_layouts(cost, models.critic, "value", workload, seq, stats, even_pp=even_pp)
    if runtime:
        la = [a for a in la if _tied_allows(models, "actor", a, stats)]
        lc = [c for c in lc if _tied_allows(models, "critic", c, stats)]
    if not la or not lc:
        raise ValueError(
            f"no training layout fits for {models.name} on {cost.cluster.gpus} x {cost.device.name} "
            f"(pruned: {dict(stats.removed)}): use more devices or devices with more memory"
        )
    ta = {a: model_step_time(cost, models.actor, "lm", a, mb, seq) for a in la}
    tc = {c: model_step_time(cost, models.critic, "value", c, mb, seq) for c in lc}
    usable = cost.usable_memory()
    act_a = {a: activation_peak(cost, models.actor, a, mb, seq) for a in la}
    act_c = {c: activation_peak(cost, models.critic, c, mb, seq) for c in lc}
    serial: list[tuple[float, float, TrainLayout, TrainLayout]] = []
    fused_pairs: list[tuple[float, float, TrainLayout, TrainLayout]] = []
    for a in la:
        for c in lc:
            step_a, step_c, peak_a, peak_c = ta[a], tc[c], act_a[a], act_c[c]
            if runtime:
                lay = Colocation(a.pp, a.tp, c.pp, c.tp)
                reason = lay.problem()
                if reason is None:
                    big = a if lay.larger == "actor" else c
                    reason = lay.problem(big.microbatches(mb))
                if reason is not None:
                    stats.removed[f"runtime: {reason}"] += 1
                    continue
                if a.tp != c.tp:  # the smaller-tp model's stages merged: its own 1F1B and peak change
                    ma, mc = lay.merge("actor"), lay.merge("critic")
                    step_a = model_step_time(cost, models.actor, "lm", a, mb, seq, ma)
                    step_c = model_step_time(cost, models.critic, "value", c, mb, seq, mc)
                    peak_a = activation_peak(cost, models.actor, a, mb, seq, ma)
                    peak_c = activation_peak(cost, models.critic, c, mb, seq, mc)
            states = resident_train_bytes(cost, models, a, c, merged=runtime)
            training = train_state_bytes(cost, models, a, c, merged=runtime)
            if training + max(peak_a, peak_c) <= usable:
                serial.append((step_a + step_c, states, a, c))
            else:
                stats.removed["memory (both models resident)"] += 1
            if not fused:
                continue
            big, small = (a, c) if a.pp >= c.pp else (c, a)
            if not runtime and (big.pp % small.pp or max(a.tp, c.tp) % min(a.tp, c.tp)):
                stats.removed["fused: stages or tp do not nest"] += 1
                continue
            if training + peak_a + peak_c > usable:
                stats.removed["fused: memory"] += 1
                continue
            bound = fused_bound(cost, models, a, c, workload, seq, merged=runtime)
            fused_pairs.append((bound, states, a, c))
    if not serial:
        raise ValueError(
            f"no training layout pair fits in memory for {models.name} (pruned: {dict(stats.removed)})"
        )
    results: list[TrainResult] = [
        serial_training(cost, models, a, c, workload, seq, merged=runtime) for _, _, a, c in _frontier(serial)
    ]
    if fused_pairs:
        fused_pairs.sort(key=lambda x: x[0])
        chosen = {(a, c) for _, _, a, c in fused_pairs[:FUSED_GREEDY_TOP_K]}
        chosen |= {(a, c) for _, _, a, c in _frontier(fused_pairs)}
        results += [fused_training(cost, models, a, c, workload, seq, merged=runtime) for a, c in chosen]
    keyed = [(r.per_minibatch, r.memory, r) for r in results]
    frontier = [r for _, _, r in _frontier(keyed)]
    out = []
    for r in frontier:
        states = resident_train_bytes(cost, models, r.actor, r.critic, merged=r.merged)
        bounds = [b for b, st, _, _ in fused_pairs if st <= states] + [r.per_minibatch]
        out.append(replace(r, bound=min(bounds)))
    return out


def search_fsdp(
    cost: CostModel, models: RLHFModels, workload: Workload, seq: float, stats: PruneStats | None = None
) -> list[TrainResult]:
    """pipeline=fsdp's training plans, fastest first: sharded data parallelism over every device (tp = pp = 1,
    dp = the devices), each micro-batch size of MICRO_BATCHES that splits the mini-batch evenly over the ranks,
    with `reshard_after_forward` on and off; kept when the busiest rank's training peak fits beside the whole
    generation copy (`CostModel.fsdp_rank_memory`: its shards, gradients and optimizer states, the gathered layers
    and unsharded gradients, activations). Refusals are counted under "fsdp: ..."."""
    stats = stats if stats is not None else PruneStats()
    world = cost.cluster.gpus
    out = []
    for b in MICRO_BATCHES:
        if workload.mini_batch % (world * b):
            stats.removed["fsdp: mini-batch does not split into devices x micro-batch"] += 1
            continue
        lay = TrainLayout(1, 1, world, b)
        for reshard in (True, False):
            train = fsdp_training(cost, models, lay, workload, seq, reshard_after_forward=reshard)
            if train.memory + cost.generation_weight_bytes(models.actor, 1) > cost.usable_memory():
                stats.removed["fsdp: memory"] += 1
                continue
            out.append(train)
    stats.kept += len(out)
    return sorted(out, key=lambda r: (r.per_minibatch, r.memory))


def _tied_allows(models: RLHFModels, name: str, lay: TrainLayout, stats: PruneStats) -> bool:
    """Whether `rlhfuse.runtime` runs `lay` for `name` beside a tied embedding / LM head
    (tie_word_embeddings): a tied model's stages would hold one tensor on two ranks (pp = 1 only), and the tied
    table is not split tensor-parallel (with a tied Actor, `validate` refuses every tp key: tp = 1)."""
    if getattr(models, name).tied and lay.pp > 1:
        stats.removed["runtime: tied embeddings need pp=1"] += 1
        return False
    if models.actor.tied and lay.tp > 1:
        stats.removed["runtime: a tied Actor needs tp=1"] += 1
        return False
    return True


def _frontier(items: list[Any]) -> list[Any]:
    """Items (time, memory, ...) sorted by time, keeping each that needs less memory than all faster ones
    (at most TRAIN_FRONTIER: the fastest ones and the leanest)."""
    out = []
    best_mem = float("inf")
    for item in sorted(items, key=lambda x: (x[0], x[1])):
        if item[1] < best_mem:
            out.append(item)
            best_mem = item[1]
    # the fastest few, and always the leanest (it may be the only one that leaves room to generate)
    return out[: TRAIN_FRONTIER - 1] + out[-1:] if len(out) > TRAIN_FRONTIER else out


@dataclass(frozen=True)
class Breakdown:
    """Iteration time split as in the paper's Figure 8 (seconds)."""

    generation: float
    """Until the last response is generated."""
    inference: float
    """Inference not hidden under generation."""
    training: float
    others: float
    """Task switching: weight resharding (train <-> generation / inference layouts)."""

    @property
    def gen_inf(self) -> float:
        return self.generation + self.inference

    @property
    def total(self) -> float:
        return self.gen_inf + self.training + self.others


@dataclass(frozen=True)
class Plan:
    """A chosen execution plan and its predicted iteration."""

    system: str
    """"RLHFuse" (both fusions) or "RLHFuse-Base" (fusion off, all else equal)."""
    models: RLHFModels
    cluster: ClusterSpec
    workload: Workload
    gen_tp: int
    inference_tp: int
    rt_fraction: float | None
    migration: MigrationDecision | None
    mechanism: str | None
    train: TrainResult
    breakdown: Breakdown
    sweep: tuple[tuple[float, float], ...] = ()
    """(Rt fraction, Gen+Inf seconds) for the chosen generation layout (RLHFuse only)."""
    train_bound: float = 0.0
    """Training seconds per iteration at the fused lower bound (= training for serial)."""

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.workload.global_batch / self.breakdown.total

    @property
    def gen_instances(self) -> int:
        return self.cluster.gpus // self.gen_tp

    def layout_rows(self) -> list[tuple[str, str]]:
        """(task, layout) rows of the plan table."""
        g = self.cluster.gpus
        rows = [("generation (Actor)", f"dp={g // self.gen_tp} pp=1 tp={self.gen_tp}")]
        if self.train.mode == "fsdp":
            lay, reshard = self.train.actor, str(self.train.reshard_after_forward).lower()
            return [
                *rows,
                (
                    "inference (Ref, RW, Critic)",
                    f"after generation, every device its share, sharded over {g}",
                ),
                ("migration", "off (pipeline=fsdp infers after generation: no freed instance to fuse into)"),
                (
                    "training (Actor, Critic)",
                    f"dp={lay.dp} sharded (FSDP2) pp=1 tp=1 micro-batch={lay.micro_batch}",
                ),
                ("training schedule", f"fsdp over {lay.dp} ranks, reshard_after_forward={reshard}"),
            ]
        if self.rt_fraction is None:
            if self.system == "RLHFuse":
                rows.append(("migration", "off (no Rt beat generating first, then inferring)"))
            tps = inference_tps(self.models, self.inference_tp)
            rows.append(
                ("inference (Ref, RW, Critic)", f"groups of {self.inference_tp}, tp={tps}, pp=1, all devices")
            )
        else:
            m = self.migration.m if self.migration else 0
            rows.append(
                (
                    "inference (Ref, RW, Critic)",
                    f"on freed instances: tp={inference_tps(self.models, self.gen_tp)}, "
                    f"{self.gen_instances - m} of {self.gen_instances}",
                )
            )
            rule = "speed/memory/KV-read" if self.migration and self.migration.m_read else "speed/memory"
            rows.append(
                (
                    "migration",
                    f"Rt={self.rt_fraction:.0%} of batch -> m={m} instance(s) ({rule} rule), {self.mechanism}",
                )
            )
        for name, lay in (("training (Actor)", self.train.actor), ("training (Critic)", self.train.critic)):
            rows.append((name, f"dp={lay.dp} pp={lay.pp} tp={lay.tp} micro-batch={lay.micro_batch}"))
        schedule = self.train.mode + (f" ({self.train.ranks} ranks)" if self.train.ranks else "")
        a, c = self.train.actor, self.train.critic
        if self.train.merged and a.tp != c.tp:
            placed = Colocation(a.pp, a.tp, c.pp, c.tp)
            narrow = "actor" if a.tp < c.tp else "critic"
            schedule += (
                f", {narrow}: {placed.merge(narrow)} consecutive stages merged per tp={placed.tp} group"
            )
        rows.append(("training schedule", schedule))
        return rows

    def to_dict(self) -> dict[str, Any]:
        out = self._dict()
        if self.train.mode == "fsdp":
            out["training"]["reshard_after_forward"] = self.train.reshard_after_forward
        return out

    def _dict(self) -> dict[str, Any]:
        b = self.breakdown
        return {
            "system": self.system,
            "actor": self.models.actor.name,
            "critic": self.models.critic.name,
            "max_len": self.workload.max_len,
            "generation": {"dp": self.gen_instances, "pp": 1, "tp": self.gen_tp},
            "inference": {"group": self.inference_tp, "pp": 1, "tp": list(inference_tps(self.models, self.inference_tp))},
            "migration": None
            if self.rt_fraction is None
            else {
                "rt_fraction": self.rt_fraction,
                "m": self.migration.m if self.migration else 0,
                "m_rule": "kv-read" if self.migration and self.migration.m_read else "paper",
                "mechanism": self.mechanism,
            },
            "training": {
                "schedule": self.train.mode,
                "actor": {"dp": self.train.actor.dp, "pp": self.train.actor.pp, "tp": self.train.actor.tp,
                          "micro_batch": self.train.actor.micro_batch},
                "critic": {"dp": self.train.critic.dp, "pp": self.train.critic.pp, "tp": self.train.critic.tp,
                           "micro_batch": self.train.critic.micro_batch},
            },
            "breakdown_s": {
                "generation": b.generation, "inference": b.inference, "gen_inf": b.gen_inf,
                "training": b.training, "others": b.others, "total": b.total,
            },
            "training_bound_s": self.train_bound,
            "throughput_samples_per_s": self.throughput,
        }  # fmt: skip


def search_plan(
    cost: CostModel,
    models: RLHFModels,
    workload: Workload,
    *,
    fused: bool,
    samples: Samples | None = None,
    stats: PruneStats | None = None,
    even_pp: bool = True,
    runtime: bool = False,
    fsdp: bool = False,
) -> Plan:
    """The least-iteration-time plan for RLHFuse (`fused=True`) or RLHFuse-Base (`fused=False`).

    `even_pp=False` admits uneven pipeline stages (see `train_layouts`); `runtime=True` only plans that
    `rlhfuse.runtime` can run (`search_training`; any generation tp: `rlhfuse.runtime.reshard`). `fsdp=True`
    also plans pipeline=fsdp (`search_fsdp`, `fsdp_plan`): the plan with the least iteration time wins, and it
    is the only candidate where no pipeline layout fits."""
    workload.validate()
    samples = samples if samples is not None else workload.sample()
    stats = stats if stats is not None else PruneStats()
    seq = float(samples.seq.mean())
    best: Plan | None = None
    cache: dict[int, Unmigrated] = {}
    trains: list[TrainResult] = []
    try:
        trains = search_training(
            cost, models, workload, seq, fused=fused, stats=stats, even_pp=even_pp, runtime=runtime
        )
    except ValueError:
        if not fsdp:
            raise
    plans = [
        _best_gen_inf(
            cost, models, workload, samples, train, fused=fused, stats=stats, cache=cache, runtime=runtime
        )
        for train in trains
    ]
    if fsdp:
        sharded = search_fsdp(cost, models, workload, seq, stats)
        plans += [
            fsdp_plan(cost, models, workload, samples, t, fused=fused, stats=stats, cache=cache)
            for t in sharded
        ]
    for plan in plans:
        if plan is not None and (best is None or plan.breakdown.total < best.breakdown.total):
            best = plan
    if best is None:
        raise ValueError(
            f"no {'plan (pipelines or pipeline=fsdp)' if fsdp else 'generation layout'} fits for {models.name} "
            f"with max_len={workload.max_len} on {cost.cluster.gpus} x {cost.device.name} "
            f"(pruned: {dict(stats.removed)}): lower max_len or use devices with more memory"
        )
    return best


def fsdp_plan(
    cost: CostModel,
    models: RLHFModels,
    workload: Workload,
    samples: Samples,
    train: TrainResult,
    *,
    fused: bool,
    stats: PruneStats,
    cache: dict[int, Unmigrated],
) -> Plan | None:
    """The iteration of pipeline=fsdp's `train` (`search_fsdp`): one generation instance per device (the whole
    Actor copy), inference after generation on every device with the sharded models (`fsdp_rollout`), the weight
    sync all-gathering the Actor (others); None when the busiest rank's rollout does not fit (its resident shards,
    the generation copy and the KV cache of its samples at maximum length, the layers inference gathers)."""
    world = cost.cluster.gpus
    per_instance = -(-len(samples) // world)
    memory = cost.fsdp_rank_memory(
        models.actor, models.critic, world, reshard_after_forward=train.reshard_after_forward,
        microbatches=train.actor.microbatches(workload.mini_batch), kv_tokens=per_instance * workload.max_context,
    )  # fmt: skip
    if memory.resident + memory.rollout > cost.usable_memory():
        stats.removed["fsdp: KV cache does not fit"] += 1
        return None
    if 1 not in cache:
        cache[1] = generate_unmigrated(cost, models.actor, samples, 1)
    res = fsdp_rollout(cost, models, samples, cache[1])
    return Plan(
        system="RLHFuse" if fused else "RLHFuse-Base",
        models=models,
        cluster=cost.cluster,
        workload=workload,
        gen_tp=1,
        inference_tp=1,
        rt_fraction=None,
        migration=None,
        mechanism=None,
        train=train,
        breakdown=Breakdown(
            res.generation.end, res.inference_exposed, train.total, fsdp_weight_sync_time(cost, models.actor)
        ),
        train_bound=train.total_bound,
    )


def _best_gen_inf(
    cost: CostModel,
    models: RLHFModels,
    workload: Workload,
    samples: Samples,
    train: TrainResult,
    *,
    fused: bool,
    stats: PruneStats,
    cache: dict[int, Unmigrated],
    runtime: bool = False,
) -> Plan | None:
    resident = resident_train_bytes(cost, models, train.actor, train.critic, merged=train.merged)
    critic_train = (train.critic.tp, train.critic.pp)
    best: tuple[float, GenInfResult, int, list[tuple[float, GenInfResult]]] | None = None
    for gen_tp in tp_candidates(models.actor, cost.cluster, stats):
        if runtime and models.actor.tied and gen_tp > 1:
            stats.removed["runtime: a tied Actor needs tp=1"] += 1
            continue
        # the generation copy stays on the device while training too (the runtime keeps it between updates)
        if train.memory + cost.generation_weight_bytes(models.actor, gen_tp) > cost.usable_memory():
            stats.removed["generation copy does not fit beside training"] += 1
            continue
        per_instance = -(-len(samples) // (cost.cluster.gpus // gen_tp))
        kv_tok = cost.instance_kv_bytes_per_token(models.actor, gen_tp)
        if free_kv_bytes(cost, models.actor, gen_tp, resident) < per_instance * kv_tok * workload.max_context:
            stats.removed["generation: KV cache does not fit"] += 1
            continue
        reshard = cost.reshard_time(models.actor, "lm", train.actor.tp, train.actor.pp, gen_tp)
        if gen_tp not in cache:
            cache[gen_tp] = generate_unmigrated(cost, models.actor, samples, gen_tp)
        sweep: list[tuple[float, GenInfResult]] = []
        if fused:
            # the paper's rule (m = max(speed, memory)), and ours with the KV-read term: the faster wins
            for slack in (None, KV_READ_SLACK):
                candidate = rt_sweep(
                    cost, models, samples, gen_tp, max_context=workload.max_context, resident_bytes=resident,
                    unmigrated=cache[gen_tp], kv_read_slack=slack, critic_train=critic_train,
                )  # fmt: skip
                if not candidate:  # a batch too small to migrate
                    continue
                _, res = min(candidate, key=lambda x: x[1].end)
                if best is None or res.end + reshard < best[0]:
                    best = (res.end + reshard, res, gen_tp, candidate)
                    sweep = candidate
        # no migration (RLHFuse-Base; for RLHFuse, the fallback where no Rt pays: the planner turns it off)
        for group in node_group_sizes(cost.cluster):
            tps = inference_tps(models, group)
            # offloaded Ref / Reward come onto the device for inference; resident ones are in `resident` already
            biggest = max(cost.weight_bytes(m, h) / tp for (m, h), tp in zip(models.inference(), tps))
            if cost.offload_frozen and resident + biggest > cost.usable_memory():
                stats.removed["inference: weights do not fit"] += 1
                continue
            res = gen_inf_serial(
                cost, models, samples, gen_tp, group, max_context=workload.max_context, resident_bytes=resident,
                unmigrated=cache[gen_tp], critic_train=critic_train,
            )  # fmt: skip
            if best is None or res.end + reshard < best[0]:
                best = (res.end + reshard, res, gen_tp, sweep)
    if best is None:
        return None
    total_gi, res, gen_tp, sweep = best
    gen = res.generation
    return Plan(
        system="RLHFuse" if fused else "RLHFuse-Base",
        models=models,
        cluster=cost.cluster,
        workload=workload,
        gen_tp=gen_tp,
        inference_tp=res.inference_tp,
        rt_fraction=None if res.rt is None else res.rt / len(samples),
        migration=gen.decision,
        mechanism=gen.mechanism,
        train=train,
        breakdown=Breakdown(gen.end, res.inference_exposed, train.total, total_gi - res.end),
        sweep=tuple((f, r.end) for f, r in sweep),
        train_bound=train.total_bound,
    )
