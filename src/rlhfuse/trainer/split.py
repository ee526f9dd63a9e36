"""Asynchronous RL, split placement (`async.generation_ranks=1`; docs/async.md): the last rank of the world
generates, the others train (for now one training rank: pipeline=plain, a world of 2).

The training rank's rollout stage is `SplitRollout`; the generation rank runs `GenerationService.serve` instead
of the trainer's iterations. They talk over one point-to-point link (a process group of the two ranks, created by
`rlhfuse.distributed.WorldGroups`), in messages of the one wire codec (`rlhfuse.core.wire`), in an order both
sides derive from the same rule, so that NCCL can run it: every message completes before the next, and neither
side sends while the other sends.

- The training rank sends a SYNC: a version's weights (the local generator's Actor copy after the sync) and the
  jobs that version generates, each iteration's prompts: iterations up to min(v + 1 + k, last) not sent yet.
- The generation rank loads the weights and generates every job its version may (r(i) = max(0, i - 1 - k) <= v),
  in iteration order, sending each batch (its chunks, each token's version, its seconds and statistics) as it is
  done. Then it waits for the next message.
- Before its next SYNC (or the STOP that ends the run), the training rank receives every batch the generation
  rank generates in between: at the weight sync of version v + 1 the batches of every iteration up to
  min(v + 1 + k, last) (the colocated stage's gate: a sync waits for the batches of the version it replaces).
  So after a sync the stage holds every batch generated ahead, which is what a checkpoint keeps.

The bound is the colocated stage's (`rlhfuse.trainer.asynchronous`) and the samples are the same: each is seeded
per sample, and the generation rank's Actor copy holds the trained weights bit for bit. At k = 0 the run is the
synchronous run, split over two processes. The weights go as whole tensors in one message per sync; a version no
batch needs is not sent (the last k + 1 syncs). The training rank keeps a generator of its own for held-out
evaluation, and its Actor copy is what the sync pushes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from rlhfuse.core.protocols import Generator, Inferencer
from rlhfuse.core.stats import GenerationStats
from rlhfuse.core.types import PromptBatch, Rollout
from rlhfuse.core.wire import Packed, pack_tensors, unpack_tensors
from rlhfuse.data.feed import PromptFeed
from rlhfuse.generation.transport import PointToPoint
from rlhfuse.trainer.asynchronous import AheadStage, AsyncGenerationError, _Generated, source_version

STOP, SYNC = 0, 1
"""The training rank's message kinds: the run is over; a version's weights and jobs."""

_ROLLOUT_FIELDS = tuple(f.name for f in dataclasses.fields(Rollout))


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


def unpack_sync(packed: Packed) -> tuple[int, dict[str, Tensor], dict[int, PromptBatch]] | None:
    """(version, weights, jobs) of a SYNC; None for STOP."""
    ints, tensors = unpack_tensors(packed)
    if ints[0] == STOP:
        return None
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
    """A generated batch: [iteration, version, n_chunks, has_stats, one presence mask of Rollout's fields per
    chunk]; its seconds and statistics (float64, NaN for None), then each chunk's present fields."""
    stats = generated.stats
    figures = [generated.seconds, *(math.nan if v is None else float(v) for v in (stats or ()))]
    ints = [iteration, generated.version, len(generated.chunks), int(stats is not None)]
    tensors: list[Tensor] = [torch.tensor(figures, dtype=torch.float64)]
    for chunk in generated.chunks:
        present = [getattr(chunk, name) for name in _ROLLOUT_FIELDS]
        ints.append(sum(1 << n for n, t in enumerate(present) if t is not None))
        tensors += [t for t in present if t is not None]
    return pack_tensors(ints, tensors, device=device)


def unpack_batch(packed: Packed) -> tuple[int, _Generated]:
    ints, tensors = unpack_tensors(packed)
    iteration, version, n_chunks, has_stats = ints[:4]
    figures = tensors[0].tolist()
    values: list[Any] = [None if math.isnan(v) else v for v in figures[1:]]
    stats = GenerationStats(*values) if has_stats else None
    chunks, pos = [], 1
    for mask in ints[4 : 4 + n_chunks]:
        fields: dict[str, Tensor | None] = {}
        for n, name in enumerate(_ROLLOUT_FIELDS):
            if mask >> n & 1:
                fields[name], pos = tensors[pos].clone(), pos + 1
            else:
                fields[name] = None
        chunks.append(Rollout(**fields))  # type: ignore[arg-type]
    return iteration, _Generated(chunks, version, float(figures[0]), stats)


