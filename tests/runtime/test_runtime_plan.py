"""Pure planning (`rlhfuse.runtime.plan`), in one process: a profile gives frozen plans whose programs are
checked, serial 1F1B and fused are two functions chosen by name, and the saved profile round-trips exactly."""

from __future__ import annotations

import dataclasses

import pytest

from rlhfuse.pipeline import serial_one_f_one_b
from rlhfuse.pipeline.ir import Schedule
from rlhfuse.pipeline.simulate import simulate
from rlhfuse.runtime.layout import ModelParallel, ParallelLayout
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
