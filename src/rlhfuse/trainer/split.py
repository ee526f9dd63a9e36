"""Asynchronous RL, split placement (`async.generation_ranks=1`; docs/async.md): the last rank of the world
generates, the others train (for now one training rank: pipeline=plain, a world of 2).

The training rank's rollout stage is `SplitRollout`; the generation rank runs `GenerationService.serve` instead
of the trainer's iterations. They share two channels, both groups of the two ranks made by
`rlhfuse.distributed.WorldGroups`: the link (`PointToPoint`, on the device: weights, jobs and batches in the one
wire codec, `rlhfuse.core.wire`) and a control channel (`Control`, gloo on the CPU: one integer each way).

- A push of version v: the training rank sends a notice of v on the control channel. The generation rank answers
  with the last iteration whose batch it has sent; the training rank receives those batches, then sends the
  SYNC on the link: v's weights (its own generator copy's state after the sync) and the jobs v generates, each
  iteration's prompts up to min(v + 1 + k, last) not sent yet.
- The generation rank generates every job its version may (r(i) = max(0, i - 1 - k) <= v), in iteration order,
  sending each batch (its chunks, each token's version, its seconds and statistics) without waiting for it to be
  received. It answers a notice once idle; with partial rollouts, also between two decode steps of a batch,
  which continues under the new weights.
- With async.frozen_inference=generation_ranks the generation rank also scores each batch with the frozen models
  (Ref, Reward: `SplitInferencer.infer_frozen`) before sending it, and the training rank runs only the Actor and
  the Critic over it (`infer_live`): the same experience, bit for bit.
- Without partial rollouts the training rank, at the sync of version v + 1, first receives every batch of
  version v (the colocated stage's gate), so a checkpoint holds every batch generated ahead. The end of the run
  is a notice of -1.

On the link each side's order is the other's: the batches sent before an answer, then the SYNC; so NCCL can run
it (every op completes before the next, per rank pair). The bound is the colocated stage's
(`rlhfuse.trainer.asynchronous`) and without partial rollouts the samples are the same: each is seeded per
sample, and the generation rank's Actor copy holds the trained weights bit for bit. At k = 0 the run is the
synchronous run, split over two processes. A version no batch needs is not pushed (the last k + 1 syncs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from rlhfuse import distributed
from rlhfuse.core.protocols import Generator, Inferencer, SplitInferencer
from rlhfuse.core.stats import GenerationStats
from rlhfuse.core.types import FrozenInference, PromptBatch, Rollout
from rlhfuse.core.wire import Packed, pack_tensors, unpack_tensors
from rlhfuse.data.feed import PromptFeed
from rlhfuse.generation.transport import PointToPoint, Sending
from rlhfuse.trainer.asynchronous import (
    AheadStage,
    AsyncGenerationError,
    PartialGenerator,
    _Generated,
    source_version,
)

SYNC = 1
"""The link's message from the training rank: a version's weights and jobs."""

_ROLLOUT_FIELDS = tuple(f.name for f in dataclasses.fields(Rollout))
_FROZEN_FIELDS = len(dataclasses.fields(FrozenInference))


# ---------------------------------------------------------------- the messages
def pack_sync(
    version: int, weights: Mapping[str, Tensor], jobs: Mapping[int, PromptBatch], device: Any
) -> Packed:
    """SYNC: [SYNC, version, n_weights, n_jobs, *job iterations]; the weights' names (utf-8, newline-separated),
    the weights, then each job's input ids, attention mask and prompt ids."""
    names = "\n".join(weights).encode()
    tensors: list[Tensor] = [torch.tensor(list(names), dtype=torch.uint8), *weights.values()]
    for batch in jobs.values():
        tensors += [batch.input_ids_BP, batch.attention_mask_BP, batch.prompt_ids_B]
    return pack_tensors([SYNC, version, len(weights), len(jobs), *jobs], tensors, device=device)


def unpack_sync(packed: Packed) -> tuple[int, dict[str, Tensor], dict[int, PromptBatch]]:
    """(version, weights, jobs) of a SYNC."""
    ints, tensors = unpack_tensors(packed)
    if ints[0] != SYNC:
        raise ValueError(f"not a SYNC message: kind {ints[0]}")
    version, n_weights, n_jobs = ints[1:4]
    names = bytes(tensors[0].cpu().tolist()).decode().split("\n") if n_weights else []
    weights = dict(zip(names, tensors[1 : 1 + n_weights], strict=True))
    rest = tensors[1 + n_weights :]
    jobs = {
        int(i): PromptBatch(*(t.clone() for t in rest[3 * n : 3 * n + 3]))
        for n, i in enumerate(ints[4 : 4 + n_jobs])
    }
    return version, weights, jobs


