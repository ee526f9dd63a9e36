"""Per-model zero-bubble baselines: ZB-H1, ZB-V and DualPipeV, each model alone, run back to back.

The question they answer: does fusing the Actor and the Critic still pay when each model could run a
zero-bubble schedule on its own? Each baseline is built from its published definition (not from our search),
as a split-backward (F/I/W) schedule of one model (`rlhfuse.pipeline.simulate`: I = input gradient, W =
weight gradient, each `SPLIT_INPUT_SHARE` of B; the activation is held until W ends):

- **ZB-H1** (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24, §3.1, Figure 3 top): 1F1B with B split
  into I and W; stage s of S runs the 1F1B warm-up (S-1-s forwards), then F/I pairs, and its W's lag its I's
  by s, so the W's fill the cool-down bubbles while every stage holds at most S micro-batches (1F1B's peak,
  that of its stage 0). For uniform stages with W <= F and M >= S micro-batches its makespan is
  M (F + I + W) + (S - 1)(F + I - W) (§3.1: the bubble (S-1)(T_F + T_B - T_W), B being our I): a third of
  1F1B's bubble (S-1)(F + I + W) when F = I = W. (With W > F the cool-down W's no longer fit between the
  returning I's and the simulated makespan is longer; the formula is then not quoted.)
- **ZB-V** (same paper, §6, Figure 8): V placement, each rank k of S holding chunk k and chunk 2S-1-k of a
  2S-chunk model, each chunk half the stage's time and activation (`v_shape`). The per-rank order is the
  paper's (as `torch.distributed.pipelining.ScheduleZBVZeroBubble` generates it): 2(S-k)-1 forwards of
  chunk k, k pairs (F of chunk 2S-1-k, F of chunk k), S-k triples F/I/W of chunk 2S-1-k, then F/I/W of
  chunk k and F/I/W of chunk 2S-1-k in turn, and a cool-down of I's whose W's are deferred to the end.
  Fewer than 2S-1 micro-batches: the order of 2S-1 with the missing ones left out (as torch does).
- **DualPipeV** (DeepSeek-V3 report §3.2.1, DualPipe's "V" variant; `torch ScheduleDualPipeV`): the same V
  placement; after a warm-up of forwards (2(S-k-1) of chunk k, k+1 pairs of both chunks, S-k-1 I/W/F of
  chunk 2S-1-k) every rank pairs the forward of one chunk with the backward of the other (F0+B1, F1+B0),
  then drains with full backwards whose second half is split into I and deferred W's. The pairs overlap
  computation with communication (all-to-all of expert parallelism); our model has no communication to hide,
  so a pair is its F then its B. It needs at least 2S micro-batches (DualPipe's `num_chunks >= 2 * ranks`).
  A full backward is I then W back to back (the same time and memory as B).

"Back to back" (`back_to_back`): the Actor's schedule, then the Critic's, on the same ranks with a barrier
between them, as `baselines.serial_makespan` runs 1F1B: the makespan is the sum of the models' makespans
alone, the peak per rank the larger of the two (each model's activations are freed before the next starts).
A model with several replicas runs its schedule on every replica's block at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from rlhfuse.pipeline.baselines import StageOrder, alone, combine, place_orders
from rlhfuse.pipeline.bounds import lower_bounds
from rlhfuse.pipeline.compiled import compile_problem
from rlhfuse.pipeline.ir import Kind, Schedule
from rlhfuse.pipeline.problem import ModelSpec, Problem
from rlhfuse.pipeline.simulate import SPLIT_INPUT_SHARE, simulate

# ----------------------------------------------------------------------------------------------------------
# Per-model problems
# ----------------------------------------------------------------------------------------------------------


def v_shape(problem: Problem, model: str) -> Problem:
    """`model` split into 2S chunks placed in a V on its S stages' ranks (ZB-V, DualPipeV).

    Chunk c runs on the rank of stage min(c, 2S-1-c) of each replica (the V: 0..S-1, then S-1..0) and takes
    half of that stage's forward, backward and activation (Qi et al. §6: each rank holds two chunks of the
    stage's layers).
    """
    m = problem.model(model)
    stages = 2 * m.stages

    def half(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(values[_v_stage(c, m.stages)] / 2 for c in range(stages))

    spec = replace(
        m,
        stages=stages,
        forward=half(m.forward),
        backward=half(m.backward),
        activation=half(m.activation),
        placement=tuple(tuple(row[_v_stage(c, m.stages)] for c in range(stages)) for row in m.placement),
    )
    return Problem(f"{problem.name}/{model} V", problem.ranks, (spec,), None, problem.comm_latency)


def _v_stage(chunk: int, stages: int) -> int:
    """The pipeline position (stage of the plain model) that holds `chunk` of the V: min(c, 2S-1-c)."""
    return min(chunk, 2 * stages - 1 - chunk)


# ----------------------------------------------------------------------------------------------------------
# ZB-H1
# ----------------------------------------------------------------------------------------------------------


def zb_h1_order(stages: int, microbatches: int, stage: int) -> StageOrder:
    """ZB-H1 on stage s (Qi et al. §3.1): 1F1B's S-1-s warm-up forwards, then per micro-batch j its F (while
    any is left) and I(j), and after I(j) with j >= s the oldest pending W; the W's left go last."""
    warmup = min(stages - stage - 1, microbatches)
    out: StageOrder = [(stage, Kind.F, i) for i in range(warmup)]
    weights = 0
    for j in range(microbatches):
        if warmup + j < microbatches:
            out.append((stage, Kind.F, warmup + j))
        out.append((stage, Kind.I, j))
        if j >= stage:
            out.append((stage, Kind.W, weights))
            weights += 1
    out += [(stage, Kind.W, i) for i in range(weights, microbatches)]
    return out


