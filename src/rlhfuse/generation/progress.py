"""Asynchronous progress between generation processes (the fused rollout's two small channels, docs/paper.md §2).

The lockstep all-gather of unfinished counts after every decode step made every rank wait for the slowest one at
every step. Here no rank waits while it generates:

- `CountWatch` (tag 11 / 12): every rank but 0 sends its unfinished count to rank 0 (non-blocking) when it
  changes; rank 0 polls for them after its own steps and, when its view of the total is at or below Rt (the
  counts only fall, so the view is never early), sends every rank the signal to migrate. Each peer answers the
  signal with a final message, so no receive is left posted when the batch ends.
- `StealChannel` (tag 13): after the migration a freed rank asks a destination for work (one small message);
  the destination polls for requests between its decode steps (and its inference micro-batches) and answers
  with finished, not yet inferred samples (a `SampleBatch` over the `PointToPoint` transport), or with an empty
  batch once it has none left and has finished decoding.

Every tensor handed to a send or receive lives on the given `device`; `control_group` gives the group and device
these messages use (the rollout's group on gloo, a gloo group over the same ranks on other backends).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhfuse import distributed

COUNT_TAG, GO_TAG, STEAL_TAG = 11, 12, 13
_FINAL, _FILLER = -1, -2  # a peer's last count message of a batch, and what fills the receives left posted
_POLL_SLEEP_S = 5e-5
"""An idle rank waiting for a message sleeps this long between polls (it shares the cores)."""


_EMPTY = -(2**62)
"""What a receive buffer holds until its message arrives."""


def _buffer(device: torch.device) -> torch.Tensor:
    return torch.full((1,), _EMPTY, dtype=torch.int64, device=device)


def control_group(group: Any = None) -> tuple[Any, torch.device]:
    """The group and device of these control messages: a gloo group over the ranks of `group` (itself on gloo)
    and the CPU (`rlhfuse.distributed.cpu_group`). Call on every rank of `group` together, as the fused
    rollout does."""
    return distributed.cpu_group(group), torch.device("cpu")


def _completed(work: distributed.Work | None, buf: torch.Tensor | None = None) -> bool:
    """Whether a non-blocking operation finished, without blocking. gloo's receives report completion only
    once waited on, but write the message into the buffer as it arrives: on the CPU a receive is complete when
    its one-int64 buffer no longer holds `_EMPTY` (then `wait` returns at once)."""
    if work is None:
        return True
    if buf is not None and buf.device.type == "cpu":
        if int(buf[0]) == _EMPTY:
            return False
        work.wait()
        return True
    return work.is_completed()


@dataclass
class CountWatch:
    """Watch the total unfinished count of `group` for Rt = `threshold` without synchronising the ranks.

    Rank 0 keeps `window` receives posted per peer, so counts flow in without a round trip each (a peer's
    newest count is read as soon as it lands); a peer ends its stream with a final message and `window - 1`
    fillers for the receives still posted, so none is left when the batch ends.

    `timeout_s`: a rank waiting idle (`wait_idle`) that has heard nothing new for that long (rank 0: no count
    from a peer; a peer: no signal) raises RuntimeError (a dead peer sends nothing, and a receive posted to it
    never completes); None waits without limit (a caller with its own watchdog)."""

    device: torch.device
    threshold: int
    group: Any | None = None
    window: int = 8
    timeout_s: float | None = None
    rank: int = field(init=False)
    world: int = field(init=False)
    counts: list[int] = field(init=False)
    _last: int = -1
    _sending: list[tuple[distributed.Work | None, torch.Tensor]] = field(default_factory=list)
    _recv: dict[int, deque[tuple[distributed.Work | None, torch.Tensor]]] = field(default_factory=dict)
    _go: tuple[distributed.Work | None, torch.Tensor] | None = None
    polls: int = 0
    poll_seconds: float = 0.0
    _news_at: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.rank, self.world = distributed.rank(self.group), distributed.world_size(self.group)
        self.counts = [-1] * self.world  # unknown until each rank's first message
        if self.rank == 0:
            for peer in range(1, self.world):
                self._recv[peer] = deque()
                for _ in range(self.window):
                    self._post(peer)
        else:
            buf = _buffer(self.device)
            self._go = (distributed.irecv(buf, self._world_rank(0), group=self.group, tag=GO_TAG), buf)

    def _world_rank(self, peer: int) -> int:
        """Rank `peer` of the group as point-to-point calls name it (its world rank)."""
        return distributed.global_rank(self.group, peer)

    def _post(self, peer: int) -> None:
        buf = _buffer(self.device)
        self._recv[peer].append(
            (distributed.irecv(buf, self._world_rank(peer), group=self.group, tag=COUNT_TAG), buf)
        )

    def _drain(self, *, until_final: bool) -> None:
        """Rank 0: read every count message that arrived (with `until_final`: until each peer's final one and
        its fillers)."""
        open_peers = {peer for peer, posted in self._recv.items() if posted}
        while open_peers:
            for peer in list(open_peers):
                posted = self._recv[peer]
                while posted and _completed(*posted[0]):
                    value = int(posted.popleft()[1].item())
                    self._news_at = time.perf_counter()
                    if value == _FINAL:  # the peer's last count message: the fillers follow
                        for work, _ in posted:
                            if work is not None:
                                work.wait()
                        posted.clear()
                    elif value >= 0:
                        self.counts[peer] = value
                        self._post(peer)
                if not posted:
                    open_peers.discard(peer)
            if not until_final or not open_peers:
                return
            time.sleep(_POLL_SLEEP_S)

    def update(self, unfinished: int) -> bool:
        """This rank's count after a step; True (on every rank, not necessarily at the same step) when the
        migration starts. Call until it returns True."""
        start = time.perf_counter()
        self.polls += 1
        try:
            if unfinished != self._last:
                self._news_at = time.perf_counter()  # this rank's own progress
            if self.rank != 0:
                if unfinished != self._last:
                    self._send(unfinished)
                assert self._go is not None
                if not _completed(*self._go):
                    return False
                for value in (_FINAL, *[_FILLER] * (self.window - 1)):
                    self._send(value)
                return True
            self.counts[0] = self._last = unfinished
            self._drain(until_final=False)
            if min(self.counts) < 0 or sum(self.counts) > self.threshold:
                return False
            go = torch.ones(1, dtype=torch.int64, device=self.device)
            works = [
                distributed.isend(go, self._world_rank(peer), group=self.group, tag=GO_TAG)
                for peer in range(1, self.world)
            ]
            self._drain(until_final=True)
            for work in works:
                if work is not None:
                    work.wait()
            return True
        finally:
            self.poll_seconds += time.perf_counter() - start

    def _send(self, value: int) -> None:
        self._last = value
        buf = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._sending.append(
            (distributed.isend(buf, self._world_rank(0), group=self.group, tag=COUNT_TAG), buf)
        )

    def close(self) -> None:
        for work, _ in self._sending:
            if work is not None:
                work.wait()
        self._sending = []

    def wait_idle(self) -> None:
        """An idle rank (no samples left) between two `update`s: let the others run (see `timeout_s`)."""
        quiet = time.perf_counter() - self._news_at
        if self.timeout_s is not None and quiet > self.timeout_s:
            silent = [p for p, c in enumerate(self.counts) if p and c != 0] if self.rank == 0 else [0]
            raise RuntimeError(
                f"rank {self.rank} heard nothing from rank(s) {silent} for {quiet:.0f} s (timeout {self.timeout_s:g} s)"
            )
        time.sleep(_POLL_SLEEP_S)


@dataclass
class StealChannel:
    """Work requests from freed ranks to destinations (the replies travel as `SampleBatch`es)."""

    device: torch.device
    group: Any | None = None
    _incoming: tuple[distributed.Work | None, torch.Tensor] | None = None

    def request(self, destination: int, rank: int) -> distributed.Work | None:
        """Ask `destination` for work (non-blocking; its reply is a `SampleBatch`, empty = no more work)."""
        buf = torch.tensor([rank], dtype=torch.int64, device=self.device)
        work = distributed.isend(
            buf, distributed.global_rank(self.group, destination), group=self.group, tag=STEAL_TAG
        )
        if work is not None:
            work.wait()
        return work

    def poll(self) -> int | None:
        """A destination: the rank asking for work, if a request has arrived (non-blocking)."""
        if self._incoming is None:
            buf = _buffer(self.device)
            self._incoming = (distributed.irecv(buf, None, group=self.group, tag=STEAL_TAG), buf)
        work, buf = self._incoming
        if not _completed(work, buf):
            return None
        self._incoming = None
        return int(buf.item())

    def wait(self) -> int:
        """A destination: the next request (blocking, sleeping between polls)."""
        while (asker := self.poll()) is None:
            time.sleep(_POLL_SLEEP_S)
        return asker
