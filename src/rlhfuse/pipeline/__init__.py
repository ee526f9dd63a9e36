"""Fused pipeline schedules (RLHFuse §intra-stage fusion): IR, simulator, baselines, lower bounds, search.

Pure planning code: a schedule is data (per-rank action lists) produced by pure functions and checked by the
simulator; the runtime lowers it into compute and communication. See `docs/schedules.md`.
"""

from rlhfuse.pipeline.baselines import (
    chimera,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    serial_makespan,
    serial_one_f_one_b,
    serial_peak,
)
from rlhfuse.pipeline.bounds import Bounds, lower_bounds
from rlhfuse.pipeline.ir import Action, Kind, Placement, Schedule, parse_action, schedule_from_labels
from rlhfuse.pipeline.problem import (
    ModelSpec,
    Problem,
    load_problem,
    load_problems,
    make_problem,
    problem_from_dict,
)
from rlhfuse.pipeline.search import SearchConfig, Solution, greedy, solve
from rlhfuse.pipeline.simulate import ScheduleError, SimResult, profile_durations, simulate

__all__ = [
    "Action",
    "Bounds",
    "Kind",
    "ModelSpec",
    "Placement",
    "Problem",
    "Schedule",
    "ScheduleError",
    "SearchConfig",
    "SimResult",
    "Solution",
    "chimera",
    "gpipe",
    "greedy",
    "interleaved_one_f_one_b",
    "load_problem",
    "load_problems",
    "lower_bounds",
    "make_problem",
    "one_f_one_b",
    "parse_action",
    "problem_from_dict",
    "profile_durations",
    "schedule_from_labels",
    "serial_makespan",
    "serial_one_f_one_b",
    "serial_peak",
    "simulate",
    "solve",
]
