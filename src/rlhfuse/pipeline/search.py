"""Search for a fused schedule: the paper's greedy + two-phase annealing, with better starts and early stop.

1. Constructive starts (`constructive_starts`): the paper's greedy list schedule (earliest start, backward
   first on ties) and a sweep of list schedules that encode the structure of good fused schedules: each model's
   micro-batches in flight per stage capped at its 1F1B count plus a few (bounded memory), the bigger pipeline
   optionally *protected* at its 1F1B timing while the smaller one fills its warm-up and cool-down bubbles,
   priorities and a small look-ahead slack.
2. Latency phase: simulated annealing on the per-rank orders (adjacent swaps and short shifts), with a
   plateau-breaking secondary objective, restarted from the best starts until the lower bound is reached or
   the latency share of the time budget is spent.
3. Memory phase: annealing of the peak activation with moves restricted to makespan <= the best found.

The memory cap is a hard constraint everywhere. Seeds run in parallel over local processes (no MPI); the
best result wins (makespan, then peak, then seed). With an iteration budget (`SearchConfig.max_iterations`)
the clock decides nothing, so a run is deterministic for a seed and a worker count on any machine under any
load; a wall-clock budget stops wherever the machine's speed lets it get.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rlhfuse.pipeline.baselines import one_f_one_b, serial_makespan, serial_peak
from rlhfuse.pipeline.bounds import Bounds, lower_bounds, peak_lower_bound
from rlhfuse.pipeline.compiled import (
    Compiled,
    anneal_latency,
    anneal_memory,
    compile_problem,
    list_schedule,
)
from rlhfuse.pipeline.ir import Action, Kind, Schedule, schedule_to_result
from rlhfuse.pipeline.problem import Problem
from rlhfuse.pipeline.simulate import DurationFn, dependencies, simulate

if TYPE_CHECKING:
    from rlhfuse.pipeline.exact import ExactResult


@dataclass(frozen=True)
class SearchConfig:
    """How hard to search.

    Attributes:
        time_budget: wall-clock seconds for the whole search (starts, both phases, all workers in parallel).
        seed: base seed; worker w uses seed + w.
        workers: local processes running independent seeds (1: in this process).
        memory_share: fraction of the budget kept for the memory phase once the latency phase has not
            reached the lower bound (when it has, the memory phase may use what is left).
        memory_patience: the memory phase stops after this many annealing rounds without improvement.
        memory_target: the memory phase stops once the peak is at most this multiple of the serial 1F1B peak
            (1.0: as low as running the models one after the other; 0: use the whole budget).
        max_iterations: a deterministic budget: annealing iterations per phase and worker. When set, the
            wall clock is not consulted at all (`time_budget` is ignored, start sweeps stop after
            `max_starts` list schedules, workers do not signal each other), so the result depends only on
            the problem and the config, never on the machine's speed or load.
        memory_effort: with `max_iterations`, the memory phase may run `memory_effort` x `max_iterations`
            iterations (it stops earlier at `memory_target` or after `memory_patience` rounds without
            progress): at the optimal makespan most memory moves are rejected, and the last steps down to
            serial 1F1B's peak come late (setting 01: 17.6 after 1M iterations, 15.75 after 2.8M).
        round_iterations: annealing iterations per round when `max_iterations` is set (otherwise rounds are
            sized by time).
        max_starts: list schedules per start sweep when `max_iterations` is set (the time-bounded search
            sweeps until its share of the budget is spent).
        exact: after the latency phase, if the makespan is above the bound, let the exact model
            (`rlhfuse.pipeline.exact`, CP-SAT) decide "makespan <= bound?" (raising the proven bound on each
            "no") and, if left open, minimise the makespan from the annealing result. Worker 0 only.
        exact_share: share of `time_budget` the exact step may use (wall-clock runs).
        exact_effort: CP-SAT deterministic time for the exact step when `max_iterations` is set (one solver
            thread, so the result is still the same on any machine).
        exact_max_ops: problems with more ops skip the exact step (the analytic bound stands).
        exact_memory_ladder: before the memory annealing (worker 0, at most `exact_memory_ops` ops), exact
            decisions at the best makespan under caps of 1.01, 1.1, 1.2, 1.35 x serial 1F1B's peak in the
            low-memory branching order (`exact.memory_ladder`: a quick try at the tightest cap, then the caps
            loosest first while they are met; a quarter of the exact budget). Skipped when the schedule is the
            exact step's own (its low-memory decision already chose the memory; on 03, 09 and 10 no cap of the
            ladder was met from there).
        exact_memory: experimental, off by default: exact decisions for memory at the best makespan, i.e. the
            restricted decisions of `exact.low_memory_search` before the memory annealing and, for problems
            of at most `exact_memory_ops` ops, decisions under a memory cap (`exact.capped_memory_search`,
            3 x `exact_effort`) after it. CP-SAT finds such schedules erratically (e.g. 10 at 318 with peak
            27.96 in one run, nothing in the next with another cap), so on the Table-3 settings they mostly
            cost time.
        exact_memory_ops: the memory decisions (`exact_memory_ladder`, `exact_memory`) run on problems of at
            most this many ops (the 64-rank dry run, 12 288 ops, would spend its budget building models).
        split_backward: search split-backward schedules (F, I, W per stage; `rlhfuse.pipeline.simulate`)
            instead of F/B ones. Beyond the paper; the runtime executes both (`pipeline.split_backward`).
        memory_lns: after the memory annealing (worker 0, at most `exact_memory_ops` ops), large-neighbourhood
            search for memory at the best makespan (`exact.memory_lns`: CP-SAT re-optimises the peak on a time
            window of a band of ranks around the peak, the rest of the schedule kept), `lns_effort` units of
            CP-SAT deterministic time (`lns_share` of the time budget in wall-clock runs). On the exact step's
            own schedule it runs instead of the memory annealing (which never moved from there).
        makespan_slack: trade makespan for memory: after the search, the memory steps may lengthen the
            schedule up to (1 + makespan_slack) x the proven lower bound (never below the best makespan
            found). The result is then the lowest-peak schedule within that limit, and `Solution.pareto`
            lists the (makespan, peak) points found on the way, from the best makespan up. 0: no trade.
    """

    time_budget: float = 60.0
    seed: int = 0
    workers: int = 1
    memory_share: float = 0.25
    memory_patience: int = 8
    memory_target: float = 1.0
    max_iterations: int | None = None
    memory_effort: float = 4.0
    round_iterations: int = 200_000
    max_starts: int = 4000
    exact: bool = True
    exact_share: float = 0.4
    exact_effort: float = 16.0
    exact_max_ops: int = 20_000
    exact_memory_ladder: bool = True
    exact_memory: bool = False
    exact_memory_ops: int = 5000
    split_backward: bool = False
    memory_lns: bool = True
    lns_effort: float = 0.75
    lns_share: float = 0.25
    makespan_slack: float = 0.0

    @property
    def deterministic(self) -> bool:
        return self.max_iterations is not None


@dataclass
class Solution:
    """A searched schedule with its figures (all makespans in the problem's time unit)."""

    problem: Problem
    schedule: Schedule
    makespan: float
    peak: float
    bounds: Bounds
    serial_makespan: float
    serial_peak: float
    greedy_makespan: float
    greedy_peak: float
    seconds: float
    stats: dict[str, Any] = field(default_factory=dict)
    proven_bound: float = 0.0
    pareto: list[tuple[float, float]] = field(default_factory=list)
    makespan_limit: float | None = None
    peak_bound: float = 0.0

    @property
    def lower_bound(self) -> float:
        """The best proven lower bound: the analytic one (`bounds.makespan`) or the exact model's."""
        return max(self.bounds.makespan, self.proven_bound)

    @property
    def gap(self) -> float:
        """(makespan - lower bound) / lower bound: 0 when the schedule is proven optimal."""
        return max(0.0, self.makespan - self.lower_bound) / self.lower_bound if self.lower_bound else 0.0

    @property
    def optimal(self) -> bool:
        return self.makespan <= self.lower_bound + 1e-9

    @property
    def schedule_size(self) -> int:
        return sum(len(rank) for rank in self.schedule.ranks)

    @property
    def speedup(self) -> float:
        return self.serial_makespan / self.makespan

    @property
    def memory_ratio(self) -> float:
        """Peak activation relative to serial 1F1B of the models (per-rank max of the two, max over ranks)."""
        return self.peak / self.serial_peak

    def to_result(self) -> dict[str, Any]:
        """docs/schedule-format.md result keys, plus a few extra figures (ignored by readers of the FORMAT)."""
        return schedule_to_result(
            self.problem,
            self.schedule,
            makespan=self.makespan,
            peak=self.peak,
            lower_bound=self.lower_bound,
            serial=self.serial_makespan,
            seconds=self.seconds,
            extra={
                "greedy_makespan": _plain(self.greedy_makespan),
                "greedy_peak_activation": round(self.greedy_peak, 6),
                "serial_1f1b_peak_activation": round(self.serial_peak, 6),
                "speedup_over_serial_1f1b": round(self.speedup, 4),
                "memory_ratio_to_serial_1f1b": round(self.memory_ratio, 4),
                "lower_bound_paper": _plain(self.bounds.paper),
                "lower_bound_analytic": _plain(self.bounds.makespan),
                "gap": round(self.gap, 6),
                "optimal": self.optimal,
                "exact_status": self.stats.get("exact_status", "not run"),
                "peak_lower_bound": round(self.peak_bound, 6),
                "makespan_limit": None if self.makespan_limit is None else _plain(self.makespan_limit),
                "pareto": [
                    {"makespan": _plain(ms), "peak_activation": round(pk, 6)} for ms, pk in self.pareto
                ],
            },
        )


def _plain(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


# ----------------------------------------------------------------------------------------------------------
# List schedules
# ----------------------------------------------------------------------------------------------------------


def _cap(problem: Problem) -> float:
    return math.inf if problem.memory_cap is None else float(problem.memory_cap)


def run_list_schedule(
    c: Compiled,
    *,
    limit: np.ndarray | None = None,
    prio: np.ndarray | None = None,
    slack: float = 0.0,
    noise: float = 0.0,
    seed: int = 0,
    planned: np.ndarray | None = None,
    cap: float | None = None,
) -> np.ndarray | None:
    """One list schedule (see `compiled.list_schedule`); None if the memory cap blocks every rank."""
    n_streams = len(c.stream_base)
    order = list_schedule(
        c.rank_ptr, c.dur, c.mem, c.pred1, c.pred2, c.lat_succ1, c.lat_succ2, c.succ1, c.succ2,
        c.stream_base, c.stream_len, c.stream_rank, c.stream_is_b, c.rank_streams_ptr, c.rank_streams,
        c.stream_len.copy() if limit is None else limit,
        np.zeros(c.n) if prio is None else (prio[c.stream] if len(prio) == n_streams else prio),
        float(slack), _cap(c.problem) if cap is None else min(cap, _cap(c.problem)), float(noise), int(seed),
        np.full(c.n, -1.0) if planned is None else planned, c.stream_limit_group, c.stream_frees,
    )  # fmt: skip
    return order if len(order) else None


def greedy_order(c: Compiled) -> np.ndarray:
    """The paper's greedy: earliest start first, backward first on ties (under the memory cap)."""
    order = run_list_schedule(c)
    if order is None:
        # Unbounded forwards can fill the cap before any backward is possible: fall back to 1F1B limits.
        order = run_list_schedule(c, limit=_limits(c, [0] * len(c.problem.models)))
    if order is None:
        # Under a tight cap: every micro-batch alone (valid whenever the problem's cap passed validation).
        order = serial_order(c)
    return order


def serial_order(c: Compiled) -> np.ndarray:
    """Each micro-batch alone, model after model: all its F (stage 0 up), then all its B (top stage down).

    Valid under any cap that `problem.min_feasible_cap` allows (a rank holds one micro-batch of one replica at
    a time): the constructive start of last resort for memory-capped problems.
    """
    lists: list[list[int]] = [[] for _ in range(c.ranks)]
    idx = c.index()
    for m in c.problem.models:
        for r in range(m.replicas):
            for i in range(m.microbatches):
                seq = [Action(m.name, r, s, Kind.F, i) for s in range(m.stages)]
                back = (Kind.I, Kind.W) if c.split_backward else (Kind.B,)
                seq += [Action(m.name, r, s, k, i) for s in reversed(range(m.stages)) for k in back]
                for a in seq:
                    lists[m.placement[r][a.stage]].append(idx[a])
    return np.array([op for ops in lists for op in ops], dtype=np.int64)


def greedy(
    problem: Problem, durations: DurationFn | None = None, *, split_backward: bool = False
) -> Schedule:
    """The paper's greedy list schedule as a Schedule (F/I/W with `split_backward`)."""
    c = compile_problem(problem, durations, split_backward)
    return c.to_schedule(greedy_order(c))


def _limits(c: Compiled, extra: list[int]) -> np.ndarray:
    """In-flight cap per F stream: the 1F1B count (stages - stage) plus `extra[model]`."""
    bonus = np.array(extra, dtype=np.int64)[c.model_of_stream]
    return np.minimum(c.stream_len, c.stages_of_stream - c.stage_of_stream + bonus)


def _planned_1f1b(c: Compiled, model_index: int, latest: float | None = None) -> np.ndarray:
    """One model's 1F1B run alone, per op: its start time (-1 for the other models' ops).

    With `latest`, the *latest* start that still ends that 1F1B by `latest` (as late as possible): the other
    model may then use the protected model's slack, not only its idle time.
    """
    problem = c.problem
    m = problem.models[model_index]
    alone = Problem(f"{problem.name}/{m.name}", problem.ranks, (m,), None, problem.comm_latency)
    schedule = one_f_one_b(alone)
    sim = simulate(alone, schedule)
    idx = c.index()
    planned = np.full(c.n, -1.0)
    if latest is None:
        for action, start in sim.start.items():
            planned[idx[action]] = start
        return planned
    next_on_rank = {a: rank[i + 1] for rank in schedule.ranks for i, a in enumerate(rank[:-1])}
    succs: dict = {}
    for a in sim.start:
        for d in dependencies(alone, a):
            succs.setdefault(d, []).append(a)
    late: dict = {}
    for a in sorted(sim.start, key=lambda x: -sim.start[x]):
        finish = latest
        for b in [*succs.get(a, []), next_on_rank.get(a)]:
            if b is not None:
                finish = min(finish, late[b])
        late[a] = finish - (sim.end[a] - sim.start[a])
        planned[idx[a]] = late[a]
    return planned


def constructive_starts(
    c: Compiled,
    deadline: float,
    seed: int = 0,
    keep: int = 8,
    cap: float | None = None,
    planned_cache: dict[tuple[int, float | None], np.ndarray] | None = None,
    max_configs: int | None = None,
) -> list[tuple[float, float, np.ndarray]]:
    """Greedy plus a sweep of structured list schedules; the `keep` best distinct (makespan, peak, order).

    `cap` tightens the problem's memory cap for this sweep (the memory phase asks for schedules under a cap).
    The sweep stops at `deadline` (perf_counter seconds) or after `max_configs` list schedules.
    """
    problem = c.problem
    rng = np.random.default_rng(seed)
    n_models = len(problem.models)
    found: dict[bytes, tuple[float, float, np.ndarray]] = {}

    def consider(order: np.ndarray | None) -> None:
        if order is None:
            return
        ms, _ = c.evaluate(order)
        if ms >= 0:
            found.setdefault(order.tobytes(), (ms, c.peak(order), order))

    if cap is None:
        consider(greedy_order(c))
    paths = lower_bounds(problem, c).critical_path
    by_path = sorted(range(n_models), key=lambda i: -paths[problem.models[i].name])
    target = lower_bounds(problem, c).makespan
    protect_options: list[tuple[int, float | None] | None] = [None, (by_path[0], None), (by_path[0], target)]
    protect_options += [(i, target) for i in by_path[1:]]
    if c.split_backward:  # the protected timing is the plain 1F1B one
        protect_options = [None]
    planned_cache = {} if planned_cache is None else planned_cache
    max_extra = [min(m.stages, m.microbatches) for m in problem.models]
    configs = []
    for protect in protect_options:
        for slack in (0.0, 1.0, 2.0, 4.0):
            for favour in range(-3, n_models):
                if n_models == 2:
                    grid = [
                        [e0, e1]
                        for e0 in range(0, min(4, max_extra[0]) + 1)
                        for e1 in range(0, max_extra[1] + 1)
                    ]
                else:
                    grid = [[int(rng.integers(0, e + 1)) for e in max_extra] for _ in range(12)]
                for extra in grid:
                    configs.append((protect, slack, favour, extra))
    # Seeded random order, the bigger pipeline protected as late as possible first: those reach the bound
    # most often (the sweep may hit its deadline on large problems).
    rng.shuffle(configs)  # type: ignore[arg-type]
    configs.sort(key=lambda cfg: 0 if cfg[0] is not None and cfg[0][1] is not None else 1)
    if max_configs is not None:
        configs = configs[:max_configs]
    for protect, slack, favour, extra in configs:
        if time.perf_counter() > deadline and (len(found) >= 2 or cap is not None):
            break
        planned = None
        if protect is not None:
            if protect not in planned_cache:
                planned_cache[protect] = _planned_1f1b(c, *protect)
            planned = planned_cache[protect]
            extra = list(extra)
            extra[protect[0]] = 0
        if favour == -3:  # critical path first, per stream: the longest dependency tail
            prio = 10.0 * c.tail / max(float(c.tail.max()), 1e-9)
        elif favour == -2:  # critical path first, per op: the longest tail (streams run in order)
            prio = 10.0 * c.seq_tail / max(float(c.seq_tail.max()), 1e-9)
        elif favour == -1:  # the paper's rule alone
            prio = np.zeros(len(c.stream_base))
        else:
            prio = (c.model_of_stream == favour).astype(float)
        consider(
            run_list_schedule(c, limit=_limits(c, extra), prio=prio, slack=slack, planned=planned, cap=cap)
        )
    ranked = sorted(found.values(), key=lambda x: (x[0], x[1]))
    return ranked[:keep]


# ----------------------------------------------------------------------------------------------------------
# Annealing
# ----------------------------------------------------------------------------------------------------------


def _anneal_latency(
    c: Compiled,
    order: np.ndarray,
    iters: int,
    rng: np.random.Generator,
    target: float,
    mem_weight: float,
    mem_ref: float,
    tried: bool = False,
) -> tuple[np.ndarray, float, float, int]:
    # Lateness past the deadlines (mode 1) with a heavy weight and a cool start is what closes the last units
    # on the hardest settings (16/16); `tried` runs exactly that, other rounds draw the parameters, and the
    # mean-finish objective (mode 0) keeps some diversity.
    mode = 1 if tried or rng.random() < 0.75 else 0
    if tried:
        weight, temp0 = 100.0, 0.5
    elif mode == 1:
        weight, temp0 = float(rng.choice([30.0, 100.0, 100.0])), float(rng.choice([0.5, 0.5, 1.0]))
    else:
        weight, temp0 = float(rng.choice([0.3, 1.0, 3.0])), float(rng.choice([0.5, 1.0, 2.0]))
    max_shift = 8 if tried else int(rng.choice([1, 4, 8, 8]))
    best, ms, peak, done = anneal_latency(
        order, c.rank_ptr, c.dur, c.pred1, c.pred2, c.succ1, c.succ2, c.lat_succ1, c.lat_succ2, c.stream,
        c.mem, c.seq_tail, _cap(c.problem), int(iters), temp0, 0.01, weight, mode, max_shift, float(target),
        int(rng.integers(0, 2**31 - 1)), float(mem_weight), float(mem_ref),
    )  # fmt: skip
    return best, float(ms), float(peak), int(done)


def _anneal_memory(
    c: Compiled, order: np.ndarray, limit: float, iters: int, rng: np.random.Generator, target: float
):
    temp0 = float(rng.choice([0.5, 1.0, 2.0]))
    best, done = anneal_memory(
        order, c.rank_ptr, c.dur, c.pred1, c.pred2, c.succ1, c.succ2, c.lat_succ1, c.lat_succ2, c.stream,
        c.mem, float(limit), int(iters), temp0, 0.01, int(rng.choice([4, 8, 16])), float(target),
        int(rng.integers(0, 2**31 - 1)),
    )  # fmt: skip
    return best, int(done)


def _round_iters(by_time: float, left: int, config: SearchConfig) -> int:
    # With an iteration cap, rounds have a fixed size so that the run does not depend on machine speed.
    if config.max_iterations is not None:
        return int(max(1, min(config.round_iterations, left)))
    return int(max(1000, by_time))


def _worker(
    problem: Problem,
    durations: DurationFn | None,
    config: SearchConfig,
    worker: int,
    t0: float,
    stop: Any,
    shared: Any = None,
) -> dict[str, Any]:
    """`_search` with the CP-SAT wall-clock caps that fired counted into its stats (`wall_capped`)."""
    from rlhfuse.pipeline.exact import counting_wall_caps

    with counting_wall_caps() as caps:
        result = _search(problem, durations, config, worker, t0, stop, shared)
    result["stats"]["wall_capped"] = caps[0]
    return result


def _search(
    problem: Problem,
    durations: DurationFn | None,
    config: SearchConfig,
    worker: int,
    t0: float,
    stop: Any,
    shared: Any = None,
) -> dict[str, Any]:
    """One seed's full search; returns a picklable summary.

    `stop`/`shared` (time-bounded runs with several workers): the first worker to reach the lower bound puts
    its schedule in `shared` and sets `stop`; the others then run their memory phase from that schedule (with
    their own seeds), so that every worker spends the rest of the budget on memory at the optimal makespan.
    """
    c = compile_problem(problem, durations, config.split_backward)
    rng = np.random.default_rng(config.seed + worker)
    budget = config.time_budget
    # Leave a little for what follows the search (collecting workers, the oracle check, baselines).
    end = t0 + budget - min(2.0, 0.04 * budget)
    fixed = config.deterministic

    def by(share: float, since: float) -> float:
        # A deadline `share` of the budget after `since`; none with an iteration budget (the clock never
        # decides anything then, so the result does not depend on the machine's speed or load).
        return math.inf if fixed else min(end, since + share * budget)

    if fixed:
        end, stop, shared = math.inf, None, None
    # With the exact step to close the gap, a quarter of the start sweep is enough.
    exact_on = config.exact and worker == 0 and c.n <= config.exact_max_ops
    sweep = {"max_configs": config.max_starts // 4 if exact_on else config.max_starts} if fixed else {}
    bounds = lower_bounds(problem, c)
    target = bounds.makespan
    serial = serial_peak(problem)
    planned_cache: dict[tuple[int, float | None], np.ndarray] = {}
    starts = constructive_starts(
        c, by(0.15, t0), seed=config.seed + worker, planned_cache=planned_cache, **sweep
    )
    best_ms, best_peak, best = starts[0]
    stats: dict[str, Any] = {
        "starts": len(starts),
        "start_makespan": best_ms,
        "latency_iters": 0,
        "memory_iters": 0,
    }
    cap_iters = config.max_iterations if config.max_iterations is not None else 2**62
    # Iterations per second, re-measured after every round; first guess from the evaluator's speed (about
    # half the moves are rejected before any evaluation).
    began = time.perf_counter()
    for _ in range(10):
        c.evaluate(best)
    rate = 2.0 * 10 / max(time.perf_counter() - began, 1e-6)

    def better(ms: float, peak: float) -> bool:
        return ms >= 0 and (ms < best_ms - 1e-9 or (ms <= best_ms + 1e-9 and peak < best_peak - 1e-9))

    def adopt(found: ExactResult | None, stat: str) -> None:
        """Take a memory step's schedule when it beats the best (makespan first, then peak)."""
        nonlocal best_ms, best_peak, best
        if found is None or found.order is None:
            return
        ms, peak = float(c.evaluate(found.order)[0]), c.peak(found.order)
        if better(ms, peak):
            best_ms, best_peak, best = ms, peak, found.order
            stats[stat] = round(best_peak, 4)

    # Phase 1 (latency). Some rounds also charge memory above the serial 1F1B peak: the latency moves alone
    # drift to high-memory schedules, which the memory phase can rarely repair at the optimal makespan.
    # With the exact step to follow, the annealing only needs to get close (the exact model closes the gap).
    latency_end = by(0.2 if exact_on else 1.0 - config.memory_share, t0)
    latency_cap = cap_iters // 4 if exact_on else cap_iters
    rounds = 0
    while best_ms > target + 1e-9 and stats["latency_iters"] < latency_cap:
        now = time.perf_counter()
        if now >= latency_end or (stop is not None and stop.is_set()):
            break
        iters = _round_iters(
            rate * min(latency_end - now, max(0.5, 0.3 * budget)),
            latency_cap - stats["latency_iters"],
            config,
        )
        start = best if rng.random() < 0.7 else starts[int(rng.integers(0, len(starts)))][2]
        tried = rounds < 1
        rounds += 1
        mem_weight = 0.0 if tried else float(rng.choice([0.0, 0.0, 0.5, 2.0]))
        began = time.perf_counter()
        order, ms, peak, done = _anneal_latency(c, start, iters, rng, target, mem_weight, serial, tried)
        rate = max(1000.0, done / max(time.perf_counter() - began, 1e-3))
        stats["latency_iters"] += done
        if better(ms, peak):
            best_ms, best_peak, best = ms, peak, order
    decided = False  # the best schedule is the exact step's
    if exact_on and best_ms > target + 1e-9:
        from rlhfuse.pipeline.exact import exact_search

        seconds = max(0.5, min(config.exact_share * budget, end - time.perf_counter()))
        r = exact_search(
            problem, compiled=c, upper_order=best, analytic_bound=target, seed=config.seed + worker,
            time_budget=seconds, deterministic_budget=config.exact_effort if fixed else None,
            max_ops=config.exact_max_ops,
        )  # fmt: skip
        stats.update(exact_status=r.status, proven_bound=r.lower_bound, exact_seconds=round(r.seconds, 3))
        if r.order is not None and better(float(r.value or -1), c.peak(r.order)):
            best_ms, best_peak, best = float(c.evaluate(r.order)[0]), c.peak(r.order), r.order
            decided = True
            stats["exact_schedule"] = True
        target = max(target, r.lower_bound)
    elif best_ms <= target + 1e-9:
        stats.update(exact_status="OPTIMAL", proven_bound=target)
    if stop is not None and best_ms <= target + 1e-9:
        if shared is not None and "order" not in shared:
            shared.update(order=best, makespan=best_ms, peak=best_peak)
        stop.set()
    elif stop is not None and shared is not None and stop.is_set():
        other = dict(shared)
        if "order" in other and better(float(other["makespan"]), float(other["peak"])):
            best_ms, best_peak, best = float(other["makespan"]), float(other["peak"]), other["order"]
            stats["adopted"] = True
    # Phase 2 (memory) at makespan <= best: alternate the paper's memory annealing (moves restricted to the
    # makespan, plus moves aimed at the peak) with latency annealing that charges memory heavily and may
    # leave the makespan for a while, keeping only results at the best makespan.
    stale, rounds = 0, 0
    memory_cap_iters = int(config.memory_effort * cap_iters) if fixed else cap_iters
    rates = [rate, rate]  # the two kinds of rounds run at different speeds
    # Low-memory starts (list schedules under the serial 1F1B peak): slower, but annealing them with memory
    # charged keeps their memory while it brings the makespan down. Decided here, swept on first use: the
    # memory phase often stops before its third round, the first to ask for one (09: 6 s of list schedules).
    wants_low_starts = best_peak > serial + 1e-9 and time.perf_counter() < end - 0.2 * budget
    low_starts: list[tuple[float, float, np.ndarray]] | None = None

    def low_memory_starts() -> list[tuple[float, float, np.ndarray]]:
        nonlocal low_starts
        if low_starts is None:
            low_starts = []
            if wants_low_starts:
                low_starts = constructive_starts(
                    c, by(0.05, time.perf_counter()), seed=config.seed + worker,
                    cap=serial * (1 + 1e-9), planned_cache=planned_cache, **sweep,
                )  # fmt: skip
        return low_starts

    mem_goal = max(bounds.memory, config.memory_target * serial)
    if (
        exact_on
        and config.exact_memory_ladder
        and not decided
        and c.n <= config.exact_memory_ops
        and best_peak > mem_goal + 1e-9
    ):
        from rlhfuse.pipeline.exact import memory_ladder

        seconds = max(0.5, min(config.exact_share * budget / 4, end - time.perf_counter()))
        laddered = memory_ladder(
            problem, compiled=c, makespan=best_ms, peak=best_peak, target=mem_goal, seed=config.seed + worker,
            time_budget=seconds, deterministic_budget=config.exact_effort / 4 if fixed else None,
        )  # fmt: skip
        adopt(laddered, "exact_memory_ladder")
    if exact_on and config.exact_memory and best_peak > mem_goal + 1e-9:
        # The exact model's schedules are at the optimal makespan but hold much memory, and the annealing
        # rarely repairs that: ask the restricted model (in-flight limits) for a low-memory one first.
        from rlhfuse.pipeline.exact import low_memory_search

        seconds = max(0.5, min(config.exact_share * budget / 2, end - time.perf_counter()))
        low = low_memory_search(
            problem, compiled=c, makespan=best_ms, peak=best_peak, serial_peak=serial, seed=config.seed + worker,
            time_budget=seconds, deterministic_budget=config.exact_effort if fixed else None,
        )  # fmt: skip
        adopt(low, "exact_low_memory")
    lns_on = exact_on and config.memory_lns and c.n <= config.exact_memory_ops

    def lns() -> None:
        nonlocal best_ms, best_peak, best
        order, trace = _lns(c, config, best, best_ms, mem_goal, end, worker)
        stats["lns_trace"] = [(ms, round(pk, 4)) for ms, pk in trace]
        ms, peak = float(c.evaluate(order)[0]), c.peak(order)
        if better(ms, peak):
            best_ms, best_peak, best = ms, peak, order

    # The exact step's own low-memory schedule (09, 10) is one the annealing rarely improves: the LNS goes
    # first there (10: 31.56 -> 29.92, against 31.16 after the annealing). Otherwise it polishes the
    # annealing's result (03: 19.50 -> 18.55, against 20.50 with the LNS first).
    lns_first = decided
    patience = config.memory_patience
    if lns_on and lns_first and best_peak > mem_goal + 1e-9:
        lns()
        # From there the annealing never moved (09 and 10, in every run with two rounds, with and without the
        # LNS before them): it is skipped (09: 4.5 s).
        patience = 0
    while stale < patience and stats["memory_iters"] < memory_cap_iters:
        now = time.perf_counter()
        if now >= end or best_peak <= mem_goal + 1e-9:
            break
        kind = rounds % 2
        iters = _round_iters(
            rates[kind] * min(end - now, max(0.5, 0.1 * budget)),
            memory_cap_iters - stats["memory_iters"],
            config,
        )
        began = time.perf_counter()
        if kind == 0:
            ref = serial if best_peak > serial + 1e-9 else bounds.memory
            start = best
            lows = low_memory_starts() if rounds % 4 == 2 else []
            if lows:
                start = lows[int(rng.integers(0, len(lows)))][2]
            order, ms, peak, done = _anneal_latency(
                c, start, iters, rng, best_ms, float(rng.choice([2.0, 5.0, 20.0])), ref
            )
        else:
            # Other starts already at the best makespan are other basins for the memory moves.
            same = [o for ms_, _, o in starts if ms_ <= best_ms + 1e-9]
            start = best if not same or rng.random() < 0.6 else same[int(rng.integers(0, len(same)))]
            order, done = _anneal_memory(c, start, best_ms, iters, rng, mem_goal)
            ms, peak = c.evaluate(order)[0], c.peak(order)
        rounds += 1
        rates[kind] = max(1000.0, done / max(time.perf_counter() - began, 1e-3))
        stats["memory_iters"] += done
        if better(ms, peak):
            best_ms, best_peak, best, stale = ms, peak, order, 0
            stats.setdefault("memory_trace", []).append(
                (stats["memory_iters"], kind, best_ms, round(best_peak, 4))
            )
        else:
            stale += 1
    if lns_on and not lns_first and best_peak > mem_goal + 1e-9:
        lns()
    if exact_on and config.exact_memory and c.n <= config.exact_memory_ops and best_peak > mem_goal + 1e-9:
        from rlhfuse.pipeline.exact import capped_memory_search

        seconds = max(
            0.5, min(config.exact_share * budget, end + min(2.0, 0.04 * budget) - time.perf_counter())
        )
        capped = capped_memory_search(
            problem, compiled=c, makespan=best_ms, peak=best_peak, target=mem_goal, seed=config.seed + worker,
            time_budget=seconds, deterministic_budget=3 * config.exact_effort if fixed else None,
        )  # fmt: skip
        adopt(capped, "exact_capped_memory")
    points = [(best_ms, best_peak)]
    limit = None
    if config.makespan_slack > 0:
        # Trade makespan for memory within (1 + slack) x the proven bound: the LNS and memory annealing at
        # that limit, from the best schedule; every schedule they return is a (makespan, peak) point.
        limit = max(best_ms, target * (1.0 + config.makespan_slack))
        # Down to the proven peak bound at the limit (not serial 1F1B's peak: the user asked for memory).
        slack_goal = max(bounds.memory, peak_lower_bound(problem, limit, c).peak)
        if best_peak > slack_goal + 1e-9:
            order = best
            found: list[tuple[float, float, np.ndarray]] = []  # (peak, makespan, order) within the limit
            if lns_on:
                order, trace = _lns(c, config, best, limit, slack_goal, end, worker, share=2.0)
                points += trace
                found.append((c.peak(order), float(c.evaluate(order)[0]), order))
            for _ in range(2):
                if c.peak(order) <= slack_goal + 1e-9:
                    break
                iters = _round_iters(rates[1] * max(0.5, 0.05 * budget), config.round_iterations, config)
                order, _done = _anneal_memory(c, order, limit, iters, rng, slack_goal)
                points.append((float(c.evaluate(order)[0]), c.peak(order)))
                found.append((c.peak(order), float(c.evaluate(order)[0]), order))
            # The lowest peak, then the shortest makespan: a point of the front, not just the last schedule.
            within = [f for f in found if 0 <= f[1] <= limit + 1e-9]
            if within:
                peak, ms, order = min(within, key=lambda f: (round(f[0], 9), f[1]))
                if peak < best_peak - 1e-9:
                    best_ms, best_peak, best = ms, peak, order
    return {
        "worker": worker, "makespan": best_ms, "peak": best_peak, "order": best, "stats": stats,
        "pareto": pareto_front(points), "limit": limit,
    }  # fmt: skip


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (makespan, peak) points no other point beats on both, by increasing makespan."""
    front: list[tuple[float, float]] = []
    for ms, pk in sorted(set((float(m), round(float(p), 9)) for m, p in points)):
        if ms >= 0 and (not front or pk < front[-1][1] - 1e-9):
            front.append((ms, pk))
    return front


def _lns(
    c: Compiled,
    config: SearchConfig,
    order: np.ndarray,
    limit: float,
    goal: float,
    end: float,
    worker: int,
    share: float = 1.0,
) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """`exact.memory_lns` at makespan <= `limit` with `share` x the configured LNS effort."""
    from rlhfuse.pipeline.exact import memory_lns

    seconds = max(0.5, min(share * config.lns_share * config.time_budget, end - time.perf_counter()))
    return memory_lns(
        c.problem, compiled=c, order=order, makespan_limit=limit, target=goal, seed=config.seed + worker,
        time_budget=seconds, deterministic_budget=share * config.lns_effort if config.deterministic else None,
    )  # fmt: skip


def solve(
    problem: Problem, config: SearchConfig | None = None, durations: DurationFn | None = None
) -> Solution:
    """Search a fused schedule for `problem` within `config.time_budget` seconds."""
    config = config or SearchConfig()
    t0 = time.perf_counter()
    c = compile_problem(problem, durations, config.split_backward)
    g_order = greedy_order(c)
    g_ms, _ = c.evaluate(g_order)
    workers = max(1, config.workers)
    if workers == 1:
        results = [_worker(problem, durations, config, 0, t0, None)]
    else:
        ctx = mp.get_context("fork" if os.name == "posix" else "spawn")
        with ctx.Manager() as manager:
            stop = manager.Event()
            shared = manager.dict()
            with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
                futures = [
                    pool.submit(_worker, problem, durations, config, w, t0, stop, shared)
                    for w in range(workers)
                ]
                results = [f.result() for f in futures]
    if config.makespan_slack > 0:  # the user trades makespan for memory: the lowest peak within the limit
        win = min(results, key=lambda r: (r["peak"], r["makespan"], r["worker"]))
    else:
        win = min(results, key=lambda r: (r["makespan"], r["peak"], r["worker"]))
    proven = max(float(r["stats"].get("proven_bound", 0.0)) for r in results)
    schedule = c.to_schedule(win["order"])
    checked = simulate(problem, schedule, durations)  # the readable oracle has the last word
    seconds = time.perf_counter() - t0
    stats = dict(win["stats"])
    stats["workers"] = workers
    return Solution(
        problem=problem,
        schedule=schedule,
        makespan=checked.makespan,
        peak=checked.peak,
        bounds=lower_bounds(problem, c),
        serial_makespan=serial_makespan(problem),
        serial_peak=serial_peak(problem),
        greedy_makespan=float(g_ms),
        greedy_peak=c.peak(g_order),
        seconds=seconds,
        stats=stats,
        proven_bound=proven,
        pareto=pareto_front([p for r in results for p in r["pareto"]]),
        makespan_limit=win["limit"],
        peak_bound=peak_lower_bound(problem, checked.makespan, c).peak,
    )
