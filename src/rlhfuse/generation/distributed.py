"""One generation instance per process of an initialised torch.distributed group.

`decode_until_migration` is the one migration trigger of this layout, for generation alone
(`DistributedCoordinator`) and for the fused rollout (`rlhfuse.generation.fusion`): every rank decodes its share
while `CountWatch` (`rlhfuse.generation.progress`) watches the total unfinished count without a lockstep (no
per-step collective: no rank waits for the slowest one at every step); the first time the total is at or below
Rt every rank runs the same `migrate` (`rlhfuse.generation.coordinator`) over a `PointToPoint` transport: the
sources send their tail samples to the destinations (request + tokens, and the slot's KV cache for `kv`, as one
`SampleBatch` message). After that no collective is needed: destinations finish the tail, the other ranks are
free. Without a threshold the ranks never communicate during generation.

A peer that dies or stops answering makes the communication raise (gloo: connection closed, or the group's
timeout); that is re-raised as `InstanceFailure` naming the rank, the step and the peers, never a hang past the
group's timeout.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from rlhfuse.generation.coordinator import Instance, MigrationReport, balance, migrate
from rlhfuse.generation.engine import SampleRequest
from rlhfuse.generation.messages import SampleBatch
from rlhfuse.generation.progress import CountWatch, control_group
from rlhfuse.generation.transport import InstanceFailure, PointToPoint, collective_device

__all__ = ["DistributedCoordinator", "InstanceFailure", "decode_until_migration", "gather_finished"]


def decode_until_migration(
    engine: Instance,
    transport: PointToPoint,
    *,
    threshold: int,
    bs_max: int,
    mechanism: str,
    link_bytes_per_s: float,
    report: MigrationReport,
    group: dist.ProcessGroup | None = None,
    timeout_s: float | None = None,
) -> Iterator[SampleRequest]:
    """Decode this rank's share until the migration (see the module); yield the samples finished here meanwhile.
    Call on every rank of `group` with the same `threshold` (> 0). `report` is filled when samples moved;
    `engine.stats` receives the watch's seconds per decode step and the migration's seconds (what the Rt tuner
    charges a fused run). `timeout_s`: how long an idle rank waits for news of the others (`CountWatch`) before
    raising `InstanceFailure`; None: without limit."""
    control, control_device = control_group(group)
    watch = CountWatch(control_device, threshold, control, timeout_s=timeout_s)
    steps = 0  # decode steps while watching (idle polls cost nothing the tuner should charge per step)
    while True:
        idle = not engine.has_work()
        if not idle:
            yield from engine.step()
            steps += 1
        try:  # a peer that died shows here: in the idle wait, or as a closed connection when a count is posted
            if idle and watch.polls:
                watch.wait_idle()
            if watch.update(engine.num_unfinished):
                break
        except RuntimeError as err:
            transport.step = watch.polls
            raise transport.fail("watching the unfinished count", err) from err
    watch.close()
    if steps:
        engine.stats.lockstep_seconds += watch.poll_seconds
        engine.stats.lockstep_steps += steps
    start = time.perf_counter()
    transport.step = watch.polls
    counts = transport.all_gather_counts(engine.num_unfinished)
    if sum(counts):  # every rank decides the same moves from the same counts
        migrate({transport.rank: engine}, counts, transport, bs_max=bs_max, mechanism=mechanism,
                link_bytes_per_s=link_bytes_per_s, report=report)  # fmt: skip
        engine.stats.migration_seconds += time.perf_counter() - start
        engine.stats.migrations += 1


@dataclass
class DistributedCoordinator:
    """Drives this rank's `engine`; call `run` on every rank of `group` with the same requests and threshold."""

    engine: Instance
    bs_max: int
    mechanism: str = "auto"
    link_bytes_per_s: float = 1e9
    group: dist.ProcessGroup | None = None
    timeout_s: float | None = None
    """How long an idle instance waits for news of the others before `InstanceFailure` (None: no limit)."""
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
        if threshold > 0:
            yield from decode_until_migration(
                engine,
                self.transport,
                threshold=threshold,
                bs_max=self.bs_max,
                mechanism=self.mechanism,
                link_bytes_per_s=self.link_bytes_per_s,
                report=self.report,
                group=self.group,
                timeout_s=self.timeout_s,
            )
        while engine.has_work():
            yield from engine.step()


def gather_finished(
    samples: Sequence[SampleRequest], group: dist.ProcessGroup | None = None
) -> list[SampleRequest]:
    """Every rank's finished samples on every rank, in row order."""
    transport = PointToPoint(collective_device(group), group)
    parts = transport.all_gather(SampleBatch.of(samples).pack(transport.device))
    return sorted((r for p in parts for r in SampleBatch.unpack(p).requests), key=lambda r: r.row)
