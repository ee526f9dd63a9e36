"""RLHFuse vs RLHFuse-Base on one setting (`compare`) and on the paper's grid (`paper_grid`, docs/paper.md §5)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from rlhfuse.pipeline import SearchConfig
from rlhfuse.planner.cost import CostModel
from rlhfuse.planner.lengths import RESPONSES, LengthDistribution
from rlhfuse.planner.plan_search import Plan, PruneStats, resident_train_bytes, search_plan
from rlhfuse.planner.plan_simulator import (
    ModeledCosts,
    RLHFModels,
    Samples,
    Speculation,
    Workload,
    gen_inf,
    iteration_reduction,
    searched_training,
)
from rlhfuse.planner.specs import DEFAULT_EFFICIENCY, ClusterSpec, Efficiency, cluster, model

PAPER_PAIRS = (("13B", "33B"), ("33B", "13B"), ("33B", "65B"), ("65B", "33B"))
"""Actor / Critic pairs of the paper's evaluation (§7)."""
PAPER_MAX_LENS = (512, 1024, 2048)
PAPER_CLUSTER = ("h100", 32, 8)
"""32 nodes x 8 H100-80GB."""
SPECULATION = Speculation(acceptance=0.4, tokens=4)
"""The speculative tail `rlhfuse-plan paper-grid` simulates by default: k = 4 draft tokens, 40% of them
accepted (what `generator.speculative=auto` measured on the tail of `experiment=longtail`, docs/generation.md)."""
GRID_SEARCH = SearchConfig(
    max_iterations=20_000, max_starts=200, exact=False, memory_effort=0.0, exact_memory_ladder=False,
    memory_lns=False,
)  # fmt: skip
"""How the grid re-schedules each fused layout: `rlhfuse.pipeline.solve`, the search the runtime runs, under a
deterministic budget (200 list-schedule starts and 20 000 annealing iterations, never the wall clock: the same
grid on any machine at any load), makespan only (the grid prices time; the memory phases are off). Measured on
the 12 cells: the CP-SAT step at 2 units of deterministic time cost 12 s more and found less (it takes the starts
and iterations it needs from the same budget: 13B/33B pipelines 1.13x faster than greedy instead of 1.22x);
20 starts instead of 200 halve the search's time and lose 33B/13B's gain (1.10x instead of 1.12x)."""
PAPER_RANGES = {"throughput_ratio": (1.2, 1.4), "gen_inf_ratio": (1.2, 1.6), "train_ratio": (1.2, 1.3)}
"""What the paper reports for RLHFuse / RLHFuse-Base (Figures 7 and 8), to compare our predictions against."""


@dataclass(frozen=True)
class Comparison:
    """RLHFuse and RLHFuse-Base planned for the same setting, and their ratios (> 1: RLHFuse is faster)."""

    rlhfuse: Plan
    base: Plan
    prune: PruneStats
    seconds: float
    """Wall time of planning both."""
    speculation: Speculation | None = None
    spec_gen_inf: tuple[float, float] | None = None
    """(RLHFuse-Base, RLHFuse) Gen+Inf seconds with the speculative tail `speculation` (the same plans)."""
    reduction: tuple[float, float] = (0.0, 0.0)
    """(RLHFuse-Base, RLHFuse) exposed data-parallel gradient all-reduce seconds per iteration (in training)."""

    def split(self, system: str) -> dict[str, float]:
        """Seconds per iteration of `system` (base | rlhfuse): generation, exposed inference, the training
        pipelines and optimizer steps, the exposed gradient reduction, others (task switching)."""
        plan, reduction = (
            (self.base, self.reduction[0]) if system == "base" else (self.rlhfuse, self.reduction[1])
        )
        b = plan.breakdown
        return {
            "generation": b.generation,
            "inference": b.inference,
            "training": b.training - reduction,
            "reduction": reduction,
            "others": b.others,
        }

    @property
    def gain_sources(self) -> tuple[float, float, float]:
        """Of the seconds RLHFuse saves per iteration: the shares from inter-stage fusion (Gen+Inf), from
        intra-stage fusion (training) and from the rest (task switching); they sum to 1."""
        base, ours = self.base.breakdown, self.rlhfuse.breakdown
        parts = (base.gen_inf - ours.gen_inf, base.training - ours.training, base.others - ours.others)
        saved = sum(parts)
        return (parts[0] / saved, parts[1] / saved, parts[2] / saved) if saved else (0.0, 0.0, 0.0)

    @property
    def throughput_ratio(self) -> float:
        return self.base.breakdown.total / self.rlhfuse.breakdown.total

    @property
    def gen_inf_ratio(self) -> float:
        return self.base.breakdown.gen_inf / self.rlhfuse.breakdown.gen_inf

    @property
    def train_ratio(self) -> float:
        return self.base.breakdown.training / self.rlhfuse.breakdown.training

    @property
    def spec_gain(self) -> float:
        """RLHFuse's Gen+Inf without / with the speculative tail (nan without `speculation`)."""
        return self.rlhfuse.breakdown.gen_inf / self.spec_gen_inf[1] if self.spec_gen_inf else float("nan")

    @property
    def spec_gen_inf_ratio(self) -> float:
        """RLHFuse-Base's Gen+Inf over RLHFuse's with migration and the speculative tail (nan without)."""
        return self.base.breakdown.gen_inf / self.spec_gen_inf[1] if self.spec_gen_inf else float("nan")

    @property
    def train_ratio_bound(self) -> float:
        """Training ratio if the fused schedule reached its lower bound (what annealing reaches on most settings)."""
        return self.base.breakdown.training / min(self.rlhfuse.train_bound, self.rlhfuse.breakdown.training)

    def _speculation_dict(self) -> dict[str, Any] | None:
        if self.speculation is None or self.spec_gen_inf is None:
            return None
        return {
            "acceptance": self.speculation.acceptance,
            "tokens": self.speculation.tokens,
            "gen_inf_base_s": self.spec_gen_inf[0],
            "gen_inf_rlhfuse_s": self.spec_gen_inf[1],
            "spec_gain": self.spec_gain,
            "spec_gen_inf_ratio": self.spec_gen_inf_ratio,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "actor": self.rlhfuse.models.actor.name,
            "critic": self.rlhfuse.models.critic.name,
            "max_len": self.rlhfuse.workload.max_len,
            "throughput_ratio": self.throughput_ratio,
            "gen_inf_ratio": self.gen_inf_ratio,
            "train_ratio": self.train_ratio,
            "train_ratio_bound": self.train_ratio_bound,
            "speculation": self._speculation_dict(),
            "plan": self.rlhfuse.to_dict(),
            "base_plan": self.base.to_dict(),
            "planner_seconds": self.seconds,
            "split_s": {"base": self.split("base"), "rlhfuse": self.split("rlhfuse")},
            "gain_sources": dict(zip(("inter", "intra", "others"), self.gain_sources, strict=True)),
        }


