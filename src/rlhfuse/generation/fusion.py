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

_META = 8  # row (-1 = end of stream), prompt_index, sample_index, group, seed, prompt len, tokens, stopped


@dataclass
class FusedResult:
    """The batch's Experience (same on every rank), this rank's migration report, and timings in seconds:
    generation (this rank's last decode step), gen_inf (wall time to the last inference output, all ranks)."""

    experience: Experience
    report: MigrationReport
    generation_s: float
    gen_inf_s: float


def _infer_rows(inferencer: Inferencer, samples: Sequence[SampleRequest], pad: int) -> list[tuple]:
    if not samples:
        return []
    exp = inferencer.infer(to_rollout(samples, pad))
    out = []
    for b, r in enumerate(samples):
        n = len(r.tokens)
        sample = (
            r.row,
            r.prompt_index,
            r.sample_index,
            r.group,
            r.prompt_P.tolist(),
            r.seed,
            r.tokens,
            r.stopped,
        )
        out.append(
            (sample, exp.logprobs_BR[b, :n].clone(), exp.ref_logprobs_BR[b, :n].clone(),
             exp.values_BR[b, :n].clone(), float(exp.scores_B[b]))
        )  # fmt: skip
    return out


def _send_sample(r: SampleRequest, dst: int, group: dist.ProcessGroup | None, pending: list) -> None:
    meta = torch.tensor(
        [
            r.row,
            r.prompt_index,
            r.sample_index,
            r.group,
            r.seed,
            len(r.prompt_P),
            len(r.tokens),
            int(r.stopped),
        ],
        dtype=torch.int64,
    )
    ids = torch.cat([r.prompt_P, torch.tensor(r.tokens, dtype=torch.int64)]).contiguous()
    pending += [(dist.isend(meta, dst, group=group), meta), (dist.isend(ids, dst, group=group), ids)]


def _recv_sample(group: dist.ProcessGroup | None) -> tuple[int, SampleRequest | None]:
    meta = torch.zeros(_META, dtype=torch.int64)
    src = dist.recv(meta, group=group)  # from any destination
    row, prompt_index, sample_index, grp, seed, p, n, stopped = meta.tolist()
    if row < 0:
        return src, None
    ids = torch.zeros(p + n, dtype=torch.int64)
    dist.recv(ids, src, group=group)
    return src, SampleRequest(
        row, prompt_index, sample_index, grp, ids[:p].clone(), seed, ids[p:].tolist(), bool(stopped)
    )


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
    rank = dist.get_rank(group)
    coordinator = DistributedCoordinator(
        engine, bs_max=bs_max, mechanism=mechanism, group=group, sync_every=sync_every
    )
    rows: list[tuple] = []
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
                rows += _infer_rows(inferencer, finished[k : k + micro_batch], pad_token_id)
            open_streams = set(report.decision.destinations if report.decision else ())
            batch: list[SampleRequest] = []
            while open_streams:
                src, arrived = _recv_sample(group)
                if arrived is None:
                    open_streams.discard(src)
                else:
                    batch.append(arrived)
                if len(batch) >= micro_batch or (not open_streams and batch):
                    rows += _infer_rows(inferencer, batch, pad_token_id)
                    batch = []
        elif report.at:
            # a destination: stream the tail samples to the freed ranks as they finish (round robin), then infer
            # its own samples that finished before the migration (as it would have without fusion)
            freed = list(report.freed)
            pending: list = []
            for sent, sample in enumerate(stream):
                _send_sample(sample, freed[sent % len(freed)], group, pending)
            gen_end = time.perf_counter()
            for dst in freed:
                end = torch.full((_META,), -1, dtype=torch.int64)
                pending.append((dist.isend(end, dst, group=group), end))
            for k in range(0, len(finished), micro_batch):
                rows += _infer_rows(inferencer, finished[k : k + micro_batch], pad_token_id)
            for work, _ in pending:
                work.wait()
        else:  # no migration: generate to the end, then infer
            finished += list(stream)
            gen_end = time.perf_counter()
            for k in range(0, len(finished), micro_batch):
                rows += _infer_rows(inferencer, finished[k : k + micro_batch], pad_token_id)
        gathered: list[list[tuple] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, rows, group=group)
        gen_inf = time.perf_counter() - start
    except RuntimeError as err:
        raise InstanceFailure(f"fused generation+inference on rank {rank} failed: {err}") from err
    all_rows = sorted((r for part in gathered for r in part or []), key=lambda r: r[0][0])
    if [r[0][0] for r in all_rows] != sorted(r.row for r in requests):
        raise InstanceFailure(
            f"fused generation+inference lost samples: got rows {[r[0][0] for r in all_rows]}"
        )
    return FusedResult(_assemble(all_rows, pad_token_id), report, gen_end - start, gen_inf)


def _assemble(rows: list[tuple], pad: int) -> Experience:
    samples = [
        SampleRequest(row, pi, si, g, torch.tensor(p, dtype=torch.int64), seed, tokens, stopped)
        for (row, pi, si, g, p, seed, tokens, stopped), *_ in rows
    ]
    rollout = to_rollout(samples, pad)
    width = rollout.response_ids_BR.shape[1]

    def pad_BR(index: int) -> Tensor:
        out = torch.zeros(len(rows), width)
        for b, row in enumerate(rows):
            out[b, : len(row[index])] = row[index]
        return out

    return Experience(
        rollout=rollout,
        logprobs_BR=pad_BR(1),
        ref_logprobs_BR=pad_BR(2),
        values_BR=pad_BR(3),
        scores_B=torch.tensor([row[4] for row in rows], dtype=torch.float32),
    )
