"""Memory at a makespan: the peak lower bound (by hand and against CP-SAT's optimum), the memory LNS, and
trading makespan for memory (`makespan_slack`, the Pareto list)."""

import itertools
import json

import numpy as np
import pytest

from rlhfuse.pipeline import SearchConfig, gpipe, make_problem, simulate, solve
from rlhfuse.pipeline.bounds import hold_lengths, peak_lower_bound
from rlhfuse.pipeline.compiled import compile_problem, time_windows
from rlhfuse.pipeline.exact import exact_search, memory_lns, prove
from rlhfuse.pipeline.schedule_command import main
from rlhfuse.pipeline.search import pareto_front


def _single(stages, micro, f, b, act=1.0):
    return make_problem(
        [{"name": "actor", "stages": stages, "microbatches": micro, "forward": f, "backward": b,
          "activation": act}]
    )  # fmt: skip


def test_peak_bound_by_hand_on_two_stages():
    # 2 stages x 2 micro-batches, f = b = 1. At makespan 6 (the optimum) or 7, F1 on stage 0 must start by 2
    # (resp. 3) and B0 cannot end before 4, so both are held at once: peak >= 2. At 8 one at a time fits
    # (F0 F1' ... : F1 after B0 at 4), so the bound is one micro-batch. These are the exact optima.
    p = _single(2, 2, 1, 1)
    assert [peak_lower_bound(p, m).peak for m in (6, 7, 8, 9)] == [2.0, 2.0, 1.0, 1.0]
    # Stage 0 holds its activation from F's start to B's end: F up to stage 1 and back (1 + 1 + 1 + 1).
    c = compile_problem(p)
    assert hold_lengths(c)[c.is_b == 0].tolist() == [4.0, 4.0, 2.0, 2.0]
    assert peak_lower_bound(p, 6).per_rank == (2.0, 1.0)


def test_peak_bound_is_the_1f1b_peak_at_the_1f1b_makespan():
    # One pipeline (4 stages, 8 micro-batches, f = 1, b = 2, activation 1.5) at its optimal makespan
    # (M + S - 1)(f + b) = 33: stage 0 has no slack, so F3 must start before B0 can end and 4 micro-batches
    # are held there, 1F1B's peak 6.0 (CP-SAT's minimum peak at 33 is 6.0 too). The energetic average alone is
    # 5.14; a rank holds whole micro-batches, which rounds it up to 4 x 1.5.
    p = _single(4, 8, 1, 2, act=1.5)
    bound = peak_lower_bound(p, (8 + 4 - 1) * 3)
    assert bound.peak == pytest.approx(4 * 1.5) and bound.feasible
    assert peak_lower_bound(p, 40).peak == pytest.approx(3 * 1.5)  # CP-SAT's minimum at 40: 4.5
    # Below the makespan bound no schedule exists, and the bound says so.
    below = peak_lower_bound(p, (8 + 4 - 1) * 3 - 1)
    assert not below.feasible and below.peak == np.inf


@pytest.mark.parametrize("limit", [42.0, 43.0, 45.0, 48.0, 55.0, 70.0])
def test_peak_bound_never_exceeds_the_exact_minimum_peak(tiny_fused, limit):
    # The fused tiny problem (optimum 42): CP-SAT's proven minimum peak at each limit is 6, 6, 6, 4.5, 4, 3;
    # the bound is valid everywhere and equal to it up to 48, where the makespan leaves little slack.
    c = compile_problem(tiny_fused)
    start = exact_search(tiny_fused, compiled=c, analytic_bound=0.0, time_budget=10)
    assert start.optimal and start.value == 42
    exact = prove(
        tiny_fused, compiled=c, objective="peak", upper_order=start.order, makespan_limit=limit,
        time_budget=20,
    )  # fmt: skip
    assert exact.optimal
    bound = peak_lower_bound(tiny_fused, limit, c)
    assert bound.peak <= exact.value + 1e-9
    if limit <= 48:
        assert bound.peak == pytest.approx(exact.value)


