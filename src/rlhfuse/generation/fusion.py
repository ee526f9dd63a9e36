"""Inter-stage fusion across processes (docs/paper.md §2): generation with migration, then the freed instances run
inference (Actor/Ref log-probs, Critic values, reward) on finished samples while the destinations finish the
tail, and take (steal) the destinations' finished samples that are not inferred yet.

`fused_generate_infer` runs on every rank of an initialised process group, one generation instance per rank:

1. every rank generates its share; with Rt > 0 the ranks watch the total unfinished count asynchronously
   (`rlhfuse.generation.distributed.decode_until_migration`, the one trigger: no lockstep, no per-step
   collective) and, when Rt samples remain, all run the one `migrate` (`rlhfuse.generation.coordinator`);
2. freed ranks infer their own finished samples, then ask the destinations for work (`StealChannel`): each
   answer is a batch of finished, not yet inferred samples of the destination (its samples finished before the
   migration, then the tail as it finishes), up to the inference token budget; destinations poll for requests
   between decode steps (decoding never waits on inference), and after the tail infer what is left of their own
   samples, still serving requests between micro-batches, until none is left;
3. every rank all-gathers the per-sample results and returns the same `Experience`, rows in canonical order.

Inference runs in micro-batches by token budget: samples in finishing order, as many per forward as fit in
`infer_tokens` padded tokens (at most `micro_batch` samples).

With `threshold=0` it is the serial baseline: every rank generates its share to the end, then infers it, and the
ranks do not communicate until the final all-gather. Results equal the serial ones up to floating-point
reassociation (micro-batches pad differently).

The rank's `engine.stats` receives the measured fused-run costs the Rt tuner reads (`CostProfile.fit`):
inference seconds and tokens, the count watch's seconds per decode step, the migration's seconds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from rlhfuse.core.protocols import Inferencer
from rlhfuse.core.types import Experience
from rlhfuse.generation.coordinator import Instance, MigrationReport, balance
from rlhfuse.generation.distributed import InstanceFailure, decode_until_migration
from rlhfuse.generation.engine import SampleRequest, to_rollout
from rlhfuse.generation.messages import InferredBatch, InferredSample, SampleBatch
from rlhfuse.generation.progress import StealChannel, control_group
from rlhfuse.generation.transport import PointToPoint, Sending, collective_device


@dataclass
class FusedResult:
    """The batch's Experience (same on every rank), this rank's migration report, and timings in seconds:
    generation (this rank's last decode step), gen_inf (wall time to the last inference output, all ranks),
    inference (this rank's inference calls) and stolen (samples this rank inferred for a destination)."""

    experience: Experience
    report: MigrationReport
    generation_s: float
    gen_inf_s: float
    inference_s: float = 0.0
    stolen: int = 0
    rows: list[InferredSample] = field(default_factory=list)
    """Every sample's inference results in row order, what `experience` was assembled from."""


def token_batches(samples: Sequence[SampleRequest], budget: int, most: int) -> Iterator[list[SampleRequest]]:
    """`samples` in order, cut into micro-batches of at most `most` samples whose padded size (samples x the
    longest prompt + response) stays within `budget` tokens (a longer sample alone)."""
    batch: list[SampleRequest] = []
    longest = 0
    for s in samples:
        n = s.prompt_len + len(s.tokens)
        if batch and (len(batch) >= most or (len(batch) + 1) * max(longest, n) > budget):
            yield batch
            batch, longest = [], 0
        batch.append(s)
        longest = max(longest, n)
    if batch:
        yield batch


class _Inference:
    """This rank's inference calls, timed (seconds and tokens go to the engine's stats)."""

    def __init__(self, inferencer: Inferencer, engine: Instance, pad: int, budget: int, most: int):
        self.inferencer, self.engine, self.pad, self.budget, self.most = inferencer, engine, pad, budget, most
        self.rows: list[InferredSample] = []
        self.seconds = 0.0

    def run(self, samples: Sequence[SampleRequest]) -> None:
        for batch in token_batches(samples, self.budget, self.most):
            self.one(batch)

    def one(self, samples: Sequence[SampleRequest]) -> None:
        if not samples:
            return
        start = time.perf_counter()
        exp = self.inferencer.infer(to_rollout(samples, self.pad))
        # the micro-batch's scores read at once (a read per sample waited for the device each time); the
        # per-token results stay on the device until the final gather packs them
        scores = exp.scores_B.tolist()
        rules: list[list[float]] = (
            [[]] * len(samples) if exp.rule_scores_BK is None else exp.rule_scores_BK.tolist()
        )
        for b, r in enumerate(samples):
            n = len(r.tokens)
            self.rows.append(
                InferredSample(r, exp.logprobs_BR[b, :n].clone(), exp.ref_logprobs_BR[b, :n].clone(),
                               exp.values_BR[b, :n].clone(), scores[b], tuple(rules[b]))
            )  # fmt: skip
        seconds = time.perf_counter() - start
        self.seconds += seconds
        self.engine.stats.inference_seconds += seconds
        self.engine.stats.inference_tokens += sum(r.prompt_len + len(r.tokens) for r in samples)


def fused_generate_infer(
    engine: Instance,
    inferencer: Inferencer,
    requests: Sequence[SampleRequest],
    *,
    threshold: int,
    bs_max: int,
    mechanism: str = "auto",
    micro_batch: int = 8,
    infer_tokens: int = 0,
    pad_token_id: int = 0,
    group: dist.ProcessGroup | None = None,
    link_bytes_per_s: float = 1e9,
    on_freed: Callable[[], object] = lambda: None,
) -> FusedResult:
    """One batch's generation + inference on this rank (see the module). `micro_batch`: most samples per
    inference forward; `infer_tokens`: padded tokens per forward (0 = `micro_batch` x the batch's longest
    possible sequence, i.e. count-bounded); `on_freed`: called on a rank the migration freed, before it infers
    (a vLLM instance sleeps there)."""
    start = time.perf_counter()
    device = collective_device(group, engine.device)
    transport = PointToPoint(device, group)
    rank, world = transport.rank, transport.world
    width = max(r.prompt_len for r in requests) + engine.params.max_new_tokens
    infer = _Inference(inferencer, engine, pad_token_id, infer_tokens or micro_batch * width, micro_batch)
    report = MigrationReport(threshold=threshold)
    finished: list[SampleRequest] = []
    stolen = 0
    engine.add(balance(requests, world)[rank])
    # the channels of the count watch and of work stealing: tags and any-source receives, so a control group
    # (gloo wherever the job runs; NCCL matches by order alone)
    control, control_device = control_group(group)
    try:
        if threshold > 0:
            finished += decode_until_migration(engine, transport, threshold=threshold, bs_max=bs_max,
                                               mechanism=mechanism, link_bytes_per_s=link_bytes_per_s,
                                               report=report, group=group)  # fmt: skip
        # the tail starts here (a destination decodes it next; a freed rank infers now; without migration
        # generation is over): frozen models' weights start moving onto the device
        inferencer.prefetch()
        if report.at and rank in report.freed:
            gen_end = time.perf_counter()
            on_freed()  # the instance has nothing left to decode: its memory may go to inference
            infer.run(finished)
            stolen = _steal(infer, transport, StealChannel(control_device, control), report)
        elif report.at:
            gen_end = _serve(
                engine, infer, transport, StealChannel(control_device, control), report, finished
            )
        else:  # no migration: generate to the end, then infer
            while engine.has_work():
                finished += engine.step()
            gen_end = time.perf_counter()
            infer.run(finished)
        gathered = transport.all_gather(InferredBatch(infer.rows).pack())
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
    return FusedResult(
        assemble_experience(all_rows, pad_token_id), report, gen_end - start, gen_inf, infer.seconds, stolen,
        all_rows,
    )  # fmt: skip


def _steal(infer: _Inference, transport: PointToPoint, channel: StealChannel, report: MigrationReport) -> int:
    """A freed rank: ask the destinations for work in turn and infer each answer, until every one has said it
    has none left (an empty batch). Returns the samples inferred for them."""
    open_ = deque(report.decision.destinations if report.decision else ())
    stolen = 0
    while open_:
        destination = open_.popleft()
        channel.request(destination, transport.rank)
        _, packed = transport.recv_packed(destination)
        got = SampleBatch.unpack(packed).requests
        if not got:
            continue  # that destination is done
        open_.append(destination)
        infer.one(got)
        stolen += len(got)
    return stolen


def _serve(
    engine: Instance,
    infer: _Inference,
    transport: PointToPoint,
    channel: StealChannel,
    report: MigrationReport,
    finished: list[SampleRequest],
) -> float:
    """A destination: decode the tail, handing finished, not yet inferred samples to the freed ranks that ask
    (between decode steps, then between its own inference micro-batches), until none is left and each freed
    rank has been told. Returns when decoding ended."""
    queue = deque(finished)
    waiting: deque[int] = deque()  # freed ranks whose request has no answer yet
    done_told: set[int] = set()
    freed = set(report.freed)
    sends: list[Sending] = []

    def take() -> list[SampleRequest]:
        return next(token_batches(list(queue), infer.budget, infer.most), []) if queue else []

    def expecting() -> bool:
        """Whether a request can still come: a freed rank not told yet and not waiting for an answer (each
        asks again only once answered, so no receive is left posted when the batch ends)."""
        return bool(freed - done_told - set(waiting))

    def answer(decoding: bool) -> None:
        while expecting() and (asker := channel.poll()) is not None:
            waiting.append(asker)
        while waiting and (queue or not decoding):
            asker = waiting.popleft()
            batch = take()
            for _ in batch:
                queue.popleft()
            if not batch:
                done_told.add(asker)
            sends.append(transport.isend(SampleBatch.of(batch).pack(), asker))

    while engine.has_work():
        queue.extend(engine.step())
        answer(decoding=True)
    gen_end = time.perf_counter()
    while queue:
        answer(decoding=False)
        batch = take()
        for _ in batch:
            queue.popleft()
        infer.one(batch)
    while done_told != freed:  # tell every freed rank there is no more work here
        answer(decoding=False)
        if expecting():
            waiting.append(channel.wait())
    for sending in sends:
        sending.wait()
    return gen_end


def assemble_experience(rows: list[InferredSample], pad: int) -> Experience:
    """The batch's Experience from every sample's inference results (row order)."""
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
        rule_scores_BK=torch.tensor([r.rule_scores for r in rows], dtype=torch.float32).reshape(
            len(rows), len(rows[0].rule_scores) if rows else 0
        ),
    )
