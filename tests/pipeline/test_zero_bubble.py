"""Per-model zero-bubble baselines (ZB-H1, ZB-V, DualPipeV) and `rlhfuse-schedule bench --zero-bubble`."""

import json

import pytest

from rlhfuse.pipeline import make_problem, simulate
from rlhfuse.pipeline.baselines import one_f_one_b, serial_makespan, serial_peak
from rlhfuse.pipeline.ir import Kind
from rlhfuse.pipeline.schedule_command import ZERO_BUBBLE_ROWS, main
from rlhfuse.pipeline.zero_bubble import (
    BASELINES,
    alone,
    back_to_back,
    combined_schedule,
    dualpipe_v,
    per_model_bound,
    v_shape,
    zb_h1,
    zb_h1_closed_form,
    zb_v,
)


def one_model(stages, microbatches, forward=1, backward=2, activation=1.0):
    spec = {"name": "actor", "stages": stages, "microbatches": microbatches, "forward": forward,
            "backward": backward, "activation": activation}  # fmt: skip
    return make_problem([spec], name=f"{stages}x{microbatches}")


def fused(actor_mb=8, critic_mb=4, critic_forward=1):
    """4 ranks: a 4-stage Actor and two reversed 2-stage Critic replicas (the Table-3 shape, small)."""
    return make_problem(
        [
            {"name": "actor", "stages": 4, "microbatches": actor_mb, "forward": 2, "backward": 4,
             "activation": 1.5},
            {"name": "critic", "stages": 2, "microbatches": critic_mb, "forward": critic_forward,
             "backward": 2 * critic_forward, "activation": 1.0},
        ],
        name="small",
    )  # fmt: skip


def rank_labels(schedule, rank):
    return [f"{a.stage}:{a.kind.value}{a.microbatch}" for a in schedule.ranks[rank]]


@pytest.mark.parametrize("baseline", BASELINES, ids=lambda b: b.key)
@pytest.mark.parametrize(
    "problem",
    [
        one_model(4, 8),
        one_model(3, 3, forward=[1, 2, 1], backward=[2, 3, 2], activation=[1, 2, 1]),  # unequal stages
        one_model(4, 2),  # fewer micro-batches than stages (ZB-V leaves the missing ones out)
        fused(),
        fused(actor_mb=9, critic_mb=5, critic_forward=2),
    ],
    ids=["4x8", "unequal", "4x2", "fused", "fused-odd"],
)
def test_every_baseline_is_a_valid_schedule(baseline, problem):
    """`simulate` validates: every F/I/W op once, on its placement's rank, dependencies met, no deadlock."""
    run = back_to_back(problem, baseline)
    if run.reason is not None:  # only DualPipeV refuses, and only below 2S micro-batches
        assert baseline.key == "dualpipe_v"
        assert any(m.microbatches < 2 * m.stages for m in problem.models)
        assert "DualPipeV needs M >= 2S" in run.reason and run.makespan is None
        return
    for r in run.runs:
        assert {a.kind for rank in r.schedule.ranks for a in rank} == {Kind.F, Kind.I, Kind.W}
        assert simulate(r.problem, r.schedule).makespan == r.makespan
    # Back to back with a barrier: the sum of the models alone; without it the combined lists end no later.
    assert run.makespan == sum(r.makespan for r in run.runs)
    p, s = combined_schedule(run)
    assert simulate(p, s).makespan <= run.makespan
    assert run.makespan >= per_model_bound(problem) - 1e-9


