"""Training-stage makespans for the planner, on `rlhfuse.pipeline`'s one model of a fused pipeline problem.

The planner describes each candidate layout's fused Actor + Critic pipelines (docs/paper.md §3) as `PipeModel`s with
uniform stages; `pipeline_problem` turns them into a `rlhfuse.pipeline.Problem`, and the makespans come from
the pipeline package: `greedy_fused_makespan` is its greedy list schedule (earliest start, backward first on
ties) evaluated by its compiled evaluator, `fused_lower_bound` its paper bound (`lower_bounds(...).paper`: each
model's critical path, average work, per-rank work + head + tail), in closed form for uniform stages (tested
equal). The greedy schedule is feasible (an upper
bound on what the search reaches), the bound is what the paper's annealing reaches on most Table 3 settings;
the planner ranks layouts by the bound and reports both. `one_f_one_b` is the closed form of one uniform 1F1B
pipeline in that same model (tests check it against `rlhfuse.pipeline`'s simulated 1F1B), used where the planner
needs only a single model's makespan: hundreds of times per grid cell.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlhfuse.pipeline import Problem, make_problem
from rlhfuse.pipeline.problem import reversed_blocks as _reversed_blocks


@dataclass(frozen=True)
class PipeModel:
    """One model of a fused problem (same meaning as docs/schedule-format.md's model object)."""

    stages: int
    replicas: int
    microbatches: int
    """Per replica."""
    forward: float
    backward: float
    placement: tuple[tuple[int, ...], ...]
    """placement[r][s]: rank of stage s of replica r."""


def one_f_one_b(stages: int, microbatches: int, forward: float, backward: float) -> float:
    """Makespan of 1F1B with uniform stages: (M + S - 1) x (F + B) (Narayanan et al. 2021)."""
    return (microbatches + stages - 1) * (forward + backward)


def serial_makespan(models: Sequence[PipeModel]) -> float:
    """The models trained one after the other, each with 1F1B (the `serial_1f1b` of docs/schedule-format.md)."""
    return sum(one_f_one_b(m.stages, m.microbatches, m.forward, m.backward) for m in models)


def reversed_blocks(ranks: int, stages: int) -> tuple[tuple[int, ...], ...]:
    """Placement of ranks // stages replicas, replica r on ranks (r+1)*stages-1 .. r*stages (reversed)."""
    return tuple(tuple(row) for row in _reversed_blocks(ranks, stages))


def pipeline_problem(
    ranks: int,
    models: Sequence[PipeModel],
    *,
    names: Sequence[str] | None = None,
    activations: Sequence[float] | None = None,
    name: str = "planner",
) -> Problem:
    """The `rlhfuse.pipeline.Problem` of `models` on `ranks` ranks (no memory cap, no link latency); `names`
    and `activations` (per model, one micro-batch's activation per stage) default to model0, model1 ... and 1."""
    return make_problem(
        [
            {"name": names[i] if names else f"model{i}", "stages": m.stages, "replicas": m.replicas,
             "microbatches": m.microbatches, "forward": m.forward, "backward": m.backward,
             "activation": activations[i] if activations else 1.0, "placement": [list(row) for row in m.placement]}
            for i, m in enumerate(models)
        ],
        ranks=ranks,
        name=name,
    )  # fmt: skip


def fused_lower_bound(ranks: int, models: Sequence[PipeModel]) -> float:
    """`rlhfuse.pipeline.lower_bounds(pipeline_problem(ranks, models)).paper` in closed form for uniform stages:
    max(each model's critical path (M + S - 1)(F + B), average work per rank, per rank: its work + earliest
    first arrival (min s x F over its stages) + shortest tail (min s x B: the backward still has s stages to
    go)). Equal to the pipeline's bound (tests/planner check it on Table 3 and the grid's layouts) and to the
    authors' published bound on Table 3; closed form because compiling a problem costs ~14 ms and the search
    bounds thousands of layouts per grid (with uneven stages the grid would take 300 s instead of 13 s)."""
    bound = max(one_f_one_b(m.stages, m.microbatches, m.forward, m.backward) for m in models)
    total = sum(m.replicas * m.stages * m.microbatches * (m.forward + m.backward) for m in models)
    bound = max(bound, total / ranks)
    work = [0.0] * ranks
    head = [float("inf")] * ranks
    tail = [float("inf")] * ranks
    for m in models:
        for row in m.placement:
            for s, rank in enumerate(row):
                work[rank] += m.microbatches * (m.forward + m.backward)
                head[rank] = min(head[rank], s * m.forward)
                tail[rank] = min(tail[rank], s * m.backward)
    for r in range(ranks):
        if work[r]:
            bound = max(bound, work[r] + head[r] + tail[r])
    return bound


def greedy_fused_makespan(ranks: int, models: Sequence[PipeModel]) -> float:
    """`rlhfuse.pipeline`'s greedy list schedule (repeatedly start the ready op with the earliest start time,
    backward first on ties; forwards and backwards of a stage in micro-batch order, in-flight micro-batches
    uncapped, as the authors' greedy start), evaluated: on the Table 3 settings within 16% of their published
    greedy makespans (tests/planner). Communication is inside forward / backward."""
    from rlhfuse.pipeline.compiled import compile_problem  # numba's kernels: loaded when first used
    from rlhfuse.pipeline.search import greedy_order

    compiled = compile_problem(pipeline_problem(ranks, models))
    makespan, _ = compiled.evaluate(greedy_order(compiled))
    return float(makespan)
