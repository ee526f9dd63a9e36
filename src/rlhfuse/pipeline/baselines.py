"""Reference schedules: GPipe, 1F1B, interleaved 1F1B, serial 1F1B of several models, Chimera-style merge.

Single-model schedules return per-rank lists holding only that model's actions; `combine` concatenates
per-rank lists of several models (running them one after the other on every rank).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rlhfuse.pipeline.ir import Action, Kind, Schedule
from rlhfuse.pipeline.problem import ModelSpec, Problem
from rlhfuse.pipeline.simulate import simulate

StageOrder = list[tuple[int, Kind, int]]
"""One pipeline position's (stage or chunk, kind, micro-batch) list within one replica."""


def place_orders(m: ModelSpec, ranks: int, orders: dict[int, StageOrder]) -> Schedule:
    """Put `orders[position]` (one replica's list for pipeline position k, naming the stage or chunk of each op)
    on the rank of that position in every replica's placement."""
    lists: list[list[Action]] = [[] for _ in range(ranks)]
    for r, row in enumerate(m.placement):
        for position, order in orders.items():
            lists[row[position]].extend(Action(m.name, r, c, kind, i) for c, kind, i in order)
    return Schedule.from_lists(lists)


def _stage_lists(problem: Problem, m: ModelSpec, per_stage: dict[int, list[tuple[Kind, int]]]) -> Schedule:
    """Place each replica's per-stage (kind, micro-batch) list on the ranks of its placement."""
    return place_orders(
        m, problem.ranks, {s: [(s, k, i) for k, i in order] for s, order in per_stage.items()}
    )


def _one_model(problem: Problem, model: str | None) -> ModelSpec:
    if model is None:
        if len(problem.models) != 1:
            raise ValueError(f"problem {problem.name!r} has {len(problem.models)} models: pass model=NAME")
        return problem.models[0]
    return problem.model(model)


def gpipe(problem: Problem, model: str | None = None) -> Schedule:
    """All forwards, then all backwards, on every stage."""
    m = _one_model(problem, model)
    order = [(Kind.F, i) for i in range(m.microbatches)] + [(Kind.B, i) for i in range(m.microbatches)]
    return _stage_lists(problem, m, {s: order for s in range(m.stages)})