def test_peak_bound_proves_the_figure10_peak_optimal(table3):
    # Setting 08 at its optimal makespan 186: every schedule holds at least serial 1F1B's 26.24, which the
    # search reaches (test_search.py), so that peak is optimal.
    assert peak_lower_bound(table3["table3-08"], 186).peak == pytest.approx(26.24)


def test_memory_lns_lowers_a_gpipe_peak_to_the_bound_at_the_same_makespan():
    # GPipe and 1F1B have the same makespan here ((M + S - 1)(f + b) = 15), GPipe holds all 4 micro-batches on
    # stage 0; the LNS must reach the bound (2, 1F1B's), which proves its result optimal.
    p = _single(2, 4, 1, 2)
    c = compile_problem(p)
    order = c.from_schedule(gpipe(p))
    ms = float(c.evaluate(order)[0])
    assert ms == 15 and c.peak(order) == 4
    best, trace = memory_lns(p, compiled=c, order=order, makespan_limit=ms, deterministic_budget=2.0)
    assert float(c.evaluate(best)[0]) <= 15 and c.peak(best) == peak_lower_bound(p, 15).peak == 2
    assert trace and trace[-1] == (15.0, 2.0)
    simulate(p, c.to_schedule(best))  # valid


@pytest.mark.parametrize("limit", [42.0, 48.0, 55.0, 70.0])
def test_memory_lns_reaches_the_exact_minimum_peak_of_a_small_problem(tiny_fused, limit):
    # Small problems get whole-schedule neighbourhoods, so the LNS ends at the minimum peak that CP-SAT proves
    # on the full model (6, 4.5, 4, 3): the reduced model of a step (time windows from the kept orders, kept
    # ranks as constants, the window's part of a rank's prefix sums as its cumulative) loses no schedule.
    c = compile_problem(tiny_fused)
    fastest = exact_search(tiny_fused, compiled=c, analytic_bound=0.0, time_budget=10)
    exact = prove(
        tiny_fused, compiled=c, objective="peak", upper_order=fastest.order, makespan_limit=limit,
        time_budget=20,
    )  # fmt: skip
    assert exact.optimal
    best, _ = memory_lns(
        tiny_fused,
        compiled=c,
        order=fastest.order,
        makespan_limit=limit,
        deterministic_budget=4.0,
        patience=60,
    )
    assert 0 <= float(c.evaluate(best)[0]) <= limit
    assert c.peak(best) == pytest.approx(exact.value)


def _neighbourhood_optimum(c, order, start, t0, t1, band, limit):
    """The reference for a neighbourhood of `memory_lns`: every op a variable, the kept orders as precedences,
    every rank's whole cumulative; the minimum largest peak with makespan <= `limit` (times as given)."""
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    s = [model.new_int_var(0, int(limit - c.dur[i]), "") for i in range(c.n)]
    after = [(int(op), int(nxt)) for op in range(c.n) for nxt in (c.succ1[op], c.succ2[op]) if nxt >= 0]
    after += [(b + i, b + i + 1) for b, n in zip(c.stream_base, c.stream_len) for i in range(n - 1)]
    for k in range(c.ranks):
        ops = [int(op) for op in order[c.rank_ptr[k] : c.rank_ptr[k + 1]]]
        if k not in band:
            after += list(itertools.pairwise(ops))
            continue
        pre = [op for op in ops if start[op] < t0]
        win = [op for op in ops if t0 <= start[op] < t1]
        suf = [op for op in ops if start[op] >= t1]
        after += list(itertools.pairwise(pre)) + list(itertools.pairwise(suf))
        after += [(pre[-1], w) for w in win + suf[:1] if pre] + [(w, suf[0]) for w in win if suf]
        model.add_no_overlap([model.new_fixed_size_interval_var(s[op], int(c.dur[op]), "") for op in ops])
    for a, b in after:
        model.add(s[b] >= s[a] + int(c.dur[a]))
    peak = model.new_int_var(0, 1000, "")
    for k in range(c.ranks):
        f_ops = [int(op) for op in np.nonzero((c.rank == k) & (c.is_b == 0))[0]]
        held = [
            model.new_interval_var(s[f], model.new_int_var(0, int(limit), ""), s[b] + int(c.dur[b]), "")
            for f, b in ((f, int(c.free_op[f])) for f in f_ops)
        ]
        model.add_cumulative(held, [round(10 * c.mem[f]) for f in f_ops], peak)
    model.minimize(peak)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    assert solver.solve(model) == cp_model.OPTIMAL
    return solver.objective_value / 10


