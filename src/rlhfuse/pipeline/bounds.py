"""Lower bounds on the makespan and on peak activation memory of any valid schedule.

The paper's bound (its "optimal" column) is the largest of
  (1) each model's 1F1B critical path: a stage must wait for the first micro-batch to reach it (head), do all
      its F and B work, then the last backward must travel back to stage 0 (tail);
  (2) total work / ranks;
  (3) per rank: its work + the earliest possible first arrival + the shortest possible backward tail.
We add (4) per rank, the optimum of the *preemptive* one-machine problem with release times (heads) and delivery
times (tails) of its ops (Jackson's preemptive schedule), which is never below (3) and is still a valid bound.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from rlhfuse.pipeline.compiled import Compiled, compile_problem
from rlhfuse.pipeline.problem import Problem


@dataclass(frozen=True)
class Bounds:
    """Lower bounds; `makespan` is the largest (valid) one and `paper` the paper's definition."""

    critical_path: dict[str, float]
    average_work: float
    per_rank: tuple[float, ...]
    preemptive: tuple[float, ...]
    memory: float

    @property
    def paper(self) -> float:
        return max(max(self.critical_path.values()), self.average_work, max(self.per_rank))

    @property
    def makespan(self) -> float:
        return max(self.paper, max(self.preemptive))


def lower_bounds(problem: Problem, compiled: Compiled | None = None) -> Bounds:
    c = compiled or compile_problem(problem)
    crit: dict[str, float] = {}
    for sid in np.nonzero(c.stream_is_b == 0)[0]:  # each F stream with its B (or I and W) streams
        f_ops = slice(c.stream_base[sid], c.stream_base[sid] + c.stream_len[sid])
        group = np.isin(c.stream, np.nonzero(c.stream_limit_group == sid)[0])
        work = float(c.dur[group].sum())
        path = float(c.head[f_ops].min()) + work + float(c.tail[group].min())
        name = c.problem.models[int(c.model_of_stream[sid])].name
        crit[name] = max(crit.get(name, 0.0), path)
    average = float(c.dur.sum()) / problem.ranks
    per_rank, preemptive, memory = [], [], 0.0
    for k in range(problem.ranks):
        ops = np.nonzero(c.rank == k)[0]
        if len(ops) == 0:
            per_rank.append(0.0)
            preemptive.append(0.0)
            continue
        per_rank.append(float(c.head[ops].min() + c.dur[ops].sum() + c.tail[ops].min()))
        preemptive.append(_jackson_preemptive(c.head[ops], c.dur[ops], c.tail[ops]))
        # Any schedule holds at least one micro-batch of each stage it runs on this rank at some point.
        memory = max(memory, float(c.mem[ops].max()))
    return Bounds(crit, average, tuple(per_rank), tuple(preemptive), memory)


def _jackson_preemptive(release: np.ndarray, proc: np.ndarray, tail: np.ndarray) -> float:
    """Optimal Cmax of 1|r_j, q_j, pmtn|Cmax: always run the released job with the longest tail."""
    jobs = sorted(zip(release.tolist(), proc.tolist(), tail.tolist()))
    heap: list[tuple[float, float]] = []  # (-tail, remaining)
    t, i, best = 0.0, 0, 0.0
    while i < len(jobs) or heap:
        if not heap and t < jobs[i][0]:
            t = jobs[i][0]
        while i < len(jobs) and jobs[i][0] <= t + 1e-12:
            heapq.heappush(heap, (-jobs[i][2], jobs[i][1]))
            i += 1
        neg_q, rem = heapq.heappop(heap)
        next_release = jobs[i][0] if i < len(jobs) else float("inf")
        run = min(rem, next_release - t)
        t += run
        if run < rem - 1e-12:
            heapq.heappush(heap, (neg_q, rem - run))
        else:
            best = max(best, t - neg_q)
    return best


