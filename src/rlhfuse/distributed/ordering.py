"""NCCL's point-to-point ordering, emulated on gloo: a documented debug mode, on by default in the test suite.

Why: PyTorch's NCCL backend runs every unbatched `isend` / `irecv` of a process group on one stream per (group,
rank pair), both directions sharing it, or — when the group's communicator was created eagerly (a `device_id`
given to `init_process_group`, as Fabric does; PyTorch PR #132900, #154132) — on the group's one stream for all
of a rank's peers: an op starts only when the op issued before it on that stream has finished, and a send finishes
only when its matching receive runs (gloo does that too: its sends wait for the receiver). gloo, though, runs every
op as soon as it is issued, so an order that hangs under NCCL (rank 0 issues [recv B, send A], rank 1 [recv A,
send B], on one group) completes on gloo. With this mode on, each stream of a rank gets one worker thread that
issues the rank's ops on it to gloo one after another, each waited to completion before the next starts: exactly
NCCL's rule, so the old order hangs here too, and a bounded wait (`QueuedWork.wait(timeout=...)`) turns the hang
into an error naming the op it waits behind.

On: `RLHFUSE_NCCL_ORDER=1` (or `pair`: one stream per (group, rank pair)) or `RLHFUSE_NCCL_ORDER=rank` (one
stream per (group, rank), the stricter model); tests/conftest.py sets it and every process started by a test
inherits it. The runtime's point-to-point groups hold one rank pair each, so both models run its programs alike.
Only point-to-point ops on *device* groups are queued; control groups (`rlhfuse.distributed.cpu_group`, gloo in
production too, the only ones that may use tags or receive from any rank) keep gloo's own semantics. Collectives
are not queued: NCCL runs a group's collectives on the group's own stream, in issue order, which is what gloo does.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

ENV = "RLHFUSE_NCCL_ORDER"

_CONTROL: set[int] = set()  # id() of the control groups (gloo wherever the job runs)


def enabled() -> bool:
    """Whether point-to-point ops on device groups follow NCCL's ordering (`RLHFUSE_NCCL_ORDER`)."""
    return os.environ.get(ENV, "0") not in ("", "0", "false", "False")


def stream_model() -> Literal["pair", "rank"]:
    """Which NCCL stream model the emulation follows: one stream per (group, rank pair) (`1`, `pair`) or one per
    (group, rank) (`rank`)."""
    return "rank" if os.environ.get(ENV, "").strip().lower() == "rank" else "pair"


def mark_control(group: Any) -> None:
    """Register `group` as a control group (gloo in production: tags and any-source receives allowed)."""
    _CONTROL.add(id(group))


def is_control(group: Any) -> bool:
    return group is not None and id(group) in _CONTROL


def emulates(group: Any) -> bool:
    """Whether ops on `group` are queued NCCL-style: the mode is on, the group is gloo and not a control group."""
    if not enabled() or is_control(group):
        return False
    return str(dist.get_backend(group)) == "gloo"


@dataclass
class QueuedWork:
    """A point-to-point op waiting in its (group, peer) queue, then running on gloo: the `Work` handle callers get.

    `wait(timeout)` blocks until the op completed; a timeout raises RuntimeError naming the op and the op its queue
    was running (what it waits behind), as NCCL would have hung there."""

    op: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int
    queue: PairQueue
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def __str__(self) -> str:
        arrow = "->" if self.op == "send" else "<-"
        return f"{self.op} {tuple(self.tensor.shape)} {self.tensor.dtype} {arrow} rank {self.peer}"

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        if not self.done.wait(seconds):
            raise RuntimeError(
                f"NCCL-ordering emulation: {self} on {self.queue.name} did not complete within {seconds:.0f}s; its "
                f"stream is running {self.queue.running or 'nothing'} (ops run one after another there, each to "
                f"completion, as under NCCL)"
            )
        if self.error is not None:
            raise RuntimeError(f"{self} on {self.queue.name} failed: {self.error}") from self.error
        return True


class PairQueue:
    """One stream of this rank: (group, peer), or the whole group under the (group, rank) model (`peer` None); a
    daemon thread issuing the queued ops to gloo in issue order, each waited to completion (with the group's own
    timeout) before the next starts."""

    def __init__(self, group: Any, peer: int | None) -> None:
        self.group, self.peer = group, peer
        self.name = f"group {_group_name(group)}" + ("" if peer is None else f" with rank {peer}")
        self.running: QueuedWork | None = None
        self._ops: queue.SimpleQueue[QueuedWork] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=f"nccl-order {self.name}", daemon=True)
        self._thread.start()

    def submit(self, op: Literal["send", "recv"], tensor: torch.Tensor, peer: int) -> QueuedWork:
        work = QueuedWork(op, tensor, peer, self)
        self._ops.put(work)
        return work

    def _serve(self) -> None:
        while True:
            work = self._ops.get()
            self.running = work
            try:
                start: Callable[..., Any] = dist.isend if work.op == "send" else dist.irecv
                start(work.tensor, work.peer, group=self.group).wait()
            except BaseException as err:  # handed to the waiter, which raises it in the caller's thread
                work.error = err
            self.running = None
            work.done.set()


_QUEUES: dict[tuple[int, int | None], PairQueue] = {}
_LOCK = threading.Lock()


def submit(op: Literal["send", "recv"], tensor: torch.Tensor, peer: int, group: Any) -> QueuedWork:
    """Queue `op` on this rank's stream: (group, peer), or the group's one stream under the (group, rank) model."""
    key = (id(group) if group is not None else 0, None if stream_model() == "rank" else peer)
    with _LOCK:
        if key not in _QUEUES:
            _QUEUES[key] = PairQueue(group, key[1])
        stream = _QUEUES[key]
    return stream.submit(op, tensor, peer)


def _group_name(group: Any) -> str:
    if group is None:
        return "world"
    try:
        return f"{dist.get_process_group_ranks(group)}#{id(group) % 10_000}"
    except (RuntimeError, ValueError):
        return f"#{id(group) % 10_000}"