def test_zb_h1_has_the_peak_of_1f1b_and_removes_two_thirds_of_its_bubble():
    """4 stages x 8 micro-batches, F = 1, B = 2 (I = W = 1).

    1F1B: (M + S - 1)(F + B) = 11 x 3 = 33, of which (S - 1)(F + B) = 9 is bubble.
    ZB-H1: stage 0 runs F0-F3 in [0, 4), then waits for the first input gradient, back at
    4F + 3I = 7 (F through four stages, I back through three); from there it never waits, and its
    remaining work is 8 x 3 - 4 = 20: it ends at 27 = M (F + I + W) + (S - 1)(F + I - W), a bubble of 3,
    a third of 1F1B's. Every stage holds at most S = 4 micro-batches, 1F1B's peak (its stage 0's).
    """
    p = one_model(4, 8)
    plain = simulate(p, one_f_one_b(p))
    zb = simulate(p, zb_h1(p, "actor"))
    assert (plain.makespan, zb.makespan) == (33, 27)
    assert zb_h1_closed_form(p.models[0]) == 27
    assert zb.start[next(a for a in zb.start if a.stage == 0 and a.kind is Kind.I and a.microbatch == 0)] == 7
    assert zb.peak == plain.peak == 4
    assert zb.peak_per_rank == (4, 4, 4, 4)  # the same in-flight count on every stage (Qi et al. §3.1)
    # On two models with reversed critic replicas the back-to-back peak is serial 1F1B's.
    two = fused()
    assert back_to_back(two, BASELINES[0]).peak == serial_peak(two)


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8), (4, 16), (8, 8), (8, 32)])
def test_zb_h1_matches_the_closed_form(stages, microbatches):
    for forward, backward in ((1, 2), (2, 2), (5, 10)):  # W <= F: the paper's regime
        p = one_model(stages, microbatches, forward, backward)
        assert simulate(p, zb_h1(p, "actor")).makespan == zb_h1_closed_form(p.models[0])
    assert zb_h1_closed_form(one_model(stages, microbatches, 1, 4).models[0]) is None  # W > F
    assert zb_h1_closed_form(one_model(stages, stages - 1).models[0]) is None  # M < S


def test_v_shape_places_two_half_chunks_per_rank():
    p = fused()
    v = v_shape(p, "critic").models[0]
    assert v.stages == 4 and v.placement == ((1, 0, 0, 1), (3, 2, 2, 3))
    assert v.forward == (0.5,) * 4 and v.backward == (1.0,) * 4 and v.activation == (0.5,) * 4
    assert alone(p, "critic").models == (p.model("critic"),)


def test_zb_v_by_hand():
    """2 ranks, 3 micro-batches (2S - 1), F = 1, B = 2: chunks of F = I = W = 0.5 in a V (rank 0: chunks 0
    and 3, rank 1: chunks 1 and 2). Rank 0 (k = 0): 2S-1 = 3 forwards of chunk 0, S = 2 triples F/I/W of
    chunk 3, then I/W of chunk 0 with F/I/W of chunk 3, and the cool-down I/W of chunk 0. Rank 1 (k = 1):
    one forward of chunk 1, the pair F2 F1, one triple of chunk 2, the steady F1 I1 W1 F2 I2 W2, the
    cool-down I1 I2, then I1 W1 and the deferred W's.
    Makespan: rank 1 waits F/2 = 0.5 for chunk 0's first forward and then never waits: 0.5 + 3 x 3 = 9.5.
    Peak: 1F1B's (2 micro-batches of the whole stage, 4 chunks of 0.5)."""
    p = one_model(2, 3)
    v = v_shape(p, "actor")
    s = zb_v(p, "actor")
    assert rank_labels(s, 0) == (
        "0:F0 0:F1 0:F2 3:F0 3:I0 3:W0 3:F1 3:I1 3:W1 0:I0 0:W0 3:F2 3:I2 3:W2 0:I1 0:W1 0:I2 0:W2".split()
    )
    assert rank_labels(s, 1) == (
        "1:F0 2:F0 1:F1 2:F1 2:I0 2:W0 1:F2 1:I0 1:W0 2:F2 2:I1 2:W1 1:I1 2:I2 1:I2 1:W1 2:W2 1:W2".split()
    )
    sim = simulate(v, s)
    assert sim.makespan == 9.5 < simulate(p, zb_h1(p, "actor")).makespan == 10
    assert sim.peak == simulate(p, one_f_one_b(p)).peak == 2


