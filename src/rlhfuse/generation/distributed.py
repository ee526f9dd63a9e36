"""`DistributedCoordinator`: one generation instance per process of an initialised torch.distributed group.

Every rank receives the whole batch of requests and keeps its share (`balance`, the same on every rank). With a
migration threshold the ranks step in lockstep, all-gathering their unfinished counts after every step; the first
time the total is at or below Rt they all run the same `migrate` (`rlhfuse.generation.coordinator`) over a
`PointToPoint` transport: the sources send their tail samples to the destinations (request + tokens, and the
slot's KV cache for `kv`, as one `SampleBatch` message). After that no collective is needed: destinations finish
the tail, the other ranks are free. Without a threshold the ranks never communicate during generation.

A peer that dies or stops answering makes the communication raise (gloo: connection closed, or the group's
timeout); that is re-raised as `InstanceFailure` naming the rank, the step and the peers, never a hang past the
group's timeout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from rlhfuse.generation.coordinator import MigrationReport, balance, migrate
from rlhfuse.generation.engine import GenerationEngine, SampleRequest
from rlhfuse.generation.transport import InstanceFailure, PointToPoint, collective_device
from rlhfuse.generation.wire import SampleBatch
from rlhfuse.planner.migration import should_migrate

__all__ = ["DistributedCoordinator", "InstanceFailure", "gather_finished"]


@dataclass
class DistributedCoordinator:
    """Drives this rank's `engine`; call `run` on every rank of `group` with the same requests and threshold."""

    engine: GenerationEngine
    bs_max: int
    mechanism: str = "auto"
    link_bytes_per_s: float = 1e9
    group: dist.ProcessGroup | None = None
    # All-gather the unfinished counts every `sync_every` steps (1 = exact Rt; more = less synchronisation, the
    # migration then starts up to sync_every - 1 steps late).
    sync_every: int = 1
    report: MigrationReport = field(default_factory=MigrationReport)

    transport: PointToPoint = field(init=False)

    def __post_init__(self) -> None:
        self.transport = PointToPoint(collective_device(self.group, self.engine.device), self.group)

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world(self) -> int:
        return self.transport.world

    def run(self, requests: Sequence[SampleRequest], *, threshold: int) -> Iterator[SampleRequest]:
        """Yield this rank's samples as they finish (including tail samples that migrated here)."""
        self.report = MigrationReport(threshold=threshold)
        engine = self.engine
        engine.add(balance(requests, self.world)[self.rank])
        step = 0
        lockstep = threshold > 0
        while lockstep:
            if engine.has_work():
                yield from engine.step()
            step += 1
            if step % self.sync_every:
                continue  # every rank counts the same loop iterations, so all reach the same sync points
            self.transport.step = step
            counts = self.transport.all_gather_counts(engine.num_unfinished)
            total = sum(counts)
            if total == 0:
                return
            if should_migrate(total, threshold):
                migrate(
                    {self.rank: engine},
                    counts,
                    self.transport,
                    bs_max=self.bs_max,
                    mechanism=self.mechanism,
                    link_bytes_per_s=self.link_bytes_per_s,
                    report=self.report,
                )
                lockstep = False
        while engine.has_work():
            yield from engine.step()


def gather_finished(
    samples: Sequence[SampleRequest], group: dist.ProcessGroup | None = None
) -> list[SampleRequest]:
    """Every rank's finished samples on every rank, in row order."""
    transport = PointToPoint(collective_device(group), group)
    parts = transport.all_gather(SampleBatch.of(samples).pack(transport.device))
    return sorted((r for p in parts for r in SampleBatch.unpack(p).requests), key=lambda r: r.row)
