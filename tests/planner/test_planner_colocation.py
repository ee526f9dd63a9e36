"""The co-location rule the planner reads (`rlhfuse.pipeline.colocation`) against `rlhfuse.runtime.ParallelLayout`,
which validates and places through it: the same layouts accepted and refused, the same stages on every rank
(`Colocation.local_stages` against the layout's `held_stages`, which go through `RankGeometry`)."""

from __future__ import annotations

import itertools

from rlhfuse.pipeline.colocation import Colocation, StageMerge, placed_on
from rlhfuse.planner.memory import local_stages
from rlhfuse.runtime.layout import ModelParallel, ParallelLayout

TPS = (1, 2, 3, 4, 8)


def _runtime(ap: int, at: int, cp: int, ct: int, microbatches: int) -> ParallelLayout | None:
    world = Colocation(ap, at, cp, ct).group_ranks
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


def test_the_docs_example_by_hand() -> None:
    """docs/distributed.md, "Merged stages": actor pp=2 tp=2, critic pp=4 tp=1 on 4 ranks."""
    lay = Colocation(2, 2, 4, 1)
    assert (lay.tp, lay.merge("actor"), lay.merge("critic"), lay.ranks, lay.group_ranks) == (2, 1, 2, 2, 4)
    # the critic's merged stage 0 (stages 0, 1) on pipeline rank 1, merged stage 1 (stages 2, 3) on rank 0
    assert lay.placement("critic") == [[1, 0]] and placed_on(lay.placement("critic"), 0) == [(0, 1)]
    assert lay.local_stages() == [(0, 2), (0, 3), (1, 0), (1, 1)]
    # the critic on tp=2 groups: sub-stage slot j on rank j of the group; stage 3 is slot 1 of merged stage 1
    critic = StageMerge(tp=2, model_tp=1)
    assert (critic.factor, critic.slot_at(1), critic.offset(1), critic.stages(1)) == (2, 1, 1, range(2, 4))
    assert (critic.merged_of(3), critic.slot_of(3), critic.stage(1, 1)) == (1, 1, 3)
    # a model of tp 2 on tp=4 groups: slot 1's tp shard 1 is the group's rank 3
    assert StageMerge(tp=4, model_tp=2).offset(1, 1) == 3 and StageMerge(tp=4, model_tp=2).slot_at(3) == 1
    # the messages name the keys and the arithmetic (the runtime's errors)
    (refusal,) = Colocation(2, 2, 3, 1).refusals()
    assert refusal.rule == Colocation(2, 2, 3, 1).problem()
    assert "critic.pp=3 must be a multiple of actor.tp / critic.tp = 2 / 1 = 2" in refusal.message
    assert [r.message for r in Colocation(0, 1, 2, 0).refusals()] == [
        "actor.pp=0 must be >= 1",
        "critic.tp=0 must be >= 1",
    ]
