"""Fused pipeline schedules (RLHFuse §intra-stage fusion): IR, simulator, baselines, lower bounds, search.

Pure planning code: a schedule is data (per-rank action lists) produced by pure functions and checked by the
simulator; the runtime lowers it into compute and communication. See `docs/schedules.md`.
"""

from typing import TYPE_CHECKING

from rlhfuse._lazy import lazy_package

if TYPE_CHECKING:
    from rlhfuse.pipeline.baselines import (
        chimera,
        gpipe,
        interleaved_one_f_one_b,
        one_f_one_b,
        serial_makespan,
        serial_one_f_one_b,
        serial_peak,
        split_each_backward,
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
    from rlhfuse.pipeline.zero_bubble import (
        BackToBack,
        ZeroBubbleBaseline,
        back_to_back,
        dualpipe_v,
        per_model_bound,
        v_shape,
        zb_h1,
        zb_v,
    )

# The public names are imported from their modules on first use (rlhfuse._lazy): importing one module of
# the package does not load the others (numba, the compiled schedule simulator, loads with `pipeline.compiled`).
_PUBLIC: dict[str, tuple[str, ...]] = {
    "rlhfuse.pipeline.baselines": (
        "chimera",
        "gpipe",
        "interleaved_one_f_one_b",
        "one_f_one_b",
        "serial_makespan",
        "serial_one_f_one_b",
        "serial_peak",
        "split_each_backward",
    ),
    "rlhfuse.pipeline.bounds": ("Bounds", "lower_bounds"),
    "rlhfuse.pipeline.ir": (
        "Action",
        "Kind",
        "Placement",
        "Schedule",
        "parse_action",
        "schedule_from_labels",
    ),
    "rlhfuse.pipeline.problem": (
        "ModelSpec",
        "Problem",
        "load_problem",
        "load_problems",
        "make_problem",
        "problem_from_dict",
    ),
    "rlhfuse.pipeline.search": ("SearchConfig", "Solution", "greedy", "solve"),
    "rlhfuse.pipeline.simulate": ("ScheduleError", "SimResult", "profile_durations", "simulate"),
    "rlhfuse.pipeline.zero_bubble": (
        "BackToBack",
        "ZeroBubbleBaseline",
        "back_to_back",
        "dualpipe_v",
        "per_model_bound",
        "v_shape",
        "zb_h1",
        "zb_v",
    ),
}
lazy_package(__name__, _PUBLIC)

__all__ = [
    "Action",
    "BackToBack",
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
    "ZeroBubbleBaseline",
    "back_to_back",
    "chimera",
    "dualpipe_v",
    "gpipe",
    "greedy",
    "interleaved_one_f_one_b",
    "load_problem",
    "load_problems",
    "lower_bounds",
    "make_problem",
    "one_f_one_b",
    "parse_action",
    "per_model_bound",
    "problem_from_dict",
    "profile_durations",
    "schedule_from_labels",
    "serial_makespan",
    "serial_one_f_one_b",
    "serial_peak",
    "simulate",
    "solve",
    "split_each_backward",
    "v_shape",
    "zb_h1",
    "zb_v",
]