def compare(
    models: RLHFModels,
    cluster_spec: ClusterSpec,
    workload: Workload,
    eff: Efficiency = DEFAULT_EFFICIENCY,
    *,
    even_pp: bool = False,
    search: SearchConfig | None = GRID_SEARCH,
    speculation: Speculation | None = None,
) -> Comparison:
    """Plan both systems on the same sampled batch (`even_pp`: only pipelines whose stages hold equal layer
    counts, see `search.train_layouts`; the runtime runs uneven ones).

    `search` re-schedules RLHFuse's chosen fused layout with `rlhfuse.pipeline.solve` (None: the paper's greedy
    list schedule only). With `speculation`, both plans' Gen+Inf are also simulated with the speculative tail
    (`speculative_gen_inf`)."""
    start = time.perf_counter()
    cost = CostModel(cluster_spec, eff)
    samples = workload.validate().sample()
    stats = PruneStats()
    fused = search_plan(cost, models, workload, fused=True, samples=samples, stats=stats, even_pp=even_pp)
    base = search_plan(cost, models, workload, fused=False, samples=samples, even_pp=even_pp)
    if search is not None and fused.train.mode == "fused":
        seq = float(samples.seq.mean())
        train = searched_training(cost, models, fused.train, workload, seq, search)
        b = fused.breakdown
        fused = replace(fused, train=train, breakdown=replace(b, training=train.total))
    spec = None
    if speculation is not None:
        spec = tuple(speculative_gen_inf(cost, p, samples, speculation.validate()) for p in (base, fused))
    seq = float(samples.seq.mean())
    reduction = tuple(iteration_reduction(cost, models, p.train, seq) for p in (base, fused))
    return Comparison(
        fused,
        base,
        stats,
        time.perf_counter() - start,
        speculation,
        None if spec is None else (spec[0], spec[1]),
        (reduction[0], reduction[1]),
    )


def speculative_gen_inf(cost: CostModel, plan: Plan, samples: Samples, speculation: Speculation) -> float:
    """`plan`'s Gen+Inf seconds with the speculative tail: its generation layout, inference layout and Rt
    re-simulated on `samples` with and without `speculation`, the difference taken off its Gen+Inf."""
    fused = plan.rt_fraction is not None
    costs = ModeledCosts(
        cost, plan.models.actor, plan.gen_tp, plan.workload.max_context,
        resident_train_bytes(cost, plan.models, plan.train.actor, plan.train.critic, merged=plan.train.merged),
        plan.models,
        None if fused else plan.inference_tp, critic_train=(plan.train.critic.tp, plan.train.critic.pp),
    )  # fmt: skip
    rt = round(plan.rt_fraction * len(samples)) if plan.rt_fraction is not None else None
    plain = gen_inf(costs, samples, rt).end
    with_spec = gen_inf(replace(costs, speculation=speculation), samples, rt).end
    return plan.breakdown.gen_inf - (plain - with_spec)


def paper_grid(
    pairs: tuple[tuple[str, str], ...] = PAPER_PAIRS,
    max_lens: tuple[int, ...] = PAPER_MAX_LENS,
    *,
    cluster_spec: ClusterSpec | None = None,
    global_batch: int = 512,
    mini_batch: int = 64,
    eff: Efficiency = DEFAULT_EFFICIENCY,
    seed: int = 0,
    responses: LengthDistribution = RESPONSES,
    even_pp: bool = False,
    search: SearchConfig | None = GRID_SEARCH,
    speculation: Speculation | None = SPECULATION,
) -> list[Comparison]:
    """The paper's grid: Actor/Critic pairs x max generation lengths on 32 x 8 H100, batch 512, mini-batch 64."""
    spec = cluster_spec or cluster(*PAPER_CLUSTER)
    out = []
    for actor, critic in pairs:
        for max_len in max_lens:
            workload = Workload(
                global_batch=global_batch,
                mini_batch=mini_batch,
                max_len=max_len,
                seed=seed,
                responses=responses,
            )
            pair = RLHFModels(model(actor), model(critic))
            out.append(
                compare(pair, spec, workload, eff, even_pp=even_pp, search=search, speculation=speculation)
            )  # fmt: skip
    return out
