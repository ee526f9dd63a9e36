"""Lowering: a fused schedule (per-rank F/B or F/I/W lists of `rlhfuse.pipeline`) -> per-rank instruction streams.

A stream holds compute (F, B; or, split backward, I and W: I computes the input gradient and sends it upstream like
B, W the weight gradients later from what I kept, on its rank only), point-to-point communication (RECV posted
early, waited just before use; SEND right after the producing compute), gradient reduction (REDUCE_GRAD, launched
asynchronously after the op that finishes a stage's weight gradients: its last B or W) and the optimizer step
(OPTIMIZER_STEP, which first waits for every send and reduction of the model).

Deadlock freedom is proven, not hoped for: `check_program` executes the streams under NCCL's point-to-point
semantics, the strictest we run on: one FIFO stream per (process group, rank pair), both directions sharing it,
each op run to completion (a send together with its receive) before the next starts, no tags; a collective
completes when every member of its group has launched its k-th operation on that group. Messages travel on one
group per model and direction (`p2p_group_key`); the single group per model used before deadlocks there (rank 0
[recv dgrad0, send act1], rank 1 [recv act1, send dgrad0]) and is rejected. Any schedule the pipeline simulator
accepts lowers into a program this check accepts (tested on many random schedules, up to 64 ranks), and the
multi-process tests run the streams under the same rule on gloo (`rlhfuse.distributed.ordering`).

Pure code: no process group, no tensors.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rlhfuse.pipeline.ir import COMPUTE_KINDS, Action, Kind, Schedule
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

    kind: F / B / I / W (compute `action`), SEND / RECV (`message` to / from `peer`; RECV with `post=True` posts the
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
        if self.kind in COMPUTE_KINDS:
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


# the ops that compute and send a stage's input gradient (B, or I of a split backward), and those that finish its
# weight gradients (B, or W)
INPUT_GRAD_KINDS = (Kind.B, Kind.I)
WEIGHT_GRAD_KINDS = (Kind.B, Kind.W)


def _input_message(problem: Problem, a: Action, group: int) -> tuple[Message, int] | None:
    """The message `a` consumes and the local rank producing it, or None (stage 0 F, last-stage B or I, W)."""
    spec = problem.model(a.model)
    if a.kind is Kind.F and a.stage > 0:
        src = spec.placement[a.replica][a.stage - 1]
        return Message(a.model, group, a.replica, a.stage - 1, a.microbatch, False), src
    if a.kind in INPUT_GRAD_KINDS and a.stage < spec.stages - 1:
        src = spec.placement[a.replica][a.stage + 1]
        return Message(a.model, group, a.replica, a.stage + 1, a.microbatch, True), src
    return None


def _output_message(problem: Problem, a: Action, group: int) -> tuple[Message, int] | None:
    spec = problem.model(a.model)
    if a.kind is Kind.F and a.stage < spec.stages - 1:
        dst = spec.placement[a.replica][a.stage + 1]
        return Message(a.model, group, a.replica, a.stage, a.microbatch, False), dst
    if a.kind in INPUT_GRAD_KINDS and a.stage > 0:
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
            if a.kind in WEIGHT_GRAD_KINDS:
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
                if a.kind in WEIGHT_GRAD_KINDS and last_b[(k, a.model, a.stage)] == i:
                    peers = grad_peers(problem, dp, a.model, a.stage)
                    if len(peers) > 1:
                        stream.append(Instr(Kind.REDUCE_GRAD, a.model, g, stage=a.stage, peers=peers))
            for m in problem.model_names() if optimizer_steps else ():
                stream.append(Instr(Kind.OPTIMIZER_STEP, m, g, peers=tuple(range(n * dp))))
            streams[base + k] = tuple(stream)
    return Program(tuple(streams), n, dp, tuple(problem.model_names()))


P2PGroupKey = Hashable
"""Which process group a point-to-point message travels on (`p2p_group_key`)."""

GroupOf = Callable[[Message, int, int], P2PGroupKey]
"""A message's process group, given the low and the high rank of the pair it travels between."""

StreamModel = Literal["pair", "rank"]
"""How NCCL runs a group's point-to-point ops: one stream per (group, rank pair), or one per (group, rank) — all
of a rank's ops on the group in one stream, whatever the peer (a communicator created eagerly; PyTorch #132900)."""

STREAM_MODELS: tuple[StreamModel, ...] = ("pair", "rank")