@pytest.mark.parametrize("band, fraction", [((1, 2), 0.4), ((0, 1, 2), 0.3), ((2, 3), 0.5), ((0, 3), 0.6)])
def test_a_memory_lns_step_has_the_optimum_of_its_neighbourhood(tiny_fused, band, fraction):
    # The reduced model of a step (time windows from the kept orders, kept ranks as constants, the window's
    # part of a rank's prefix sums as its cumulative) has the same optimum as the whole neighbourhood written
    # out, on windows that keep a prefix and a suffix of the band's ranks.
    from ortools.sat.python import cp_model

    from rlhfuse.pipeline.exact import _dependency_edges, _lns_step, _retime

    c = compile_problem(tiny_fused)  # whole durations; activations 1.5 and 1.0 are 15 and 10 tenths
    limit = 55
    order = exact_search(tiny_fused, compiled=c, analytic_bound=0.0, time_budget=10).order  # 42, peak 6
    dur = c.dur.astype(np.int64)
    start = _retime(c, order, dur, 0) - dur
    assert start.max() + 4 <= limit
    t0 = int(start.max() * fraction / 2)
    t1 = t0 + int(start.max() * fraction) + 1
    demand = np.round(10 * np.abs(c.mem)).astype(np.int64)
    _, new = _lns_step(
        c, cp_model, order, start, dur, demand, _dependency_edges(c, dur, 0), limit, t0, t1, set(band),
        round(10 * c.peak(order)), 5.0, True, 0,
    )  # fmt: skip
    assert new is not None and 0 <= c.evaluate(new)[0] <= limit
    assert c.peak(new) == pytest.approx(_neighbourhood_optimum(c, order, start, t0, t1, set(band), limit))


def test_time_windows_by_hand():
    # 0 -> 1 (gap 2) -> 2 (gap 3), durations 2, 3, 1, horizon 10: earliest starts 0, 2, 5; latest 4, 6, 9.
    edges = (np.array([0, 1]), np.array([1, 2]), np.array([2, 3]))
    est, lst = time_windows(3, *edges, np.array([2, 3, 1]), 10)
    assert est.tolist() == [0, 2, 5] and lst.tolist() == [4, 6, 9]
    est, lst = time_windows(2, np.array([0, 1]), np.array([1, 0]), np.array([1, 1]), np.array([1, 1]), 10)
    assert len(est) == len(lst) == 0  # a cycle has no windows


def test_a_wall_clock_safety_cap_that_fires_is_counted(monkeypatch):
    # deterministic-effort solves cut by their wall-clock safety cap (here: all of them) are counted, so that
    # the search can say its result may depend on the machine's load (Solution.stats["wall_capped"])
    from rlhfuse.pipeline import exact

    p = _single(2, 4, 1, 2)
    c = compile_problem(p)
    order = c.from_schedule(gpipe(p))
    with exact.counting_wall_caps() as caps:
        memory_lns(p, compiled=c, order=order, makespan_limit=15, deterministic_budget=2.0)
    assert caps[0] == 0  # the real cap leaves room
    monkeypatch.setattr(exact, "SAFETY_SECONDS_PER_UNIT", 0.0)
    monkeypatch.setattr(exact, "SAFETY_SECONDS_BASE", 0.0)
    with exact.counting_wall_caps() as caps:
        memory_lns(p, compiled=c, order=order, makespan_limit=15, deterministic_budget=2.0)
    assert caps[0] > 0


