"""The proof side: a constraint-programming model of the fused schedule problem (OR-Tools CP-SAT).

One interval per op (fixed duration), one no-overlap per rank, the FORMAT's dependencies as precedences (plus
`comm_latency` across ranks), and, when there is a memory cap or memory is the objective, one cumulative per
rank whose items are the activations, each held from the start of its F to the end of its B (which is exactly
the prefix-sum peak of the rank's list, since a rank runs one op at a time and a B frees before a later F).

Symmetry breaking: each stream (model, replica, stage, kind) runs its micro-batches in order. This loses no
schedule: in any valid timed schedule the k-th F to start on stage s starts after the k-th F of stage s-1 ended
(k distinct micro-batches must have left stage s-1), and likewise the k-th B of stage s starts after the k-th F
of stage s and the k-th B of stage s+1 ended; renaming micro-batches by position on every stream therefore gives
a valid schedule with the same times, and the same memory (a stage's held activation depends only on how many
F's started and B's ended). So the model's optimum is the problem's optimum, and the solver's proven objective
bound is a lower bound for the problem.

Times are scaled to integers: by the smallest power of ten that makes every duration (and the latency) whole;
when none up to 10^4 does, durations are rounded *down* at 10^3, which relaxes the problem, so the proven bound
stays valid and every schedule found is re-timed with the true durations. Activations are scaled the same way
(rounded down, the cap rounded up, when not exact).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlhfuse.pipeline.compiled import Compiled, _sequenced_heads_tails, compile_problem
from rlhfuse.pipeline.problem import Problem

DEFAULT_MAX_OPS = 20_000
# Wall-clock cap per unit of CP-SAT deterministic time, plus SAFETY_SECONDS_BASE: a guard against a solver that
# never returns, never a budget. At 12 s per unit it fired on Table 3's 00, 01 and 09 at load 1 and 3 and changed
# 09's result (peak 39.40 at load 1, 38.40 at load 3, 37.40 uncapped); at 60 s per unit none fired at load 1 and 09
# gave 37.40 in 129 s instead of 166 s. 120 leaves room for a machine several times slower or busier.
SAFETY_SECONDS_PER_UNIT = 120.0
SAFETY_SECONDS_BASE = 5.0


@dataclass(frozen=True)
class ExactResult:
    """What the exact model proved and found.

    Attributes:
        lower_bound: proven lower bound on the objective (makespan, or peak activation with `objective="peak"`),
            never below the analytic bound it was given.
        value: the objective of the best schedule the model found (true durations), or None.
        order: that schedule as op ids rank after rank (`Compiled.to_schedule`), or None.
        optimal: the solver proved `value` optimal (then `value == lower_bound` up to rounding).
        status: the CP-SAT status name, or `TOO_LARGE` / `NO_SOLVER` when the model was not run.
        seconds: wall-clock seconds spent building and solving.
        ops: size of the model (ops).
        note: why the bound is what it is, in words.
        effort: CP-SAT's deterministic time spent (machine-independent with one worker).
        wall_capped: a deterministic solve was stopped by its wall-clock safety cap (`SAFETY_SECONDS_PER_UNIT`)
            before its deterministic budget was spent: the result may then depend on the machine's load.
    """

    lower_bound: float
    value: float | None
    order: np.ndarray | None
    optimal: bool
    status: str
    seconds: float
    ops: int
    note: str = ""
    effort: float = 0.0
    wall_capped: bool = False


def _scale(values: np.ndarray, candidates: tuple[int, ...] = (1, 10, 100, 1000, 10000)) -> tuple[int, bool]:
    """The smallest power of ten making every value whole (True), else 1000 with rounding (False)."""
    for s in candidates:
        scaled = values * s
        if np.all(np.abs(scaled - np.round(scaled)) < 1e-6 * np.maximum(1.0, np.abs(scaled))):
            return s, True
    return 1000, False


def _ints(values: np.ndarray, scale: int, exact: bool) -> np.ndarray:
    scaled = values * scale
    return (np.round(scaled) if exact else np.floor(scaled + 1e-9)).astype(np.int64)


def have_solver() -> bool:
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:  # pragma: no cover - ortools is a dependency
        return False
    return True


def prove(
    problem: Problem,
    *,
    compiled: Compiled | None = None,
    upper_order: np.ndarray | None = None,
    analytic_bound: float = 0.0,
    objective: str = "makespan",
    makespan_limit: float | None = None,
    time_budget: float = 10.0,
    deterministic_budget: float | None = None,
    workers: int = 1,
    seed: int = 0,
    max_ops: int = DEFAULT_MAX_OPS,
    resource_ranks: tuple[int, ...] | None = None,
    at_most: float | None = None,
    inflight_extra: tuple[int, ...] | None = None,
    cap_override: float | None = None,
    low_memory_search_order: bool = False,
    light_propagation: bool = False,
) -> ExactResult:
    """Solve (or bound) `problem` exactly with CP-SAT, warm-started from `upper_order`.

    objective: "makespan" (minimise the makespan; peak activation under the problem's cap), or "peak"
        (minimise the largest per-rank peak activation with makespan <= `makespan_limit`, which is then the
        horizon: a limit above the hint's makespan lets the solver trade makespan for memory).
    upper_order: a valid order (e.g. the annealing result): its times are the solver's hint and, for the
        makespan objective, its makespan the horizon (an order is needed for `objective="peak"`).
    analytic_bound: a bound already known (`Bounds.makespan`); the result never reports less.
    time_budget: wall-clock seconds for the solver; `deterministic_budget`, when set, is CP-SAT's deterministic
        time limit instead (with `workers=1` the result then does not depend on the machine's speed or load).
    max_ops: larger problems are not modelled; the result then says so and keeps `analytic_bound`.
    resource_ranks: model only these ranks' no-overlap and memory (the others run their ops whenever their
        dependencies allow): a relaxation, so its optimum is a valid lower bound (a *window* bound) and is
        much easier to prove; its schedules are not valid orders and are not returned.
    at_most: look only for schedules with makespan <= this (a decision: INFEASIBLE proves the optimum is
        above it; the bound returned is then the next possible makespan).
    inflight_extra: per model, allow at most the 1F1B count (stages - stage) + extra micro-batches in flight
        on each stage: a *restriction* that steers the solver to low-memory schedules (the bound is then not
        a bound for the problem and is not reported: `lower_bound` stays `analytic_bound`).
    cap_override: a memory cap tighter than the problem's (heuristic use only, with `inflight_extra`).
    low_memory_search_order: branch in a fixed order, every B as early as possible, then every F as late as
        possible: the first schedule found holds little activation (F's are started just in time). The search
        is still complete, so INFEASIBLE still proves the bound.
    light_propagation: solve without the LP relaxation and the no-overlaps' precedence reasoning (always so for
        an uncapped decision in the low-memory order, which then mostly propagates).
    """
    began = time.perf_counter()
    c = compiled or compile_problem(problem)
    if objective not in ("makespan", "peak"):
        raise ValueError(f"objective must be 'makespan' or 'peak' (got {objective!r})")
    if objective == "peak" and (upper_order is None or makespan_limit is None):
        raise ValueError("objective='peak' needs upper_order and makespan_limit (the makespan to keep)")
    if c.n > max_ops:
        return ExactResult(
            analytic_bound, None, None, False, "TOO_LARGE", time.perf_counter() - began, c.n,
            f"{c.n} ops is more than the exact model takes (max_ops={max_ops}); the bound is the analytic one",
        )  # fmt: skip
    if not have_solver():  # pragma: no cover
        return ExactResult(
            analytic_bound, None, None, False, "NO_SOLVER", time.perf_counter() - began, c.n,
            "ortools is not installed (pip install ortools); the bound is the analytic one",
        )  # fmt: skip
    from ortools.sat.python import cp_model

    lat = float(problem.comm_latency)
    t_scale, t_exact = _scale(np.append(c.dur, lat))
    dur = _ints(c.dur, t_scale, t_exact)
    lat_i = int(_ints(np.array([lat]), t_scale, t_exact)[0])
    act = np.abs(c.mem)
    m_scale, m_exact = _scale(np.append(act, problem.memory_cap or 0.0))
    demand = _ints(act, m_scale, m_exact)
    cap = None
    if cap_override is not None:
        problem = dataclasses.replace(problem, memory_cap=min(cap_override, problem.memory_cap or math.inf))
        m_scale, m_exact = _scale(np.append(act, problem.memory_cap or 0.0))
        demand = _ints(act, m_scale, m_exact)
    if problem.memory_cap is not None:
        cap = (
            math.ceil(problem.memory_cap * m_scale - 1e-9)
            if not m_exact
            else round(problem.memory_cap * m_scale)
        )
    seq_head, seq_tail = _sequenced_heads_tails(
        c.n, c.pred1, c.pred2, c.succ1, c.succ2, list(c.stream_base), list(c.stream_len), dur.astype(float)
    )
    head = np.round(seq_head).astype(np.int64)
    tail = np.round(seq_tail).astype(np.int64)

    hint_start: np.ndarray | None = None
    upper: float | None = None
    if upper_order is not None:
        ms, _finish = c.evaluate(upper_order)
        if ms < 0:
            raise ValueError("upper_order deadlocks: pass a valid order (or none)")
        upper = float(ms)
        # Re-time the hint with the model's (integer) durations.
        int_c_finish = _retime(c, upper_order, dur, lat_i)
        hint_start = int_c_finish - dur
    horizon = int((hint_start + dur).max()) if hint_start is not None else int(dur.sum())
    if objective == "peak":
        assert makespan_limit is not None
        # The limit, not the hint's makespan: a schedule up to the limit may hold less activation.
        # (Rounded-down durations only shorten schedules, so the limit stays valid without exact times.)
        horizon = math.floor(makespan_limit * t_scale + 1e-6)
    lb_scaled = (
        math.ceil(analytic_bound * t_scale - 1e-6) if t_exact else math.floor(analytic_bound * t_scale)
    )
    lb_scaled = max(lb_scaled, int((head + dur + tail).max()))
    if at_most is not None:
        horizon = min(horizon, math.floor(at_most * t_scale + 1e-6))
    if objective == "makespan" and lb_scaled > horizon:
        horizon = lb_scaled

    model = cp_model.CpModel()
    start = []
    intervals = []
    for op in range(c.n):
        lo = int(head[op])
        hi = max(lo, int(horizon - dur[op] - tail[op]))  # below lo: no schedule within the horizon
        s = model.new_int_var(lo, hi, f"s{op}")
        if horizon - dur[op] - tail[op] < lo:
            model.add(s < lo)  # an empty domain, stated so the solver reports INFEASIBLE
        start.append(s)
        intervals.append(model.new_fixed_size_interval_var(s, int(dur[op]), f"i{op}"))
    for op in range(c.n):
        for succ, has_lat in ((c.succ1[op], c.lat_succ1[op] > 0), (c.succ2[op], c.lat_succ2[op] > 0)):
            if succ >= 0:
                model.add(start[succ] >= start[op] + int(dur[op]) + (lat_i if has_lat else 0))
    for base, length in zip(c.stream_base, c.stream_len):  # symmetry breaking (module docstring)
        for i in range(int(base), int(base) + int(length) - 1):
            model.add(start[i + 1] >= start[i] + int(dur[i]))
    modelled = range(problem.ranks) if resource_ranks is None else sorted(set(resource_ranks))
    for k in modelled:
        ops = np.nonzero(c.rank == k)[0]
        model.add_no_overlap([intervals[op] for op in ops])
    if inflight_extra is not None:
        for sid in np.nonzero(c.stream_is_b == 0)[0]:
            limit = int(c.stages_of_stream[sid] - c.stage_of_stream[sid]) + int(
                inflight_extra[int(c.model_of_stream[sid])]
            )
            base, length = int(c.stream_base[sid]), int(c.stream_len[sid])
            for i in range(length - limit):
                b = int(c.free_op[base + i])  # the op that frees micro-batch i's activation
                model.add(start[base + i + limit] >= start[b] + int(dur[b]))
    makespan = model.new_int_var(lb_scaled, max(lb_scaled, horizon), "makespan")
    for base, length in zip(c.stream_base, c.stream_len):
        last = int(base) + int(length) - 1
        model.add(makespan >= start[last] + int(dur[last]) + int(tail[last]))
    peak = None
    if cap is not None or objective == "peak":
        peak_lo = int(demand.max())
        peak = model.new_int_var(peak_lo, cap if cap is not None else int(demand.sum()), "peak")
        for k in modelled:
            held, demands = [], []
            for op in map(int, np.nonzero((c.rank == k) & (c.is_b == 0))[0]):
                b = int(c.free_op[op])
                size = model.new_int_var(int(dur[op] + dur[b]), horizon, f"h{op}")
                held.append(model.new_interval_var(start[op], size, start[b] + int(dur[b]), f"m{op}"))
                demands.append(int(demand[op]))
            if held:
                model.add_cumulative(held, demands, peak)
    if objective == "makespan":
        model.minimize(makespan)
    elif objective == "peak":
        assert peak is not None
        model.add(makespan <= horizon)
        model.minimize(peak)
    if low_memory_search_order:
        backward = [start[op] for op in range(c.n) if c.is_b[op]]
        forward = [start[op] for op in range(c.n) if not c.is_b[op]]
        model.add_decision_strategy(backward, cp_model.CHOOSE_LOWEST_MIN, cp_model.SELECT_MIN_VALUE)
        model.add_decision_strategy(forward, cp_model.CHOOSE_HIGHEST_MAX, cp_model.SELECT_MAX_VALUE)
    if hint_start is not None:
        for op in range(c.n):
            model.add_hint(start[op], int(hint_start[op]))
        model.add_hint(makespan, int((hint_start + dur).max()))

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = max(1, int(workers))
    solver.parameters.random_seed = int(seed)
    if low_memory_search_order:
        solver.parameters.search_branching = cp_model.FIXED_SEARCH
    if deterministic_budget is not None:
        solver.parameters.max_deterministic_time = float(deterministic_budget)
        # A safety net only (CP-SAT's deterministic time can run far slower than the clock on some models);
        # when it stops a solve, the result may depend on the machine, and `note` says so.
        solver.parameters.max_time_in_seconds = (
            SAFETY_SECONDS_PER_UNIT * float(deterministic_budget) + SAFETY_SECONDS_BASE
        )
    else:
        solver.parameters.max_time_in_seconds = max(0.01, float(time_budget))
    if light_propagation or (low_memory_search_order and peak is None):
        # The fixed search of an uncapped decision mostly propagates: without the LP relaxation and the
        # precedence reasoning of the no-overlaps it finds the same schedule with less work (09 at 606: 36 s
        # instead of 62 s on a loaded machine, 0.5 instead of 8.9 units of deterministic time).
        solver.parameters.linearization_level = 0
        solver.parameters.use_precedences_in_disjunctive_constraint = False
        # The linear propagator of CP-SAT 9.10+ costs more than the older one on these precedence-only models:
        # the same schedule on 09 at 606 with 14 instead of 17 s.
        solver.parameters.new_linear_propagation = False
    status = solver.solve(model)
    name = solver.status_name(status)
    capped = _wall_capped(solver, status, deterministic_budget is not None)
    order = None
    value: float | None = None
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    if found and resource_ranks is None:
        starts = np.array([solver.value(s) for s in start], dtype=np.int64)
        order = _order_from_starts(c, starts)
        ms, _ = c.evaluate(order)
        value = float(ms) if objective == "makespan" else c.peak(order)
    if inflight_extra is not None or cap_override is not None:  # a restriction proves nothing
        return ExactResult(
            analytic_bound, value, order, False, name, time.perf_counter() - began, c.n,
            "restricted model (in-flight limits)", float(solver.response_proto.deterministic_time), capped,
        )  # fmt: skip
    if objective == "makespan":
        scaled_bound = (
            solver.best_objective_bound if found else (horizon + 1 if status == cp_model.INFEASIBLE else 0)
        )
        proven = float(scaled_bound) / t_scale
        if t_exact:
            proven = math.ceil(proven - 1e-9) if t_scale == 1 else proven
        lower = max(analytic_bound, proven)
        if status == cp_model.INFEASIBLE and upper is None:
            note = "no schedule meets the memory cap"
        else:
            note = (
                "proven optimal"
                if status == cp_model.OPTIMAL
                else f"solver stopped ({name}); bound proven so far"
            )
    else:
        scaled_peak = solver.best_objective_bound if found else 0.0
        lower = max(analytic_bound, float(scaled_peak) / m_scale)
        note = (
            "peak proven optimal at this makespan"
            if status == cp_model.OPTIMAL
            else f"solver stopped ({name})"
        )
    optimal = status == cp_model.OPTIMAL and t_exact and (objective == "makespan" or m_exact)
    if value is not None and optimal:
        lower = max(lower, value) if objective == "makespan" else lower
    return ExactResult(
        lower_bound=float(lower),
        value=value,
        order=order,
        optimal=bool(optimal),
        status=name,
        seconds=time.perf_counter() - began,
        ops=c.n,
        note=note
        + ("; stopped by the wall-clock safety cap: may depend on the machine's load" if capped else ""),
        effort=float(solver.response_proto.deterministic_time),
        wall_capped=capped,
    )


def _retime(c: Compiled, order: np.ndarray, dur: np.ndarray, lat: int) -> np.ndarray:
    """Finish times of `order` with integer durations `dur` (the compiled evaluator on other durations)."""
    from rlhfuse.pipeline.compiled import evaluate_order

    finish = np.zeros(c.n)
    lat1 = np.where(c.lat_succ1 > 0, float(lat), 0.0)
    lat2 = np.where(c.lat_succ2 > 0, float(lat), 0.0)
    evaluate_order(
        order, c.rank_ptr, dur.astype(float), c.pred1, c.pred2, c.succ1, c.succ2, lat1, lat2, finish
    )
    return np.round(finish).astype(np.int64)


def _order_from_starts(c: Compiled, starts: np.ndarray) -> np.ndarray:
    """Per-rank order by start time (ties, only possible for zero-length ops, by op id)."""
    order = np.empty(c.n, dtype=np.int64)
    for k in range(c.ranks):
        ops = np.nonzero(c.rank == k)[0]
        ranked = ops[np.lexsort((ops, starts[ops]))]
        order[c.rank_ptr[k] : c.rank_ptr[k + 1]] = ranked
    return order


def exact_search(
    problem: Problem,
    *,
    compiled: Compiled | None = None,
    upper_order: np.ndarray | None = None,
    analytic_bound: float = 0.0,
    time_budget: float = 10.0,
    deterministic_budget: float | None = None,
    workers: int = 1,
    seed: int = 0,
    max_ops: int = DEFAULT_MAX_OPS,
) -> ExactResult:
    """Close the gap between a bound and a schedule: decide "makespan <= bound?", raise the bound on each
    "no", stop at the first "yes" (then optimal); if a decision is left open, minimise the makespan from the
    best schedule with what is left of the budget. The budget (seconds, or CP-SAT deterministic time) is for
    all the solves together.
    """
    began = time.perf_counter()
    c = compiled or compile_problem(problem)
    deterministic = deterministic_budget is not None
    total = float(deterministic_budget) if deterministic_budget is not None else float(time_budget)
    used = 0.0
    lower = float(analytic_bound)
    best_order = upper_order
    best = math.inf if upper_order is None else float(c.evaluate(upper_order)[0])
    t_scale, t_exact = _scale(np.append(c.dur, float(problem.comm_latency)))
    step = 1.0 / t_scale
    status, note, last = "UNKNOWN", "", None
    if c.n > max_ops:
        return prove(problem, compiled=c, analytic_bound=lower, max_ops=max_ops)

    def left() -> float:
        return total - used

    # Decisions at the bound: each is much easier than the optimisation (tight time windows for every op).
    # The first one branches in the low-memory order (B early, F late); if it stays open, the solver's own
    # search takes over. Under a cap the memory is bounded anyway, so the fixed order gets less of the budget.
    tries = 0
    while best > lower + 1e-9 and left() > 0.05 * total:
        low_order = tries == 0
        share = left() * ((0.7 if problem.memory_cap is None else 0.35) if low_order else 0.6)
        tries += 1
        r = prove(
            problem, compiled=c, analytic_bound=lower, at_most=lower, workers=workers, seed=seed,
            time_budget=share, deterministic_budget=share if deterministic else None, max_ops=max_ops,
            low_memory_search_order=low_order,
        )  # fmt: skip
        used += _spent(r, deterministic, share)
        last = r
        if r.value is not None and r.value < best - 1e-9:
            best, best_order = r.value, r.order
        if r.status == "INFEASIBLE":
            # No schedule ends by `lower`; with whole scaled times the next possible makespan is one step up.
            lower = (math.floor(lower * t_scale + 1e-6) + 1) / t_scale if t_exact else lower + step
            continue
        if r.value is not None and r.value <= lower + 1e-9:
            status, note = "OPTIMAL", "a schedule at the proven bound (optimal)"
            break
        if not low_order or problem.memory_cap is not None:
            # Under a cap the cap-blind bound is often far below the optimum: improving the schedule from the
            # warm start (below) does more with the budget than more decisions at the bound.
            break
    if best > lower + 1e-9 and left() > 0.05 * total and best_order is not None:
        share = left()
        r = prove(
            problem, compiled=c, upper_order=best_order, analytic_bound=lower, workers=workers, seed=seed,
            time_budget=share, deterministic_budget=share if deterministic else None, max_ops=max_ops,
        )  # fmt: skip
        used += _spent(r, deterministic, share)
        last = r
        lower = max(lower, r.lower_bound)
        if r.value is not None and r.value < best - 1e-9:
            best, best_order = r.value, r.order
    if best <= lower + 1e-9:
        status = "OPTIMAL"
        note = note or "a schedule at the proven bound (optimal)"
    elif last is not None:
        status = last.status
        note = f"gap left: schedule {best:g}, proven bound {lower:g} (solver {last.status})"
    return ExactResult(
        lower_bound=lower,
        value=None if best_order is None else best,
        order=best_order,
        optimal=status == "OPTIMAL",
        status=status,
        seconds=time.perf_counter() - began,
        ops=c.n,
        note=note,
    )


def _spent(r: ExactResult, deterministic: bool, share: float) -> float:
    # Deterministic budgets count CP-SAT's deterministic time (the same on any machine), others seconds.
    return min(share, r.effort if deterministic else r.seconds)


def low_memory_search(
    problem: Problem,
    *,
    compiled: Compiled | None = None,
    makespan: float,
    peak: float,
    serial_peak: float | None = None,
    time_budget: float = 10.0,
    deterministic_budget: float | None = None,
    seed: int = 0,
    per_try: float = 0.2,
    max_tries: int = 8,
) -> ExactResult | None:
    """A schedule with makespan <= `makespan` and peak below `peak`, or None. A heuristic (it proves nothing):
    decisions of *restricted* models, each with at most `per_try` of the budget:

    1. the model with the longest critical path held at its 1F1B in-flight count (the structure of the
       low-memory optimal schedules: the big pipeline runs 1F1B, the other fills its bubbles) under a cap of
       1.0, 1.15, 1.3, 1.5 x `serial_peak`, tightest first, until one succeeds;
    2. otherwise in-flight limits alone (1F1B count + extra per model), loosest first, each success lowering
       the peak to beat.
    """
    c = compiled or compile_problem(problem)
    deterministic = deterministic_budget is not None
    total = float(deterministic_budget) if deterministic_budget is not None else float(time_budget)
    paths = lower_bounds_critical(c)
    protected = int(np.argmax(paths))
    loose = tuple(0 if i == protected else m.microbatches for i, m in enumerate(problem.models))
    tries: list[tuple[float | None, tuple[int, ...], bool]] = []
    if serial_peak is not None:
        tries += [(f * serial_peak, loose, True) for f in (1.0, 1.15, 1.3, 1.5)]
    grid = sorted(((_inflight_peak(c, e), e) for e in _extra_grid(problem)), reverse=True)
    tries += [(None, e, False) for allowed, e in grid if allowed < peak - 1e-9]
    used, best, n_tries, capped_done = 0.0, None, 0, False
    for cap, extras, capped in tries:
        if used >= 0.95 * total or n_tries >= max_tries:
            break
        if capped and (capped_done or cap is None or cap >= peak - 1e-9):
            continue
        if not capped and _inflight_peak(c, extras) >= peak - 1e-9:
            continue
        n_tries += 1
        share = min(total - used, per_try * total)
        r = prove(
            problem, compiled=c, at_most=makespan, inflight_extra=extras, seed=seed, time_budget=share,
            deterministic_budget=share if deterministic else None, cap_override=cap,
        )  # fmt: skip
        used += min(share, r.effort if deterministic else r.seconds)
        if r.order is not None and r.value is not None and r.value <= makespan + 1e-9:
            found = c.peak(r.order)
            if found < peak - 1e-9:
                best, peak = r, found
                capped_done = capped_done or capped
    return best


def memory_ladder(
    problem: Problem,
    *,
    compiled: Compiled | None = None,
    makespan: float,
    peak: float,
    target: float,
    factors: tuple[float, ...] = (1.01, 1.1, 1.2, 1.35),
    time_budget: float = 4.0,
    deterministic_budget: float | None = None,
    seed: int = 0,
    quick_share: float = 0.1,
) -> ExactResult | None:
    """A schedule with makespan <= `makespan` and a lower peak, or None: decisions "makespan <= M under a memory
    cap of f x `target`?" (`target`: serial 1F1B's peak) for the factors below the current peak, each with an
    equal share of the budget and the low-memory branching order. A heuristic: an open or refuted decision
    proves nothing about the problem's memory.

    First a quick try at the tightest cap, `quick_share` of a cap's share with light propagation (no LP
    relaxation, no precedence reasoning in the no-overlaps): where the low-memory order meets that cap at all,
    it often does so at once that way (06: 26.24 in 1.5 s, where the full propagation left both of its caps
    open after 14 s). Then the caps loosest first, each "yes" lowering the peak to beat, until a decision is
    not met: a decision that stays open spends its whole share, and on Table 3 a cap left open was never met
    by a tighter one (00 and 01 meet 1.35 and 1.2 and not 1.1; 03 and 04 none: 1 decision instead of 4).
    """
    c = compiled or compile_problem(problem)
    caps = [f * target for f in factors if f * target < peak - 1e-6]
    if not caps:
        return None
    total = float(deterministic_budget) if deterministic_budget is not None else float(time_budget)
    share = total / len(caps)

    def decide(cap: float, budget: float, light: bool, below: float) -> tuple[ExactResult, float] | None:
        """The decision's schedule and its peak if it meets the makespan with a peak below `below`."""
        r = prove(
            problem, compiled=c, at_most=makespan, seed=seed, time_budget=budget, cap_override=cap,
            deterministic_budget=budget if deterministic_budget is not None else None, analytic_bound=makespan,
            low_memory_search_order=True, light_propagation=light,
        )  # fmt: skip
        if r.order is None or r.value is None or r.value > makespan + 1e-9:
            return None
        found = c.peak(r.order)
        return (r, found) if found < below - 1e-9 else None

    quick = decide(caps[0], quick_share * share, True, peak)
    if quick is not None:
        return quick[0]
    best = None
    for cap in reversed(caps):
        if cap >= peak - 1e-6:  # a looser cap's schedule is below this one already
            continue
        met = decide(cap, share, False, peak)
        if met is None:
            break
        best, peak = met
    return best


def capped_memory_search(
    problem: Problem,
    *,
    compiled: Compiled | None = None,
    makespan: float,
    peak: float,
    target: float,
    time_budget: float = 10.0,
    deterministic_budget: float | None = None,
    seed: int = 0,
    tries: int = 3,
) -> ExactResult | None:
    """A schedule with makespan <= `makespan` and a lower peak, or None: exact decisions "makespan <= M under
    a memory cap X?", first with X just above `target` (serial 1F1B's peak), then halving the distance
    between the best peak and the last cap that was not met. Each try gets an equal share of the budget; an
    open or refuted try proves nothing about the unrestricted problem's memory.
    """
    c = compiled or compile_problem(problem)
    deterministic = deterministic_budget is not None
    total = float(deterministic_budget) if deterministic_budget is not None else float(time_budget)
    lo, best = target * 1.01, None
    used = 0.0
    for _ in range(tries):
        cap = lo if best is None and used == 0.0 else (lo + peak) / 2
        if cap >= peak - 1e-6 or used >= 0.95 * total:
            break
        share = min(total - used, total / tries)
        r = prove(
            problem, compiled=c, at_most=makespan, seed=seed, time_budget=share, cap_override=cap,
            deterministic_budget=share if deterministic else None, analytic_bound=makespan,
        )  # fmt: skip
        used += min(share, r.effort if deterministic else r.seconds)
        if r.order is not None and r.value is not None and r.value <= makespan + 1e-9:
            found = c.peak(r.order)
            if found < peak - 1e-9:
                best, peak = r, found
        else:
            lo = cap
    return best


def lower_bounds_critical(c: Compiled) -> np.ndarray:
    """Per model, its longest stage critical path (head + the stage's work + tail), as in `bounds`."""
    out = np.zeros(len(c.problem.models))
    for sid in np.nonzero(c.stream_is_b == 0)[0]:
        group = np.isin(c.stream, np.nonzero(c.stream_limit_group == sid)[0])
        f_ops = slice(int(c.stream_base[sid]), int(c.stream_base[sid] + c.stream_len[sid]))
        path = float(c.head[f_ops].min() + c.dur[group].sum() + c.tail[group].min())
        mi = int(c.model_of_stream[sid])
        out[mi] = max(out[mi], path)
    return out


def _extra_grid(problem: Problem) -> list[tuple[int, ...]]:
    per_model: list[list[int]] = []
    for m in problem.models:
        options = {0, 1, 2, 3, 4, m.stages // 4, m.stages // 2, m.stages, m.microbatches}
        per_model.append(sorted(x for x in options if 0 <= x <= m.microbatches))
    grid: list[tuple[int, ...]] = [()]
    for cands in per_model:
        grid = [(*g, x) for g in grid for x in cands]
    return grid


def _inflight_peak(c: Compiled, extras: tuple[int, ...]) -> float:
    """The largest per-rank activation the in-flight limits allow (all stages of a rank at their limits)."""
    per_rank = np.zeros(c.ranks)
    for sid in np.nonzero(c.stream_is_b == 0)[0]:
        limit = int(c.stages_of_stream[sid] - c.stage_of_stream[sid]) + extras[int(c.model_of_stream[sid])]
        limit = min(limit, int(c.stream_len[sid]))
        per_rank[int(c.stream_rank[sid])] += limit * float(c.mem[int(c.stream_base[sid])])
    return float(per_rank.max())


# Wall-clock safety caps that fired in the current `counting_wall_caps` block (none: not counted).
_WALL_CAPS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "rlhfuse_wall_caps", default=None
)


@contextlib.contextmanager
def counting_wall_caps() -> Iterator[list[int]]:
    """Count, in `counter[0]`, the deterministic-budget CP-SAT solves inside the block that were stopped by
    their wall-clock safety cap (`SAFETY_SECONDS_PER_UNIT`) before their deterministic budget: each is a place
    where the result may depend on the machine's load, which the search reports (`Solution.stats`)."""
    counter = [0]
    token = _WALL_CAPS.set(counter)
    try:
        yield counter
    finally:
        _WALL_CAPS.reset(token)


def _wall_capped(solver: Any, status: Any, deterministic: bool) -> bool:
    """Whether a deterministic-budget solve ended on its wall-clock safety cap instead (not at its
    deterministic budget, not solved); counted in the current `counting_wall_caps` block."""
    from ortools.sat.python import cp_model

    if not deterministic or status in (cp_model.OPTIMAL, cp_model.INFEASIBLE):
        return False
    cap = solver.parameters.max_time_in_seconds
    spent = float(solver.response_proto.deterministic_time)
    capped = bool(solver.wall_time >= 0.99 * cap and spent < 0.99 * solver.parameters.max_deterministic_time)
    counter = _WALL_CAPS.get()
    if capped and counter is not None:
        counter[0] += 1
    return capped


def memory_lns(
    problem: Problem,
    *,
    compiled: Compiled | None = None,
    order: np.ndarray,
    makespan_limit: float,
    time_budget: float = 30.0,
    deterministic_budget: float | None = None,
    per_solve: float = 0.1,
    seed: int = 0,
    target: float = 0.0,
    patience: int = 24,
) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """Large-neighbourhood search for memory: lower the peak of `order` keeping makespan <= `makespan_limit`.

    Each step frees a *neighbourhood* of the current schedule, a time window [t0, t1) on a band of ranks
    around the ranks at the peak (the window starts before the peak time, since a warm-up's activation builds
    up from its start), and asks CP-SAT to minimise the largest per-rank peak with everything else kept: on
    the band, the ops that start before t0 keep their order and precede the window, those from t1 on keep
    theirs and follow it; other ranks keep their whole order (their times stay free); the makespan is at most
    the limit (the horizon) and the cumulative memory of every rank counts. The current schedule is the hint,
    so every step is feasible and never worse; a step whose neighbourhood holds no lower peak asks again with
    the window's ops unhinted, for another schedule of the same peak (a move on the plateau). The model of a
    step holds only what the neighbourhood can change (`_lns_step`). Each step gets `per_solve` of the budget
    (CP-SAT deterministic time when `deterministic_budget` is set: one worker, so the result is the same on
    any machine); the window sizes and bands are drawn from `seed`; on small problems (at most 1000 ops) some
    steps free the whole schedule. Stops at `target` or at the peak lower bound at the limit (`bounds.peak_lower_bound`: the
    result is then proven optimal), after `patience` steps without progress, or when the budget is spent.

    Returns the best order and the (makespan, peak) of every improvement, in order. A heuristic: it proves
    nothing about the peak (`bounds.peak_lower_bound` does).
    """
    from ortools.sat.python import cp_model

    from rlhfuse.pipeline.bounds import peak_lower_bound
    from rlhfuse.pipeline.compiled import rank_peaks

    c = compiled or compile_problem(problem)
    target = max(target, peak_lower_bound(problem, makespan_limit, c).peak)
    deterministic = deterministic_budget is not None
    total = float(deterministic_budget) if deterministic_budget is not None else float(time_budget)
    rng = np.random.default_rng(seed)
    lat = float(problem.comm_latency)
    t_scale, t_exact = _scale(np.append(c.dur, lat))
    dur = _ints(c.dur, t_scale, t_exact)
    lat_i = int(_ints(np.array([lat]), t_scale, t_exact)[0])
    act = np.abs(c.mem)
    m_scale, m_exact = _scale(act)
    demand = _ints(act, m_scale, m_exact)
    dependencies = _dependency_edges(c, dur, lat_i)
    horizon = math.floor(makespan_limit * t_scale + 1e-6)
    cap_scaled = None if problem.memory_cap is None else math.floor(problem.memory_cap * m_scale + 1e-6)
    best = np.asarray(order, dtype=np.int64).copy()
    best_ms = float(c.evaluate(best)[0])
    if best_ms < 0 or best_ms > makespan_limit + 1e-9:
        raise ValueError(
            f"memory_lns needs a valid order with makespan <= {makespan_limit:g} (got {best_ms:g})"
        )
    best_peak = c.peak(best)
    trace: list[tuple[float, float]] = []
    kept = (best_peak, best_ms, best)
    used, began, stale = 0.0, time.perf_counter(), 0
    widths = [0.2, 0.26, 0.33, 0.4] + ([1.0] if c.n <= 1000 else [])
    while used < total * 0.98 and best_peak > target + 1e-9 and stale < patience:
        share = min(per_solve * total, total - used)
        peaks = rank_peaks(best, c.rank_ptr, c.mem)
        finish = _retime(c, best, dur, lat_i)
        st = finish - dur
        at_peak = np.nonzero(peaks >= best_peak - 1e-9)[0]
        k = int(rng.choice(at_peak))
        ops_k = best[c.rank_ptr[k] : c.rank_ptr[k + 1]]
        t_peak = int(st[ops_k[int(np.argmax(np.cumsum(c.mem[ops_k])))]])
        span = max(1, int(finish.max()))
        fraction = float(rng.choice(widths))
        width = max(1, int(span * fraction)) if fraction < 1.0 else span + 1
        t0 = max(0, t_peak - int(rng.integers(width // 4, max(width // 4 + 1, width - width // 16))))
        if fraction >= 1.0:
            t0 = 0
        band = int(rng.choice([3, 4, 5, 6])) * max(1, c.ranks // 16)
        lo_r, hi_r = max(0, int(at_peak.min()) - band), min(c.ranks, int(at_peak.max()) + band + 1)
        if hi_r - lo_r > max(4, c.ranks * 3 // 4):  # keep the neighbourhood small enough to solve
            lo_r, hi_r = max(0, k - band), min(c.ranks, k + band + 1)
        r = _lns_step(
            c, cp_model, best, st, dur, demand, dependencies, horizon, t0, t0 + width, range(lo_r, hi_r),
            round(best_peak * m_scale) if cap_scaled is None else min(cap_scaled, round(best_peak * m_scale)),
            share, deterministic, seed + len(trace),
        )  # fmt: skip
        spent, new = r
        used = used + min(share, spent) if deterministic else time.perf_counter() - began
        stale += 1
        if new is None:
            continue
        ms, pk = float(c.evaluate(new)[0]), c.peak(new)
        if (
            0 <= ms <= makespan_limit + 1e-9
            and pk <= best_peak + 1e-9
            and (problem.memory_cap is None or pk <= problem.memory_cap + 1e-9)
        ):
            if pk < best_peak - 1e-9:
                trace.append((ms, pk))
                stale = 0
            if pk < kept[0] - 1e-9 or (pk <= kept[0] + 1e-9 and ms < kept[1] - 1e-9):
                kept = (pk, ms, new)
            best, best_ms, best_peak = new, ms, pk
    # The search moves on plateaus of equal peak (any makespan up to the limit); the result is the lowest
    # peak at the shortest makespan seen, so it matches the trace's last point.
    return kept[2], trace


def _dependency_edges(c: Compiled, dur: np.ndarray, lat_i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(from, to, gap) of every precedence `start[to] >= start[from] + gap` that holds in every schedule: the
    dependencies (plus the latency across ranks) and each stream's micro-batch order."""
    ops = np.arange(c.n)
    froms, tos, gaps = [], [], []
    for succ, lat in ((c.succ1, c.lat_succ1), (c.succ2, c.lat_succ2)):
        has = succ >= 0
        froms.append(ops[has])
        tos.append(succ[has])
        gaps.append(dur[has] + np.where(lat[has] > 0, lat_i, 0))
    in_stream = np.ones(c.n, dtype=bool)
    in_stream[c.stream_base + c.stream_len - 1] = False  # the last op of each stream has no next
    froms.append(ops[in_stream])
    tos.append(ops[in_stream] + 1)
    gaps.append(dur[in_stream])
    return np.concatenate(froms), np.concatenate(tos), np.concatenate(gaps).astype(np.int64)


def _lns_step(
    c: Compiled, cp_model, order, st, dur, demand, dependencies, horizon, t0, t1, band, cap, share,
    deterministic, seed,
):  # type: ignore[no-untyped-def]  # fmt: skip
    """One neighbourhood of `memory_lns`: (deterministic time or seconds spent, new order or None).

    The model holds only what the neighbourhood can change. The kept orders are precedences; with the
    dependencies and the horizon they give every op a time window (`compiled.time_windows`), and an op whose
    window is a single time is a constant. A rank that keeps its whole order keeps its peak (the largest
    prefix sum of its list), so it enters as a lower bound on the peak, not as a cumulative; on a band rank
    only the window's part of the prefix sums can change (below).
    """
    from rlhfuse.pipeline.compiled import time_windows

    froms, tos, gaps = [dependencies[0]], [dependencies[1]], [dependencies[2]]
    kept_peak = 0
    windows: list[tuple[list[int], list[int], list[int]]] = []  # (pre, win, suf) of each band rank
    signed = np.where(c.mem >= 0, demand, -demand)
    for k in range(c.ranks):
        ops = order[c.rank_ptr[k] : c.rank_ptr[k + 1]]
        if k not in band:
            froms.append(ops[:-1])
            tos.append(ops[1:])
            gaps.append(dur[ops[:-1]])
            kept_peak = max(kept_peak, int(np.cumsum(signed[ops]).max(initial=0)))
            continue
        pre = [int(op) for op in ops if st[op] < t0]
        win = [int(op) for op in ops if t0 <= st[op] < t1]
        suf = [int(op) for op in ops if st[op] >= t1]
        windows.append((pre, win, suf))
        # pre and suf keep their chains; the last of pre precedes the window and the first of suf follows it
        chain = list(itertools.pairwise(pre)) + list(itertools.pairwise(suf))
        chain += [(a, w) for a in pre[-1:] for w in win + suf[:1]] + [(w, b) for b in suf[:1] for w in win]
        if chain:
            froms.append(np.array([a for a, _ in chain], dtype=np.int64))
            tos.append(np.array([b for _, b in chain], dtype=np.int64))
            gaps.append(dur[froms[-1]])
    e_from, e_to, e_gap = np.concatenate(froms), np.concatenate(tos), np.concatenate(gaps).astype(np.int64)
    est, lst = time_windows(c.n, e_from, e_to, e_gap, dur, int(horizon))
    assert len(est) == c.n and np.all(est <= st) and np.all(st <= lst), "the current schedule fits the model"
    model = cp_model.CpModel()
    free = est < lst
    start = [model.new_int_var(int(est[i]), int(lst[i]), "") if free[i] else int(est[i]) for i in range(c.n)]
    both = free[e_from] & free[e_to]  # a precedence with a constant end is in the other end's window already
    for a, b, gap in zip(e_from[both].tolist(), e_to[both].tolist(), e_gap[both].tolist()):
        model.add(start[b] >= start[a] + gap)
    for pre, win, suf in windows:
        model.add_no_overlap(
            [
                model.new_fixed_size_interval_var(start[op], int(dur[op]), "")
                for op in win + pre[-1:] + suf[:1]
            ]
        )
    hints: list[tuple[Any, int]] = []

    def held(first: int, last: int) -> Any:
        """Activation held from the start of op `first` (time 0 if -1) to the end of op `last` (the horizon
        if -1), as an interval."""
        begin = (0, 0, 0, 0) if first < 0 else (start[first], est[first], lst[first], st[first])
        d = 0 if last < 0 else int(dur[last])
        end = (horizon,) * 4 if last < 0 else (start[last] + d, est[last] + d, lst[last] + d, st[last] + d)
        if begin[1] == begin[2] and end[1] == end[2]:
            return model.new_fixed_size_interval_var(int(begin[1]), int(end[1] - begin[1]), "")
        size = model.new_int_var(int(max(0, end[1] - begin[2])), int(end[2] - begin[1]), "")
        hints.append((size, int(end[3] - begin[3])))
        return model.new_interval_var(begin[0], size, end[0], "")

    # A band rank's peak is the largest prefix sum ending in `pre`, in the window or in `suf`; only the middle
    # one can change. It is the level held when the window begins plus the largest prefix sum of the window's
    # ops: a cumulative of the window's F (held until their B ends, or to the horizon when the B follows the
    # window) and of the window's B whose F came before it (held from time 0), whose capacity is the peak
    # minus (that level less those B's activations).
    f_ops = np.nonzero(c.is_b == 0)[0]
    freed_by = np.full(c.n, -1, dtype=np.int64)  # the F whose activation an op frees
    freed_by[c.free_op[f_ops]] = f_ops
    cumulatives = []
    for pre, win, suf in windows:
        level = int(signed[pre].sum())
        kept_peak = max(kept_peak, int(np.cumsum(signed[pre]).max(initial=0)))
        kept_peak = max(
            kept_peak, level + int(signed[win].sum()) + int(np.cumsum(signed[suf]).max(initial=0))
        )
        in_window = set(win)
        items, demands, base = [], [], level
        for op in win:
            if c.is_b[op] == 0:
                b = int(c.free_op[op])
                items.append(held(op, b if b in in_window else -1))
            elif c.mem[op] < 0 and int(freed_by[op]) not in in_window:
                items.append(held(-1, op))
                base -= int(demand[op])
            else:
                continue
            demands.append(int(demand[op]))
        cumulatives.append((items, demands, base))
    peak = model.new_int_var(kept_peak, max(kept_peak, cap), "peak")
    for items, demands, base in cumulatives:
        if items:
            model.add_cumulative(items, demands, peak - base)
    model.minimize(peak)
    for op in np.nonzero(free)[0].tolist():
        model.add_hint(start[op], int(st[op]))
    for var, value in hints:
        model.add_hint(var, value)
    model.add_hint(peak, int(cap))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = int(seed)
    # Without the LP relaxation a neighbourhood solves several times faster (09: 5 s instead of 15 s for the
    # same optimum); the cumulative and no-overlap propagators do the work here. Without presolve: on the
    # whole-schedule model CP-SAT's presolve (probing, its fixpoint over 14 000 precedences) took most of a
    # step, and this model is reduced already; and with the linear propagator of before 9.10, the cheaper one
    # on precedences (09: the LNS 34 s -> 12 s, 36.76 instead of 37.40 with the same budget).
    solver.parameters.linearization_level = 0
    solver.parameters.cp_model_presolve = False
    solver.parameters.new_linear_propagation = False

    def solve(budget: float) -> tuple[Any, float]:
        if deterministic:
            solver.parameters.max_deterministic_time = float(budget)
            solver.parameters.max_time_in_seconds = (
                SAFETY_SECONDS_PER_UNIT * float(budget) + SAFETY_SECONDS_BASE
            )
        else:
            solver.parameters.max_time_in_seconds = max(0.01, float(budget))
        began = time.perf_counter()
        status = solver.solve(model)
        _wall_capped(solver, status, deterministic)
        used = (
            float(solver.response_proto.deterministic_time) if deterministic else time.perf_counter() - began
        )
        return status, used

    status, spent = solve(share)
    if status == cp_model.OPTIMAL and round(solver.objective_value) >= cap and spent < 0.9 * share:
        # No lower peak here, and the solver returned the hint. Without presolve it always does, and the search
        # stalls on plateaus (03 stopped at 18.60): ask again with the window's ops unhinted, for another
        # schedule of the same peak (a move on the plateau).
        model.clear_hints()
        window_ops = {op for _, win, _ in windows for op in win}
        for op in np.nonzero(free)[0].tolist():
            if op not in window_ops:
                model.add_hint(start[op], int(st[op]))
        status, more = solve(share - spent)
        spent += more
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return spent, None
    starts = np.array(
        [solver.value(s) if free[i] else int(est[i]) for i, s in enumerate(start)], dtype=np.int64
    )
    return spent, _order_from_starts(c, starts)
