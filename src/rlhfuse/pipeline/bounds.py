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
