"""The proof side: proven bounds and optimal schedules on problems whose optimum is known by hand or by
enumerating every schedule; memory caps; bad input named before any search."""

import itertools
import json

import numpy as np
import pytest

from rlhfuse.pipeline import SearchConfig, lower_bounds, make_problem, simulate, solve
from rlhfuse.pipeline.compiled import compile_problem
from rlhfuse.pipeline.exact import exact_search, prove
from rlhfuse.pipeline.ir import parse_action
from rlhfuse.pipeline.problem import min_feasible_cap, problem_from_dict
from rlhfuse.pipeline.schedule_command import main


def _single(stages, micro, f, b, cap=None):
    return make_problem(
        [{"name": "actor", "stages": stages, "microbatches": micro, "forward": f, "backward": b}],
        memory_cap=cap,
    )


def test_1f1b_optimum_is_proven():
    # One pipeline: stage 0 does M(f+b) work and waits (S-1)(f+b) for the first backward, so (M+S-1)(f+b)
    # is optimal, and 1F1B reaches it.
    p = _single(3, 4, 1, 2)
    r = exact_search(p, analytic_bound=0.0, time_budget=10)
    assert r.optimal and r.value == r.lower_bound == (4 + 3 - 1) * 3


def test_memory_cap_of_one_microbatch_serialises_and_the_proof_sees_it():
    # Cap 1 with activation 1: rank 0 holds micro-batch 0 until its B on stage 0, so micro-batch 1 cannot
    # start before it: 2 x (F0 F1 B1 B0) = 8, while the cap-blind bound says (2+2-1)(1+1) = 6.
    p = _single(2, 2, 1, 1, cap=1.0)
    assert lower_bounds(p).makespan == 6
    r = exact_search(p, analytic_bound=6.0, time_budget=10)
    assert r.optimal and r.lower_bound == 8 and r.value == 8
    s = solve(p, SearchConfig(max_iterations=2000))
    assert s.makespan == s.lower_bound == 8 and s.gap == 0 and s.peak <= 1.0


def _brute_force(problem):
    """The optimum over every per-rank merge of the streams (micro-batches in order on each stream)."""
    c = compile_problem(problem)
    per_rank = []
    for k in range(c.ranks):
        streams = [int(s) for s in c.rank_streams[c.rank_streams_ptr[k] : c.rank_streams_ptr[k + 1]]]
        labels = [sid for sid in streams for _ in range(int(c.stream_len[sid]))]
        merges = []
        for perm in set(itertools.permutations(labels)):
            nxt = {sid: int(c.stream_base[sid]) for sid in streams}
            ops = []
            for sid in perm:
                ops.append(nxt[sid])
                nxt[sid] += 1
            merges.append(ops)
        per_rank.append(merges)
    best = np.inf
    for combo in itertools.product(*per_rank):
        ms, _ = c.evaluate(np.array([op for ops in combo for op in ops], dtype=np.int64))
        order = np.array([op for ops in combo for op in ops], dtype=np.int64)
        if ms >= 0 and (problem.memory_cap is None or c.peak(order) <= problem.memory_cap + 1e-9):
            best = min(best, ms)
    return best


@pytest.mark.parametrize(("cap", "optimum"), [(None, 15), (2.5, 20)])
def test_exact_optimum_equals_enumeration_on_a_tiny_fused_problem(cap, optimum):
    # Under cap 2.5 an Actor micro-batch (1.5) and a Critic one (1.0) fit together on a rank but two Actor
    # micro-batches do not: the optimum (20, by enumeration) is well above the cap-blind bound (15).
    p = make_problem(
        [
            {"name": "actor", "stages": 2, "microbatches": 2, "forward": 2, "backward": 3, "activation": 1.5},
            {
                "name": "critic",
                "stages": 2,
                "microbatches": 1,
                "forward": 1,
                "backward": 2,
                "activation": 1.0,
            },
        ],
        memory_cap=cap,
    )
    assert lower_bounds(p).makespan == 15
    assert _brute_force(p) == optimum
    r = exact_search(p, analytic_bound=lower_bounds(p).makespan, time_budget=10)
    assert r.optimal and r.value == r.lower_bound == optimum
    assert simulate(p, compile_problem(p).to_schedule(r.order)).makespan == optimum