def zb_h1(problem: Problem, model: str) -> Schedule:
    """ZB-H1 of `model` on its own placement (`alone(problem, model)`'s ops only)."""
    m = problem.model(model)
    orders = {s: zb_h1_order(m.stages, m.microbatches, s) for s in range(m.stages)}
    return place_orders(m, problem.ranks, orders)


def zb_h1_closed_form(m: ModelSpec) -> float | None:
    """ZB-H1's makespan M (F + I + W) + (S - 1)(F + I - W) (Qi et al. §3.1), for uniform stages with
    W <= F and M >= S (checked against the simulator for S <= 8, M < 20 and ten F/B ratios); None where it
    does not apply (then the simulator's figure stands alone)."""
    f, b = m.forward[0], m.backward[0]
    i, w = b * SPLIT_INPUT_SHARE, b * (1.0 - SPLIT_INPUT_SHARE)
    if not m.uniform() or w > f or m.microbatches < m.stages:
        return None
    return m.microbatches * (f + i + w) + (m.stages - 1) * (f + i - w)


# ----------------------------------------------------------------------------------------------------------
# ZB-V
# ----------------------------------------------------------------------------------------------------------


def zb_v_order(ranks: int, microbatches: int, position: int) -> StageOrder:
    """ZB-V on pipeline position k of S (chunks k and 2S-1-k; Qi et al. §6, torch's ScheduleZBVZeroBubble).

    The order is built for max(2S-1, M) micro-batches, the fewest that fill the V, and the ones past M are
    left out."""
    n = max(2 * ranks - 1, microbatches)
    down, up = position, 2 * ranks - 1 - position  # chunk k (first leg), chunk 2S-1-k (second leg)
    count = {(c, kind): 0 for c in (down, up) for kind in (Kind.F, Kind.I, Kind.W)}
    out: StageOrder = []

    def op(chunk: int, kind: Kind) -> None:
        out.append((chunk, kind, count[chunk, kind]))
        count[chunk, kind] += 1

    for _ in range(2 * (ranks - position) - 1):
        op(down, Kind.F)
    for _ in range(position):
        op(up, Kind.F)
        op(down, Kind.F)
    for _ in range(ranks - position):
        for kind in (Kind.F, Kind.I, Kind.W):
            op(up, kind)
    while count[up, Kind.F] < count[down, Kind.F] or count[down, Kind.F] < n:
        if count[down, Kind.F] < n:
            op(down, Kind.F)
        op(down, Kind.I)
        op(down, Kind.W)
        for kind in (Kind.F, Kind.I, Kind.W):
            op(up, kind)
    for _ in range(position):  # cool-down: input gradients first, weight gradients deferred
        op(down, Kind.I)
        op(up, Kind.I)
    for _ in range(ranks - position):
        op(down, Kind.I)
        op(down, Kind.W)
    while count[up, Kind.W] < count[up, Kind.I]:
        op(up, Kind.W)
    while count[down, Kind.W] < count[down, Kind.I]:
        op(down, Kind.W)
    return [x for x in out if x[2] < microbatches]


