"""Every generator and what they decode with: the generation engine and inter-stage fusion (docs/paper.md §2):
continuous batching over engine-owned KV-cache slots with prefix sharing and per-sample RNG streams, several
instances with long-tail migration (KV transfer or re-prefill) decided by `rlhfuse.planner`'s pure functions
(`generator`, `engine`, `coordinator`, `distributed`, `fusion`, `vllm_engine`); a rollout whose batch stays open
while it decodes (`open_rollout`); batched sampling in one process
or over tensor-parallel instances (`batched`, sampling vocabulary-parallel with `vocab_parallel`).
"""

from typing import TYPE_CHECKING

from rlhfuse._lazy import lazy_package

if TYPE_CHECKING:
    from rlhfuse.generation.coordinator import Coordinator, MigrationReport, balance, migrate
    from rlhfuse.generation.distributed import DistributedCoordinator, InstanceFailure, gather_finished
    from rlhfuse.generation.engine import (
        EngineStats,
        GenerationEngine,
        MigratingSample,
        SampleRequest,
        SamplingParams,
        requests_for,
        to_rollout,
    )
    from rlhfuse.generation.fusion import FusedResult, fused_generate_infer
    from rlhfuse.generation.generation_config import GenerationConfig
    from rlhfuse.generation.generator import EngineGenerator, InstanceSetup
    from rlhfuse.generation.messages import InferredBatch, InferredSample, SampleBatch
    from rlhfuse.generation.migration import (
        MECHANISMS,
        BatchObservation,
        FixedThreshold,
        MigrationPolicy,
        NoMigration,
        pick_mechanism,
        resolve_threshold,
    )
    from rlhfuse.generation.open_rollout import OpenRollout
    from rlhfuse.generation.transport import InProcess, PointToPoint, Transport
    from rlhfuse.generation.tuning import AutoThreshold, CostProfile, SimResult, rt_sweep, simulate

# The public names are imported from their modules on first use (rlhfuse._lazy): importing one module of
# the package does not load the others (`rlhfuse-train --help` reads the configs without torch).
_PUBLIC: dict[str, tuple[str, ...]] = {
    "rlhfuse.generation.coordinator": ("Coordinator", "MigrationReport", "balance", "migrate"),
    "rlhfuse.generation.distributed": ("DistributedCoordinator", "InstanceFailure", "gather_finished"),
    "rlhfuse.generation.open_rollout": ("OpenRollout",),
    "rlhfuse.generation.engine": (
        "EngineStats",
        "GenerationEngine",
        "MigratingSample",
        "SampleRequest",
        "SamplingParams",
        "requests_for",
        "to_rollout",
    ),
    "rlhfuse.generation.fusion": ("FusedResult", "fused_generate_infer"),
    "rlhfuse.generation.generation_config": ("GenerationConfig",),
    "rlhfuse.generation.generator": ("EngineGenerator", "InstanceSetup"),
    "rlhfuse.generation.messages": ("InferredBatch", "InferredSample", "SampleBatch"),
    "rlhfuse.generation.migration": (
        "MECHANISMS",
        "BatchObservation",
        "FixedThreshold",
        "MigrationPolicy",
        "NoMigration",
        "pick_mechanism",
        "resolve_threshold",
    ),
    "rlhfuse.generation.transport": ("InProcess", "PointToPoint", "Transport"),
    "rlhfuse.generation.tuning": ("AutoThreshold", "CostProfile", "SimResult", "rt_sweep", "simulate"),
}
lazy_package(__name__, _PUBLIC)

__all__ = [
    "FusedResult",
    "fused_generate_infer",
    "DistributedCoordinator",
    "InstanceFailure",
    "gather_finished",
    "AutoThreshold",
    "BatchObservation",
    "CostProfile",
    "SimResult",
    "rt_sweep",
    "simulate",
    "MECHANISMS",
    "Coordinator",
    "OpenRollout",
    "EngineGenerator",
    "InstanceSetup",
    "EngineStats",
    "FixedThreshold",
    "GenerationConfig",
    "GenerationEngine",
    "MigratingSample",
    "MigrationPolicy",
    "MigrationReport",
    "NoMigration",
    "SampleRequest",
    "SamplingParams",
    "balance",
    "migrate",
    "InProcess",
    "PointToPoint",
    "Transport",
    "InferredBatch",
    "InferredSample",
    "SampleBatch",
    "pick_mechanism",
    "requests_for",
    "resolve_threshold",
    "to_rollout",
]