def pack_batch(iteration: int, generated: _Generated, device: Any) -> Packed:
    """A generated batch: [iteration, version, n_chunks, has_stats, has_frozen, one presence mask of Rollout's
    fields per chunk]; its seconds and statistics (float64, NaN for None), then each chunk's present fields and,
    with has_frozen, its frozen-model inference (`FrozenInference`'s fields)."""
    stats, frozen = generated.stats, generated.frozen
    figures = [generated.seconds, *(math.nan if v is None else float(v) for v in (stats or ()))]
    ints = [
        iteration,
        generated.version,
        len(generated.chunks),
        int(stats is not None),
        int(frozen is not None),
    ]
    tensors: list[Tensor] = [torch.tensor(figures, dtype=torch.float64)]
    for c, chunk in enumerate(generated.chunks):
        present = [getattr(chunk, name) for name in _ROLLOUT_FIELDS]
        ints.append(sum(1 << n for n, t in enumerate(present) if t is not None))
        tensors += [t for t in present if t is not None]
        if frozen is not None:
            tensors += list(dataclasses.astuple(frozen[c]))
    return pack_tensors(ints, tensors, device=device)


def unpack_batch(packed: Packed) -> tuple[int, _Generated]:
    ints, tensors = unpack_tensors(packed)
    iteration, version, n_chunks, has_stats, has_frozen = ints[:5]
    figures = tensors[0].tolist()
    values: list[Any] = [None if math.isnan(v) else v for v in figures[1:]]
    stats = GenerationStats(*values) if has_stats else None
    chunks, frozen, pos = [], [], 1
    for mask in ints[5 : 5 + n_chunks]:
        fields: dict[str, Tensor | None] = {}
        for n, name in enumerate(_ROLLOUT_FIELDS):
            if mask >> n & 1:
                fields[name], pos = tensors[pos].clone(), pos + 1
            else:
                fields[name] = None
        chunks.append(Rollout(**fields))  # type: ignore[arg-type]
        if has_frozen:
            frozen.append(FrozenInference(*(t.clone() for t in tensors[pos : pos + _FROZEN_FIELDS])))
            pos += _FROZEN_FIELDS
    return iteration, _Generated(chunks, version, float(figures[0]), stats, frozen if has_frozen else None)