def zb_v(problem: Problem, model: str) -> Schedule:
    """ZB-V of `model`: a schedule of `v_shape(problem, model)`."""
    m = v_shape(problem, model).models[0]
    ranks = m.stages // 2
    return place_orders(m, problem.ranks, {k: zb_v_order(ranks, m.microbatches, k) for k in range(ranks)})


# ----------------------------------------------------------------------------------------------------------
# DualPipeV
# ----------------------------------------------------------------------------------------------------------


def dualpipe_v_order(ranks: int, microbatches: int, position: int) -> StageOrder:
    """DualPipeV on pipeline position k of S (chunks k and 2S-1-k; DeepSeek's DualPipeV, torch's
    ScheduleDualPipeV), M >= 2S. Steps 1-8 as DualPipe numbers them; a full backward is I then W."""
    if microbatches < 2 * ranks:
        raise ValueError(
            f"DualPipeV needs at least 2 x {ranks} = {2 * ranks} micro-batches over {ranks} ranks (got "
            f"{microbatches}): use ZB-V or ZB-H1"
        )
    down, up = position, 2 * ranks - 1 - position
    count = {(c, kind): 0 for c in (down, up) for kind in (Kind.F, Kind.I, Kind.W)}
    pending: list[tuple[int, int]] = []  # the W's of split backwards, oldest first
    out: StageOrder = []

    def forward(chunk: int) -> None:
        out.append((chunk, Kind.F, count[chunk, Kind.F]))
        count[chunk, Kind.F] += 1

    def backward(chunk: int, split: bool = False) -> None:
        i = count[chunk, Kind.I]
        out.append((chunk, Kind.I, i))
        count[chunk, Kind.I] += 1
        if split:
            pending.append((chunk, i))
        else:
            out.append((chunk, Kind.W, i))

    def weight() -> None:
        if pending:
            chunk, i = pending.pop(0)
            out.append((chunk, Kind.W, i))

    for _ in range(2 * (ranks - position - 1)):  # 1: F0
        forward(down)
    for _ in range(position + 1):  # 2: F0 F1
        forward(down)
        forward(up)
    for _ in range(ranks - position - 1):  # 3: I1 W F1 (zero bubble)
        backward(up, split=True)
        weight()
        forward(up)
    for _ in range(microbatches - 2 * ranks + position + 1):  # 4: F0+B1, F1+B0 (overlapped pairs)
        forward(down)
        backward(up)
        forward(up)
        backward(down)
    for _ in range(ranks - position - 1):  # 5: B1, F1+B0
        backward(up)
        forward(up)
        backward(down)
    split = False
    for i in range(position + 1):  # 6: B1 B0, the second half split (I now, W later)
        split = split or (i == (position + 1) // 2 and position % 2 == 1)
        backward(up, split)
        split = split or (i == (position + 1) // 2 and position % 2 == 0)
        backward(down, split)
    for _ in range(ranks - position - 1):  # 7: W B0
        weight()
        backward(down, split)
    for _ in range(position + 1):  # 8: W
        weight()
    return out


def dualpipe_v(problem: Problem, model: str) -> Schedule:
    """DualPipeV of `model`: a schedule of `v_shape(problem, model)` (ValueError below 2S micro-batches)."""
    m = v_shape(problem, model).models[0]
    ranks = m.stages // 2
    return place_orders(
        m, problem.ranks, {k: dualpipe_v_order(ranks, m.microbatches, k) for k in range(ranks)}
    )


def dualpipe_v_unsupported(m: ModelSpec) -> str | None:
    """Why DualPipeV does not apply to `m`, or None: it needs M >= 2S (two micro-batches per V chunk)."""
    if m.microbatches < 2 * m.stages:
        return f"{m.name}: {m.microbatches} micro-batches < 2 x {m.stages} stages (DualPipeV needs M >= 2S)"
    return None


# ----------------------------------------------------------------------------------------------------------
# Registry and back to back
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZeroBubbleBaseline:
    """One per-model zero-bubble schedule.

    Attributes:
        key: short name (results keys, CLI rows): `zb_h1`, `zb_v`, `dualpipe_v`.
        title: the name the papers use.
        build: (problem, model) -> the model's schedule, on `shape(problem, model)`.
        shape: (problem, model) -> the per-model problem the schedule runs on (`alone` or `v_shape`).
        unsupported: model -> why the definition does not apply (None: it does).
        closed_form: model -> the published makespan formula where one applies (None: none).
    """

    key: str
    title: str
    build: Callable[[Problem, str], Schedule]
    shape: Callable[[Problem, str], Problem]
    unsupported: Callable[[ModelSpec], str | None] = lambda m: None
    closed_form: Callable[[ModelSpec], float | None] = lambda m: None


BASELINES: tuple[ZeroBubbleBaseline, ...] = (
    ZeroBubbleBaseline("zb_h1", "ZB-H1", zb_h1, alone, closed_form=zb_h1_closed_form),
    ZeroBubbleBaseline("zb_v", "ZB-V", zb_v, v_shape),
    ZeroBubbleBaseline("dualpipe_v", "DualPipeV", dualpipe_v, v_shape, unsupported=dualpipe_v_unsupported),
)


@dataclass(frozen=True)
class ModelRun:
    """One model's zero-bubble schedule alone: its problem, schedule and simulated figures."""

    model: str
    problem: Problem
    schedule: Schedule
    makespan: float
    peak_per_rank: tuple[float, ...]
    closed_form: float | None


@dataclass(frozen=True)
class BackToBack:
    """A baseline run for every model, one after the other with a barrier (`zero_bubble` module docstring).

    Attributes:
        baseline: the baseline's key.
        makespan: sum of the models' makespans alone; None where the baseline does not apply.
        peak: max over ranks of the larger model peak on that rank; None where it does not apply.
        closed_form: sum of the models' published makespan formulas, None unless every model has one.
        runs: each model's run (empty where the baseline does not apply).
        reason: why the baseline does not apply (None: it does).
    """

    baseline: str
    makespan: float | None
    peak: float | None
    closed_form: float | None
    runs: tuple[ModelRun, ...]
    reason: str | None = None


def back_to_back(problem: Problem, baseline: ZeroBubbleBaseline) -> BackToBack:
    """Run `baseline` for each model of `problem` alone, the Actor's then the Critic's (model order), with a
    barrier between them: makespan = sum of the makespans alone, peak = max_k max_model peak_k."""
    reasons = [r for m in problem.models if (r := baseline.unsupported(m)) is not None]
    if reasons:
        return BackToBack(baseline.key, None, None, None, (), "; ".join(reasons))
    runs = []
    for m in problem.models:
        shaped = baseline.shape(problem, m.name)
        schedule = baseline.build(problem, m.name)
        sim = simulate(shaped, schedule)
        runs.append(
            ModelRun(m.name, shaped, schedule, sim.makespan, sim.peak_per_rank, baseline.closed_form(m))
        )
    forms = [r.closed_form for r in runs]
    return BackToBack(
        baseline.key,
        sum(r.makespan for r in runs),
        max(max(peaks) for peaks in zip(*(r.peak_per_rank for r in runs))),
        None if None in forms else sum(f for f in forms if f is not None),
        tuple(runs),
    )


def combined_schedule(result: BackToBack) -> tuple[Problem, Schedule]:
    """The back-to-back runs as one problem (every model with its own shape) and one schedule
    (`baselines.combine`: each rank runs the first model's list, then the next's). Simulated without a
    barrier it can only end earlier than `result.makespan`, which keeps the barrier."""
    if not result.runs:
        raise ValueError(f"{result.baseline} does not apply here ({result.reason}): nothing to combine")
    first = result.runs[0].problem
    problem = Problem(
        first.name.rsplit("/", 1)[0] + f" {result.baseline}",
        first.ranks,
        tuple(r.problem.models[0] for r in result.runs),
        None,
        first.comm_latency,
    )
    return problem, combine([r.schedule for r in result.runs])


def per_model_bound(problem: Problem) -> float:
    """A lower bound on every per-model split-backward schedule run back to back, on the models' own
    placements or in a V: the sum over models of the smaller of the two analytic bounds
    (`bounds.lower_bounds` of the model alone, F/I/W), since each model may choose its placement."""
    total = 0.0
    for m in problem.models:
        total += min(
            lower_bounds(shaped, compile_problem(shaped, split_backward=True)).makespan
            for shaped in (alone(problem, m.name), v_shape(problem, m.name))
        )
    return total
