"""Inter-stage fusion across processes (DESIGN §2): generation with migration, then the freed instances run
inference (Actor/Ref log-probs, Critic values, reward) on finished samples while the destinations finish the
tail and stream each tail sample to them as it finishes.

`fused_generate_infer` runs on every rank of an initialised process group, one generation instance per rank:

1. all ranks generate their share in lockstep until Rt samples remain (`DistributedCoordinator`), then migrate;
2. freed ranks infer their own finished samples in micro-batches, then receive (point-to-point) the tail samples
   as the destinations finish them and infer them as they arrive; destinations decode the tail and send
   (non-blocking, so decoding never waits on inference), then infer their own samples finished before the
   migration;
3. every rank all-gathers the per-sample results and returns the same `Experience`, rows in canonical order.

With `threshold=0` it is the serial baseline: every rank generates its share to the end, then infers it.
Results equal the serial ones up to floating-point reassociation (micro-batches pad differently).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from rlhfuse.core.protocols import Inferencer, SwapsWeights
from rlhfuse.core.types import Experience
from rlhfuse.generation.coordinator import MigrationReport
from rlhfuse.generation.distributed import DistributedCoordinator, InstanceFailure
from rlhfuse.generation.engine import GenerationEngine, SampleRequest, to_rollout
from rlhfuse.generation.transport import PointToPoint, Sending
from rlhfuse.generation.wire import InferredBatch, InferredSample, SampleBatch


@dataclass
class FusedResult:
    """The batch's Experience (same on every rank), this rank's migration report, and timings in seconds:
    generation (this rank's last decode step), gen_inf (wall time to the last inference output, all ranks)."""

    experience: Experience
    report: MigrationReport
    generation_s: float
    gen_inf_s: float


def _infer(inferencer: Inferencer, samples: Sequence[SampleRequest], pad: int) -> list[InferredSample]:
    if not samples:
        return []
    exp = inferencer.infer(to_rollout(samples, pad))
    out = []
    for b, r in enumerate(samples):
        n = len(r.tokens)
        out.append(
            InferredSample(r, exp.logprobs_BR[b, :n].clone(), exp.ref_logprobs_BR[b, :n].clone(),
                           exp.values_BR[b, :n].clone(), float(exp.scores_B[b]))
        )  # fmt: skip
    return out


def fused_generate_infer(
    engine: GenerationEngine,
    inferencer: Inferencer,
    requests: Sequence[SampleRequest],
    *,
    threshold: int,
    bs_max: int,
    mechanism: str = "auto",
    micro_batch: int = 8,
    pad_token_id: int = 0,
    group: dist.ProcessGroup | None = None,
    sync_every: int = 1,
) -> FusedResult:
    start = time.perf_counter()
    coordinator = DistributedCoordinator(
        engine, bs_max=bs_max, mechanism=mechanism, group=group, sync_every=sync_every
    )
    transport: PointToPoint = coordinator.transport
    rank = coordinator.rank
    rows: list[InferredSample] = []
    finished: list[SampleRequest] = []
    stream = coordinator.run(requests, threshold=threshold)
    # generate until this rank is free (migration moved its tail away) or done
    for sample in stream:
        finished.append(sample)
        if coordinator.report.at and rank in coordinator.report.freed:
            break
    report = coordinator.report
    if isinstance(inferencer, SwapsWeights):
        # the tail starts here (a destination decodes it next; a freed rank infers now; without migration
        # generation is over): frozen models' weights start moving onto the device
        inferencer.prefetch()
    try:
        if report.at and rank in report.freed:
            gen_end = time.perf_counter()
            for k in range(0, len(finished), micro_batch):
                rows += _infer(inferencer, finished[k : k + micro_batch], pad_token_id)
            open_streams = set(report.decision.destinations if report.decision else ())
            batch: list[SampleRequest] = []
            while open_streams:
                src, packed = transport.recv_packed()  # from any destination; an empty batch ends its stream
                arrived = SampleBatch.unpack(packed).requests
                if not arrived:
                    open_streams.discard(src)
                batch += arrived
                if len(batch) >= micro_batch or (not open_streams and batch):
                    rows += _infer(inferencer, batch, pad_token_id)
                    batch = []
        elif report.at:
            # a destination: stream the tail samples to the freed ranks as they finish (round robin), then infer
            # its own samples that finished before the migration (as it would have without fusion)
            freed = list(report.freed)
            pending: list[Sending] = []
            for sent, sample in enumerate(stream):
                pending.append(transport.isend(SampleBatch.of([sample]).pack(), freed[sent % len(freed)]))
            gen_end = time.perf_counter()
            pending += [transport.isend(SampleBatch([]).pack(), dst) for dst in freed]
            for k in range(0, len(finished), micro_batch):
                rows += _infer(inferencer, finished[k : k + micro_batch], pad_token_id)
            for sending in pending:
                sending.wait()
        else:  # no migration: generate to the end, then infer
            finished += list(stream)
            gen_end = time.perf_counter()
            for k in range(0, len(finished), micro_batch):
                rows += _infer(inferencer, finished[k : k + micro_batch], pad_token_id)
        gathered = transport.all_gather(InferredBatch(rows).pack())
        gen_inf = time.perf_counter() - start
    except RuntimeError as err:
        raise InstanceFailure(f"fused generation+inference on rank {rank} failed: {err}") from err
    all_rows = sorted(
        (r for p in gathered for r in InferredBatch.unpack(p).rows), key=lambda r: r.request.row
    )
    if [r.request.row for r in all_rows] != sorted(r.row for r in requests):
        raise InstanceFailure(
            f"fused generation+inference lost samples: got rows {[r.request.row for r in all_rows]}"
        )
    return FusedResult(_assemble(all_rows, pad_token_id), report, gen_end - start, gen_inf)


def _assemble(rows: list[InferredSample], pad: int) -> Experience:
    rollout = to_rollout([r.request for r in rows], pad)
    width = rollout.response_ids_BR.shape[1]

    def pad_BR(values_N: list[Tensor]) -> Tensor:
        out = torch.zeros(len(rows), width)
        for b, values in enumerate(values_N):
            out[b, : len(values)] = values
        return out

    return Experience(
        rollout=rollout,
        logprobs_BR=pad_BR([r.logprobs_N for r in rows]),
        ref_logprobs_BR=pad_BR([r.ref_logprobs_N for r in rows]),
        values_BR=pad_BR([r.values_N for r in rows]),
        scores_B=torch.tensor([r.score for r in rows], dtype=torch.float32),
    )
