"""Execution-plan generator and paper-scale simulator (docs/paper.md §4-5). Pure Python + numpy (no torch).

- `specs`: device, cluster and model specifications (H100, H200, A100, this CPU; LLaMA 7B-65B), efficiencies.
- `cost.CostModel`: prefill / training compute, memory-bound decoding with BSmax, KV memory, TP / PP / DP
  communication, resharding and swap-in.
- `migration`: the migration decision (trigger, m, destinations, mechanism) as pure functions; the
  generation engine reuses them.
- `simulate`: generation with a long-tailed length distribution and migration, fused or serial inference,
  fused or serial training, the Rt sweep.
- `search`: per-task (dp, pp, tp) candidates pruned by Megatron-LM's guidelines, searched exhaustively; with
  `fsdp=True`, pipeline=fsdp (sharded data parallelism over every device) beside them.
- `grid`, `plan_command`: RLHFuse vs RLHFuse-Base, the paper's grid, `rlhfuse-plan`.
- `plan_for`: what the trainer's `plan=auto` calls.
"""

from typing import TYPE_CHECKING

from rlhfuse._lazy import lazy_package

if TYPE_CHECKING:
    from rlhfuse.planner.api import as_model_spec, plan_for
    from rlhfuse.planner.cost import CostModel
    from rlhfuse.planner.grid import PAPER_RANGES, Comparison, compare, paper_grid
    from rlhfuse.planner.lengths import LengthDistribution
    from rlhfuse.planner.memory import (
        RankMemory,
        fsdp_rank_memories,
        fsdp_rank_memory,
        rank_memories,
        rank_memory,
        shard_count,
    )
    from rlhfuse.planner.migration_decision import (
        MigrationDecision,
        choose_mechanism,
        decide_migration,
        destination_count,
        should_migrate,
        threshold_from_fraction,
    )
    from rlhfuse.planner.plan_search import (
        Breakdown,
        Plan,
        PruneStats,
        search_fsdp,
        search_plan,
        search_training,
        train_layouts,
    )
    from rlhfuse.planner.plan_simulator import (
        RLHFModels,
        Samples,
        TrainLayout,
        Workload,
        gen_inf_fused,
        gen_inf_serial,
        rt_sweep,
        simulate_generation,
    )
    from rlhfuse.planner.schedule import (
        PipeModel,
        fused_lower_bound,
        greedy_fused_makespan,
        one_f_one_b,
        serial_makespan,
    )
    from rlhfuse.planner.specs import (
        A100,
        CPU,
        DEVICES,
        H100,
        H200,
        ClusterSpec,
        DeviceSpec,
        Efficiency,
        ModelSpec,
        cluster,
        model,
    )

# The public names are imported from their modules on first use (rlhfuse._lazy): importing one module of
# the package does not load the others (`rlhfuse-train --help` reads the configs without torch).
_PUBLIC: dict[str, tuple[str, ...]] = {
    "rlhfuse.planner.api": ("as_model_spec", "plan_for"),
    "rlhfuse.planner.cost": ("CostModel",),
    "rlhfuse.planner.grid": ("PAPER_RANGES", "Comparison", "compare", "paper_grid"),
    "rlhfuse.planner.lengths": ("LengthDistribution",),
    "rlhfuse.planner.memory": (
        "RankMemory",
        "fsdp_rank_memories",
        "fsdp_rank_memory",
        "rank_memories",
        "rank_memory",
        "shard_count",
    ),
    "rlhfuse.planner.migration_decision": (
        "MigrationDecision",
        "choose_mechanism",
        "decide_migration",
        "destination_count",
        "should_migrate",
        "threshold_from_fraction",
    ),
    "rlhfuse.planner.plan_search": (
        "Breakdown",
        "Plan",
        "PruneStats",
        "search_fsdp",
        "search_plan",
        "search_training",
        "train_layouts",
    ),
    "rlhfuse.planner.plan_simulator": (
        "RLHFModels",
        "Samples",
        "TrainLayout",
        "Workload",
        "gen_inf_fused",
        "gen_inf_serial",
        "rt_sweep",
        "simulate_generation",
    ),
    "rlhfuse.planner.schedule": (
        "PipeModel",
        "fused_lower_bound",
        "greedy_fused_makespan",
        "one_f_one_b",
        "serial_makespan",
    ),
    "rlhfuse.planner.specs": (
        "A100",
        "CPU",
        "DEVICES",
        "H100",
        "H200",
        "ClusterSpec",
        "DeviceSpec",
        "Efficiency",
        "ModelSpec",
        "cluster",
        "model",
    ),
}
lazy_package(__name__, _PUBLIC)

__all__ = [
    "A100",
    "CPU",
    "DEVICES",
    "H100",
    "H200",
    "PAPER_RANGES",
    "Breakdown",
    "ClusterSpec",
    "Comparison",
    "CostModel",
    "DeviceSpec",
    "Efficiency",
    "LengthDistribution",
    "MigrationDecision",
    "ModelSpec",
    "PipeModel",
    "Plan",
    "PruneStats",
    "RLHFModels",
    "RankMemory",
    "Samples",
    "TrainLayout",
    "Workload",
    "as_model_spec",
    "choose_mechanism",
    "cluster",
    "compare",
    "decide_migration",
    "destination_count",
    "fsdp_rank_memories",
    "fsdp_rank_memory",
    "fused_lower_bound",
    "gen_inf_fused",
    "gen_inf_serial",
    "greedy_fused_makespan",
    "model",
    "one_f_one_b",
    "paper_grid",
    "plan_for",
    "rank_memories",
    "rank_memory",
    "rt_sweep",
    "search_fsdp",
    "search_plan",
    "search_training",
    "serial_makespan",
    "shard_count",
    "should_migrate",
    "simulate_generation",
    "threshold_from_fraction",
    "train_layouts",
]
