"""Pure planning (`rlhfuse.runtime.plan`), in one process: a profile gives frozen plans whose programs are
checked, serial 1F1B and fused are two functions chosen by name, and the saved profile round-trips exactly."""

from __future__ import annotations

import dataclasses

import pytest

from rlhfuse.pipeline import serial_one_f_one_b, zb_h1
from rlhfuse.pipeline.baselines import combine
from rlhfuse.pipeline.ir import Action, Kind, Schedule
from rlhfuse.pipeline.simulate import is_split, simulate
from rlhfuse.runtime.layout import ModelParallel, ParallelLayout, actor_only_layout
from rlhfuse.runtime.plan import (
    PLANNERS,
    PlanOptions,
    StageProfile,
    plan_fused,
    plan_serial_1f1b,
    planner_for,
    unprofiled_plan,
)
from rlhfuse.trainer.strategies import STRATEGIES, PipelinePart, strategy_class

LAYOUT = ParallelLayout(ModelParallel(2), ModelParallel(1), dp=1, world_size=2, microbatches=4)
# hand-picked seconds per micro-batch: (actor, stage, F/B) and the critic's single stage; one below the floor
MEANS = {
    ("actor", 0, "F"): 0.010,
    ("actor", 0, "B"): 0.020,
    ("actor", 1, "F"): 0.012,
    ("actor", 1, "B"): 0.025,
    ("critic", 0, "F"): 0.008,
    ("critic", 0, "B"): 0.0,
}


def test_profile_floors_scales_and_round_trips() -> None:
    profile = StageProfile.from_means(LAYOUT, 4, MEANS)
    assert profile.forward == {"actor": (0.010, 0.012), "critic": (0.008,)}
    assert profile.backward == {"actor": (0.020, 0.025), "critic": (1e-6,)}
    assert StageProfile.from_json(profile.to_json()) == profile
    # twice the micro-batches of the same mini-batch: each takes half as long
    half = profile.problem(LAYOUT, 8).model("actor")
    assert half.forward == pytest.approx((0.005, 0.006)) and half.microbatches == 8
    assert profile.problem(LAYOUT, 4).model("critic").microbatches == 2  # per replica of the smaller model


def test_serial_and_fused_are_two_planning_functions_chosen_by_name() -> None:
    # the runtime's schedules are the strategies registered with a pipeline layout
    assert set(PLANNERS) == {n for n in STRATEGIES.names() if issubclass(strategy_class(n), PipelinePart)}
    assert planner_for("fused") is plan_fused and planner_for("serial_1f1b") is plan_serial_1f1b
    with pytest.raises(ValueError, match=r"schedule='zigzag' is not one of \['fused', 'serial_1f1b'\]"):
        planner_for("zigzag")


def test_plans_are_frozen_lowered_and_predicted_from_the_profile() -> None:
    profile = StageProfile.from_means(LAYOUT, 4, MEANS)
    before = unprofiled_plan(LAYOUT, 4, prefetch=1)
    assert before.profiled is None and before.schedule == serial_one_f_one_b(before.problem)
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.microbatches = 2  # type: ignore[misc]

    serial = plan_serial_1f1b(LAYOUT, profile, 6, PlanOptions(prefetch=1, search_budget_s=5.0))
    assert serial.microbatches == 6 and serial.schedule == serial_one_f_one_b(serial.problem)
    assert serial.profiled is not None and serial.predicted_s == serial.predicted_serial_s > 0
    assert serial.note == "" and len(serial.program.streams) == LAYOUT.group_size

    searches: list[Schedule] = []

    def agree(search):  # what a rank that did not search would do: take the searched schedule
        searches.append(search())
        return searches[-1]

    fused = plan_fused(LAYOUT, profile, 4, PlanOptions(prefetch=1, search_budget_s=0.0), agree)
    assert len(searches) == 1 and fused.schedule is searches[0]
    assert fused.profiled is not None
    assert fused.predicted_s == simulate(fused.profiled, fused.schedule).makespan
    assert fused.predicted_serial_s == simulate(fused.profiled, serial_one_f_one_b(fused.profiled)).makespan
    assert "(4 micro-batches)" in fused.note and "vs serial 1F1B" in fused.note