def test_dualpipe_v_by_hand():
    """2 ranks, 4 micro-batches (the least DualPipeV takes: 2S), F = 1, B = 2, chunks of F = I = W = 0.5.
    Rank 0 (k = 0), DualPipe's steps: 1) F0 F0, 2) F0 F3, 3) I3 W F3, 4) one round F0+B3 F3+B0, 5) B3
    F3+B0, 6) B3 then B0 split (I now), 7) W, I0, 8) W. Rank 1 (k = S - 1): 2) F1 F2 F1 F2, 4) two rounds,
    the first F1 then B2 not overlapped, 6) B2 B1, then the second pair split, 8) the two W's. A full B is
    I then W. Makespan: rank 1 waits 0.5, then never: 0.5 + 4 x 3 = 12.5. Peak: rank 0 holds chunk 0's
    four micro-batches and one of chunk 3 when F0 of micro-batch 3 starts: 5 x 0.5 = 2.5 (1F1B: 2)."""
    p = one_model(2, 4)
    s = dualpipe_v(p, "actor")
    assert rank_labels(s, 0) == (
        "0:F0 0:F1 0:F2 3:F0 3:I0 3:W0 3:F1 0:F3 3:I1 3:W1 3:F2 0:I0 0:W0 3:I2 3:W2 3:F3 0:I1 0:W1 "
        "3:I3 3:W3 0:I2 0:W2 0:I3 0:W3".split()
    )
    assert rank_labels(s, 1) == (
        "1:F0 2:F0 1:F1 2:F1 1:F2 2:I0 2:W0 2:F2 1:I0 1:W0 1:F3 2:I1 2:W1 2:F3 1:I1 1:W1 2:I2 2:W2 "
        "1:I2 1:W2 2:I3 1:I3 2:W3 1:W3".split()
    )
    sim = simulate(v_shape(p, "actor"), s)
    assert (sim.makespan, sim.peak) == (12.5, 2.5)
    with pytest.raises(ValueError, match="DualPipeV needs at least 2 x 2 = 4 micro-batches"):
        dualpipe_v(one_model(2, 3), "actor")


def test_back_to_back_runs_each_model_alone_then_the_next():
    p = fused()
    h1 = back_to_back(p, BASELINES[0])
    assert [r.model for r in h1.runs] == ["actor", "critic"]
    # Actor 4 x 8 (F 2, I = W = 2): 8 x 6 + 3 x 2 = 54; each critic replica 2 x 4 (F 1, I = W = 1): 4 x 3 + 1.
    assert [r.makespan for r in h1.runs] == [54, 13] and h1.makespan == h1.closed_form == 67
    assert serial_makespan(p) == (8 + 3) * 6 + (4 + 1) * 3 == 81


def test_cli_bench_zero_bubble_writes_the_documented_keys(tmp_path, capsys):
    table = tmp_path / "table.json"
    small = fused()
    table.write_text(json.dumps({"problems": [small.to_dict()]}))
    out = tmp_path / "zb.json"
    assert main(["bench", "--zero-bubble", str(table), "--max-iterations", "2000", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert {"benchmark", "command", "date", "seconds", "machine", "figures", "output"} <= set(record)
    figures = record["figures"]
    assert {"effort", "table3", "fiw_within_1pct", "fiw_optimal", "wins", "per_model_beats_fiw",
            "per_model_beats_fb", "fiw_below_per_model_bound", "total_s"} <= set(figures)  # fmt: skip
    for key in ("per_model_beats_fiw", "per_model_beats_fb", "fiw_below_per_model_bound"):
        assert figures[key]["count"] == len(figures[key]["settings"])
    row = figures["table3"]["small"]
    assert {key for key, _ in ZERO_BUBBLE_ROWS} <= set(row)
    assert {"winner", "runner_up", "winner_margin", "best_per_model", "per_model_bound",
            "fiw_over_best_per_model", "fb_over_best_per_model"} <= set(row)  # fmt: skip
    for key in ("fused_fb", "fused_fiw"):
        assert {"makespan", "lower_bound", "gap", "optimal", "peak", "memory_ratio"} <= set(row[key])
    assert row["zb_h1"]["makespan"] == row["zb_h1"]["closed_form"] == 67
    assert row["dualpipe_v"]["makespan"] is not None  # 8 >= 2 x 4 and 4 >= 2 x 2
    assert row["fused_fiw"]["makespan"] <= row["fused_fb"]["makespan"] <= row["serial_1f1b"]["makespan"]
    assert row[row["winner"]]["makespan"] == min(
        row[k]["makespan"] for k, _ in ZERO_BUBBLE_ROWS if row[k]["makespan"] is not None
    )
    assert "winner:" in capsys.readouterr().out and any("winner:" in line for line in record["output"])
    assert main(["bench", "--zero-bubble", str(table), "--max-iterations", "0"]) == 2
