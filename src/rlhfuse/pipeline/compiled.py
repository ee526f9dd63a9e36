"""Integer form of a problem and compiled kernels: evaluate, list-schedule and anneal per-rank orders.

Ops are numbered by *stream*: one stream per (model, replica, stage, kind); the ops of a stream are its
micro-batches in order and carry consecutive ids. Micro-batches of one model are interchangeable, so running each
stream in micro-batch order loses nothing (the k-th F of a stage can always take the k-th micro-batch to arrive),
and the search only decides which stream each rank advances next. Moves never reorder a stream.

The kernels are written in the subset of Python that numba compiles; without numba they run as plain Python
(same results, about 100x slower), so numba is an accelerator, not a requirement for correctness.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlhfuse.pipeline.ir import Action, Kind, Schedule
from rlhfuse.pipeline.problem import Problem

try:  # pragma: no cover - exercised by whichever branch the environment has
    import numba

    def jit(fn: Callable[..., Any]) -> Callable[..., Any]:
        return numba.njit(cache=True, nogil=True)(fn)

    def jit_leaf(fn: Callable[..., Any]) -> Callable[..., Any]:
        # For helpers that allocate nothing and are called in inner loops: without numba's reference counting
        # (its `_nrt` option, missing from the type stubs), which took an atomic increment and decrement per
        # array argument per call (85% of a list schedule's time: 6 ms -> 0.4 ms for 4096 ops, the same orders).
        return numba.njit(cache=True, nogil=True, _nrt=False)(fn)  # type: ignore[call-overload]

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover

    def jit(fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn

    jit_leaf = jit

    HAVE_NUMBA = False


@dataclass(frozen=True)
class Compiled:
    """A problem as flat arrays (index = op id). `pred*`/`succ*` are -1 where absent."""

    problem: Problem
    actions: tuple[Action, ...]
    rank: np.ndarray  # int64 [N]
    dur: np.ndarray  # float64 [N]
    mem: np.ndarray  # float64 [N]: +activation for F, -activation for B
    is_b: np.ndarray  # int64 [N]
    stream: np.ndarray  # int64 [N]
    pred1: np.ndarray  # int64 [N]
    pred2: np.ndarray
    succ1: np.ndarray
    succ2: np.ndarray
    lat_succ1: np.ndarray  # float64 [N]: latency on the edge op -> succ1
    lat_succ2: np.ndarray
    stream_base: np.ndarray  # int64 [n_streams]: first op id of each stream
    stream_len: np.ndarray
    stream_rank: np.ndarray
    stream_is_b: np.ndarray
    stream_limit_group: np.ndarray  # int64 [n_streams]: the F stream id of the same (model, replica, stage)
    free_op: np.ndarray  # int64 [N]: for an F, the op whose end frees its activation (B, or W); else -1
    stream_frees: np.ndarray  # int64 [n_streams]: 1 for the streams that free activations (B, or W)
    split_backward: bool
    rank_ptr: np.ndarray  # int64 [R+1]: ops of rank k are order[rank_ptr[k]:rank_ptr[k+1]]
    rank_streams_ptr: np.ndarray  # int64 [R+1]
    rank_streams: np.ndarray  # int64: stream ids per rank
    head: np.ndarray  # float64 [N]: earliest possible start of op (longest path from the sources)
    tail: np.ndarray  # float64 [N]: shortest possible time from the op's end to the end of the schedule
    seq_head: np.ndarray  # float64 [N]: `head`, also counting that a stream runs its ops one after another
    seq_tail: np.ndarray  # float64 [N]: `tail`, likewise (the k-th last B of a stage still has k B to go)
    model_of_stream: np.ndarray  # int64 [n_streams]
    stage_of_stream: np.ndarray
    stages_of_stream: np.ndarray  # the model's stage count
    micro_of_stream: np.ndarray  # the model's micro-batch count

    @property
    def n(self) -> int:
        return len(self.actions)

    @property
    def ranks(self) -> int:
        return self.problem.ranks

    def index(self) -> dict[Action, int]:
        return {a: i for i, a in enumerate(self.actions)}

    def to_schedule(self, order: np.ndarray) -> Schedule:
        return Schedule(
            tuple(
                tuple(self.actions[int(op)] for op in order[self.rank_ptr[k] : self.rank_ptr[k + 1]])
                for k in range(self.ranks)
            )
        )

    def from_schedule(self, schedule: Schedule) -> np.ndarray:
        """Op ids of a schedule, rank after rank (the schedule must be structurally valid)."""
        idx = self.index()
        order = np.empty(self.n, dtype=np.int64)
        for k, rank in enumerate(schedule.ranks):
            start = self.rank_ptr[k]
            if len(rank) != self.rank_ptr[k + 1] - start:
                raise ValueError(f"rank {k} has {len(rank)} ops, expected {self.rank_ptr[k + 1] - start}")
            for i, a in enumerate(rank):
                order[start + i] = idx[a]
        return order

    def evaluate(self, order: np.ndarray) -> tuple[float, np.ndarray]:
        """(makespan, finish times); makespan is -1 when the order deadlocks."""
        finish = np.zeros(self.n)
        ms = evaluate_order(
            order,
            self.rank_ptr,
            self.dur,
            self.pred1,
            self.pred2,
            self.succ1,
            self.succ2,
            self.lat_succ1,
            self.lat_succ2,
            finish,
        )
        return ms, finish

    def peak(self, order: np.ndarray) -> float:
        return float(rank_peaks(order, self.rank_ptr, self.mem).max())


def compile_problem(
    problem: Problem, durations: Callable[[Action], float] | None = None, split_backward: bool = False
) -> Compiled:
    """Number the ops of `problem` by stream and precompute dependencies, heads and tails.

    `split_backward`: each stage's B becomes I then W (`rlhfuse.pipeline.simulate`, split backward): streams
    F, I, W per stage; I carries the backward chain between stages, W frees the activation.
    """
    from rlhfuse.pipeline.simulate import stage_duration, stage_kinds

    kinds = stage_kinds(split_backward)
    actions: list[Action] = []
    rank: list[int] = []
    dur: list[float] = []
    mem: list[float] = []
    is_b: list[int] = []
    stream: list[int] = []
    s_base: list[int] = []
    s_len: list[int] = []
    s_rank: list[int] = []
    s_is_b: list[int] = []
    s_group: list[int] = []
    s_frees: list[int] = []
    s_model: list[int] = []
    s_stage: list[int] = []
    s_stages: list[int] = []
    s_micro: list[int] = []
    ids: dict[tuple[int, int, int, int], int] = {}
    for mi, m in enumerate(problem.models):
        for r in range(m.replicas):
            for s in range(m.stages):
                f_stream = len(s_base)
                for ki, kind in enumerate(kinds):
                    sid = len(s_base)
                    ids[(mi, r, s, ki)] = sid
                    s_base.append(len(actions))
                    s_len.append(m.microbatches)
                    s_rank.append(m.placement[r][s])
                    s_is_b.append(int(kind is not Kind.F))
                    s_frees.append(int(kind in (Kind.B, Kind.W)))
                    s_group.append(f_stream)
                    s_model.append(mi)
                    s_stage.append(s)
                    s_stages.append(m.stages)
                    s_micro.append(m.microbatches)
                    for i in range(m.microbatches):
                        a = Action(m.name, r, s, kind, i)
                        actions.append(a)
                        rank.append(m.placement[r][s])
                        d = durations(a) if durations else stage_duration(problem, m.name, s, kind)
                        dur.append(float(d))
                        held = {Kind.F: m.activation[s], Kind.I: 0.0}.get(kind, -m.activation[s])
                        mem.append(held)
                        is_b.append(int(kind is not Kind.F))
                        stream.append(sid)
    n = len(actions)
    pred1 = np.full(n, -1, dtype=np.int64)
    pred2 = np.full(n, -1, dtype=np.int64)
    succ1 = np.full(n, -1, dtype=np.int64)
    succ2 = np.full(n, -1, dtype=np.int64)
    free_op = np.full(n, -1, dtype=np.int64)
    for mi, m in enumerate(problem.models):
        for r in range(m.replicas):
            for s in range(m.stages):
                f0 = s_base[ids[(mi, r, s, 0)]]
                b0 = s_base[ids[(mi, r, s, 1)]]  # B, or I when split
                for i in range(m.microbatches):
                    f, b = f0 + i, b0 + i
                    pred1[b] = f  # B(s) after F(s)
                    succ2[f] = b
                    free_op[f] = b
                    if split_backward:
                        w = s_base[ids[(mi, r, s, 2)]] + i
                        pred1[w] = b  # W(s) after I(s); nothing waits for W
                        succ2[b] = w
                        free_op[f] = w
                    if s > 0:
                        fp = s_base[ids[(mi, r, s - 1, 0)]] + i
                        pred1[f] = fp
                        succ1[fp] = f
                    if s < m.stages - 1:
                        bn = s_base[ids[(mi, r, s + 1, 1)]] + i
                        pred2[b] = bn
                        succ1[bn] = b
    rank_a = np.array(rank, dtype=np.int64)
    lat1 = np.zeros(n)
    lat2 = np.zeros(n)
    if problem.comm_latency:
        for op in range(n):
            if succ1[op] >= 0 and rank_a[succ1[op]] != rank_a[op]:
                lat1[op] = problem.comm_latency
            if succ2[op] >= 0 and rank_a[succ2[op]] != rank_a[op]:
                lat2[op] = problem.comm_latency
    dur_a = np.array(dur)
    head = np.zeros(n)
    # Ids are ordered so that F(s-1) < F(s) and B(s+1) > B(s); sweep F forward by stage, B from the top stage.
    topo = _topological(n, pred1, pred2)
    for op in topo:
        for p in (pred1[op], pred2[op]):
            if p >= 0:
                hop = problem.comm_latency if rank_a[p] != rank_a[op] else 0.0
                head[op] = max(head[op], head[p] + dur_a[p] + hop)
    tail = np.zeros(n)
    for op in reversed(topo):
        for sc in (succ1[op], succ2[op]):
            if sc >= 0:
                hop = problem.comm_latency if rank_a[sc] != rank_a[op] else 0.0
                tail[op] = max(tail[op], hop + dur_a[sc] + tail[sc])
    seq_head, seq_tail = _sequenced_heads_tails(n, pred1, pred2, succ1, succ2, s_base, s_len, dur_a)
    counts = np.bincount(rank_a, minlength=problem.ranks)
    rank_ptr = np.zeros(problem.ranks + 1, dtype=np.int64)
    rank_ptr[1:] = np.cumsum(counts)
    per_rank: list[list[int]] = [[] for _ in range(problem.ranks)]
    for sid, k in enumerate(s_rank):
        per_rank[k].append(sid)
    rs_ptr = np.zeros(problem.ranks + 1, dtype=np.int64)
    rs_ptr[1:] = np.cumsum([len(x) for x in per_rank])
    rank_streams = np.array([sid for x in per_rank for sid in x], dtype=np.int64)
    as_int = lambda xs: np.array(xs, dtype=np.int64)  # noqa: E731
    return Compiled(
        problem=problem,
        actions=tuple(actions),
        rank=rank_a,
        dur=dur_a,
        mem=np.array(mem),
        is_b=as_int(is_b),
        stream=as_int(stream),
        pred1=pred1,
        pred2=pred2,
        succ1=succ1,
        succ2=succ2,
        lat_succ1=lat1,
        lat_succ2=lat2,
        stream_base=as_int(s_base),
        stream_len=as_int(s_len),
        stream_rank=as_int(s_rank),
        stream_is_b=as_int(s_is_b),
        stream_limit_group=as_int(s_group),
        free_op=free_op,
        stream_frees=as_int(s_frees),
        split_backward=split_backward,
        rank_ptr=rank_ptr,
        rank_streams_ptr=rs_ptr,
        rank_streams=rank_streams,
        head=head,
        tail=tail,
        seq_head=seq_head,
        seq_tail=seq_tail,
        model_of_stream=as_int(s_model),
        stage_of_stream=as_int(s_stage),
        stages_of_stream=as_int(s_stages),
        micro_of_stream=as_int(s_micro),
    )


def _sequenced_heads_tails(
    n: int,
    pred1: np.ndarray,
    pred2: np.ndarray,
    succ1: np.ndarray,
    succ2: np.ndarray,
    s_base: list[int],
    s_len: list[int],
    dur: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    # Streams run in micro-batch order (see the module docstring), so consecutive ops of a stream are one
    # more chain edge: heads and tails over dependencies plus those edges. (Communication latency is left out:
    # these feed heuristics and bounds that stay valid without it.)
    prev = np.full(n, -1, dtype=np.int64)
    nxt = np.full(n, -1, dtype=np.int64)
    for base, length in zip(s_base, s_len):
        for i in range(1, length):
            prev[base + i] = base + i - 1
            nxt[base + i - 1] = base + i
    topo = _topological(n, pred1, pred2, prev)
    head = np.zeros(n)
    for op in topo:
        for p in (pred1[op], pred2[op], prev[op]):
            if p >= 0:
                head[op] = max(head[op], head[p] + dur[p])
    tail = np.zeros(n)
    for op in reversed(topo):
        for sc in (succ1[op], succ2[op], nxt[op]):
            if sc >= 0:
                tail[op] = max(tail[op], dur[sc] + tail[sc])
    return head, tail


def _topological(n: int, *preds: np.ndarray) -> list[int]:
    """Op ids in an order where every predecessor (in any of `preds`, -1 for none) comes first."""
    indeg = np.zeros(n, dtype=np.int64)
    succs: list[list[int]] = [[] for _ in range(n)]
    for pred in preds:
        for op in range(n):
            p = int(pred[op])
            if p >= 0:
                indeg[op] += 1
                succs[p].append(op)
    stack = [op for op in range(n) if indeg[op] == 0]
    out = []
    while stack:
        op = stack.pop()
        out.append(op)
        for sc in succs[op]:
            indeg[sc] -= 1
            if indeg[sc] == 0:
                stack.append(sc)
    return out


# ----------------------------------------------------------------------------------------------------------
# Kernels (numba-compilable)
# ----------------------------------------------------------------------------------------------------------


@jit
def evaluate_order(order, rank_ptr, dur, pred1, pred2, succ1, succ2, lat1, lat2, finish):  # type: ignore[no-untyped-def]
    """Longest-path times of a per-rank order (Kahn's algorithm); returns the makespan, or -1 on deadlock."""
    n = dur.shape[0]
    nranks = rank_ptr.shape[0] - 1
    nxt = np.full(n, -1, dtype=np.int64)
    indeg = np.zeros(n, dtype=np.int64)
    ready = np.zeros(n)
    for k in range(nranks):
        for p in range(rank_ptr[k], rank_ptr[k + 1] - 1):
            nxt[order[p]] = order[p + 1]
            indeg[order[p + 1]] += 1
    stack = np.empty(n, dtype=np.int64)
    top = 0
    for op in range(n):
        if pred1[op] >= 0:
            indeg[op] += 1
        if pred2[op] >= 0:
            indeg[op] += 1
    for op in range(n):
        if indeg[op] == 0:
            stack[top] = op
            top += 1
    done = 0
    makespan = 0.0
    while top > 0:
        top -= 1
        op = stack[top]
        t = ready[op] + dur[op]
        finish[op] = t
        done += 1
        if t > makespan:
            makespan = t
        s = succ1[op]
        if s >= 0:
            if t + lat1[op] > ready[s]:
                ready[s] = t + lat1[op]
            indeg[s] -= 1
            if indeg[s] == 0:
                stack[top] = s
                top += 1
        s = succ2[op]
        if s >= 0:
            if t + lat2[op] > ready[s]:
                ready[s] = t + lat2[op]
            indeg[s] -= 1
            if indeg[s] == 0:
                stack[top] = s
                top += 1
        s = nxt[op]
        if s >= 0:
            if t > ready[s]:
                ready[s] = t
            indeg[s] -= 1
            if indeg[s] == 0:
                stack[top] = s
                top += 1
    if done < n:
        return -1.0
    return makespan


@jit
def rank_peaks(order, rank_ptr, mem):  # type: ignore[no-untyped-def]
    """Per-rank peak activation of an order (F adds, B frees; ops on a rank never overlap)."""
    nranks = rank_ptr.shape[0] - 1
    peaks = np.zeros(nranks)
    for k in range(nranks):
        level = 0.0
        best = 0.0
        for p in range(rank_ptr[k], rank_ptr[k + 1]):
            level += mem[order[p]]
            if level > best:
                best = level
        peaks[k] = best
    return peaks


@jit_leaf
def _next_planned(k, ptr, planned, stream_base, stream_len, rank_streams_ptr, rank_streams):  # type: ignore[no-untyped-def]
    t = np.inf
    for j in range(rank_streams_ptr[k], rank_streams_ptr[k + 1]):
        sid = rank_streams[j]
        if ptr[sid] < stream_len[sid]:
            p = planned[stream_base[sid] + ptr[sid]]
            if p >= 0 and p < t:
                t = p
    return t


@jit
def list_schedule(  # type: ignore[no-untyped-def]
    rank_ptr,
    dur,
    mem,
    pred1,
    pred2,
    lat1,
    lat2,
    succ1,
    succ2,
    stream_base,
    stream_len,
    stream_rank,
    stream_is_b,
    rank_streams_ptr,
    rank_streams,
    stream_limit,
    op_prio,
    slack,
    cap,
    noise,
    seed,
    planned,
    stream_group,
    stream_frees,
):
    """Greedy list schedule over streams; returns the per-rank order (op ids) or an empty array if stuck.

    At every step, among the ready stream heads of all ranks, take the one that can start earliest
    (`max(rank free, inputs ready)`); among those starting within `slack` of the earliest on the same rank, the
    highest `op_prio` (per op) wins (ties: backward first, then lower stream id). An F is eligible only while its
    stage holds fewer than `stream_limit` micro-batches in flight and the rank stays under `cap`.
    `noise` > 0 adds uniform noise of that size to priorities (randomised restarts).
    `planned[op]` >= 0 marks a *protected* op (the bigger pipeline's 1F1B, timed as if alone): another op may
    run on that rank only if it ends before the next protected op's planned start, so the protected pipeline
    keeps its critical path and the other fills its bubbles.
    """
    np.random.seed(seed)
    n = dur.shape[0]
    nranks = rank_ptr.shape[0] - 1
    nstreams = stream_base.shape[0]
    ptr = np.zeros(nstreams, dtype=np.int64)
    inflight = np.zeros(nstreams, dtype=np.int64)  # indexed by the F stream (B frees its F stream's count)
    ready_time = np.zeros(n)
    npreds = np.zeros(n, dtype=np.int64)
    for op in range(n):
        if pred1[op] >= 0:
            npreds[op] += 1
        if pred2[op] >= 0:
            npreds[op] += 1
    free = np.zeros(nranks)
    level = np.zeros(nranks)
    fill = rank_ptr[:-1].copy()
    order = np.empty(n, dtype=np.int64)
    prio = op_prio
    # each rank's earliest start, kept between steps: a step changes it only on the rank that ran the op, the
    # ranks of the op's successors (their inputs' ready times) and the rank of the F stream it frees a slot of
    op_rank = np.empty(n, dtype=np.int64)
    for sid in range(nstreams):
        for i in range(stream_len[sid]):
            op_rank[stream_base[sid] + i] = stream_rank[sid]
    k_starts = np.empty(nranks)
    dirty = np.ones(nranks, dtype=np.bool_)
    for done in range(n):
        best_rank = -1
        best_start = np.inf
        for k in range(nranks):
            if dirty[k]:
                k_starts[k] = _rank_start(
                    k, ptr, npreds, inflight, level, free, ready_time, dur, mem, planned, stream_base,
                    stream_len, stream_is_b, stream_limit, rank_streams_ptr, rank_streams, cap,
                )  # fmt: skip
                dirty[k] = False
            if k_starts[k] < best_start - 1e-9:
                best_start = k_starts[k]
                best_rank = k
        if best_rank < 0:
            return np.empty(0, dtype=np.int64)
        k = best_rank
        nxt_plan = _next_planned(k, ptr, planned, stream_base, stream_len, rank_streams_ptr, rank_streams)
        chosen = -1
        chosen_key = -np.inf
        for j in range(rank_streams_ptr[k], rank_streams_ptr[k + 1]):
            sid = rank_streams[j]
            st = _head_start(
                k, sid, ptr, npreds, inflight, level, free, ready_time, dur, mem, planned, stream_base,
                stream_len, stream_is_b, stream_limit, cap, nxt_plan,
            )  # fmt: skip
            if st == np.inf or st > best_start + slack + 1e-9:
                continue
            op = stream_base[sid] + ptr[sid]
            key = prio[op] + 0.5 * stream_is_b[sid] - 1e-6 * sid
            if noise > 0:
                key += noise * np.random.random()
            if key > chosen_key:
                chosen_key = key
                chosen = sid
        sid = chosen
        op = stream_base[sid] + ptr[sid]
        ptr[sid] += 1
        st = max(free[k], ready_time[op])
        t = st + dur[op]
        free[k] = t
        level[k] += mem[op]
        g = stream_group[sid]
        if stream_is_b[sid] == 0:
            inflight[g] += 1
        elif stream_frees[sid] == 1:
            inflight[g] -= 1
        order[fill[k]] = op
        fill[k] += 1
        dirty[k] = True
        dirty[stream_rank[g]] = True
        s = succ1[op]
        if s >= 0:
            npreds[s] -= 1
            dirty[op_rank[s]] = True
            if t + lat1[op] > ready_time[s]:
                ready_time[s] = t + lat1[op]
        s = succ2[op]
        if s >= 0:
            npreds[s] -= 1
            dirty[op_rank[s]] = True
            if t + lat2[op] > ready_time[s]:
                ready_time[s] = t + lat2[op]
        _ = done
    return order


@jit_leaf
def _rank_start(  # type: ignore[no-untyped-def]
    k, ptr, npreds, inflight, level, free, ready_time, dur, mem, planned, stream_base, stream_len, stream_is_b,
    stream_limit, rank_streams_ptr, rank_streams, cap,
):  # fmt: skip
    """The earliest start of a ready stream head on rank `k` (`_head_start`), inf if none."""
    k_start = np.inf
    nxt_plan = _next_planned(k, ptr, planned, stream_base, stream_len, rank_streams_ptr, rank_streams)
    for j in range(rank_streams_ptr[k], rank_streams_ptr[k + 1]):
        st = _head_start(
            k, rank_streams[j], ptr, npreds, inflight, level, free, ready_time, dur, mem, planned, stream_base,
            stream_len, stream_is_b, stream_limit, cap, nxt_plan,
        )  # fmt: skip
        if st < k_start:
            k_start = st
    return k_start


@jit_leaf
def _head_start(  # type: ignore[no-untyped-def]
    k, sid, ptr, npreds, inflight, level, free, ready_time, dur, mem, planned, stream_base, stream_len,
    stream_is_b, stream_limit, cap, nxt_plan,
):  # fmt: skip
    """When the head of stream `sid` (on rank `k`) can start under `list_schedule`'s rules, inf if it cannot now:
    the stream has an op left, its inputs are done, an F stays within its stream's in-flight limit and the rank's
    memory cap, and an unprotected op ends before the rank's next protected (planned) op."""
    if ptr[sid] >= stream_len[sid]:
        return np.inf
    op = stream_base[sid] + ptr[sid]
    if npreds[op] > 0:
        return np.inf
    if stream_is_b[sid] == 0 and (inflight[sid] >= stream_limit[sid] or level[k] + mem[op] > cap + 1e-9):
        return np.inf
    st = max(free[k], ready_time[op])
    if planned[op] < 0 and st + dur[op] > nxt_plan + 1e-9:
        return np.inf
    return st


@jit
def _objective(finish, tail, makespan, weight, target, mode):  # type: ignore[no-untyped-def]
    # The makespan alone is flat under most moves, so a secondary term guides the walk across plateaus
    # (never outweighing much of one unit of makespan):
    #   mode 0: mean finish time (pulls work earlier, which frees the critical rank);
    #   mode 1: mean lateness past each op's deadline, target - tail (the latest end that still allows the
    #           target makespan): how far the schedule is from the target everywhere, not just on its critical path.
    if mode == 0:
        return makespan + weight * finish.mean()
    late = 0.0
    for op in range(finish.shape[0]):
        d = finish[op] + tail[op] - target
        if d > 0:
            late += d
    return makespan + weight * late / finish.shape[0]


@jit
def _excess(peaks, ref, summed):  # type: ignore[no-untyped-def]
    """Peak activation above `ref`: of the highest rank, or (`summed`) summed over the ranks."""
    if summed == 0:
        return max(0.0, peaks.max() - ref)
    total = 0.0
    for k in range(peaks.shape[0]):
        if peaks[k] > ref:
            total += peaks[k] - ref
    return total


@jit
def _rank_lateness(cur, rank_ptr, finish, tail, target, out):  # type: ignore[no-untyped-def]
    """Cumulative per-rank weights: 1 + how far each rank's ops end past their deadline (target - tail)."""
    total = 0.0
    for k in range(rank_ptr.shape[0] - 1):
        late = 1e-3
        for j in range(rank_ptr[k], rank_ptr[k + 1]):
            op = cur[j]
            d = finish[op] + tail[op] - target + 1.0
            if d > 0:
                late += d
        total += late
        out[k] = total


@jit
def anneal_latency(  # type: ignore[no-untyped-def]
    order,
    rank_ptr,
    dur,
    pred1,
    pred2,
    succ1,
    succ2,
    lat1,
    lat2,
    stream,
    mem,
    tail,
    cap,
    iters,
    temp0,
    temp1,
    weight,
    mode,
    max_shift,
    target,
    seed,
    mem_weight,
    mem_ref,
):
    """Simulated annealing on per-rank orders for makespan, then peak activation.

    Moves: swap two adjacent ops of different streams (the paper's move) or shift one op by up to
    `max_shift` places on its rank past ops of other streams. Deadlocking or cap-violating orders are
    rejected. The cost is the makespan plus the plateau-breaking term (`_objective`) plus `mem_weight` per
    unit of peak activation above `mem_ref` (0: memory ignored). The best order is the lowest makespan, then
    the lowest peak. Stops early once the makespan reaches `target` (and the peak `mem_ref` when
    `mem_weight` > 0). Returns (best order, best makespan, best peak, iterations).
    """
    np.random.seed(seed)
    n = order.shape[0]
    nranks = rank_ptr.shape[0] - 1
    rank_of_pos = np.empty(n, dtype=np.int64)
    for k in range(nranks):
        for p in range(rank_ptr[k], rank_ptr[k + 1]):
            rank_of_pos[p] = k
    finish = np.zeros(n)
    cur = order.copy()
    peaks = rank_peaks(cur, rank_ptr, mem)
    ms = evaluate_order(cur, rank_ptr, dur, pred1, pred2, succ1, succ2, lat1, lat2, finish)
    top = peaks.max()
    cost = _objective(finish, tail, ms, weight, target, mode) + mem_weight * _excess(peaks, mem_ref, 0)
    best = cur.copy()
    best_ms = ms
    best_peak = top
    saved = np.empty(max_shift + 2, dtype=np.int64)
    focus = np.zeros(nranks)
    _rank_lateness(cur, rank_ptr, finish, tail, target, focus)
    it = 0
    for it in range(iters):
        if best_ms <= target + 1e-9 and (mem_weight == 0 or best_peak <= mem_ref + 1e-9):
            break
        temp = temp0 * (temp1 / temp0) ** (it / iters)
        p, q = _shift_move(cur, stream, rank_ptr, rank_of_pos, max_shift, saved, focus)
        if p < 0:
            continue
        k = rank_of_pos[p]
        old_peak = peaks[k]
        peaks[k] = _rank_peak(cur, rank_ptr[k], rank_ptr[k + 1], mem)
        new_ms = -1.0
        if peaks[k] <= cap + 1e-9:
            new_ms = evaluate_order(cur, rank_ptr, dur, pred1, pred2, succ1, succ2, lat1, lat2, finish)
        if new_ms < 0:
            peaks[k] = old_peak
            for j in range(p, q + 1):
                cur[j] = saved[j - p]
            continue
        top = peaks.max()
        new_cost = _objective(finish, tail, new_ms, weight, target, mode) + mem_weight * _excess(
            peaks, mem_ref, 0
        )
        delta = new_cost - cost
        if delta <= 0 or np.random.random() < np.exp(-delta / temp):
            cost = new_cost
            if it % 16 == 0:
                _rank_lateness(cur, rank_ptr, finish, tail, new_ms if new_ms > target else target, focus)
            if new_ms < best_ms or (new_ms == best_ms and top < best_peak - 1e-9):
                best_ms = new_ms
                best_peak = top
                best[:] = cur
        else:
            peaks[k] = old_peak
            for j in range(p, q + 1):
                cur[j] = saved[j - p]
    return best, best_ms, best_peak, it + 1


@jit
def _shift_move(cur, stream, rank_ptr, rank_of_pos, max_shift, saved, focus):  # type: ignore[no-untyped-def]
    """Move one op up to `max_shift` places on its rank past other streams; returns (p, q) or (-1, -1).

    `focus`: empty, or the cumulative per-rank weights used to pick the rank half of the time.
    """
    n = cur.shape[0]
    p = np.random.randint(0, n - 1)
    if focus.shape[0] > 0 and np.random.random() < 0.5:
        # Aim at ranks in proportion to how late their ops are: moves elsewhere rarely change the makespan.
        x = np.random.random() * focus[-1]
        k = np.searchsorted(focus, x, side="right")
        if k < rank_ptr.shape[0] - 1 and rank_ptr[k + 1] - rank_ptr[k] > 1:
            p = np.random.randint(rank_ptr[k], rank_ptr[k + 1] - 1)
    k = rank_of_pos[p]
    shift = 1
    if max_shift > 1 and np.random.random() < 0.5:
        shift = np.random.randint(1, max_shift + 1)
    q = p + shift
    if q >= rank_ptr[k + 1]:
        return -1, -1
    down = shift == 1 or np.random.random() < 0.5
    moving = stream[cur[p]] if down else stream[cur[q]]
    lo = p + 1 if down else p
    hi = q + 1 if down else q
    for j in range(lo, hi):
        if stream[cur[j]] == moving:
            return -1, -1
    for j in range(p, q + 1):
        saved[j - p] = cur[j]
    if down:
        x = cur[p]
        for j in range(p, q):
            cur[j] = cur[j + 1]
        cur[q] = x
    else:
        y = cur[q]
        for j in range(q, p, -1):
            cur[j] = cur[j - 1]
        cur[p] = y
    return p, q


@jit
def _rank_peak(cur, lo, hi, mem):  # type: ignore[no-untyped-def]
    level = 0.0
    best = 0.0
    for j in range(lo, hi):
        level += mem[cur[j]]
        if level > best:
            best = level
    return best


@jit
def _peak_move(cur, stream, mem, rank_ptr, peaks, max_shift, saved):  # type: ignore[no-untyped-def]
    """Move an op across the peak of the highest rank: an F from before the peak to after it, or a B from
    after the peak to before it (either lowers that peak by one activation if nothing else moves).
    Returns (lo, hi) of the shifted range, or (-1, -1)."""
    nranks = peaks.shape[0]
    top = peaks.max()
    k = np.random.randint(0, nranks)
    for j in range(nranks):
        kk = (k + j) % nranks
        if peaks[kk] >= top - 1e-9:
            k = kk
            break
    lo = rank_ptr[k]
    hi = rank_ptr[k + 1]
    level = 0.0
    peak_pos = lo
    for j in range(lo, hi):
        level += mem[cur[j]]
        if level >= peaks[k] - 1e-9:
            peak_pos = j
            break
    if np.random.random() < 0.5:
        a = np.random.randint(lo, peak_pos + 1)
        if mem[cur[a]] <= 0:
            return -1, -1
        last = min(hi - 1, a + max_shift)
        for j in range(a + 1, last + 1):
            if stream[cur[j]] == stream[cur[a]]:
                last = j - 1
                break
        if last <= peak_pos:
            return -1, -1
        q = np.random.randint(peak_pos + 1, last + 1)
        for j in range(a, q + 1):
            saved[j - a] = cur[j]
        x = cur[a]
        for j in range(a, q):
            cur[j] = cur[j + 1]
        cur[q] = x
        return a, q
    if peak_pos + 1 >= hi:
        return -1, -1
    b = np.random.randint(peak_pos + 1, hi)
    if mem[cur[b]] >= 0:
        return -1, -1
    first = max(lo, b - max_shift)
    for j in range(b - 1, first - 1, -1):
        if stream[cur[j]] == stream[cur[b]]:
            first = j + 1
            break
    if first > peak_pos:
        return -1, -1
    q = np.random.randint(first, peak_pos + 1)
    for j in range(q, b + 1):
        saved[j - q] = cur[j]
    y = cur[b]
    for j in range(b, q, -1):
        cur[j] = cur[j - 1]
    cur[q] = y
    return q, b


@jit
def anneal_memory(  # type: ignore[no-untyped-def]
    order,
    rank_ptr,
    dur,
    pred1,
    pred2,
    succ1,
    succ2,
    lat1,
    lat2,
    stream,
    mem,
    makespan_limit,
    iters,
    temp0,
    temp1,
    max_shift,
    target,
    seed,
    excess_weight=1.0,
):
    """The paper's second phase: anneal peak activation with moves restricted to makespan <= the limit.

    Cost: the largest per-rank peak, plus a small share of the sum of per-rank peaks, plus `excess_weight` x
    the sum over ranks of the peak above `target` (the peak is flat while several ranks share it: lowering any rank's peak must
    count, and lowering one above the target counts as much as the highest one). Only the moved rank's peak
    changes, so memory is re-evaluated incrementally and the (costlier) makespan check runs only for moves the
    memory cost would accept.
    """
    np.random.seed(seed)
    n = order.shape[0]
    nranks = rank_ptr.shape[0] - 1
    rank_of_pos = np.empty(n, dtype=np.int64)
    for k in range(nranks):
        for p in range(rank_ptr[k], rank_ptr[k + 1]):
            rank_of_pos[p] = k
    finish = np.zeros(n)
    cur = order.copy()
    peaks = rank_peaks(cur, rank_ptr, mem)
    no_focus = np.zeros(0)
    share = 0.1 / nranks
    cost = peaks.max() + share * peaks.sum() + excess_weight * _excess(peaks, target, 1)
    best = cur.copy()
    best_cost = cost
    saved = np.empty(max_shift + 2, dtype=np.int64)
    it = 0
    for it in range(iters):
        if peaks.max() <= target + 1e-9:
            break
        temp = temp0 * (temp1 / temp0) ** (it / iters)
        if np.random.random() < 0.6:
            p, q = _peak_move(cur, stream, mem, rank_ptr, peaks, max_shift, saved)
        else:
            p, q = _shift_move(cur, stream, rank_ptr, rank_of_pos, max_shift, saved, no_focus)
        if p < 0:
            continue
        k = rank_of_pos[p]
        old_peak = peaks[k]
        peaks[k] = _rank_peak(cur, rank_ptr[k], rank_ptr[k + 1], mem)
        new_cost = peaks.max() + share * peaks.sum() + excess_weight * _excess(peaks, target, 1)
        delta = new_cost - cost
        accept = delta <= 0 or np.random.random() < np.exp(-delta / temp)
        if accept:
            ms = evaluate_order(cur, rank_ptr, dur, pred1, pred2, succ1, succ2, lat1, lat2, finish)
            accept = ms >= 0 and ms <= makespan_limit + 1e-9
        if accept:
            cost = new_cost
            if cost < best_cost - 1e-12:
                best_cost = cost
                best[:] = cur
        else:
            peaks[k] = old_peak
            for j in range(p, q + 1):
                cur[j] = saved[j - p]
    return best, it + 1


@jit
def time_windows(n, edge_from, edge_to, edge_gap, dur, horizon):  # type: ignore[no-untyped-def]
    """Earliest and latest starts of ops under precedences `start[to] >= start[from] + gap` that end by
    `horizon` (longest paths forward and backward, Kahn's order); both empty if the edges have a cycle."""
    m = edge_from.shape[0]
    out_ptr = np.zeros(n + 1, dtype=np.int64)
    for e in range(m):
        out_ptr[edge_from[e] + 1] += 1
    for i in range(n):
        out_ptr[i + 1] += out_ptr[i]
    out_edge = np.empty(m, dtype=np.int64)
    fill = out_ptr[:-1].copy()
    indeg = np.zeros(n, dtype=np.int64)
    for e in range(m):
        out_edge[fill[edge_from[e]]] = e
        fill[edge_from[e]] += 1
        indeg[edge_to[e]] += 1
    topo = np.empty(n, dtype=np.int64)
    top, done = 0, 0
    for i in range(n):
        if indeg[i] == 0:
            topo[top] = i
            top += 1
    est = np.zeros(n, dtype=np.int64)
    while done < top:
        u = topo[done]
        done += 1
        for j in range(out_ptr[u], out_ptr[u + 1]):
            e = out_edge[j]
            v = edge_to[e]
            if est[u] + edge_gap[e] > est[v]:
                est[v] = est[u] + edge_gap[e]
            indeg[v] -= 1
            if indeg[v] == 0:
                topo[top] = v
                top += 1
    if done < n:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    lst = horizon - dur
    for i in range(n - 1, -1, -1):
        u = topo[i]
        for j in range(out_ptr[u], out_ptr[u + 1]):
            e = out_edge[j]
            if lst[edge_to[e]] - edge_gap[e] < lst[u]:
                lst[u] = lst[edge_to[e]] - edge_gap[e]
    return est, lst
