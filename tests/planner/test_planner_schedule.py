"""Training-stage makespans: 1F1B formula, the fused lower bound and the greedy list schedule."""

import json

import pytest

from rlhfuse.pipeline.schedule_command import default_table_path
from rlhfuse.planner import PipeModel, fused_lower_bound, greedy_fused_makespan, one_f_one_b, serial_makespan
from rlhfuse.planner.schedule import reversed_blocks

TABLE3 = default_table_path()  # the Table-3 settings shipped with the package


def _problems():
    raw = json.loads(TABLE3.read_text())
    for p in raw if isinstance(raw, list) else raw["problems"]:
        models = [
            PipeModel(m["stages"], m["replicas"], m["microbatches"], m["forward"], m["backward"],
                      tuple(tuple(r) for r in m["placement"]))
            for m in p["models"]
        ]  # fmt: skip
        yield p, models


@pytest.mark.parametrize(("stages", "micro"), [(1, 1), (4, 4), (4, 9), (8, 16)])
def test_greedy_on_one_model_is_1f1b(stages, micro):
    m = PipeModel(stages, 1, micro, 1.0, 2.0, (tuple(range(stages)),))
    assert (
        greedy_fused_makespan(stages, [m]) == one_f_one_b(stages, micro, 1.0, 2.0) == (micro + stages - 1) * 3
    )


def test_reversed_blocks():
    assert reversed_blocks(8, 4) == ((3, 2, 1, 0), (7, 6, 5, 4))


def test_lower_bound_equals_the_published_bound_on_table3():
    # the published bound (the authors' FlexFusion) is reached by their annealing on all 12 settings but 09
    for p, models in _problems():
        ref = p["reference"]
        assert fused_lower_bound(p["ranks"], models) == ref["lower_bound"], p["name"]
        assert ref["lower_bound"] <= ref["flexfusion_sa_makespan"], p["name"]


# The greedy list schedule's makespan on each Table-3 setting, next to the authors' published greedy. Both take
# the earliest start, backward first on ties; the other tie-breaks differ, so the two are not expected to be equal:
# ours is shorter on 8 settings, equal on 06 and longer on 02, 05 and 08 (by 23, 34 and 18 units). Pinned exactly:
# the list schedule is deterministic, and a change of its rule shows here first.
GREEDY = {  # setting: (ours, the authors')
    "table3-00": (720, 741), "table3-01": (402, 425), "table3-02": (262, 239), "table3-03": (742, 755),
    "table3-04": (385, 419), "table3-05": (259, 225), "table3-06": (632, 632), "table3-07": (336, 366),
    "table3-08": (232, 214), "table3-09": (640, 651), "table3-10": (352, 363), "table3-11": (204, 219),
}  # fmt: skip


def test_greedy_is_feasible_bounded_and_beats_serial_1f1b():
    for p, models in _problems():
        greedy = greedy_fused_makespan(p["ranks"], models)
        ours, theirs = GREEDY[p["name"].split()[0]]
        assert theirs == p["reference"]["flexfusion_greedy_makespan"], p["name"]
        assert greedy == ours, p["name"]
        assert fused_lower_bound(p["ranks"], models) <= greedy < serial_makespan(models), p["name"]


def test_opposite_pipelines_fill_each_others_bubbles():
    # Chimera's case: two equal models, 8 stages, 8 micro-batches, opposite directions
    fwd = PipeModel(8, 1, 8, 1.0, 2.0, (tuple(range(8)),))
    bwd = PipeModel(8, 1, 8, 1.0, 2.0, reversed_blocks(8, 8))
    assert greedy_fused_makespan(8, [fwd, bwd]) < serial_makespan([fwd, bwd])


def test_bound_is_rlhfuse_pipelines_bound_and_1f1b_its_simulated_1f1b():
    # one makespan model: the closed forms equal rlhfuse.pipeline's bound and simulated 1F1B
    from rlhfuse.pipeline import lower_bounds
    from rlhfuse.pipeline import serial_makespan as simulated_serial
    from rlhfuse.planner.schedule import pipeline_problem

    cases = [(p["ranks"], models) for p, models in _problems()]
    for stages, other, micro, f, b in [(8, 4, 8, 1.0, 2.0), (4, 2, 6, 1.5, 2.5), (16, 8, 4, 0.7, 1.9)]:
        cases.append((stages, [PipeModel(stages, 1, micro, f, b, (tuple(range(stages)),)),
                               PipeModel(other, stages // other, micro, b, f, reversed_blocks(stages, other))]))  # fmt: skip
    for ranks, models in cases:
        problem = pipeline_problem(ranks, models)
        assert fused_lower_bound(ranks, models) == pytest.approx(lower_bounds(problem).paper, rel=1e-12)
        assert serial_makespan(models) == pytest.approx(simulated_serial(problem), rel=1e-12)
