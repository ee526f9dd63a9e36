"""`Coordinator`: several generation instances in this process, stepped in turn, with long-tail migration.

Prompts are spread over the instances balanced by sample count, a prompt's n samples kept together (they share
its prefill). After every round of steps the coordinator counts the unfinished samples; the first time the count
drops to Rt (`rlhfuse.planner.should_migrate`), `decide_migration` picks the destinations and the moves, and the
samples of the other instances move there by KV transfer or re-prefill (`migrate`, the same function
`DistributedCoordinator` calls over point-to-point sends). The freed instances are then idle (what
an inference stage may use); `finished_order` says which instance finished each sample.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlhfuse.core.balance import least_loaded
from rlhfuse.generation.engine import EngineStats, MigratingSample, SampleRequest, SamplingParams
from rlhfuse.generation.migration import pick_mechanism
from rlhfuse.generation.transport import InProcess, Transport
from rlhfuse.planner.migration_decision import MigrationDecision, decide_migration, should_migrate


@dataclass
class MigrationReport:
    """What one batch's migration did: threshold Rt (0 = off), samples moved, destinations m, mechanism,
    and when it happened (perf_counter seconds; 0.0 = it did not)."""

    threshold: int = 0
    samples_moved: int = 0
    destinations: int = 0
    mechanism: str = ""
    at: float = 0.0
    decision: MigrationDecision | None = None
    freed: tuple[int, ...] = ()


def balance(
    requests: Sequence[SampleRequest], instances: int, loads: Sequence[int] | None = None
) -> list[list[SampleRequest]]:
    """Split samples over instances by whole prompt groups, each group to the least-loaded instance (ties:
    lower index), in order; `loads`: the unfinished samples each instance holds already (default none)."""
    groups: dict[int, list[SampleRequest]] = {}
    for request in requests:
        groups.setdefault(request.group, []).append(request)
    members = list(groups.values())
    return [
        [r for g in share for r in members[g]]
        for share in least_loaded([len(m) for m in members], instances, loads)
    ]


class KVCapacity(Protocol):
    """What the migration decision reads of an instance's KV cache."""

    @property
    def num_slots(self) -> int: ...

    @property
    def max_len(self) -> int: ...

    def nbytes_per_slot(self) -> int: ...


class Instance(Protocol):
    """A generation instance as the coordinator drives it (`GenerationEngine`, `VLLMInstance`)."""

    @property
    def cache(self) -> KVCapacity: ...

    @property
    def stats(self) -> EngineStats: ...

    @property
    def running(self) -> Mapping[Any, SampleRequest]: ...

    @property
    def num_unfinished(self) -> int: ...

    def has_work(self) -> bool: ...

    def add(self, requests: Iterable[SampleRequest]) -> None: ...

    def step(self) -> list[SampleRequest]: ...

    def evict(self, count: int, *, with_kv: bool) -> list[MigratingSample]: ...

    def admit(self, samples: Sequence[MigratingSample]) -> None: ...

    @property
    def device(self) -> torch.device:
        """Where the instance computes (its collectives' tensors live there under NCCL)."""
        ...

    @property
    def params(self) -> SamplingParams:
        """The sampling parameters of the batch it runs."""
        ...


