"""A generation instance over several ranks (one tensor-parallel vLLM engine on generator.tp ranks), driven as one.

The instance's first rank (its leader) takes part in generation like a one-rank instance: the coordinator, the
count watch and the migration run among the leaders only (`DistributedCoordinator` on the leaders' group). Every
call that changes the engine is repeated on the instance's other ranks in the same order: the leader's
`LockstepLeader` tells them each call before it makes it (over the instance's gloo control group), and `follow`
makes it on theirs, so the engine's own collectives inside a step (vLLM's tensor-parallel all-reduces) meet on
every rank. A call is one small broadcast of two ints on the CPU; migrated-in samples follow as one `SampleBatch`
message. Reads (`num_unfinished`, `has_work`) are the same on every rank and are not sent.

Every rank first queues the instance's share itself (the same requests in the same order), so the engines start
alike; the calls keep them alike. Under greedy or seeded sampling the backend chooses the same tokens on every
rank of a tensor-parallel group (vLLM's `external_launcher` contract).

Inter-stage fusion runs the same way: the leaders run `fused_generate_infer` among themselves (a freed engine's
leader infers and steals), the other ranks repeat the engine calls, then take their leader's result
(`shared_result`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from rlhfuse import distributed
from rlhfuse.core.wire import Packed
from rlhfuse.generation.coordinator import Instance, KVCapacity, MigrationReport
from rlhfuse.generation.engine import EngineStats, MigratingSample, SampleRequest, SamplingParams
from rlhfuse.generation.fusion import FusedResult, assemble_experience
from rlhfuse.generation.messages import InferredBatch, SampleBatch

STEP, EVICT, ADMIT, RELEASE, DONE = range(5)
CPU = torch.device("cpu")


class LockstepLeader:
    """`Instance` of the leader of an instance over the ranks of `group` (its first, global rank `leader`): each
    changing call is broadcast to the other ranks, then made here."""

    def __init__(self, engine: Instance, group: Any, leader: int, on_release: Callable[[], None]) -> None:
        self.engine, self.group, self.leader, self.on_release = engine, group, leader, on_release

    def _say(self, op: int, arg: int = 0) -> None:
        distributed.broadcast(torch.tensor([op, arg], dtype=torch.int64), self.leader, group=self.group)

    # ------------------------------------------------------------------ the calls repeated on every rank
    def step(self) -> list[SampleRequest]:
        self._say(STEP)
        return self.engine.step()

    def evict(self, count: int, *, with_kv: bool) -> list[MigratingSample]:
        self._say(EVICT, count)
        return self.engine.evict(count, with_kv=with_kv)

    def admit(self, samples: Sequence[MigratingSample]) -> None:
        self._say(ADMIT)
        distributed.broadcast_packed(SampleBatch(list(samples)).pack(CPU), self.leader, CPU, group=self.group)
        self.engine.admit(samples)

    def release(self) -> None:
        """Freed by a migration: every rank releases its part of the engine until the next batch."""
        self._say(RELEASE)
        self.on_release()

    def finish(self) -> None:
        """The batch is over on this instance: the other ranks stop following."""
        self._say(DONE)

    # ------------------------------------------------------------------ read here only
    def add(self, requests: Iterable[SampleRequest]) -> None:
        """The instance's share, which every other rank of the instance queues itself (`follow`)."""
        self.engine.add(requests)

    def has_work(self) -> bool:
        return self.engine.has_work()

    @property
    def num_unfinished(self) -> int:
        return self.engine.num_unfinished

    @property
    def cache(self) -> KVCapacity:
        return self.engine.cache

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    @property
    def running(self) -> Mapping[Any, SampleRequest]:
        return self.engine.running

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def params(self) -> SamplingParams:
        return self.engine.params


def follow(
    engine: Instance,
    share: Iterable[SampleRequest],
    group: Any,
    leader: int,
    on_release: Callable[[], None],
) -> Iterator[SampleRequest]:
    """On a rank of an instance other than its first (`leader`): queue the instance's `share` (as the leader's
    coordinator does), then make on `engine` every call the leader's `LockstepLeader` makes, in its order, until
    it says the batch is over; yield the samples finished here (the same as the leader's)."""
    engine.add(share)
    while True:
        said = torch.zeros(2, dtype=torch.int64)
        distributed.broadcast(said, leader, group=group)
        op, arg = said.tolist()
        if op == STEP:
            yield from engine.step()
        elif op == EVICT:
            engine.evict(
                arg, with_kv=False
            )  # the same samples leave (the engines are alike); the leader sends them
        elif op == ADMIT:
            packed: Packed = distributed.broadcast_packed(None, leader, CPU, group=group)
            engine.admit(SampleBatch.unpack(packed).samples)
        elif op == RELEASE:
            on_release()
        elif op == DONE:
            return
        else:
            raise RuntimeError(f"lockstep: unknown call {op} from rank {leader}")


def shared_result(result: FusedResult | None, group: Any, leader: int, pad_token_id: int) -> FusedResult:
    """The leader's fused generation + inference result (`result`, None elsewhere) on every rank of its instance:
    every sample's inference results and the timings as two messages; the other ranks assemble the same
    Experience (their migration report stays empty: the leaders decided)."""
    packed = InferredBatch(result.rows).pack(CPU) if result is not None else None
    rows = InferredBatch.unpack(distributed.broadcast_packed(packed, leader, CPU, group=group)).rows
    seconds = [result.generation_s, result.gen_inf_s] if result is not None else [0.0, 0.0]
    times = torch.tensor(seconds, dtype=torch.float64)
    distributed.broadcast(times, leader, group=group)
    if result is not None:
        return result
    generation_s, gen_inf_s = times.tolist()
    return FusedResult(
        assemble_experience(rows, pad_token_id), MigrationReport(), generation_s, gen_inf_s, rows=rows
    )