def p2p_group_key(message: Message, lo: int, hi: int) -> tuple[str, str, int, int]:
    """The process group of a message between ranks `lo` < `hi`: one per model, direction ("act": activations to
    the next stage, "grad": input gradients to the previous one) and rank pair. On a group the two ranks then
    exchange messages in one direction only, in the sender's order, which the receiver's posts follow (`lower`):
    NCCL runs that under either stream model, since the group's one pair is its one stream (one group per model,
    both directions on it, cannot run it: see `check_program`)."""
    return (message.model, "grad" if message.grad else "act", lo, hi)


def check_program(
    program: Program, group_of: GroupOf = p2p_group_key, streams_per: StreamModel = "pair"
) -> None:
    """Execute `program` under NCCL's point-to-point semantics; raise LoweringError on a mismatch or a deadlock.

    Transport model (the strictest we run on, NCCL's): every message travels on the process group `group_of`
    gives it; each (group, rank pair) — or, with `streams_per="rank"`, each (group, rank), whatever the peer — is
    one FIFO stream per rank, both directions sharing it. A rank's sends and receive posts enter their stream in
    issue order and never block the rank; only the op at the head of a rank's stream is running, and it completes
    only together with the head of the peer's stream on the same group, which must be its counterpart (a send of
    the same message to this rank). Two heads that are both sends or both receives, or a head whose peer's head
    is an op with a third rank, wait: a cycle of such waits is a deadlock, reported with what every rank waits
    for. No tags: counterpart heads carrying different messages are a mismatch.

    Blocking points: a RECV wait (its receive completed), an OPTIMIZER_STEP (every send of this model completed,
    every reduction launched by all its members, then a blocking collective over all ranks for the gradient
    norm), the end of the stream (every send completed). Compute, SEND, RECV posts and REDUCE_GRAD launches never
    block. Data dependencies are checked too: a compute's input was received or produced earlier on this rank.
    """
    streams = program.streams
    nranks = len(streams)
    # (group, low rank, high rank), or (group,) per rank -> rank -> its ops on its stream not yet completed:
    # (send?, message, peer)
    queues: dict[tuple[Any, ...], dict[int, deque[tuple[bool, Message, int]]]] = defaultdict(
        lambda: defaultdict(deque)
    )
    received: list[set[Message]] = [set() for _ in range(nranks)]  # receives completed
    open_sends: list[dict[str, int]] = [
        defaultdict(int) for _ in range(nranks)
    ]  # model -> sends not completed
    launches: dict[tuple[str, int, tuple[int, ...]], dict[int, int]] = defaultdict(dict)
    my_reduces: list[list[tuple[tuple[str, int, tuple[int, ...]], int]]] = [[] for _ in range(nranks)]
    norm_arrivals: dict[str, set[int]] = defaultdict(set)
    posted: list[set[Message]] = [set() for _ in range(nranks)]
    available: list[set[Message]] = [set() for _ in range(nranks)]
    done: list[set[tuple[Action, int]]] = [set() for _ in range(nranks)]
    pointer = [0] * nranks

    def stream_key(k: int, peer: int, message: Message) -> tuple[Any, ...]:
        lo, hi = min(k, peer), max(k, peer)
        group = group_of(message, lo, hi)
        return (group, lo, hi) if streams_per == "pair" else (group,)

    def advance(key: tuple[Any, ...]) -> None:
        """Complete the heads of the ranks' streams on one group while two of them are counterparts."""
        sides = queues[key]
        progressed = True
        while progressed:
            progressed = False
            for k in list(sides):
                if not sides[k]:
                    continue
                send_a, msg_a, peer = sides[k][0]
                other = sides.get(peer)
                if not other or other[0][2] != k or other[0][0] == send_a:
                    continue  # the peer runs nothing here, an op with a third rank, or the same direction
                msg_b = other[0][1]
                sender, receiver = (k, peer) if send_a else (peer, k)
                if msg_a != msg_b:
                    sent, wanted = (msg_a, msg_b) if send_a else (msg_b, msg_a)
                    raise LoweringError(
                        f"mismatch on channel rank {sender} -> rank {receiver} (group {key[0]}): the sender's next "
                        f"message on the stream is {sent} but the receiver's next receive is {wanted}"
                    )
                sides[k].popleft()
                other.popleft()
                received[receiver].add(msg_a)
                open_sends[sender][msg_a.model] -= 1
                progressed = True

    def head_of(k: int, key: tuple[Any, ...]) -> str:
        side = queues[key][k]
        if not side:
            return "nothing"
        send, msg, peer = side[0]
        return f"{'SEND' if send else 'RECV'} {msg} {'->' if send else '<-'} {peer}"

    def blocked_on(k: int, ins: Instr) -> str | None:
        """None if `ins` can run now on rank k, else what it waits for."""
        if ins.kind is Kind.RECV and not ins.post:
            assert ins.message is not None
            if ins.message not in posted[k]:
                raise LoweringError(f"rank {k}: waits for {ins.message} that it never posted")
            if ins.message in received[k]:
                return None
            key = stream_key(k, ins.peer, ins.message)
            return (
                f"{ins} (stream of group {key[0]} with rank {ins.peer}: rank {k} runs {head_of(k, key)}, rank "
                f"{ins.peer} runs {head_of(ins.peer, key)})"
            )
        if ins.kind is Kind.OPTIMIZER_STEP:
            if open_sends[k][ins.model] > 0:
                return f"{ins}: {open_sends[k][ins.model]} send(s) not yet received"
            for group_key, idx in my_reduces[k]:
                late = [p for p in group_key[2] if launches[group_key].get(p, 0) <= idx]
                if group_key[0] == ins.model and late:
                    return f"{ins}: REDUCE_GRAD {group_key[0]}.s{group_key[1]} not launched by ranks {late}"
            norm_arrivals[ins.model].add(k)
            if len(norm_arrivals[ins.model]) < nranks:
                return f"{ins}: norm collective, ranks {sorted(set(range(nranks)) - norm_arrivals[ins.model])} missing"
        return None

    def execute(k: int, ins: Instr) -> None:
        if ins.kind in (Kind.RECV, Kind.SEND) and (ins.kind is Kind.SEND or ins.post):
            assert ins.message is not None
            send = ins.kind is Kind.SEND
            if send:
                open_sends[k][ins.message.model] += 1
            else:
                posted[k].add(ins.message)
            key = stream_key(k, ins.peer, ins.message)
            queues[key][k].append((send, ins.message, ins.peer))
            advance(key)
        elif ins.kind is Kind.RECV:
            assert ins.message is not None
            available[k].add(ins.message)
        elif ins.kind in COMPUTE_KINDS:
            assert ins.action is not None
            a = ins.action
            if ins.needs is not None and ins.needs not in available[k]:
                raise LoweringError(
                    f"rank {k}: {ins} runs before its input {ins.needs} arrived or was produced"
                )
            before = {Kind.B: Kind.F, Kind.I: Kind.F, Kind.W: Kind.I}.get(a.kind)
            if (
                before is not None
                and (Action(a.model, a.replica, a.stage, before, a.microbatch), ins.group) not in done[k]
            ):
                raise LoweringError(f"rank {k}: {ins} runs before its {before.value}")
            done[k].add((a, ins.group))
            if a.kind is not Kind.W:  # W produces no message
                out = Message(a.model, ins.group, a.replica, a.stage, a.microbatch, a.kind is not Kind.F)
                available[k].add(out)  # a local consumer (same rank) may use it
        elif ins.kind is Kind.REDUCE_GRAD:
            reduce_key = (ins.model, ins.stage, ins.peers)
            if k not in ins.peers:
                raise LoweringError(f"rank {k}: {ins} but rank {k} is not in its group")
            n = launches[reduce_key].get(k, 0)
            launches[reduce_key][k] = n + 1
            my_reduces[k].append((reduce_key, n))

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
    for stream, sides in queues.items():
        left = {
            k: [f"{'SEND' if s else 'RECV'} {m}" for s, m, _ in side] for k, side in sides.items() if side
        }
        if left:
            where = f"between ranks {stream[1]} and {stream[2]}" if len(stream) == 3 else "(per rank)"
            raise LoweringError(
                f"stream of group {stream[0]} {where}: ops never completed (a send without its receive, or a "
                f"deadlock at the end of the streams): {left}"
            )
    for reduced, counts in launches.items():
        if len(set(counts.get(p, 0) for p in reduced[2])) != 1:
            raise LoweringError(
                f"REDUCE_GRAD {reduced[0]}.s{reduced[1]}: launch counts differ over {reduced[2]}: {counts}"
            )


def lower_checked(
    problem: Problem, schedule: Schedule, *, dp: int = 1, prefetch: int = 1, optimizer_steps: bool = True
) -> Program:
    """`lower` then `check_program` under both of NCCL's stream models: the program every rank will run, proven
    free of deadlock and mismatch whichever model the job's NCCL follows."""
    program = lower(problem, schedule, dp=dp, prefetch=prefetch, optimizer_steps=optimizer_steps)
    for model in STREAM_MODELS:
        check_program(program, streams_per=model)
    return program


def streams_for(program: Program, rank: int) -> Sequence[Instr]:
    return program.streams[rank]