# ---------------------------------------------------------------- the training rank
class SplitRollout(AheadStage):
    """The rollout stage of the split placement, on the training rank (see the module). `generator`: the local
    one (held-out evaluation; its Actor copy is what a sync pushes); `link`: the point-to-point link of the two
    ranks; `peer`: the generation rank's rank in the link's group."""

    def __init__(
        self,
        generator: Generator,
        inferencer: Inferencer,
        feed: PromptFeed,
        link: PointToPoint,
        *,
        peer: int,
        max_staleness: int,
        last_iteration: int,
        pad_token_id: int,
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
        self.link, self.peer = link, peer
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
        """The sync of the next version: loaded here, then (once the run has started) every batch the generation
        rank generates with the version it holds is received, and the version is pushed when a batch needs it."""
        with self._weights:
            load()
        self.version += 1
        if self._pushed < 0:  # a resume's sync, before `restore`: the first push carries the weights
            return
        self._drain()
        if (
            self.version + 1 + self.max_staleness <= self.last_iteration
        ):  # iteration v + 1 + k needs version v
            self._push({})

    def _push(self, given: Mapping[int, PromptBatch]) -> None:
        """SYNC of the version held here and of its jobs (`given` prompts where the trainer drew them)."""
        last = min(self.version + 1 + self.max_staleness, self.last_iteration)
        jobs = {j: given[j] if j in given else self.feed.batch(j) for j in range(self._sent + 1, last + 1)}
        with self._weights:
            weights = self.inner.actor_copies()[0].state_dict()
            packed = pack_sync(self.version, weights, jobs, self.link.device)
        self._send(packed, f"the weights of version {self.version}")
        self._sent, self._pushed = max(self._sent, last), self.version

    def _drain(self) -> None:
        """Receive every batch the generation rank generates before it takes another message: the jobs sent whose
        version is at most the one it holds."""
        while (
            self._received < self._sent
            and source_version(self._received + 1, self.max_staleness) <= self._pushed
        ):
            self._receive()

    def _receive(self) -> None:
        expected = self._received + 1
        try:
            _, packed = self.link.recv_packed(self.peer)
        except RuntimeError as err:
            raise AsyncGenerationError(
                f"asynchronous generation of iteration {expected}'s batch on the generation rank failed: "
                f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}; the generation rank died, or "
                "made no progress within distributed.timeout_s (see its output)"
            ) from err
        iteration, generated = unpack_batch(packed)
        if iteration != expected:
            raise AsyncGenerationError(
                f"the generation rank sent iteration {iteration}'s batch, {expected} expected"
            )
        self._ready[iteration] = generated
        self._received = iteration

    def _send(self, packed: Packed, what: str) -> None:
        try:
            self.link.isend(packed, self.peer).wait()
        except RuntimeError as err:
            raise AsyncGenerationError(
                f"sending {what} to the generation rank failed: {type(err).__name__}: "
                f"{str(err).strip().splitlines()[0][:200]}; the generation rank died (see its output)"
            ) from err

    def close(self) -> None:
        """The generation rank's batches still due received, then STOP: its `serve` returns."""
        if not self._closed:
            self._drain()
            self._send(pack_tensors([STOP], [], device=self.link.device), "the end of the run")
        self._closed = True

    def state_dict(self) -> dict[str, Any]:
        """The batches received ahead of the trained iteration (after a sync: every batch generated ahead)."""
        return self._ready_state()

    def restore(self, state: Mapping[str, Any], iteration: int) -> None:
        """A resume from iteration `iteration`'s checkpoint: its batches trained as they were generated, and the
        first push (at the first batch asked) starts the generation rank at version `iteration` after them."""
        self._restore_ready(state, iteration)
        self._sent = self._received = max(self._ready, default=iteration)


# ---------------------------------------------------------------- the generation rank
class GenerationService:
    """The split placement's generation rank: `serve` generates what the training rank's messages ask, until
    STOP (see the module). `generator`: this rank's; `peer`: the training rank's rank in the link's group."""

    def __init__(self, generator: Generator, link: PointToPoint, *, peer: int, max_staleness: int) -> None:
        self.generator, self.link, self.peer = generator, link, peer
        self.max_staleness = max_staleness
        self.version = -1
        self._jobs: dict[int, PromptBatch] = {}

    def serve(self) -> None:
        """Generate until the training rank sends STOP."""
        while True:
            _, packed = self.link.recv_packed(self.peer)
            message = unpack_sync(packed)
            if message is None:
                return
            version, weights, jobs = message
            if weights:
                self.generator.load_weights(weights)
            self.version = version
            self._jobs.update(jobs)
            for iteration in sorted(self._jobs):
                if source_version(iteration, self.max_staleness) > self.version:
                    break
                generated = self._generate(iteration, self._jobs.pop(iteration))
                self.link.isend(pack_batch(iteration, generated, self.link.device), self.peer).wait()

    @torch.no_grad()
    def _generate(self, iteration: int, prompts: PromptBatch) -> _Generated:
        start = time.perf_counter()
        chunks: Sequence[Rollout] = [
            c.with_version(self.version) for c in self.generator.generate(prompts, iteration=iteration)
        ]
        return _Generated(
            list(chunks), self.version, time.perf_counter() - start, self.generator.generation_stats()
        )

    def close(self) -> None:
        self.generator.close()
