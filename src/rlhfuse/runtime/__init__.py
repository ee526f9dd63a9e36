"""Distributed execution of fused Actor+Critic pipeline schedules (RLHFuse intra-stage fusion).

Pure planning (`layout`, `plan`, `lower`, `balance`) is separate from execution (`executor`, which touches
process groups). See `docs/runtime.md`.
"""

from typing import TYPE_CHECKING

from rlhfuse._lazy import lazy_package

if TYPE_CHECKING:
    from rlhfuse.runtime.batch_split import karmarkar_karp, sample_costs, split_minibatch
    from rlhfuse.runtime.executor import (
        PipelineError,
        PipelineExecutor,
        PlanExecutor,
        StepResult,
        StepWork,
        ppo_losses,
    )
    from rlhfuse.runtime.layout import ModelParallel, ParallelLayout, ProcessGroups, build_process_groups
    from rlhfuse.runtime.lower import (
        Instr,
        LoweringError,
        Message,
        Program,
        check_program,
        lower,
        lower_checked,
    )
    from rlhfuse.runtime.partition import RankStages, stages_for_rank
    from rlhfuse.runtime.plan import (
        PLANNERS,
        PlanOptions,
        StageProfile,
        StepSchedule,
        plan_fused,
        plan_serial_1f1b,
    )

# The public names are imported from their modules on first use (rlhfuse._lazy): importing one module of
# the package does not load the others (`rlhfuse-train --help` reads the configs without torch).
_PUBLIC: dict[str, tuple[str, ...]] = {
    "rlhfuse.runtime.batch_split": ("karmarkar_karp", "sample_costs", "split_minibatch"),
    "rlhfuse.runtime.executor": (
        "PipelineError",
        "PipelineExecutor",
        "PlanExecutor",
        "StepResult",
        "StepWork",
        "ppo_losses",
    ),
    "rlhfuse.runtime.layout": ("ModelParallel", "ParallelLayout", "ProcessGroups", "build_process_groups"),
    "rlhfuse.runtime.lower": (
        "Instr",
        "LoweringError",
        "Message",
        "Program",
        "check_program",
        "lower",
        "lower_checked",
    ),
    "rlhfuse.runtime.partition": ("RankStages", "stages_for_rank"),
    "rlhfuse.runtime.plan": (
        "PLANNERS",
        "PlanOptions",
        "StageProfile",
        "StepSchedule",
        "plan_fused",
        "plan_serial_1f1b",
    ),
}
lazy_package(__name__, _PUBLIC)

__all__ = [
    "PLANNERS",
    "Instr",
    "LoweringError",
    "Message",
    "ModelParallel",
    "ParallelLayout",
    "PipelineError",
    "PipelineExecutor",
    "StepSchedule",
    "PlanExecutor",
    "PlanOptions",
    "ProcessGroups",
    "Program",
    "RankStages",
    "StageProfile",
    "StepResult",
    "StepWork",
    "build_process_groups",
    "check_program",
    "karmarkar_karp",
    "lower",
    "lower_checked",
    "plan_fused",
    "plan_serial_1f1b",
    "ppo_losses",
    "sample_costs",
    "split_minibatch",
    "stages_for_rank",
]