def test_proven_bound_is_never_above_a_found_schedule_and_gap_is_reported(tiny_fused):
    s = solve(tiny_fused, SearchConfig(max_iterations=3000))
    assert s.lower_bound <= s.makespan and s.gap == pytest.approx(
        (s.makespan - s.lower_bound) / s.lower_bound
    )
    result = s.to_result()
    for key in ("makespan", "lower_bound", "gap", "peak_activation", "ranks", "serial_1f1b"):
        assert key in result


def test_fractional_durations_are_scaled_exactly():
    p = _single(2, 3, 0.5, 1.25)
    r = exact_search(p, analytic_bound=0.0, time_budget=10)
    assert r.optimal and r.value == pytest.approx((3 + 2 - 1) * 1.75)


def test_exact_step_is_deterministic_with_an_iteration_budget():
    p = make_problem(
        [{"name": "actor", "stages": 4, "microbatches": 6, "forward": 2, "backward": 4, "activation": 1.0},
         {"name": "critic", "stages": 2, "microbatches": 4, "forward": 1, "backward": 2, "activation": 1.0}],
        memory_cap=4.0,
    )  # fmt: skip
    cfg = SearchConfig(seed=1, max_iterations=3000, max_starts=50)
    a, b = solve(p, cfg), solve(p, cfg)
    assert a.schedule == b.schedule and a.lower_bound == b.lower_bound
    assert simulate(p, a.schedule).peak <= 4.0 + 1e-9
    assert a.makespan <= 1.05 * a.lower_bound


def test_capped_unseen_problem_within_5_percent_never_over_cap():
    # Unequal stage times, a micro-batch count that is not a multiple of the stages, a tight cap.
    p = make_problem(
        [{"name": "actor", "stages": 6, "microbatches": 9, "forward": [2, 3, 2, 2, 3, 2],
          "backward": [4, 6, 4, 4, 6, 4], "activation": 1.0},
         {"name": "critic", "stages": 3, "microbatches": 5, "forward": 1, "backward": 2, "activation": 2.0}],
        memory_cap=7.0,
    )  # fmt: skip
    s = solve(p, SearchConfig(max_iterations=20_000, max_starts=100))
    sim = simulate(p, s.schedule)
    assert sim.peak <= 7.0 + 1e-9
    assert s.makespan <= 1.05 * s.lower_bound


def test_too_large_for_the_exact_model_says_so_and_keeps_the_bound(tiny_fused):
    c = compile_problem(tiny_fused)
    bound = lower_bounds(tiny_fused, c).makespan
    r = prove(tiny_fused, compiled=c, analytic_bound=bound, max_ops=10)
    assert r.status == "TOO_LARGE" and r.lower_bound == bound and "max_ops" in r.note


