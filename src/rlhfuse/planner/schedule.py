"""Training-stage makespans for the planner, on `rlhfuse.pipeline`'s one model of a fused pipeline problem.

The planner describes each candidate layout's fused Actor + Critic pipelines (DESIGN §3) as `PipeModel`s with
uniform stages; `pipeline_problem` turns them into a `rlhfuse.pipeline.Problem`, and the makespans come from
the pipeline package: `greedy_fused_makespan` is its greedy list schedule (earliest start, backward first on
ties) evaluated by its compiled evaluator. `fused_lower_bound` is still the planner's own closed-form bound. The greedy schedule is feasible (an upper
bound on what the search reaches), the bound is what the paper's annealing reaches on most Table 3 settings;
the planner ranks layouts by the bound and reports both. `one_f_one_b` is the closed form of one uniform 1F1B
pipeline in that same model (tests check it against `rlhfuse.pipeline`'s simulated 1F1B), used where the planner
needs only a single model's makespan: hundreds of times per grid cell.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlhfuse.pipeline import Problem, make_problem
from rlhfuse.pipeline.compiled import compile_problem
from rlhfuse.pipeline.problem import reversed_blocks as _reversed_blocks
from rlhfuse.pipeline.search import greedy_order


@dataclass(frozen=True)
class PipeModel:
    """One model of a fused problem (same meaning as bench/FORMAT.md's model object)."""

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
    """The models trained one after the other, each with 1F1B (the `serial_1f1b` of bench/FORMAT.md)."""
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
    """max(each model's 1F1B critical path, per rank: its work + earliest first arrival + shortest tail).

    On the Table 3 settings this is within 5% below the authors' published bound (tests/planner)."""
    bound = max(one_f_one_b(m.stages, m.microbatches, m.forward, m.backward) for m in models)
    work = [0.0] * ranks
    head = [float("inf")] * ranks
    tail = [float("inf")] * ranks
    for m in models:
        for row in m.placement:
            for s, rank in enumerate(row):
                work[rank] += m.microbatches * (m.forward + m.backward)
                head[rank] = min(head[rank], s * m.forward)
                tail[rank] = min(tail[rank], (m.stages - 1 - s) * m.backward)
    for r in range(ranks):
        if work[r]:
            bound = max(bound, work[r] + head[r] + tail[r])
    return bound


def greedy_fused_makespan(ranks: int, models: Sequence[PipeModel]) -> float:
    """`rlhfuse.pipeline`'s greedy list schedule (repeatedly start the ready op with the earliest start time,
    backward first on ties; forwards and backwards of a stage in micro-batch order, in-flight micro-batches
    uncapped, as the authors' greedy start), evaluated: on the Table 3 settings within 16% of their published
    greedy makespans (tests/planner). Communication is inside forward / backward."""
    compiled = compile_problem(pipeline_problem(ranks, models))
    makespan, _ = compiled.evaluate(greedy_order(compiled))
    return float(makespan)