@dataclass
class Coordinator:
    """Drives `engines` over one batch; `threshold` = Rt (0 = no migration)."""

    engines: Sequence[Instance]
    bs_max: int
    mechanism: str = "auto"
    link_bytes_per_s: float = 1e9
    report: MigrationReport = field(default_factory=MigrationReport)

    def run(
        self, requests: Sequence[SampleRequest], *, threshold: int
    ) -> Iterator[tuple[int, SampleRequest]]:
        """Yield (instance, sample) for each sample as it finishes."""
        self.start(threshold)
        self.add(requests)
        while self.has_work():
            yield from self.step()

    def start(self, threshold: int) -> None:
        """A new batch, with Rt = `threshold` (its samples come by `add`)."""
        self.report = MigrationReport(threshold=threshold)

    def add(self, requests: Sequence[SampleRequest]) -> None:
        """Spread samples over the instances (`balance`, counting what each holds unfinished already); once a
        migration has freed instances, over its destinations only (an open batch's later prompts:
        `rlhfuse.generation.open_rollout`)."""
        active = [i for i in range(len(self.engines)) if i not in self.report.freed]
        loads = [self.engines[i].num_unfinished for i in active]
        for i, share in zip(active, balance(requests, len(active), loads), strict=True):
            if share:
                self.engines[i].add(share)

    def has_work(self) -> bool:
        return any(e.has_work() for e in self.engines)

    def step(self) -> list[tuple[int, SampleRequest]]:
        """One step of every instance with work, then the migration check: (instance, sample) for each sample
        that finished."""
        done = [
            (index, sample)
            for index, engine in enumerate(self.engines)
            if engine.has_work()
            for sample in engine.step()
        ]
        unfinished = sum(e.num_unfinished for e in self.engines)
        if not self.report.at and self.report.threshold and should_migrate(unfinished, self.report.threshold):
            self.migrate()
        return done

    def abandon(self) -> list[SampleRequest]:
        """Every unfinished sample out of the instances, their slots freed (an open batch that has what it
        needs): the samples, with the tokens they had."""
        return [
            moved.request
            for engine in self.engines
            for moved in engine.evict(engine.num_unfinished, with_kv=False)
        ]

    def migrate(self) -> MigrationReport:
        """Move the tail per `decide_migration` (called once per batch, when Rt samples remain)."""
        return migrate(
            dict(enumerate(self.engines)),
            [e.num_unfinished for e in self.engines],
            InProcess(),
            bs_max=self.bs_max,
            mechanism=self.mechanism,
            link_bytes_per_s=self.link_bytes_per_s,
            report=self.report,
        )


def migrate(
    instances: Mapping[int, Instance],
    unfinished: Sequence[int],
    transport: Transport,
    *,
    bs_max: int,
    mechanism: str,
    link_bytes_per_s: float,
    report: MigrationReport,
) -> MigrationReport:
    """The one migration mechanism (docs/paper.md §2), for instances in one process or one per rank.

    `instances`: the instances this process drives, by their index among all `len(unfinished)` instances;
    `unfinished`: every instance's unfinished count (the same on every process). Every process computes the
    same `decide_migration` and, from sums over all instances (`transport.all_sum`), the same mechanism; then
    the moves run in the same global order everywhere: a source evicts and sends, a destination receives and
    admits. Fills and returns `report`.
    """
    cache = next(iter(instances.values())).cache
    slot_bytes = cache.nbytes_per_slot()
    decision = decide_migration(
        unfinished, bs_max, kv_bytes_per_sample=slot_bytes, free_kv_bytes=slot_bytes * cache.num_slots
    )
    sources = {src for src, _, _ in decision.moves}
    moving = [r for i, e in instances.items() if i in sources for r in e.running.values()]
    stats = [e.stats for e in instances.values()]
    tokens, prefill_s, prefill_tokens = transport.all_sum(
        [
            sum(r.prompt_len + len(r.tokens) for r in moving),
            sum(s.prefill_seconds for s in stats),
            sum(s.prefill_tokens for s in stats),
        ]
    )
    chosen = pick_mechanism(
        mechanism,
        kv_bytes=tokens * slot_bytes / cache.max_len,
        link_bytes_per_s=link_bytes_per_s,
        reprefill_tokens=int(tokens),
        prefill_s_per_token=prefill_s / max(prefill_tokens, 1.0),
    )
    for src, dst, count in decision.moves:
        if src in instances:
            transport.send(instances[src].evict(count, with_kv=chosen == "kv"), src, dst)
        if dst in instances:
            instances[dst].admit(transport.recv(src, dst))
    report.samples_moved = decision.moved
    report.destinations = decision.m
    report.mechanism = chosen
    report.at = time.perf_counter()
    report.decision = decision
    report.freed = tuple(i for i in range(len(unfinished)) if i not in decision.destinations)
    return report
