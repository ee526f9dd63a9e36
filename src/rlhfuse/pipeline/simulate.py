"""Event-driven reference simulator: makespan, bubbles and activation memory of a schedule, or a precise error.

Semantics (docs/schedule-format.md): a rank runs its list in order; F of stage s waits for F of stage s-1
(same model, replica, micro-batch); B of stage s waits for F of stage s and B of stage s+1. A dependency between
two different ranks costs `comm_latency` (0 in the FORMAT). Activation memory of a micro-batch is held on a
stage from the start of its F to the end of its B.

Split backward (beyond the paper; zero-bubble style): B of a stage split into I (input gradient: waits for F
of stage s and I of stage s+1; stage s-1 waits for it) and W (weight gradient: waits for I of the same stage;
nothing waits for it). Each takes `SPLIT_INPUT_SHARE` / the rest of the stage's backward time, and the
activation is held until the end of W (conservative: the weight gradient still reads the stored inputs). A
schedule is either plain (F/B) or split (F/I/W); `simulate` tells which from its kinds.

This is the readable oracle; `rlhfuse.pipeline.compiled` is the fast evaluator the search uses, and the two are
tested to agree.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from rlhfuse.pipeline.ir import Action, Kind, Placement, Schedule
from rlhfuse.pipeline.problem import Problem

DurationFn = Callable[[Action], float]

SPLIT_INPUT_SHARE = 0.5  # share of a stage's backward time taken by I (input gradient); W takes the rest

SplitBackward = Literal["auto", True, False]
"""Which backward form a planner plans (pipeline.split_backward): F/I/W (True), F/B (False), or both, keeping the
shorter predicted makespan ("auto")."""


class ScheduleError(ValueError):
    """An invalid schedule; the message names the op(s), rank(s) and what to change."""


@dataclass(frozen=True)
class SimResult:
    """What a schedule does on the problem's ranks.

    Attributes:
        makespan: end time of the last action.
        start, end: per action, its start and end time.
        busy: per rank, total compute time.
        bubble_ratio: per rank, idle fraction of the makespan: 1 - busy / makespan.
        memory: per rank, the activation timeline as (time, memory after the event) steps.
        peak_per_rank: per rank, the largest activation held at once.
        peak: the largest activation on any rank.
    """

    makespan: float
    start: Mapping[Action, float]
    end: Mapping[Action, float]
    busy: tuple[float, ...]
    bubble_ratio: tuple[float, ...]
    memory: tuple[tuple[tuple[float, float], ...], ...]
    peak_per_rank: tuple[float, ...]
    peak: float

    @property
    def mean_bubble_ratio(self) -> float:
        return sum(self.bubble_ratio) / max(len(self.bubble_ratio), 1)


def stage_kinds(split_backward: bool = False) -> tuple[Kind, ...]:
    """The compute kinds of one stage, in stream order: F, B or (split) F, I, W."""
    return (Kind.F, Kind.I, Kind.W) if split_backward else (Kind.F, Kind.B)


def all_actions(problem: Problem, split_backward: bool = False) -> list[Action]:
    """Every F and B (or F, I, W) the problem needs, in a canonical order."""
    out: list[Action] = []
    for m in problem.models:
        for r in range(m.replicas):
            for s in range(m.stages):
                for kind in stage_kinds(split_backward):
                    out.extend(Action(m.name, r, s, kind, i) for i in range(m.microbatches))
    return out


def dependencies(problem: Problem, a: Action) -> list[Action]:
    """The actions `a` waits for (docs/schedule-format.md execution semantics; I/W as in the module docstring)."""
    if a.kind is Kind.F:
        return [Action(a.model, a.replica, a.stage - 1, Kind.F, a.microbatch)] if a.stage > 0 else []
    if a.kind is Kind.W:
        return [Action(a.model, a.replica, a.stage, Kind.I, a.microbatch)]
    deps = [Action(a.model, a.replica, a.stage, Kind.F, a.microbatch)]
    if a.stage < problem.model(a.model).stages - 1:
        deps.append(Action(a.model, a.replica, a.stage + 1, a.kind, a.microbatch))
    return deps


def stage_duration(problem: Problem, model: str, stage: int, kind: Kind) -> float:
    """The problem's time for one op (I and W split the backward time, `SPLIT_INPUT_SHARE`)."""
    m = problem.model(model)
    if kind is Kind.F:
        return m.forward[stage]
    if kind is Kind.I:
        return m.backward[stage] * SPLIT_INPUT_SHARE
    if kind is Kind.W:
        return m.backward[stage] * (1.0 - SPLIT_INPUT_SHARE)
    return m.backward[stage]


def default_durations(problem: Problem) -> DurationFn:
    def duration(a: Action) -> float:
        return stage_duration(problem, a.model, a.stage, a.kind)

    return duration


def is_split(schedule: Schedule) -> bool:
    """True when the schedule uses split backward (I/W) instead of B."""
    return any(a.kind in (Kind.I, Kind.W) for rank in schedule.ranks for a in rank)