@dataclass(frozen=True)
class PeakBound:
    """A lower bound on the peak activation of any schedule with makespan <= `makespan_limit`.

    Attributes:
        makespan_limit: the makespan the bound holds for (a longer one may need less memory).
        peak: the bound: the largest of `per_rank` (inf when no schedule ends by the limit).
        per_rank: per rank, the largest of the single-micro-batch bound, the compulsory-part (timetable) bound
            and the energetic bound (see `peak_lower_bound`).
        feasible: False when no schedule ends by the limit (below the analytic makespan bound, or some op's
            window is empty); `peak` is then inf.
    """

    makespan_limit: float
    peak: float
    per_rank: tuple[float, ...]
    feasible: bool = True


def hold_lengths(c: Compiled) -> np.ndarray:
    """Per F op, the shortest time its activation is held: from its start to the end of the op that frees it
    (its B, or W with split backward), the longest dependency path between the two (communication latency
    included); 0 for the other ops. Other ranks' contention is ignored, so it is a lower bound."""
    dur, lat1, lat2 = c.dur.tolist(), c.lat_succ1.tolist(), c.lat_succ2.tolist()
    succ1, succ2, free = c.succ1.tolist(), c.succ2.tolist(), c.free_op.tolist()
    out = np.zeros(c.n)
    # to_own[f]: longest path from f's start to the start of its own B (or I): directly, or up through the
    # next stage's F, that stage's loop, and its B (or I) back down. Next-stage F ops have larger ids.
    to_own: dict[int, float] = {}
    for f in sorted(np.nonzero(c.is_b == 0)[0].tolist(), reverse=True):
        own = succ2[f]
        longest = dur[f] + lat2[f]
        up = succ1[f]
        if up >= 0:
            up_own = succ2[up]  # the next stage's B (or I); its succ1 is `own`
            longest = max(longest, dur[f] + lat1[f] + to_own[up] + dur[up_own] + lat1[up_own])
        to_own[f] = longest
        out[f] = longest + dur[own] + (0.0 if free[f] == own else lat2[own] + dur[free[f]])
    return out


def peak_lower_bound(problem: Problem, makespan_limit: float, compiled: Compiled | None = None) -> PeakBound:
    """A lower bound on the peak activation of every schedule that ends by `makespan_limit`.

    Each F op f of a rank holds its activation a_f over one interval [x, y]: x, its start, lies in
    [est, lst] (the sequenced head; the limit minus its sequenced tail and duration), y, the end of the op
    that frees it, lies in [eft, lft] likewise, and y - x is at least the hold length (`hold_lengths`: F up
    the stages and back). Per rank the bound is the largest of
      - one micro-batch (the largest activation of the rank);
      - the timetable: the largest sum of a_f over the *compulsory parts* [lst, eft) that overlap at one time;
      - the energetic bound: for a window [t1, t2), each f holds a_f for at least its smallest overlap with the
        window over all placements, and the peak is at least the average held over the window.
    The time windows come from dependencies and stream order only (other ranks' contention and this rank's
    own no-overlap are relaxed), so the bound is valid for any schedule; it is tight where the limit leaves
    little slack (a pipeline at its 1F1B makespan holds its 1F1B peak) and weak where there is much.
    """
    c = compiled or compile_problem(problem)
    m_limit = float(makespan_limit)
    if m_limit < lower_bounds(problem, c).makespan - 1e-9:  # no schedule ends by the limit
        return PeakBound(m_limit, math.inf, tuple(math.inf for _ in range(c.ranks)), False)
    hold = hold_lengths(c)
    per_rank: list[float] = []
    feasible = True
    for k in range(c.ranks):
        fs = np.nonzero((c.rank == k) & (c.is_b == 0))[0]
        if len(fs) == 0:
            per_rank.append(0.0)
            continue
        frees = c.free_op[fs]
        a = c.mem[fs]
        ell = hold[fs]
        est = c.seq_head[fs]
        eft = c.seq_head[frees] + c.dur[frees]
        lft = m_limit - c.seq_tail[frees]
        lst = np.minimum(m_limit - c.seq_tail[fs] - c.dur[fs], lft - ell)
        if np.any(lst < est - 1e-9) or np.any(np.maximum(eft, est + ell) > lft + 1e-9):
            feasible = False
            per_rank.append(np.inf)
            continue
        best = float(a.max())
        # Timetable: every placement holds [lst, y(est)) where y(x) = max(eft, x + ell) is the earliest end.
        lo, hi = lst, np.maximum(eft, est + ell)
        events = sorted([(float(t), float(d)) for t, d in zip(lo[lo < hi], a[lo < hi])]
                        + [(float(t), -float(d)) for t, d in zip(hi[lo < hi], a[lo < hi])])  # fmt: skip
        held = 0.0
        for _, d in events:  # ends sort before starts at equal times (negative first)
            held += d
            best = max(best, held)
        best = max(best, _energetic(a, ell, est, lst, eft))
        # What a rank holds is a sum of whole micro-batches of its stages: round up to such a sum.
        streams = sorted(set(c.stream[fs].tolist()))
        per_rank.append(
            _round_up_to_holdable(
                best, [(float(c.mem[c.stream_base[sid]]), int(c.stream_len[sid])) for sid in streams]
            )
        )
    return PeakBound(m_limit, float(max(per_rank)) if per_rank else 0.0, tuple(per_rank), feasible)