def one_f_one_b_order(
    stages: int, microbatches: int, stage: int, warmup_extra: int = 0
) -> list[tuple[Kind, int]]:
    """1F1B on one stage: S-s-1 (+ warmup_extra) warm-up forwards, then F/B pairs, then the remaining B."""
    warmup = min(stages - stage - 1 + warmup_extra, microbatches)
    out = [(Kind.F, i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        out += [(Kind.F, warmup + i), (Kind.B, i)]
    out += [(Kind.B, i) for i in range(microbatches - warmup, microbatches)]
    return out


def one_f_one_b(problem: Problem, model: str | None = None) -> Schedule:
    """PipeDream-flush 1F1B: at most S-s micro-batches in flight on stage s."""
    m = _one_model(problem, model)
    return _stage_lists(
        problem, m, {s: one_f_one_b_order(m.stages, m.microbatches, s) for s in range(m.stages)}
    )


def interleaved_one_f_one_b(problem: Problem, model: str | None = None) -> Schedule:
    """Megatron's interleaved 1F1B: stage s on rank s % R (v = S / R chunks per rank), M a multiple of R."""
    m = _one_model(problem, model)
    if m.replicas != 1:
        raise ValueError(f"interleaved 1F1B takes one replica (model {m.name!r} has replicas={m.replicas})")
    ranks = len(set(m.placement[0]))
    if m.stages % ranks or any(m.placement[0][s] != m.placement[0][s % ranks] for s in range(m.stages)):
        raise ValueError(
            f"interleaved 1F1B needs stage s on the rank of stage s % {ranks} (stages={m.stages} over {ranks} ranks)"
        )
    if m.microbatches % ranks:
        raise ValueError(
            f"interleaved 1F1B needs microbatches ({m.microbatches}) to be a multiple of ranks ({ranks})"
        )
    v, mbs = m.stages // ranks, m.microbatches
    total = mbs * v

    def unit(i: int, forward: bool) -> tuple[int, int]:
        chunk = (i // ranks) % v
        if not forward:
            chunk = v - 1 - chunk
        return chunk, (i // (ranks * v)) * ranks + i % ranks

    lists: list[list[Action]] = [[] for _ in range(problem.ranks)]
    for k in range(ranks):
        rank = m.placement[0][k]
        warmup = min((ranks - k - 1) * 2 + (v - 1) * ranks, total)
        seq: list[tuple[bool, int]] = [(True, i) for i in range(warmup)]
        for j in range(total - warmup):
            seq += [(True, warmup + j), (False, j)]
        seq += [(False, j) for j in range(total - warmup, total)]
        for forward, i in seq:
            chunk, mb = unit(i, forward)
            lists[rank].append(Action(m.name, 0, chunk * ranks + k, Kind.F if forward else Kind.B, mb))
    return Schedule.from_lists(lists)


def combine(schedules: Sequence[Schedule]) -> Schedule:
    """Run several schedules one after the other on every rank."""
    ranks = max(len(s.ranks) for s in schedules)
    return Schedule(
        tuple(tuple(a for s in schedules if k < len(s.ranks) for a in s.ranks[k]) for k in range(ranks))
    )


def serial_one_f_one_b(problem: Problem) -> Schedule:
    """Every model with 1F1B, one after the other on each rank (the memory of one model is freed first)."""
    return combine([one_f_one_b(problem, m.name) for m in problem.models])


def serial_makespan(problem: Problem) -> float:
    """The paper's serial baseline: the models trained one after the other, each with 1F1B (with a barrier).

    Equal to docs/schedule-format.md's sum over models of (microbatches + stages - 1) * (forward + backward) for uniform stages.
    """
    return sum(
        simulate(alone(problem, m.name), one_f_one_b(alone(problem, m.name))).makespan for m in problem.models
    )


def serial_peak(problem: Problem) -> float:
    """Peak activation of serial 1F1B: per rank the larger of the models' 1F1B peaks, maximised over ranks."""
    return simulate(problem, serial_one_f_one_b(problem)).peak


def alone(problem: Problem, model: str) -> Problem:
    """`model` alone on the problem's ranks and placement (no memory cap)."""
    return Problem(
        f"{problem.name}/{model}", problem.ranks, (problem.model(model),), None, problem.comm_latency
    )


def chimera(problem: Problem) -> Schedule:
    """Chimera-style bidirectional schedule of two equal models placed in opposite directions.

    Each model runs 1F1B as if alone; every rank interleaves the two by start time (backward first on ties).
    Applies only where the two pipelines are mirror images (same stages, micro-batches, durations).
    """
    if len(problem.models) != 2:
        raise ValueError(f"chimera needs exactly two models (got {len(problem.models)})")
    a, b = problem.models
    same = (a.stages, a.replicas, a.microbatches, a.forward, a.backward) == (
        b.stages,
        b.replicas,
        b.microbatches,
        tuple(reversed(b.forward)),
        tuple(reversed(b.backward)),
    ) or (a.stages, a.replicas, a.microbatches, a.forward, a.backward) == (
        b.stages,
        b.replicas,
        b.microbatches,
        b.forward,
        b.backward,
    )
    mirrored = all(list(ra) == list(reversed(rb)) for ra, rb in zip(a.placement, b.placement))
    if not (same and mirrored):
        raise ValueError(
            f"chimera applies to two equal models in opposite directions ({a.name} and {b.name} differ in "
            "stages, replicas, micro-batches, durations or placement); use the fused search instead"
        )
    return merge_by_time(problem, [one_f_one_b(problem, a.name), one_f_one_b(problem, b.name)])


def merge_by_time(problem: Problem, schedules: Sequence[Schedule]) -> Schedule:
    """Interleave single-model schedules on each rank by their start times when run alone (never deadlocks)."""
    keyed: list[list[tuple[float, int, int, Action]]] = [[] for _ in range(problem.ranks)]
    for j, sched in enumerate(schedules):
        model = sched.ranks[next(k for k, r in enumerate(sched.ranks) if r)][0].model
        sim = simulate(alone(problem, model), sched)
        for k, rank in enumerate(sched.ranks):
            for a in rank:
                keyed[k].append((sim.start[a], 0 if a.kind is Kind.B else 1, j, a))
    return Schedule(tuple(tuple(x[3] for x in sorted(rank, key=lambda x: x[:3])) for rank in keyed))


def split_each_backward(schedule: Schedule, which: Callable[[Action], bool] = lambda a: True) -> Schedule:
    """`schedule` with every B (every B `which` accepts) replaced by its I then its W, in place (the same order
    otherwise): the F/B schedule's split-backward twin, with the same dependencies between ranks and W right after
    its I."""
    return Schedule(
        tuple(
            tuple(
                part
                for a in rank
                for part in (
                    (Action(a.model, a.replica, a.stage, Kind.I, a.microbatch),
                     Action(a.model, a.replica, a.stage, Kind.W, a.microbatch))
                    if a.kind is Kind.B and which(a)
                    else (a,)
                )
            )
            for rank in schedule.ranks
        )
    )  # fmt: skip