def test_cli_bound_writes_the_proven_bound(tmp_path, capsys):
    problem = tmp_path / "p.json"
    problem.write_text(json.dumps(_single(2, 2, 1, 1, cap=1.0).to_dict()))
    out = tmp_path / "b.json"
    assert main(["bound", str(problem), "--time-budget", "5", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["lower_bound"] == 8 == got["makespan"] and got["optimal"] and got["lower_bound_analytic"] == 6
    assert "proven lower bound 8" in capsys.readouterr().out
    assert main(["bound", str(problem), "--max-ops", "3", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["status"] == "TOO_LARGE"


# --- bad input: a clear error naming the field, before any search ------------------------------------------


def test_cap_no_schedule_can_meet_is_refused_naming_the_field():
    # Two stages of one replica on rank 0 (interleaved): one micro-batch holds 1 + 1 there, whatever the order.
    raw = {
        "name": "interleaved",
        "ranks": 1,
        "models": [{"name": "actor", "stages": 2, "replicas": 1, "microbatches": 2, "forward": 1,
                    "backward": 1, "activation": 1.0, "placement": [[0, 0]]}],
        "memory_cap": 1.5,
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"memory_cap=1.5 is below 2"):
        problem_from_dict(raw)
    raw["memory_cap"] = 2.0
    assert min_feasible_cap(problem_from_dict(raw)) == 2.0


def test_contradictory_placement_is_refused():
    raw = {
        "name": "overlap",
        "ranks": 2,
        "models": [{"name": "critic", "stages": 2, "replicas": 2, "microbatches": 1, "forward": 1,
                    "backward": 1, "placement": [[1, 0], [0, 1]]}],
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"placement\[1\]\[0\] puts replica 1 on rank 0, which replica 0"):
        problem_from_dict(raw)


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown action kind 'X'"):
        parse_action("actor.0.s0:X3")


# --- split backward (beyond the paper) ------------------------------------------------------------------


def test_split_backward_one_stage_pair_by_hand():
    # 2 stages, 1 micro-batch, F=1, B=2 (I=W=1): F0 F1 I1 I0 W0 is the critical path and W1 runs on rank 1
    # beside I0, so the optimum is 5 (plain: F0 F1 B1 B0 = 6).
    p = _single(2, 1, 1, 2)
    s = solve(p, SearchConfig(max_iterations=1000, split_backward=True))
    sim = simulate(p, s.schedule)
    assert {a.kind.value for rank in s.schedule.ranks for a in rank} == {"F", "I", "W"}
    assert sim.makespan == s.makespan == s.lower_bound == 5
    assert solve(p, SearchConfig(max_iterations=1000)).makespan == 6


def test_split_backward_search_is_valid_and_never_worse_on_a_fused_problem(tiny_fused):
    plain = solve(tiny_fused, SearchConfig(max_iterations=3000))
    split = solve(tiny_fused, SearchConfig(max_iterations=3000, split_backward=True))
    assert simulate(tiny_fused, split.schedule).makespan == split.makespan >= split.lower_bound
    assert split.makespan <= plain.makespan and split.optimal


def test_a_schedule_mixing_b_and_i_is_refused(tiny_fused):
    from rlhfuse.pipeline import ScheduleError
    from rlhfuse.pipeline.ir import Action, Kind, Schedule

    good = solve(tiny_fused, SearchConfig(max_iterations=500)).schedule
    first = good.ranks[0][0]
    bad = Schedule(
        ((Action(first.model, first.replica, first.stage, Kind.I, 0), *good.ranks[0]), *good.ranks[1:])
    )
    with pytest.raises(ScheduleError, match="not both B and I/W"):
        simulate(tiny_fused, bad)


def test_low_memory_search_keeps_the_makespan_and_lowers_the_peak():
    from rlhfuse.pipeline.baselines import serial_peak
    from rlhfuse.pipeline.exact import low_memory_search

    p = make_problem(
        [{"name": "actor", "stages": 4, "microbatches": 8, "forward": 1, "backward": 2, "activation": 1.0},
         {"name": "critic", "stages": 2, "microbatches": 4, "forward": 1, "backward": 2, "activation": 1.0}],
    )  # fmt: skip
    c = compile_problem(p)
    r = exact_search(p, compiled=c, analytic_bound=lower_bounds(p, c).makespan, time_budget=10)
    assert r.optimal
    peak = c.peak(r.order)
    low = low_memory_search(
        p, compiled=c, makespan=r.value, peak=peak + 1.0, serial_peak=serial_peak(p), time_budget=10
    )
    assert low is not None and c.evaluate(low.order)[0] <= r.value and c.peak(low.order) < peak + 1.0


def test_capped_memory_search_meets_its_cap_at_the_makespan():
    from rlhfuse.pipeline.exact import capped_memory_search

    p = make_problem(
        [{"name": "actor", "stages": 4, "microbatches": 8, "forward": 1, "backward": 2, "activation": 1.0},
         {"name": "critic", "stages": 2, "microbatches": 4, "forward": 1, "backward": 2, "activation": 1.0}],
    )  # fmt: skip
    c = compile_problem(p)
    bound = lower_bounds(p, c).makespan
    r = prove(p, compiled=c, analytic_bound=bound, at_most=bound, time_budget=10)  # the solver's own order
    peak = c.peak(r.order)
    assert r.optimal and peak == 10
    # The solver's first solution has peak 10 (forwards as early as possible); the actor's 1F1B needs 4 on rank 0,
    # and a cap just above that is met at the optimal makespan 39.
    low = capped_memory_search(p, compiled=c, makespan=r.value, peak=peak, target=4.0, time_budget=20)
    assert low is not None and c.evaluate(low.order)[0] <= r.value == 39
    assert c.peak(low.order) <= 4.0 * 1.01 < peak


def test_cli_solve_reports_gap_and_split_backward_next_to_the_plain_result(tmp_path, tiny_fused):
    problem = tmp_path / "p.json"
    problem.write_text(json.dumps(tiny_fused.to_dict()))
    out = tmp_path / "r.json"
    args = ["solve", str(problem), "--max-iterations", "2000", "--split-backward", "--out", str(out)]
    assert main(args) == 0
    got = json.loads(out.read_text())
    assert got["lower_bound"] <= got["makespan"] and got["gap"] == 0 and got["optimal"]
    split = got["split_backward"]
    assert split["makespan"] <= got["makespan"] and "executes F/I/W schedules too" in split["note"]
    assert {label.split(":")[1][0] for rank in split["ranks"] for label in rank} == {"F", "I", "W"}
    assert {label.split(":")[1][0] for rank in got["ranks"] for label in rank} == {"F", "B"}


def test_low_memory_search_order_finds_the_optimum_with_less_memory():
    # Branching B early / F late (what exact_search tries first) gives the 1F1B-like peak here.
    p = make_problem(
        [{"name": "actor", "stages": 4, "microbatches": 8, "forward": 1, "backward": 2, "activation": 1.0},
         {"name": "critic", "stages": 2, "microbatches": 4, "forward": 1, "backward": 2, "activation": 1.0}],
    )  # fmt: skip
    c = compile_problem(p)
    bound = lower_bounds(p, c).makespan
    plain = prove(p, compiled=c, analytic_bound=bound, at_most=bound, time_budget=10)
    low = prove(
        p, compiled=c, analytic_bound=bound, at_most=bound, time_budget=10, low_memory_search_order=True
    )
    assert plain.optimal and low.optimal and low.value == plain.value == 39
    assert c.peak(low.order) < c.peak(plain.order)


def test_memory_ladder_meets_the_tightest_cap_it_can_at_the_makespan():
    from rlhfuse.pipeline.exact import memory_ladder

    p = make_problem(
        [{"name": "actor", "stages": 4, "microbatches": 8, "forward": 1, "backward": 2, "activation": 1.0},
         {"name": "critic", "stages": 2, "microbatches": 4, "forward": 1, "backward": 2, "activation": 1.0}],
    )  # fmt: skip
    c = compile_problem(p)
    bound = lower_bounds(p, c).makespan
    r = prove(p, compiled=c, analytic_bound=bound, at_most=bound, time_budget=10)
    assert c.peak(r.order) == 10
    low = memory_ladder(p, compiled=c, makespan=r.value, peak=10.0, target=4.0, time_budget=20)
    assert low is not None and c.evaluate(low.order)[0] <= 39 and c.peak(low.order) <= 4.0 * 1.01


def test_peak_objective_and_window_relaxation_on_the_enumerated_problem():
    p = make_problem(
        [
            {"name": "actor", "stages": 2, "microbatches": 2, "forward": 2, "backward": 3, "activation": 1.5},
            {
                "name": "critic",
                "stages": 2,
                "microbatches": 1,
                "forward": 1,
                "backward": 2,
                "activation": 1.0,
            },
        ],
    )
    c = compile_problem(p)
    best = exact_search(p, compiled=c, analytic_bound=15.0, time_budget=10)
    assert best.optimal and best.value == 15
    # Least peak at the optimal makespan: never below the memory bound, never above the schedule it started from.
    low = prove(p, compiled=c, objective="peak", upper_order=best.order, makespan_limit=15.0, time_budget=10)
    assert low.order is not None and c.evaluate(low.order)[0] <= 15
    assert lower_bounds(p, c).memory <= low.lower_bound <= c.peak(low.order) <= c.peak(best.order)
    # No-overlap on rank 0 only is a relaxation: its optimum is a valid bound, at most the true optimum 15.
    window = prove(p, compiled=c, resource_ranks=(0,), time_budget=10)
    assert window.order is None and window.lower_bound <= 15


def _spec(name, stages, micro, f, b, act):
    return {
        "name": name,
        "stages": stages,
        "microbatches": micro,
        "forward": f,
        "backward": b,
        "activation": act,
    }


@pytest.mark.parametrize(
    ("models", "cap_factor", "latency"),
    [
        # other stage counts, micro-batch counts that are not multiples of the stages, unequal stage times
        (
            [_spec("actor", 5, 7, [2, 3, 2, 3, 2], [4, 6, 4, 6, 4], 1.2), _spec("critic", 5, 6, 1, 2, 1.0)],
            None,
            0.0,
        ),
        ([_spec("actor", 6, 8, 3, 6, 1.5), _spec("critic", 3, 5, 2, 4, 1.0)], 1.1, 0.0),
        ([_spec("actor", 4, 9, 2, 4, 2.0), _spec("critic", 2, 7, [1, 2], [2, 4], 1.0)], 1.0, 1.0),
        ([_spec("actor", 6, 6, 2, 5, 1.0), _spec("critic", 2, 4, 1, 3, 3.0)], 1.25, 0.0),
    ],
    ids=["5/5-unequal", "6/3-cap1.1", "4/2-unequal-cap1.0-latency", "6/2x3-cap1.25"],
)
def test_unseen_problems_within_5_percent_of_the_proven_bound_and_never_over_the_cap(
    models, cap_factor, latency
):
    from rlhfuse.pipeline.baselines import serial_peak

    plain = make_problem(models, comm_latency=latency)
    cap = None if cap_factor is None else round(cap_factor * serial_peak(plain), 6)
    p = make_problem(models, comm_latency=latency, memory_cap=cap)
    s = solve(p, SearchConfig(max_iterations=20_000, max_starts=100, exact_effort=1.0))
    sim = simulate(p, s.schedule)
    assert sim.makespan == pytest.approx(s.makespan)
    assert s.makespan <= 1.05 * s.lower_bound
    assert s.lower_bound >= lower_bounds(p, compile_problem(p)).makespan
    if cap is not None:
        assert sim.peak <= cap + 1e-9


def test_peak_objective_uses_the_makespan_limit_not_the_hint():
    # 2 stages, 2 micro-batches, f = b = 1 (activation 1): the optimum 6 needs both micro-batches in flight on
    # stage 0 (peak 2); with one at a time, stage 0 starts F1 only after B0 ends (at 4), so 8 with peak 1.
    p = _single(2, 2, 1, 1)
    c = compile_problem(p)
    best = exact_search(p, compiled=c, analytic_bound=0.0, time_budget=10)
    assert best.optimal and best.value == 6 and c.peak(best.order) == 2
    for limit, peak in ((6.0, 2.0), (7.0, 2.0), (8.0, 1.0)):
        low = prove(
            p, compiled=c, objective="peak", upper_order=best.order, makespan_limit=limit, time_budget=10
        )
        assert low.optimal and low.value == low.lower_bound == peak
        assert c.evaluate(low.order)[0] <= limit
