"""`Coordinator`: several generation instances in this process, stepped in turn, with long-tail migration.

Prompts are spread over the instances balanced by sample count, a prompt's n samples kept together (they share
its prefill). After every round of steps the coordinator counts the unfinished samples; the first time the count
drops to Rt (`rlhfuse.planner.should_migrate`), `decide_migration` picks the destinations and the moves, and the
samples of the other instances move there by KV transfer or re-prefill. The freed instances are then idle (what
an inference stage may use); `finished_order` says which instance finished each sample.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlhfuse.core.balance import least_loaded
from rlhfuse.generation.engine import EngineStats, MigratingSample, SampleRequest
from rlhfuse.generation.migration import pick_mechanism
from rlhfuse.planner.migration import MigrationDecision, decide_migration, should_migrate


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


def balance(requests: Sequence[SampleRequest], instances: int) -> list[list[SampleRequest]]:
    """Split samples over instances by whole prompt groups, each group to the least-loaded instance (ties:
    lower index), in order."""
    groups: dict[int, list[SampleRequest]] = {}
    for request in requests:
        groups.setdefault(request.group, []).append(request)
    members = list(groups.values())
    return [
        [r for g in share for r in members[g]] for share in least_loaded([len(m) for m in members], instances)
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
        self.report = MigrationReport(threshold=threshold)
        for engine, share in zip(self.engines, balance(requests, len(self.engines)), strict=True):
            engine.add(share)
        while any(e.has_work() for e in self.engines):
            for index, engine in enumerate(self.engines):
                if engine.has_work():
                    for sample in engine.step():
                        yield index, sample
            unfinished = sum(e.num_unfinished for e in self.engines)
            if not self.report.at and threshold and should_migrate(unfinished, threshold):
                self.migrate()

    def migrate(self) -> MigrationReport:
        """Move the tail per `decide_migration` (called once per batch, when Rt samples remain)."""
        first = self.engines[0]
        slot_bytes = first.cache.nbytes_per_slot()
        decision = decide_migration(
            [e.num_unfinished for e in self.engines],
            self.bs_max,
            kv_bytes_per_sample=slot_bytes,
            free_kv_bytes=slot_bytes * first.cache.num_slots,
        )
        moving = [r for src, _, _ in decision.moves for r in self.engines[src].running.values()]
        stats = [e.stats for e in self.engines]
        prefill_s = sum(s.prefill_seconds for s in stats) / max(sum(s.prefill_tokens for s in stats), 1)
        mechanism = pick_mechanism(
            self.mechanism,
            kv_bytes=sum(
                slot_bytes * (len(r.prompt_P) + len(r.tokens)) / first.cache.max_len for r in moving
            ),
            link_bytes_per_s=self.link_bytes_per_s,
            reprefill_tokens=sum(len(r.prompt_P) + len(r.tokens) for r in moving),
            prefill_s_per_token=prefill_s,
        )
        for src, dst, count in decision.moves:
            self.engines[dst].admit(self.engines[src].evict(count, with_kv=mechanism == "kv"))
        self.report.samples_moved = decision.moved
        self.report.destinations = decision.m
        self.report.mechanism = mechanism
        self.report.at = time.perf_counter()
        self.report.decision = decision
        self.report.freed = tuple(i for i in range(len(self.engines)) if i not in decision.destinations)
        return self.report