def profile_durations(problem: Problem, measured: Mapping[tuple[str, int, str], float]) -> DurationFn:
    """Durations from profiling: `measured[(model, stage, "F" | "B")]`, falling back to the problem's values."""
    base = default_durations(problem)

    def duration(a: Action) -> float:
        return float(measured.get((a.model, a.stage, a.kind.value), base(a)))

    return duration


def validate(problem: Problem, schedule: Schedule) -> None:
    """Raise ScheduleError for a structurally invalid schedule (deadlocks are found by `simulate`)."""
    placement = Placement.of(problem)
    if len(schedule.ranks) != problem.ranks:
        raise ScheduleError(
            f"schedule has {len(schedule.ranks)} rank lists but the problem has {problem.ranks} ranks"
        )
    split = is_split(schedule)
    expected = set(all_actions(problem, split))
    kinds = stage_kinds(split)
    seen: dict[Action, int] = {}
    problems: list[str] = []
    for k, rank in enumerate(schedule.ranks):
        forwards_here: set[Action] = set()
        for a in rank:
            if a.kind not in kinds:
                problems.append(
                    f"rank {k}: {a} has kind {a.kind.value}; a schedule holds F/B or (split backward) F/I/W "
                    "compute ops only, not both B and I/W"
                )
                continue
            if a not in expected:
                problems.append(
                    f"rank {k}: {a} is not an op of this problem (check model, replica, stage, micro-batch)"
                )
                continue
            if a in seen:
                problems.append(f"{a} appears twice (ranks {seen[a]} and {k}): keep one")
                continue
            seen[a] = k
            want = placement.rank(a.model, a.replica, a.stage)
            if want != k:
                problems.append(
                    f"{a} is on rank {k} but its placement puts {a.model}.{a.replica} stage {a.stage} on rank {want}"
                )
            if a.kind is Kind.F:
                forwards_here.add(a)
            elif Action(a.model, a.replica, a.stage, Kind.F, a.microbatch) not in forwards_here and want == k:
                problems.append(
                    f"rank {k}: backward {a} is listed before its forward; move it after {a.model}.{a.replica}:F{a.microbatch}"
                )
        if len(problems) > 20:
            break
    missing = expected - set(seen)
    if missing:
        shown = ", ".join(str(a) for a in sorted(missing)[:8])
        problems.append(f"{len(missing)} op(s) missing, e.g. {shown}")
    if problems:
        raise ScheduleError("invalid schedule:\n  - " + "\n  - ".join(problems[:20]))


def simulate(
    problem: Problem,
    schedule: Schedule,
    durations: DurationFn | None = None,
    comm_latency: float | None = None,
) -> SimResult:
    """Run `schedule` as soon as every dependency allows; raise ScheduleError if it is invalid or deadlocks."""
    validate(problem, schedule)
    duration = durations or default_durations(problem)
    latency = problem.comm_latency if comm_latency is None else comm_latency
    placement = Placement.of(problem)
    activation = {m.name: m.activation for m in problem.models}
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    pointer = [0] * problem.ranks
    free = [0.0] * problem.ranks
    remaining = sum(len(r) for r in schedule.ranks)
    while remaining:
        progressed = False
        for k, rank in enumerate(schedule.ranks):
            while pointer[k] < len(rank):
                a = rank[pointer[k]]
                deps = dependencies(problem, a)
                if any(d not in end for d in deps):
                    break
                ready = free[k]
                for d in deps:
                    hop = latency if placement.rank(d.model, d.replica, d.stage) != k else 0.0
                    ready = max(ready, end[d] + hop)
                start[a] = ready
                end[a] = free[k] = ready + duration(a)
                pointer[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = []
            for k, rank in enumerate(schedule.ranks):
                if pointer[k] < len(rank):
                    a = rank[pointer[k]]
                    waits = [d for d in dependencies(problem, a) if d not in end]
                    blocked.append(
                        f"rank {k} at step {pointer[k]} ({a.label()}) waits for "
                        + ", ".join(str(w) for w in waits)
                    )
            raise ScheduleError("deadlock: no rank can proceed:\n  - " + "\n  - ".join(blocked))
    makespan = max(end.values(), default=0.0)
    busy = tuple(sum(end[a] - start[a] for a in rank) for rank in schedule.ranks)
    bubbles = tuple(1.0 - b / makespan if makespan else 0.0 for b in busy)
    events: dict[int, list[tuple[float, int, float]]] = defaultdict(list)
    for k, rank in enumerate(schedule.ranks):
        for a in rank:
            size = activation[a.model][a.stage]
            if a.kind is Kind.F:
                events[k].append((start[a], 1, size))
            elif a.kind is not Kind.I:  # B, or W when split: the stored activation is freed at its end
                events[k].append((end[a], 0, -size))  # frees first at equal times: a later F may reuse it
    memory = []
    peaks = []
    for k in range(problem.ranks):
        level, peak, steps = 0.0, 0.0, []
        for t, _, delta in sorted(events[k]):
            level += delta
            peak = max(peak, level)
            steps.append((t, level))
        memory.append(tuple(steps))
        peaks.append(round(peak, 9))
    return SimResult(
        makespan, start, end, busy, bubbles, tuple(memory), tuple(peaks), max(peaks, default=0.0)
    )
