"""The planner's mirror of the runtime's co-location rule (`rlhfuse.planner.colocation`) against
`rlhfuse.runtime.ParallelLayout` itself: the same layouts accepted and refused, the same stages on every rank."""

from __future__ import annotations

import itertools

from rlhfuse.planner.colocation import Colocation
from rlhfuse.planner.memory import local_stages
from rlhfuse.runtime.layout import ModelParallel, ParallelLayout, fused_group_width

TPS = (1, 2, 3, 4, 8)


def _runtime(ap: int, at: int, cp: int, ct: int, microbatches: int) -> ParallelLayout | None:
    world = fused_group_width(ap, at, cp, ct)
    try:
        return ParallelLayout(ModelParallel(ap, at), ModelParallel(cp, ct), 1, world, microbatches)
    except ValueError:
        return None


def test_the_planner_admits_exactly_the_layouts_the_runtime_accepts() -> None:
    accepted = merged = 0
    for ap, at, cp, ct in itertools.product(range(1, 9), TPS, range(1, 9), TPS):
        lay = Colocation(ap, at, cp, ct)
        for microbatches in (1, 2, 3, 4, 8):
            runtime = _runtime(ap, at, cp, ct, microbatches)
            reason = lay.problem(microbatches)
            assert (runtime is not None) == (reason is None), (ap, at, cp, ct, microbatches, reason)
        runtime = _runtime(ap, at, cp, ct, 8 * 7 * 5 * 3)  # micro-batches every replica count divides
        if runtime is None:
            assert lay.problem() is not None, (ap, at, cp, ct)
            continue
        accepted += 1
        merged += at != ct
        assert lay.problem() is None
        assert (lay.tp, lay.ranks, lay.larger) == (runtime.tp, runtime.group_size, runtime.larger)
        for m in ("actor", "critic"):
            assert (lay.merge(m), lay.positions(m), lay.replicas(m)) == (
                runtime.merge(m),
                runtime.merged_stages(m),
                runtime.replicas(m),
            )
        # every global rank of the fused group holds, of each model, the stage local_stages names for it
        stages = local_stages(ap, cp, at, ct)
        t = min(at, ct)
        assert len(stages) == lay.ranks * lay.width
        for rank in range(runtime.world_size):
            held = runtime.held_stages(rank)
            sa, sc = stages[runtime.pipeline_rank(rank) * lay.width + (rank % runtime.tp) // t]
            assert held == {"actor": {sa}, "critic": {sc}}, (ap, at, cp, ct, rank)
    assert accepted > 100 and merged > 40, (accepted, merged)


def test_refusals_name_the_rule() -> None:
    assert Colocation(2, 2, 4, 1).problem() is None
    assert Colocation(2, 4, 2, 3).problem() == "the smaller tp does not divide the larger"
    assert (
        Colocation(2, 2, 3, 1).problem() == "the smaller-tp model's pp is not a multiple of max tp / its tp"
    )
    assert Colocation(3, 1, 2, 1).problem() == "merged stages do not nest"
    # actor pp=4 tp=1 -> 2 merged stages on tp=2 groups, critic pp=1 tp=2: 2 critic replicas
    assert Colocation(4, 1, 1, 2).problem(3) == "micro-batches do not split over the smaller model's replicas"
