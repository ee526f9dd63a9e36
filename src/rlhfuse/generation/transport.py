"""How samples travel between generation instances: a `Transport` moves `MigratingSample`s from instance `src`
to instance `dst` and sums a few numbers over every instance (so all pick the same mechanism).

- `InProcess`: every instance lives in this process (`Coordinator`); samples are handed over as objects.
- `PointToPoint`: one instance per rank of a torch.distributed group (`DistributedCoordinator`); each message is
  a `rlhfuse.generation.messages` dataclass packed by the one tensor codec (`rlhfuse.core.wire`) and sent as three
  tensors (frame, header, payload), created on the transport's device (the KV cache's: gloo on CPU, NCCL on GPU).

Any failure of a collective or a send/receive is raised as `InstanceFailure`, naming this instance, the step and
what was being exchanged, within the process group's timeout.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from rlhfuse import distributed
from rlhfuse.core.wire import Packed
from rlhfuse.generation.engine import MigratingSample
from rlhfuse.generation.messages import SampleBatch


class InstanceFailure(RuntimeError):
    """A generation instance (process) failed or stopped answering."""


class Transport(Protocol):
    """Moves samples between instances and sums figures over all of them."""

    def send(self, samples: list[MigratingSample], src: int, dst: int) -> None: ...

    def recv(self, src: int, dst: int) -> list[MigratingSample]: ...

    def all_sum(self, values: Sequence[float]) -> list[float]:
        """`values` summed over every instance's call (the same list everywhere)."""
        ...


@dataclass
class InProcess:
    """All instances in this process: samples handed over as they are (no copy); sums are the local ones
    (the caller already sums over every instance it drives)."""

    _queues: defaultdict[tuple[int, int], deque[list[MigratingSample]]] = field(
        default_factory=lambda: defaultdict(deque)
    )

    def send(self, samples: list[MigratingSample], src: int, dst: int) -> None:
        self._queues[(src, dst)].append(samples)

    def recv(self, src: int, dst: int) -> list[MigratingSample]:
        return self._queues[(src, dst)].popleft()

    def all_sum(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]


def collective_device(group: dist.ProcessGroup | None, data: torch.device | None = None) -> torch.device:
    """Where tensors for `group`'s collectives live (`rlhfuse.distributed.group_device`): the CPU for gloo; for
    NCCL the data's CUDA device, else this rank's current GPU."""
    return distributed.group_device(group, data)


@dataclass
class Sending:
    """Non-blocking sends in flight and the tensors they read (kept alive until `wait`)."""

    works: list[distributed.Work]
    tensors: tuple[torch.Tensor, ...]

    def wait(self) -> None:
        distributed.wait_all(self.works)


@dataclass
class PointToPoint:
    """One instance per rank of `group`; tensors for the wire and the collectives are created on `device`."""

    device: torch.device
    group: dist.ProcessGroup | None = None
    step: int = 0
    """The caller's step counter, named in failures."""

    @property
    def rank(self) -> int:
        return distributed.rank(self.group)

    @property
    def world(self) -> int:
        return distributed.world_size(self.group)

    def fail(self, what: str, err: Exception) -> InstanceFailure:
        return InstanceFailure(
            f"generation instance {self.rank} of {self.world}: {what} failed at step {self.step} ({err}); another "
            "generation process probably died (see its log) or stopped answering within the process group's "
            "timeout"
        )

    # ------------------------------------------------------------------ samples
    def send(self, samples: list[MigratingSample], src: int, dst: int) -> None:
        try:
            self.isend(SampleBatch(samples).pack(self.device), dst).wait()
        except RuntimeError as err:
            raise self.fail(f"moving {len(samples)} samples {src} -> {dst}", err) from err

    def recv(self, src: int, dst: int) -> list[MigratingSample]:
        try:
            _, packed = self.recv_packed(src)
        except RuntimeError as err:
            raise self.fail(f"receiving samples {src} -> {dst}", err) from err
        return SampleBatch.unpack(packed).samples

    # ------------------------------------------------------------------ packed messages
    def isend(self, packed: Packed, dst: int) -> Sending:
        """Non-blocking send of one message (decoding never waits on the receiver); wait on the result."""
        packed = packed.to(self.device)
        frame = torch.tensor(packed.frame, dtype=torch.int64, device=self.device)
        tensors = (frame, packed.header_H, packed.payload_N)
        peer = distributed.global_rank(self.group, dst)
        works = [distributed.isend(t, peer, group=self.group) for t in tensors]
        return Sending([w for w in works if w is not None], tensors)

    def recv_packed(self, src: int | None = None) -> tuple[int, Packed]:
        """(sender, message); `src=None` receives the next message from any rank (ranks of `group`)."""
        frame = torch.empty(2, dtype=torch.int64, device=self.device)
        peer = None if src is None else distributed.global_rank(self.group, src)
        sender = distributed.recv(frame, peer, group=self.group)  # a world rank
        packed = Packed.empty(frame.tolist(), self.device)
        distributed.recv(packed.header_H, sender, group=self.group)
        distributed.recv(packed.payload_N, sender, group=self.group)
        return distributed.rank_in(self.group, sender), packed

    def all_gather(self, packed: Packed) -> list[Packed]:
        """Every rank's message, in rank order (messages padded to the longest for the collective)."""
        return distributed.all_gather_packed(packed, self.device, group=self.group)

    def all_sum(self, values: Sequence[float]) -> list[float]:
        sums = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        try:
            distributed.all_reduce(sums, group=self.group)
        except RuntimeError as err:
            raise self.fail("agreeing on the migration mechanism", err) from err
        return [float(v) for v in sums.tolist()]

    def all_gather_counts(self, count: int) -> list[int]:
        mine = torch.tensor([count], dtype=torch.int64, device=self.device)
        try:
            out = distributed.all_gather(mine, group=self.group)
        except RuntimeError as err:
            raise self.fail("all-gathering the unfinished counts", err) from err
        return [int(t) for t in out]