def _energetic(a: np.ndarray, ell: np.ndarray, est: np.ndarray, lst: np.ndarray, eft: np.ndarray) -> float:
    """max over windows [t1, t2) of (sum_f a_f * min overlap of f's hold with the window) / (t2 - t1)."""
    # The hold of f starting at x is [x, max(eft, x + ell)); its overlap with a window, as a function of x,
    # falls, then rises, stays and falls again, so its minimum is at est, lst or the breakpoint eft - ell.
    xs = np.stack([est, lst, np.clip(eft - ell, est, lst)])  # [3, F]
    ys = np.maximum(eft[None, :], xs + ell[None, :])
    # Windows from the earliest and latest placements (any window gives a valid bound; these are the usual
    # candidates of energetic reasoning).
    t1s = np.unique(np.concatenate([est, lst]))
    t2s = np.unique(np.concatenate([ys[0], ys[1]]))
    # At most about 8M overlap terms per rank (the 64-rank dry run has 200 ops a rank): evenly spaced
    # candidates beyond that (every window is valid, so this only loosens the bound).
    keep = max(16, int(math.sqrt(8e6 / (3 * len(a)))))
    t1s = t1s[np.unique(np.linspace(0, len(t1s) - 1, min(keep, len(t1s))).astype(int))]
    t2s = t2s[np.unique(np.linspace(0, len(t2s) - 1, min(keep, len(t2s))).astype(int))]
    best = 0.0
    for t1 in t1s:
        t2 = t2s[t2s > t1 + 1e-9]
        if len(t2) == 0:
            continue
        # [T2, 3, F] overlaps
        ov = np.minimum(ys[None, :, :], t2[:, None, None]) - np.maximum(xs[None, :, :], t1)
        held = (np.maximum(ov, 0.0).min(axis=1) * a[None, :]).sum(axis=1)
        best = max(best, float((held / (t2 - t1)).max()))
    return best


def _round_up_to_holdable(value: float, stages: list[tuple[float, int]]) -> float:
    """The smallest sum of n_s x activation_s (0 <= n_s <= micro-batches of stage s) that is >= `value`."""
    sums = {0.0}
    for act, count in stages:
        sums = {round(x + n * act, 9) for x in sums for n in range(count + 1)}
        if len(sums) > 200_000:  # many stages on one rank: keep the unrounded bound
            return value
    above = [x for x in sums if x >= value - 1e-9]
    return min(above) if above else value
