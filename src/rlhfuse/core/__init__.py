"""The bottom of rlhfuse's package graph: the typed data passed between stages, the plug-point Protocols,
typed statistics, errors, the PPO micro-batch losses, sampling and optimizer helpers, checkpoint files and the
name registry. `runtime`, `generation`, `pipeline` and `planner` build on it and never import `rlhfuse.trainer`
(the composition root); `tests/test_architecture.py` checks this from the source.
"""

from typing import TYPE_CHECKING

from rlhfuse._lazy import lazy_package

if TYPE_CHECKING:
    from rlhfuse.core.errors import CheckpointError, NonFiniteError
    from rlhfuse.core.protocols import Callback, Checkpointer, Generator, Inferencer, Logger, Strategy
    from rlhfuse.core.stats import LossStats, PipelineStats, TrainStats, mean_stats, sum_stats
    from rlhfuse.core.types import Experience, ModelRole, PromptBatch, Rollout, TrainBatch

# The public names are imported from their modules on first use (rlhfuse._lazy): importing one module of
# the package does not load the others (`rlhfuse-train --help` reads the configs without torch).
_PUBLIC: dict[str, tuple[str, ...]] = {
    "rlhfuse.core.errors": ("CheckpointError", "NonFiniteError"),
    "rlhfuse.core.protocols": ("Callback", "Checkpointer", "Generator", "Inferencer", "Logger", "Strategy"),
    "rlhfuse.core.stats": ("LossStats", "PipelineStats", "TrainStats", "mean_stats", "sum_stats"),
    "rlhfuse.core.types": ("Experience", "ModelRole", "PromptBatch", "Rollout", "TrainBatch"),
}
lazy_package(__name__, _PUBLIC)

__all__ = [
    "Callback",
    "CheckpointError",
    "Checkpointer",
    "Experience",
    "Generator",
    "Inferencer",
    "Logger",
    "LossStats",
    "ModelRole",
    "NonFiniteError",
    "PipelineStats",
    "PromptBatch",
    "Rollout",
    "Strategy",
    "TrainBatch",
    "TrainStats",
    "mean_stats",
    "sum_stats",
]