# ---------------------------------------------------------------- the control channel
@dataclasses.dataclass
class Notice:
    """A posted receive of the training rank's next notice (`Control.listen`)."""

    value: Tensor
    work: distributed.Work

    def arrived(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> int:
        """The notice, once it has arrived (a gloo receive's `wait` takes the next message, so it is waited for
        only while not yet arrived)."""
        if not self.work.is_completed():
            self.work.wait()
        return int(self.value)


class Control:
    """The split placement's control channel: a gloo group of the two ranks (`WorldGroups.control`), apart from the
    link, for the training rank's notices (a version to push, or the end: -1) and the generation rank's answers
    (the last iteration whose batch it has sent). One int64 each way, on the CPU. `timeout_s`: the groups' bound
    on every wait (distributed.timeout_s), named when a wait on the peer breaks (`peer_wait`)."""

    def __init__(self, group: Any, peer: int, *, timeout_s: float) -> None:
        self.group, self.peer, self.timeout_s = group, distributed.global_rank(group, peer), timeout_s

    @contextlib.contextmanager
    def peer_wait(self, what: str, peer: str, longer: str) -> Iterator[None]:
        """Waits on `peer` (the peer's role) for `what`: a broken one (a dead peer's closed connection, or the
        timeout) is an `AsyncGenerationError` naming the peer, the timeout and, as `longer`, the legitimate wait
        that could outlast it; the transport's own words last, so that the line's start says what happened."""
        try:
            yield
        except RuntimeError as err:
            cause = (str(err).strip().splitlines() or [""])[0]
            raise AsyncGenerationError(
                f"{what} failed: the {peer} (rank {self.peer}) died or stalled, nothing within "
                f"distributed.timeout_s={self.timeout_s:g} s (raise it if {longer}); {type(err).__name__}: {cause}"
            ) from err

    def send(self, value: int) -> None:
        distributed.isend(torch.tensor([value]), self.peer, group=self.group).wait()

    def recv(self) -> int:
        value = torch.zeros(1, dtype=torch.int64)
        distributed.recv(value, self.peer, group=self.group)
        return int(value)

    def listen(self) -> Notice:
        """A posted receive of the next notice."""
        value = torch.zeros(1, dtype=torch.int64)
        return Notice(value, distributed.irecv(value, self.peer, group=self.group))


STOP_NOTICE = -1
"""The notice that ends the generation rank's `serve`."""


# ---------------------------------------------------------------- the training rank
class SplitRollout(AheadStage):
    """The rollout stage of the split placement, on the training rank (see the module). `generator`: the local
    one (held-out evaluation; its Actor copy is what a sync pushes); `link`: the point-to-point link of the two
    ranks and `control` their control channel; `peer`: the generation rank's rank in the link's group.
    `partial_rollout`: a sync does not wait for the batch being generated (the generation rank takes the new
    weights at its next decode step)."""

    def __init__(
        self,
        generator: Generator,
        inferencer: Inferencer,
        feed: PromptFeed,
        link: PointToPoint,
        control: Control,
        *,
        peer: int,
        max_staleness: int,
        last_iteration: int,
        pad_token_id: int,
        partial_rollout: bool = False,
    ) -> None:
        super().__init__(
            generator, inferencer, feed,
            max_staleness=max_staleness, last_iteration=last_iteration, pad_token_id=pad_token_id,
        )  # fmt: skip
        if not generator.actor_copies():
            raise TypeError(
                f"the split placement pushes the weights of the local generator's Actor copy, and "
                f"{type(generator).__name__} holds none in this process"
            )
        self.link, self.control, self.peer = link, control, peer
        self.partial_rollout = partial_rollout
        self._sent = 0  # the last iteration whose job was sent
        self._received = 0  # the last iteration whose batch was received
        self._pushed = -1  # the version the generation rank holds (-1: nothing sent yet)
        self._closed = False

    def _batch(self, iteration: int, prompts: PromptBatch) -> _Generated:
        if self._pushed < 0:  # the first batch asked: the generation rank starts at the version held here
            self._push({iteration: prompts})
        while iteration not in self._ready:
            self._receive()
        return self._ready.pop(iteration)

    def load_weights(self, load: Any) -> None:
        """The sync of the next version: loaded here; then (once the run has started, and without partial
        rollouts) every batch the generation rank generates with the version it holds is received, and the
        version is pushed when a batch needs it."""
        with self._weights:
            load()
        self.version += 1
        if self._pushed < 0:  # a resume's sync, before `restore`: the first push carries the weights
            return
        if not self.partial_rollout:
            self._drain()
        if (
            self.version + 1 + self.max_staleness <= self.last_iteration
        ):  # iteration v + 1 + k needs version v
            self._push({})

    def _push(self, given: Mapping[int, PromptBatch]) -> None:
        """Notice of the version held here; once the generation rank answers, the batches it sent before it are
        received and then the SYNC of the version and its jobs (`given` prompts where the trainer drew them)."""
        self._ask(self.version)
        last = min(self.version + 1 + self.max_staleness, self.last_iteration)
        jobs = {j: given[j] if j in given else self.feed.batch(j) for j in range(self._sent + 1, last + 1)}
        with self._weights:
            weights = self.inner.actor_copies()[0].state_dict()
            packed = pack_sync(self.version, weights, jobs, self.link.device)
        self._send(packed, f"the weights of version {self.version}")
        self._sent, self._pushed = max(self._sent, last), self.version

    def _ask(self, notice: int) -> None:
        """Send `notice`, and receive every batch the generation rank sent before it answered."""
        with self._waiting("the generation rank's answer to a weight sync"):
            self.control.send(notice)
            sent = self.control.recv()
        while self._received < sent:
            self._receive()

    def _drain(self) -> None:
        """Receive every batch the generation rank generates with the version it holds: the jobs sent whose
        version is at most that one."""
        while (
            self._received < self._sent
            and source_version(self._received + 1, self.max_staleness) <= self._pushed
        ):
            self._receive()

    def _receive(self) -> None:
        expected = self._received + 1
        with self._waiting(f"asynchronous generation of iteration {expected}'s batch"):
            _, packed = self.link.recv_packed(self.peer)
        iteration, generated = unpack_batch(packed)
        if iteration != expected:
            raise AsyncGenerationError(
                f"the generation rank sent iteration {iteration}'s batch, {expected} expected"
            )
        self._ready[iteration] = generated
        self._received = iteration

    def _send(self, packed: Packed, what: str) -> None:
        with self._waiting(f"sending {what} to the generation rank"):
            self.link.isend(packed, self.peer).wait()

    def _waiting(self, what: str) -> contextlib.AbstractContextManager[None]:
        return self.control.peer_wait(what, "generation rank", "a batch takes longer to generate")

    def close(self) -> None:
        """The end notice: the generation rank's `serve` returns, its batches sent before it received here."""
        if not self._closed:
            self._closed = True
            self._ask(STOP_NOTICE)

    def state_dict(self) -> dict[str, Any]:
        """The batches received ahead of the trained iteration (after a sync without partial rollouts: every batch
        generated ahead; with them, a batch still being generated is not among them, and a resumed run
        generates it again from the checkpoint's weights)."""
        return self._ready_state()

    def restore(self, state: Mapping[str, Any], iteration: int) -> None:
        """A resume from iteration `iteration`'s checkpoint: its batches trained as they were generated, and the
        first push (at the first batch asked) starts the generation rank at version `iteration` after them."""
        self._restore_ready(state, iteration)
        self._sent = self._received = max(self._ready, default=iteration)


# ---------------------------------------------------------------- the generation rank
class _Stopped(Exception):
    """The end notice came while a batch was being generated (a run stopped early): the batch is dropped."""


class GenerationService:
    """The split placement's generation rank: `serve` generates what the training rank asks, until its end notice
    (see the module). `generator`: this rank's; `peer`: the training rank's rank in the link's group;
    `partial_rollout`: a notice is answered at the next decode step (`generate_partial`), else once every job
    of the version held is generated; `frozen`: the inferencer whose frozen models (Ref, Reward) score each batch
    here, sent with it (async.frozen_inference=generation_ranks), or None."""

    def __init__(
        self,
        generator: Generator,
        link: PointToPoint,
        control: Control,
        *,
        peer: int,
        max_staleness: int,
        partial_rollout: bool = False,
        frozen: SplitInferencer | None = None,
    ) -> None:
        self.generator, self.link, self.control, self.peer = generator, link, control, peer
        self.max_staleness, self.partial_rollout, self.frozen = max_staleness, partial_rollout, frozen
        self.version = -1
        self._jobs: dict[int, PromptBatch] = {}
        self._sent = 0  # the last iteration whose batch was sent
        self._sending: list[Sending] = []
        self._notice = self.control.listen()

    def serve(self) -> None:
        """Generate until the end notice."""
        try:
            while True:
                startable = [
                    j for j in sorted(self._jobs) if source_version(j, self.max_staleness) <= self.version
                ]
                if not startable:  # idle: the next notice, once the training rank has trained what it has
                    with self._waiting(f"waiting for the notice after batch {self._sent}"):
                        self._notice.wait()
                if self._notice.arrived():
                    self._answer()
                    continue
                self._send_batch(startable[0])
        except _Stopped:
            with self._waiting("the batches' last sends"):
                for sending in self._sending:
                    sending.wait()

    def _waiting(self, what: str) -> contextlib.AbstractContextManager[None]:
        return self.control.peer_wait(
            what, "training rank", "an iteration's inference and training, or the run's start, take longer"
        )

    def _answer(self) -> None:
        """A notice arrived: answer with the last batch sent; then the SYNC it announces (its weights loaded
        between two decode steps of a batch being generated), or the end (`_Stopped`)."""
        notice = self._notice.wait()
        with self._waiting(f"answering the notice of version {notice}"):
            self.control.send(self._sent)
        if notice == STOP_NOTICE:
            raise _Stopped
        with self._waiting(f"the weights of version {notice}"):
            _, packed = self.link.recv_packed(self.peer)
            for sending in self._sending:  # received before the SYNC was sent
                sending.wait()
        self._sending.clear()
        version, weights, jobs = unpack_sync(packed)
        assert version == notice, (notice, version)
        if weights:
            self.generator.load_weights(weights)
        self.version = version
        self._jobs.update(jobs)
        self._notice = self.control.listen()

    def _send_batch(self, iteration: int) -> None:
        generated = self._generate(iteration, self._jobs.pop(iteration))
        self._sending.append(self.link.isend(pack_batch(iteration, generated, self.link.device), self.peer))
        self._sent = iteration

    @contextlib.contextmanager
    def step(self) -> Iterator[int]:
        """A partial rollout's decode step (`StepGate`): a notice that has arrived is answered first, so the
        step decodes with the version it announced; that version yielded."""
        if self._notice.arrived():
            self._answer()
        yield self.version

    @torch.no_grad()
    def _generate(self, iteration: int, prompts: PromptBatch) -> _Generated:
        start = time.perf_counter()
        if self.partial_rollout:
            assert isinstance(self.generator, PartialGenerator), type(self.generator)
            chunks = list(self.generator.generate_partial(prompts, iteration=iteration, gate=self))
        else:
            chunks = [
                c.with_version(self.version) for c in self.generator.generate(prompts, iteration=iteration)
            ]
        seconds, stats = time.perf_counter() - start, self.generator.generation_stats()
        frozen = None if self.frozen is None else [self.frozen.infer_frozen(chunk) for chunk in chunks]
        return _Generated(chunks, self.version, seconds, stats, frozen)

    def close(self) -> None:
        self.generator.close()