# both models with 2 stages: the paper's greedy leaves bubbles a split backward fills
PP2 = ParallelLayout(ModelParallel(2), ModelParallel(2), dp=1, world_size=2, microbatches=4)


def _split_means(input_share: float, overhead: float) -> dict[tuple[str, int, str], float]:
    """F 10 ms and B 20 ms on every stage of PP2, with I and W measured: I takes `input_share` of B and I + W is
    B times `overhead`."""
    means = {}
    for m in ("actor", "critic"):
        for s in (0, 1):
            means.update({(m, s, "F"): 0.010, (m, s, "B"): 0.020})
            means.update({(m, s, "I"): 0.020 * input_share * overhead})
            means.update({(m, s, "W"): 0.020 * (1 - input_share) * overhead})
    return means


def test_split_backward_is_planned_from_measured_i_and_w_and_auto_keeps_the_shorter() -> None:
    cheap = StageProfile.from_means(PP2, 4, _split_means(0.3, 1.0))  # W is most of B, free to move
    assert cheap.backward_input["actor"] == pytest.approx((0.006, 0.006))
    assert StageProfile.from_json(cheap.to_json()) == cheap
    # measured shares, scaled like F and B: twice the micro-batches, half the time
    durations = cheap.durations(PP2, 8)
    assert durations(Action("actor", 0, 1, Kind.W, 0)) == pytest.approx(0.020 * 0.7 / 2)
    # a profile without I / W falls back to the fixed share of B
    plain = StageProfile.from_means(LAYOUT, 4, MEANS)
    assert plain.durations(LAYOUT, 4)(Action("actor", 0, 0, Kind.I, 0)) == pytest.approx(0.020 * 0.5)

    def plan(profile: StageProfile, split: object, planner=plan_fused):
        return planner(PP2, profile, 4, PlanOptions(prefetch=1, split_backward=split))  # type: ignore[arg-type]

    auto = plan(cheap, "auto")
    assert is_split(auto.schedule) and "F/I/W (split backward), the F/B one predicted" in auto.note
    forced_fb = plan(cheap, False)
    assert not is_split(forced_fb.schedule) and auto.predicted_s < forced_fb.predicted_s
    assert auto.predicted_s == simulate(auto.profiled, auto.schedule, cheap.durations(PP2, 4)).makespan
    assert auto.program.counts()["W"] == auto.program.counts()["I"] > 0
    # splitting costs twice B here: auto keeps F/B, true still plans F/I/W
    costly = StageProfile.from_means(PP2, 4, _split_means(0.5, 2.0))
    assert not is_split(plan(costly, "auto").schedule)
    assert is_split(plan(costly, True).schedule)
    # serial 1F1B: each model's ZB-H1, one after the other, where shorter
    serial = plan(cheap, "auto", plan_serial_1f1b)
    assert serial.schedule == combine([zb_h1(serial.problem, m) for m in ("actor", "critic")])
    assert serial.predicted_s < serial.predicted_serial_s and serial.note.startswith("serial 1F1B F/I/W")
    assert (
        simulate(serial.problem, serial.schedule).peak
        == simulate(serial.problem, serial_one_f_one_b(serial.problem)).peak
    )  # at 1F1B's peak memory
    # an Actor alone (a critic-free algorithm): ZB-H1 in place of 1F1B where shorter
    alone = actor_only_layout(ModelParallel(2), 1, 2, 4)
    means = {k: v for k, v in _split_means(0.3, 1.0).items() if k[0] == "actor"}
    actor = plan_fused(alone, StageProfile.from_means(alone, 4, means), 4, PlanOptions(split_backward="auto"))
    assert actor.schedule == zb_h1(actor.problem, "actor") and actor.predicted_s < actor.predicted_serial_s


def test_the_profiling_step_splits_odd_microbatches_to_measure_i_and_w() -> None:
    split = unprofiled_plan(LAYOUT, 4, prefetch=1, split_backward="auto")
    kinds = {(a.kind, a.microbatch % 2) for _, _, a in split.schedule.actions() if a.kind is not Kind.F}
    assert kinds == {(Kind.B, 0), (Kind.I, 1), (Kind.W, 1)}
    assert unprofiled_plan(LAYOUT, 4, prefetch=1, split_backward=False).schedule == serial_one_f_one_b(
        split.problem
    )
