"""Training-stage makespans for the planner: serial 1F1B, the fused schedule's lower bound and a greedy list
schedule of the fused Actor + Critic pipelines (DESIGN §3).

`rlhfuse.pipeline` (issue 3) owns the full problem IR, simulator and annealing search; the planner needs a
makespan for hundreds of candidate layouts per grid cell within a second or so, so it keeps these small
pieces of its own: a closed-form 1F1B, the paper's lower bound, and the paper's greedy start (earliest start,
backward first on ties). The greedy schedule is feasible (an upper bound on what the search reaches), the
bound is what the paper's annealing reaches on most Table 3 settings; the planner ranks layouts by the bound
and reports both.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PipeModel:
    """One model of a fused problem (same meaning as bench/FORMAT.md's model object)."""

    stages: int
    replicas: int
    microbatches: int
    """Per replica."""
    forward: float
    backward: float
    placement: tuple[tuple[int, ...], ...]
    """placement[r][s]: rank of stage s of replica r."""


def one_f_one_b(stages: int, microbatches: int, forward: float, backward: float) -> float:
    """Makespan of 1F1B with uniform stages: (M + S - 1) x (F + B) (Narayanan et al. 2021)."""
    return (microbatches + stages - 1) * (forward + backward)


def serial_makespan(models: Sequence[PipeModel]) -> float:
    """The models trained one after the other, each with 1F1B (the `serial_1f1b` of bench/FORMAT.md)."""
    return sum(one_f_one_b(m.stages, m.microbatches, m.forward, m.backward) for m in models)


def reversed_blocks(ranks: int, stages: int) -> tuple[tuple[int, ...], ...]:
    """Placement of ranks // stages replicas, replica r on ranks (r+1)*stages-1 .. r*stages (reversed)."""
    return tuple(tuple(range((r + 1) * stages - 1, r * stages - 1, -1)) for r in range(ranks // stages))


def fused_lower_bound(ranks: int, models: Sequence[PipeModel]) -> float:
    """max(each model's 1F1B critical path, per rank: its work + earliest first arrival + shortest tail).

    On the Table 3 settings this is within 5% below the authors' published bound (tests/planner)."""
    bound = max(one_f_one_b(m.stages, m.microbatches, m.forward, m.backward) for m in models)
    work = [0.0] * ranks
    head = [float("inf")] * ranks
    tail = [float("inf")] * ranks
    for m in models:
        for row in m.placement:
            for s, rank in enumerate(row):
                work[rank] += m.microbatches * (m.forward + m.backward)
                head[rank] = min(head[rank], s * m.forward)
                tail[rank] = min(tail[rank], (m.stages - 1 - s) * m.backward)
    for r in range(ranks):
        if work[r]:
            bound = max(bound, work[r] + head[r] + tail[r])
    return bound


def greedy_fused_makespan(
    ranks: int, models: Sequence[PipeModel], inflight_factor: float | None = None
) -> float:
    """List schedule: repeatedly start the ready op with the earliest start time (backward first on ties).

    Forwards of a stage run in micro-batch order, backwards too. With `inflight_factor` f, stage s of an
    S-stage model holds at most f x (S - s) micro-batches in flight (f = 1 is 1F1B's warm-up depth); None
    leaves it uncapped, as the authors' greedy start (on the Table 3 settings our makespans are within 16% of
    their published greedy makespans, tests/planner). Communication is inside forward / backward.
    """
    # slot = (model index, replica, stage); per slot: next forward, next backward, end times
    cap = None if inflight_factor is None else [inflight_factor] * len(models)
    slots = [(x, r, s) for x, m in enumerate(models) for r in range(m.replicas) for s in range(m.stages)]
    index = {slot: i for i, slot in enumerate(slots)}
    rank_of = [models[x].placement[r][s] for x, r, s in slots]
    n_f = [0] * len(slots)
    n_b = [0] * len(slots)
    f_end: list[list[float]] = [[] for _ in slots]
    b_end: list[list[float]] = [[] for _ in slots]
    rank_free = [0.0] * ranks
    heap: list[tuple[float, int, int, int]] = []  # (start, 0 = backward / 1 = forward, slot, op number)

    def ready(i: int, kind: int) -> float | None:
        """Dependency time of slot i's next op of `kind`, None when not schedulable yet."""
        x, r, s = slots[i]
        m = models[x]
        if kind == 1:
            j = n_f[i]
            if j >= m.microbatches or (cap is not None and j - n_b[i] >= cap[x] * (m.stages - s)):
                return None
            if s == 0:
                return 0.0
            prev = index[(x, r, s - 1)]
            return f_end[prev][j] if n_f[prev] > j else None
        j = n_b[i]
        if j >= m.microbatches or n_f[i] <= j:
            return None
        if s == m.stages - 1:
            return f_end[i][j]
        nxt = index[(x, r, s + 1)]
        return max(f_end[i][j], b_end[nxt][j]) if n_b[nxt] > j else None

    def push(i: int, kind: int) -> None:
        t = ready(i, kind)
        if t is not None:
            number = n_f[i] if kind == 1 else n_b[i]
            heapq.heappush(heap, (max(t, rank_free[rank_of[i]]), kind, i, number))

    for i in range(len(slots)):
        push(i, 1)
    makespan = 0.0
    total = 2 * sum(m.replicas * m.stages * m.microbatches for m in models)
    done = 0
    while heap:
        start, kind, i, number = heapq.heappop(heap)
        if number != (n_f[i] if kind == 1 else n_b[i]):
            continue  # stale entry: this op was already scheduled
        t = ready(i, kind)
        if t is None:
            continue
        actual = max(t, rank_free[rank_of[i]])
        if actual > start:
            heapq.heappush(heap, (actual, kind, i, number))
            continue
        x, r, s = slots[i]
        m = models[x]
        end = actual + (m.forward if kind == 1 else m.backward)
        rank_free[rank_of[i]] = end
        makespan = max(makespan, end)
        done += 1
        if kind == 1:
            f_end[i].append(end)
            n_f[i] += 1
            push(i, 1)
            push(i, 0)
            if s + 1 < m.stages:
                push(index[(x, r, s + 1)], 1)
        else:
            b_end[i].append(end)
            n_b[i] += 1
            push(i, 0)
            push(i, 1)  # a freed in-flight slot may unblock the next forward
            if s > 0:
                push(index[(x, r, s - 1)], 0)
        # ops on the same rank whose start moved are re-pushed lazily when popped
    if done != total:
        raise RuntimeError(f"greedy fused schedule stalled after {done} of {total} ops (a bug)")
    return makespan
