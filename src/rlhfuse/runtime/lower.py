"""Lowering: a fused schedule (per-rank F/B lists of `rlhfuse.pipeline`) -> per-rank instruction streams.

A stream holds compute (F, B), point-to-point communication (RECV posted early, waited just before use; SEND
right after the producing compute), gradient reduction (REDUCE_GRAD, launched asynchronously after a stage's last
backward) and the optimizer step (OPTIMIZER_STEP, which first waits for every send and reduction of the model).

Deadlock freedom is proven, not hoped for: `check_program` executes the streams under the strictest transport
semantics we run on (NCCL-like, no tags: on each (sender, receiver, model) channel the k-th send matches the
k-th posted receive, and they must carry the same message; a collective completes when every member of its
group has launched its k-th operation on that group, in the same order). Any schedule the pipeline simulator
accepts lowers into a program this check accepts (tested on many random schedules, up to 64 ranks).

Pure code: no process group, no tensors.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from rlhfuse.pipeline.ir import Action, Kind, Schedule
from rlhfuse.pipeline.problem import Problem


class LoweringError(ValueError):
    """A program that would deadlock or mis-match messages; the message names the ranks and instructions."""


@dataclass(frozen=True, order=True)
class Message:
    """One point-to-point tensor: the activation F(stage) -> F(stage+1) (`grad=False`), or the input gradient
    B(stage) -> B(stage-1) (`grad=True`), of one micro-batch of one replica in data-parallel group `group`."""

    model: str
    group: int
    replica: int
    stage: int  # the producing stage
    microbatch: int
    grad: bool

    def __str__(self) -> str:
        what = "dgrad" if self.grad else "act"
        return f"{self.model}.g{self.group}.r{self.replica}.s{self.stage}:{what}{self.microbatch}"


@dataclass(frozen=True)
class Instr:
    """One instruction of a rank's stream.

    kind: F / B (compute `action`), SEND / RECV (`message` to / from `peer`; RECV with `post=True` posts the
    receive, with `post=False` waits for it), REDUCE_GRAD (launch the sum of (model, stage)'s gradients over
    `peers`, the ranks holding that stage), OPTIMIZER_STEP (wait for this model's sends and reductions, global
    gradient norm, step).
    """

    kind: Kind
    model: str
    group: int = 0
    action: Action | None = None
    message: Message | None = None
    peer: int = -1
    post: bool = False
    stage: int = -1
    peers: tuple[int, ...] = ()
    needs: Message | None = None  # compute only: the input it consumes (received, or produced on this rank)

    def __str__(self) -> str:
        if self.kind in (Kind.F, Kind.B):
            return f"{self.action}@g{self.group}"
        if self.kind is Kind.SEND:
            return f"SEND {self.message} -> {self.peer}"
        if self.kind is Kind.RECV:
            return f"{'POST' if self.post else 'WAIT'} RECV {self.message} <- {self.peer}"
        if self.kind is Kind.REDUCE_GRAD:
            return f"REDUCE_GRAD {self.model}.s{self.stage} over {list(self.peers)}"
        return f"OPTIMIZER_STEP {self.model}"


@dataclass(frozen=True)
class Program:
    """Per-rank instruction streams of one training step (one mini-batch) over `dp` fused groups."""

    streams: tuple[tuple[Instr, ...], ...]
    group_size: int
    dp: int
    models: tuple[str, ...] = field(default=())

    def __str__(self) -> str:
        return "\n".join(f"rank {k}: " + "; ".join(str(i) for i in s) for k, s in enumerate(self.streams))

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for stream in self.streams:
            for i in stream:
                key = f"{i.kind.value}{'_POST' if i.kind is Kind.RECV and i.post else ''}"
                out[key] += 1
        return dict(out)


def _input_message(problem: Problem, a: Action, group: int) -> tuple[Message, int] | None:
    """The message `a` consumes and the local rank producing it, or None (stage 0 F, last-stage B)."""
    spec = problem.model(a.model)
    if a.kind is Kind.F and a.stage > 0:
        src = spec.placement[a.replica][a.stage - 1]
        return Message(a.model, group, a.replica, a.stage - 1, a.microbatch, False), src
    if a.kind is Kind.B and a.stage < spec.stages - 1:
        src = spec.placement[a.replica][a.stage + 1]
        return Message(a.model, group, a.replica, a.stage + 1, a.microbatch, True), src
    return None


def _output_message(problem: Problem, a: Action, group: int) -> tuple[Message, int] | None:
    spec = problem.model(a.model)
    if a.kind is Kind.F and a.stage < spec.stages - 1:
        dst = spec.placement[a.replica][a.stage + 1]
        return Message(a.model, group, a.replica, a.stage, a.microbatch, False), dst
    if a.kind is Kind.B and a.stage > 0:
        dst = spec.placement[a.replica][a.stage - 1]
        return Message(a.model, group, a.replica, a.stage, a.microbatch, True), dst
    return None


def grad_peers(problem: Problem, dp: int, model: str, stage: int) -> tuple[int, ...]:
    """Global ranks holding (model, stage) over all replicas and data-parallel groups."""
    spec = problem.model(model)
    n = problem.ranks
    return tuple(g * n + spec.placement[r][stage] for g in range(dp) for r in range(spec.replicas))


def lower(
    problem: Problem, schedule: Schedule, *, dp: int = 1, prefetch: int = 1, optimizer_steps: bool = True
) -> Program:
    """Compile `schedule` (one fused group, local ranks 0..N-1) into streams for `dp` fused groups.

    optimizer_steps=False: no OPTIMIZER_STEP at the end (a forward-only schedule: inference); the executor
    then waits for its sends when its stream ends, and `check_program` requires every send matched.

    prefetch: a receive is posted this many compute instructions before its consumer (at least), and never
    after an earlier message of the same channel: posts follow the sender's order, so in-order matching holds
    even where the consumer runs micro-batches in another order than the producer.
    """
    if prefetch < 0:
        raise ValueError(f"prefetch={prefetch} must be >= 0")
    n = problem.ranks
    if len(schedule.ranks) != n:
        raise LoweringError(f"schedule has {len(schedule.ranks)} rank lists, the problem {n} ranks")
    # Sender order of every channel (src, dst, model), local ranks: the same in every fused group.
    sent: dict[tuple[int, int, str], list[Message]] = defaultdict(list)
    for k, rank in enumerate(schedule.ranks):
        for a in rank:
            produced = _output_message(problem, a, 0)
            if produced is not None and produced[1] != k:
                sent[(k, produced[1], a.model)].append(produced[0])
    last_b: dict[tuple[int, str, int], int] = {}
    for k, rank in enumerate(schedule.ranks):
        for i, a in enumerate(rank):
            if a.kind is Kind.B:
                last_b[(k, a.model, a.stage)] = i

    streams: list[tuple[Instr, ...]] = [() for _ in range(n * dp)]
    for k, rank in enumerate(schedule.ranks):
        # consumption index of every incoming message (local group 0 naming)
        consumed: dict[Message, int] = {}
        for i, a in enumerate(rank):
            inp = _input_message(problem, a, 0)
            if inp is not None and inp[1] != k:
                consumed[inp[0]] = i
        # post deadline: prefetch before its consumer, and no later than any later message of its channel
        posts_at: dict[int, list[tuple[int, int, Message, int]]] = defaultdict(list)
        for (src, dst, _model), msgs in sorted(sent.items()):
            if dst != k:
                continue
            deadline = len(rank)
            for j in range(len(msgs) - 1, -1, -1):
                if msgs[j] not in consumed:
                    raise LoweringError(f"rank {k} never consumes {msgs[j]} sent by rank {src}")
                deadline = min(deadline, max(0, consumed[msgs[j]] - prefetch))
                posts_at[deadline].append((src, j, msgs[j], src))
        for g in range(dp):
            base = g * n
            stream: list[Instr] = []

            def shift(m: Message, g: int = g) -> Message:
                return Message(m.model, g, m.replica, m.stage, m.microbatch, m.grad)

            for i, a in enumerate(rank):
                for src, _j, msg, _ in sorted(posts_at.get(i, []), key=lambda x: (x[0], x[2].model, x[1])):
                    stream.append(
                        Instr(Kind.RECV, msg.model, g, message=shift(msg), peer=base + src, post=True)
                    )
                inp = _input_message(problem, a, g)
                if inp is not None and inp[1] != k:
                    stream.append(
                        Instr(Kind.RECV, a.model, g, message=inp[0], peer=base + inp[1], post=False)
                    )
                stream.append(Instr(a.kind, a.model, g, action=a, needs=inp[0] if inp else None))
                res = _output_message(problem, a, g)
                if res is not None and res[1] != k:
                    stream.append(Instr(Kind.SEND, a.model, g, message=res[0], peer=base + res[1]))
                if a.kind is Kind.B and last_b[(k, a.model, a.stage)] == i:
                    peers = grad_peers(problem, dp, a.model, a.stage)
                    if len(peers) > 1:
                        stream.append(Instr(Kind.REDUCE_GRAD, a.model, g, stage=a.stage, peers=peers))
            for m in problem.model_names() if optimizer_steps else ():
                stream.append(Instr(Kind.OPTIMIZER_STEP, m, g, peers=tuple(range(n * dp))))
            streams[base + k] = tuple(stream)
    return Program(tuple(streams), n, dp, tuple(problem.model_names()))


def check_program(program: Program) -> None:
    """Execute `program` under strict in-order matching; raise LoweringError on a mismatch or a deadlock.

    Blocking points: a RECV wait (its matched send must have been issued), an OPTIMIZER_STEP (every send of
    this rank matched by a posted receive, every reduction launched by all its members, then a blocking
    collective over all ranks for the gradient norm). Compute, SEND, RECV posts and REDUCE_GRAD launches never
    block. Data dependencies are checked too: a compute's input was received or produced earlier on this rank.
    """
    streams = program.streams
    nranks = len(streams)
    sends: dict[tuple[int, int, str], list[Message]] = defaultdict(list)
    posts: dict[tuple[int, int, str], list[Message]] = defaultdict(list)
    post_index: dict[tuple[int, Message], tuple[tuple[int, int, str], int]] = {}
    my_sends: list[list[tuple[tuple[int, int, str], int]]] = [[] for _ in range(nranks)]
    launches: dict[tuple[str, int, tuple[int, ...]], dict[int, int]] = defaultdict(dict)
    my_reduces: list[list[tuple[tuple[str, int, tuple[int, ...]], int]]] = [[] for _ in range(nranks)]
    norm_arrivals: dict[str, set[int]] = defaultdict(set)
    available: list[set[Message]] = [set() for _ in range(nranks)]
    done: list[set[tuple[Action, int]]] = [set() for _ in range(nranks)]
    pointer = [0] * nranks

    def blocked_on(k: int, ins: Instr) -> str | None:
        """None if `ins` can run now on rank k, else what it waits for."""
        if ins.kind is Kind.RECV and not ins.post:
            assert ins.message is not None
            posted = post_index.get((k, ins.message))
            if posted is None:
                raise LoweringError(f"rank {k}: waits for {ins.message} that it never posted")
            channel, idx = posted
            if len(sends[channel]) <= idx:
                return f"{ins} (rank {ins.peer} has sent {len(sends[channel])} of {idx + 1})"
            return None
        if ins.kind is Kind.OPTIMIZER_STEP:
            for channel, idx in my_sends[k]:
                if channel[2] == ins.model and len(posts[channel]) <= idx:
                    return f"{ins}: send #{idx} to rank {channel[1]} not yet received"
            for group_key, idx in my_reduces[k]:
                late = [p for p in group_key[2] if launches[group_key].get(p, 0) <= idx]
                if group_key[0] == ins.model and late:
                    return f"{ins}: REDUCE_GRAD {group_key[0]}.s{group_key[1]} not launched by ranks {late}"
            norm_arrivals[ins.model].add(k)
            if len(norm_arrivals[ins.model]) < nranks:
                return f"{ins}: norm collective, ranks {sorted(set(range(nranks)) - norm_arrivals[ins.model])} missing"
        return None

    def execute(k: int, ins: Instr) -> None:
        if ins.kind is Kind.RECV:
            assert ins.message is not None
            channel = (ins.peer, k, ins.model)
            if ins.post:
                idx = len(posts[channel])
                posts[channel].append(ins.message)
                post_index[(k, ins.message)] = (channel, idx)
                _match(channel, idx)
            else:
                available[k].add(ins.message)
        elif ins.kind is Kind.SEND:
            assert ins.message is not None
            channel = (k, ins.peer, ins.model)
            idx = len(sends[channel])
            sends[channel].append(ins.message)
            my_sends[k].append((channel, idx))
            _match(channel, idx)
        elif ins.kind in (Kind.F, Kind.B):
            assert ins.action is not None
            a = ins.action
            if ins.needs is not None and ins.needs not in available[k]:
                raise LoweringError(
                    f"rank {k}: {ins} runs before its input {ins.needs} arrived or was produced"
                )
            if (
                a.kind is Kind.B
                and (Action(a.model, a.replica, a.stage, Kind.F, a.microbatch), ins.group) not in done[k]
            ):
                raise LoweringError(f"rank {k}: {ins} runs before its forward")
            done[k].add((a, ins.group))
            out = Message(a.model, ins.group, a.replica, a.stage, a.microbatch, a.kind is Kind.B)
            available[k].add(out)  # a local consumer (same rank) may use it
        elif ins.kind is Kind.REDUCE_GRAD:
            key = (ins.model, ins.stage, ins.peers)
            if k not in ins.peers:
                raise LoweringError(f"rank {k}: {ins} but rank {k} is not in its group")
            n = launches[key].get(k, 0)
            launches[key][k] = n + 1
            my_reduces[k].append((key, n))

    def _match(channel: tuple[int, int, str], idx: int) -> None:
        if idx < len(sends[channel]) and idx < len(posts[channel]):
            s, r = sends[channel][idx], posts[channel][idx]
            if s != r:
                raise LoweringError(
                    f"mismatch on channel rank {channel[0]} -> rank {channel[1]} ({channel[2]}): message #{idx} "
                    f"is {s} on the sender but {r} on the receiver"
                )

    remaining = sum(len(s) for s in streams)
    while remaining:
        progressed = False
        for k in range(nranks):
            while pointer[k] < len(streams[k]):
                ins = streams[k][pointer[k]]
                if blocked_on(k, ins) is not None:
                    break
                execute(k, ins)
                pointer[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waits = [
                f"rank {k} at instruction {pointer[k]}: {blocked_on(k, streams[k][pointer[k]])}"
                for k in range(nranks)
                if pointer[k] < len(streams[k])
            ]
            raise LoweringError("deadlock: no rank can proceed:\n  - " + "\n  - ".join(waits[:16]))
    for channel in set(sends) | set(posts):
        if len(sends[channel]) != len(posts[channel]):
            raise LoweringError(
                f"channel rank {channel[0]} -> rank {channel[1]} ({channel[2]}): {len(sends[channel])} sends "
                f"but {len(posts[channel])} receives"
            )
    for key, counts in launches.items():
        if len(set(counts.get(p, 0) for p in key[2])) != 1:
            raise LoweringError(
                f"REDUCE_GRAD {key[0]}.s{key[1]}: launch counts differ over {key[2]}: {counts}"
            )


def lower_checked(
    problem: Problem, schedule: Schedule, *, dp: int = 1, prefetch: int = 1, optimizer_steps: bool = True
) -> Program:
    """`lower` then `check_program`: the program every rank will run, proven free of deadlock and mismatch."""
    program = lower(problem, schedule, dp=dp, prefetch=prefetch, optimizer_steps=optimizer_steps)
    check_program(program)
    return program


def streams_for(program: Program, rank: int) -> Sequence[Instr]:
    return program.streams[rank]
