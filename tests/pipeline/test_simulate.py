"""Simulator golden values, invalid schedules and agreement with the compiled evaluator."""

import json

import numpy as np
import pytest

from rlhfuse.pipeline import (
    Action,
    Kind,
    Placement,
    Schedule,
    ScheduleError,
    chimera,
    gpipe,
    interleaved_one_f_one_b,
    make_problem,
    one_f_one_b,
    profile_durations,
    schedule_from_labels,
    serial_makespan,
    serial_one_f_one_b,
    serial_peak,
    simulate,
)
from rlhfuse.pipeline.compiled import compile_problem


def single(stages=4, micro=6, f=1.0, b=2.0, act=1.0):
    return make_problem([{"name": "m", "stages": stages, "microbatches": micro, "forward": f, "backward": b,
                          "activation": act}])  # fmt: skip


def test_1f1b_golden_makespan_bubble_and_memory():
    # (M + S - 1)(f + b) = (6 + 3) * 3 = 27; each rank works 6 * 3 = 18, idle 9: bubble 1/3.
    p = single()
    sim = simulate(p, one_f_one_b(p))
    assert sim.makespan == 27
    assert sim.busy == (18, 18, 18, 18)
    assert sim.bubble_ratio == pytest.approx((1 / 3,) * 4)
    # 1F1B keeps S - s micro-batches in flight on stage s.
    assert sim.peak_per_rank == (4, 3, 2, 1)
    assert sim.peak == 4


def test_gpipe_golden():
    # GPipe: all F then all B: makespan (M + S - 1)(f + b) too with uniform stages, but all M in flight.
    p = single()
    sim = simulate(p, gpipe(p))
    assert sim.makespan == 27
    assert sim.peak_per_rank == (6, 6, 6, 6)


def test_interleaved_1f1b_runs_and_beats_plain_bubble():
    p = make_problem([{"name": "m", "stages": 8, "microbatches": 8, "forward": 1, "backward": 2,
                       "placement": [[0, 1, 2, 3, 0, 1, 2, 3]]}], ranks=4)  # fmt: skip
    sim = simulate(p, interleaved_one_f_one_b(p))
    plain = single(stages=4, micro=8, f=2, b=4)
    assert sim.makespan < simulate(plain, one_f_one_b(plain)).makespan


def test_serial_and_chimera():
    p = make_problem([
        {"name": "a", "stages": 4, "microbatches": 4, "forward": 1, "backward": 2},
        {"name": "b", "stages": 4, "microbatches": 4, "forward": 1, "backward": 2},
    ])  # fmt: skip
    assert serial_makespan(p) == 2 * (4 + 3) * 3
    sim = simulate(p, serial_one_f_one_b(p))
    assert sim.makespan <= serial_makespan(p)
    assert serial_peak(p) == 4
    fused = simulate(p, chimera(p))
    assert fused.makespan < serial_makespan(p)
    with pytest.raises(ValueError, match="opposite directions"):
        chimera(make_problem([{"name": "a", "stages": 4, "microbatches": 4, "forward": 1, "backward": 2},
                              {"name": "b", "stages": 2, "microbatches": 4, "forward": 1, "backward": 2}]))  # fmt: skip


def test_profiled_durations_and_latency():
    p = single(stages=2, micro=1)
    # F0 s0 [0,3) -> F0 s1 [3+1, 5) -> B s1 [5, 7) -> B s0 [7+1, 10)
    sim = simulate(p, one_f_one_b(p), durations=profile_durations(p, {("m", 0, "F"): 3.0}), comm_latency=1.0)
    assert sim.makespan == 10


def test_invalid_schedules_have_precise_errors():
    p = single(stages=2, micro=2)
    good = one_f_one_b(p)
    lists = [list(r) for r in good.ranks]
    missing = Schedule.from_lists([lists[0][:-1], lists[1]])
    with pytest.raises(ScheduleError, match="missing"):
        simulate(p, missing)
    dup = Schedule.from_lists([lists[0] + [lists[0][0]], lists[1]])
    with pytest.raises(ScheduleError, match="twice"):
        simulate(p, dup)
    wrong = Schedule.from_lists([lists[0] + [lists[1][0]], lists[1][1:]])
    with pytest.raises(ScheduleError, match="placement puts"):
        simulate(p, wrong)
    b_first = Schedule.from_lists([[lists[0][-1], *lists[0][:-1]], lists[1]])
    with pytest.raises(ScheduleError, match="before its forward"):
        simulate(p, b_first)
    # Rank 1 waits for F1 before running B0, while rank 0 waits for B0 before sending F1: a deadlock.
    r0 = [Action("m", 0, 0, Kind.F, 0), Action("m", 0, 0, Kind.B, 0), Action("m", 0, 0, Kind.F, 1),
          Action("m", 0, 0, Kind.B, 1)]  # fmt: skip
    r1 = [Action("m", 0, 1, Kind.F, 0), Action("m", 0, 1, Kind.F, 1), Action("m", 0, 1, Kind.B, 0),
          Action("m", 0, 1, Kind.B, 1)]  # fmt: skip
    with pytest.raises(ScheduleError, match=r"deadlock(.|\n)*rank 0(.|\n)*rank 1"):
        simulate(p, Schedule.from_lists([r0, r1]))


def test_round_trips(tiny_fused):
    s = serial_one_f_one_b(tiny_fused)
    placement = Placement.of(tiny_fused)
    assert schedule_from_labels(s.labels(), placement) == s
    assert Schedule.from_json(s.to_json()) == s
    assert Schedule.from_csv(s.to_csv()) == s
    assert json.loads(json.dumps(tiny_fused.to_dict()))["models"][1]["placement"] == [[1, 0], [3, 2]]


def test_compiled_evaluator_agrees_with_simulator(tiny_fused):
    c = compile_problem(tiny_fused)
    s = serial_one_f_one_b(tiny_fused)
    order = c.from_schedule(s)
    ms, finish = c.evaluate(order)
    sim = simulate(tiny_fused, s)
    assert ms == sim.makespan
    assert c.peak(order) == pytest.approx(sim.peak)
    idx = c.index()
    assert all(finish[idx[a]] == sim.end[a] for a in sim.end)
    # A deadlocking order is reported as -1.
    bad = order.copy()
    lo = c.rank_ptr[0]
    bad[lo], bad[lo + 1] = bad[lo + 1], bad[lo]
    first = c.actions[int(bad[lo])]
    if first.kind is Kind.B:
        assert c.evaluate(bad)[0] == -1
    assert np.all(c.tail >= 0)


def test_problem_validation_names_keys_and_fixes():
    from rlhfuse.pipeline import problem_from_dict

    raw = {"name": "x", "ranks": 2, "models": [{"name": "a", "stages": 2, "replicas": 1, "microbatches": 0,
           "forward": 1, "backward": [1], "placement": [[0, 5]]}], "memory_cap": -1}  # fmt: skip
    with pytest.raises(ValueError) as err:
        problem_from_dict(raw)
    text = str(err.value)
    assert "microbatches must be >= 1" in text
    assert "backward has 1 per-stage values but stages=2" in text
    assert "placement[0][1] must be a rank in 0..1" in text
    assert "memory_cap must be null or a number > 0" in text