def test_memory_lns_refuses_an_order_over_the_limit():
    p = _single(2, 4, 1, 2)
    c = compile_problem(p)
    with pytest.raises(ValueError, match="makespan <= 14"):
        memory_lns(p, compiled=c, order=c.from_schedule(gpipe(p)), makespan_limit=14, deterministic_budget=1)


def test_pareto_front_keeps_only_undominated_points():
    pts = [(8.0, 1.0), (6.0, 2.0), (7.0, 2.0), (6.0, 3.0), (9.0, 1.0)]
    assert pareto_front(pts) == [(6.0, 2.0), (8.0, 1.0)]


def test_makespan_slack_trades_makespan_for_memory_with_a_pareto_list():
    # The 2 x 2 problem: (6, peak 2) is makespan-optimal; 1/3 slack allows 8, where one micro-batch at a time
    # fits (peak 1, the bound there).
    p = _single(2, 2, 1, 1)
    plain = solve(p, SearchConfig(max_iterations=2000))
    assert (plain.makespan, plain.peak) == (6, 2) and plain.pareto == [(6.0, 2.0)]
    assert plain.makespan_limit is None and plain.peak_bound == 2.0
    traded = solve(p, SearchConfig(max_iterations=2000, makespan_slack=0.34))
    assert traded.makespan_limit == pytest.approx(6 * 1.34)
    assert (traded.makespan, traded.peak) == (8, 1) and traded.peak_bound == 1.0
    assert traded.pareto == [(6.0, 2.0), (8.0, 1.0)]
    assert (traded.makespan, traded.peak) in traded.pareto  # the result is a point of the front
    assert traded.lower_bound == 6  # the proven makespan bound is unchanged; the gap is the trade
    result = traded.to_result()
    assert result["pareto"] == [
        {"makespan": 6, "peak_activation": 2.0},
        {"makespan": 8, "peak_activation": 1.0},
    ]
    assert result["makespan"] == 8 and result["peak_lower_bound"] == 1.0


def test_cli_makespan_slack_and_peak_bound(tmp_path, capsys):
    problem = tmp_path / "p.json"
    problem.write_text(json.dumps(_single(2, 2, 1, 1).to_dict()))
    out = tmp_path / "r.json"
    argv = ["solve", str(problem), "--max-iterations", "2000", "--makespan-slack", "0.34", "--out", str(out)]
    assert main(argv) == 0
    got = json.loads(out.read_text())
    assert got["makespan"] == 8 and got["peak_activation"] == 1 and len(got["pareto"]) == 2
    for key in (
        "problem",
        "makespan",
        "peak_activation",
        "lower_bound",
        "serial_1f1b",
        "search_seconds",
        "ranks",
    ):
        assert key in got  # docs/schedule-format.md's keys stay
    assert main(["solve", str(problem), "--makespan-slack", "1.5"]) == 2
    assert "--makespan-slack=1.5 must be a fraction" in capsys.readouterr().err
    b = tmp_path / "b.json"
    assert main(["bound", str(problem), "--time-budget", "5", "--out", str(b)]) == 0
    got = json.loads(b.read_text())
    assert got["peak_lower_bound"] == 2 and got["peak_lower_bound_makespan"] == 6 == got["lower_bound"]
    assert main(["bound", str(problem), "--time-budget", "5", "--makespan-limit", "8", "--out", str(b)]) == 0
    got = json.loads(b.read_text())
    assert got["peak_lower_bound"] == 1 and got["peak_lower_bound_per_rank"] == [1, 1]
    assert main(["bound", str(problem), "--time-budget", "5", "--makespan-limit", "5"]) == 2
    assert "--makespan-limit=5 is below the proven lower bound 6" in capsys.readouterr().err
