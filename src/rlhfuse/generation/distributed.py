"""`DistributedCoordinator`: one generation instance per process of an initialised torch.distributed group.

Every rank receives the whole batch of requests and keeps its share (`balance`, the same on every rank). With a
migration threshold the ranks step in lockstep, all-gathering their unfinished counts after every step; the first
time the total is at or below Rt they all compute the same `decide_migration` and the sources send their tail
samples to the destinations point-to-point (request + tokens, and the slot's KV cache for `kv`). After that no
collective is needed: destinations finish the tail, the other ranks are free. Without a threshold the ranks never
communicate during generation.

A peer that dies or stops answering makes the communication raise (gloo: connection closed, or the group's
timeout); that is re-raised as `InstanceFailure` naming the rank, the step and the peers, never a hang past the
group's timeout.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rlhfuse.generation.coordinator import MigrationReport, balance
from rlhfuse.generation.engine import GenerationEngine, MigratingSample, SampleRequest
from rlhfuse.generation.migration import pick_mechanism
from rlhfuse.models import SlotState
from rlhfuse.planner.migration import decide_migration, should_migrate

_META = 10  # row, prompt_index, sample_index, group, seed, prompt len, tokens, has kv, kv length, stopped


class InstanceFailure(RuntimeError):
    """A generation instance (process) failed or stopped answering."""


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

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

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
            counts = self._gather_counts(engine.num_unfinished, step)
            total = sum(counts)
            if total == 0:
                return
            if should_migrate(total, threshold):
                self._migrate(counts, step)
                lockstep = False
        while engine.has_work():
            yield from engine.step()

    # ------------------------------------------------------------------ communication
    def _fail(self, what: str, step: int, err: Exception) -> InstanceFailure:
        return InstanceFailure(
            f"generation instance {self.rank} of {self.world}: {what} failed at step {step} ({err}); another "
            "generation process probably died (see its log) or stopped answering within the process group's "
            "timeout"
        )

    def _gather_counts(self, unfinished: int, step: int) -> list[int]:
        mine = torch.tensor([unfinished], dtype=torch.int64)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        try:
            dist.all_gather(out, mine, group=self.group)
        except RuntimeError as err:
            raise self._fail("all-gathering the unfinished counts", step, err) from err
        return [int(t) for t in out]

    def _migrate(self, counts: list[int], step: int) -> None:
        engine = self.engine
        slot_bytes = engine.cache.nbytes_per_slot()
        decision = decide_migration(
            counts,
            self.bs_max,
            kv_bytes_per_sample=slot_bytes,
            free_kv_bytes=slot_bytes * engine.cache.num_slots,
        )
        # the mechanism from global sums, so every rank picks the same one
        sources = {src for src, _, _ in decision.moves}
        moving = list(engine.running.values()) if self.rank in sources else []
        sums = torch.tensor(
            [
                float(sum(len(r.prompt_P) + len(r.tokens) for r in moving)),
                engine.stats.prefill_seconds,
                float(engine.stats.prefill_tokens),
            ],
            dtype=torch.float64,
        )
        try:
            dist.all_reduce(sums, group=self.group)
        except RuntimeError as err:
            raise self._fail("agreeing on the migration mechanism", step, err) from err
        tokens, prefill_s, prefill_tokens = sums.tolist()
        mechanism = pick_mechanism(
            self.mechanism,
            kv_bytes=tokens * slot_bytes / engine.cache.max_len,
            link_bytes_per_s=self.link_bytes_per_s,
            reprefill_tokens=int(tokens),
            prefill_s_per_token=prefill_s / max(prefill_tokens, 1.0),
        )
        # moves in the same global order on every rank; sources only send, destinations only receive
        for src, dst, count in decision.moves:
            try:
                if self.rank == src:
                    self._send(engine.evict(count, with_kv=mechanism == "kv"), dst)
                elif self.rank == dst:
                    engine.admit(self._recv(src))
            except RuntimeError as err:
                raise self._fail(f"moving {count} samples {src} -> {dst}", step, err) from err
        self.report.samples_moved = decision.moved
        self.report.destinations = decision.m
        self.report.mechanism = mechanism
        self.report.at = time.perf_counter()
        self.report.decision = decision
        self.report.freed = tuple(i for i in range(self.world) if i not in decision.destinations)

    def _send(self, samples: Sequence[MigratingSample], dst: int) -> None:
        dist.send(torch.tensor([len(samples)], dtype=torch.int64), dst, group=self.group)
        for sample in samples:
            r, kv = sample.request, sample.kv
            meta = [r.row, r.prompt_index, r.sample_index, r.group, r.seed, len(r.prompt_P), len(r.tokens)]
            meta += [int(kv is not None), kv.length if kv is not None else 0, int(r.stopped)]
            dist.send(torch.tensor(meta, dtype=torch.int64), dst, group=self.group)
            ids = torch.cat([r.prompt_P, torch.tensor(r.tokens, dtype=torch.int64)])
            dist.send(ids.contiguous(), dst, group=self.group)
            if kv is not None:
                dist.send(kv.k_LHTD.contiguous(), dst, group=self.group)
                dist.send(kv.v_LHTD.contiguous(), dst, group=self.group)
                dist.send(kv.valid_T.to(torch.uint8).contiguous(), dst, group=self.group)

    def _recv(self, src: int) -> list[MigratingSample]:
        count = torch.zeros(1, dtype=torch.int64)
        dist.recv(count, src, group=self.group)
        cache = self.engine.cache
        layers, _, heads, _, head_dim = cache.k_LSHTD.shape
        out = []
        for _ in range(int(count)):
            meta_t = torch.zeros(_META, dtype=torch.int64)
            dist.recv(meta_t, src, group=self.group)
            row, prompt_index, sample_index, group, seed, p, n, has_kv, kv_len, stopped = meta_t.tolist()
            ids = torch.zeros(p + n, dtype=torch.int64)
            dist.recv(ids, src, group=self.group)
            kv = None
            if has_kv:
                k = torch.zeros((layers, heads, kv_len, head_dim), dtype=cache.k_LSHTD.dtype)
                v = torch.zeros_like(k)
                valid = torch.zeros(kv_len, dtype=torch.uint8)
                for t in (k, v, valid):
                    dist.recv(t, src, group=self.group)
                kv = SlotState(k, v, valid.bool())
            request = SampleRequest(
                row=row,
                prompt_index=prompt_index,
                sample_index=sample_index,
                group=group,
                prompt_P=ids[:p].clone(),
                seed=seed,
                tokens=ids[p:].tolist(),
                stopped=bool(stopped),
            )
            out.append(MigratingSample(request, kv))
        return out


def gather_finished(
    samples: Sequence[SampleRequest], group: dist.ProcessGroup | None = None
) -> list[SampleRequest]:
    """Every rank's finished samples on every rank, in row order."""
    per_rank: list[list[tuple[int, int, int, int, int, list[int], list[int], bool]] | None] = [None] * (
        dist.get_world_size(group)
    )
    mine = [
        (r.row, r.prompt_index, r.sample_index, r.group, r.seed, r.prompt_P.tolist(), r.tokens, r.stopped)
        for r in samples
    ]
    dist.all_gather_object(per_rank, mine, group=group)
    out = [
        SampleRequest(row, pi, si, g, torch.tensor(p, dtype=torch.int64), seed, tokens, stopped)
        for part in per_rank
        for row, pi, si, g, seed, p, tokens, stopped in part or []
    ]
    return sorted(out, key=lambda r: r.row)
