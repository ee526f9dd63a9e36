"""Configuration of the distributed training strategies (`pipeline=fused`, `pipeline=serial_1f1b`) and of the
multi-process launch (`distributed.*`), declared next to the runtime that reads them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rlhfuse.core.config_checks import choice_problems, flat_field, need, positive
from rlhfuse.core.optim_config import OptimConfig
from rlhfuse.pipeline.simulate import SplitBackward

if TYPE_CHECKING:
    from rlhfuse.runtime.layout import ParallelLayout


@dataclass
class PipelineConfig:
    """The training strategy (Hydra group `pipeline`): its name, the optimizer settings every strategy reads
    (`optim`, keys `pipeline.actor_lr` ...) and the pipeline fields (read by pipeline=fused / serial_1f1b; plain
    ignores them)."""

    # Registered strategy name: plain (no pipeline: one process, or data parallel over the generation
    # instances) | fsdp (plain's data parallelism with the four models, gradients and optimizer states sharded
    # over the ranks: FSDP2) | fused | serial_1f1b (Actor and Critic pipelines on the same ranks).
    name: str = "plain"
    optim: OptimConfig = flat_field(OptimConfig)

    # Pipeline stages of the Actor / the Critic. The model with more stages spans a fused group of ranks in
    # order; the other runs (larger pp / its pp) replicas reversed over blocks of ranks. World size must be
    # max(actor_pp, critic_pp) * data-parallel groups.
    actor_pp: int = 2
    critic_pp: int = 2
    # Tensor-parallel degree of the Actor / the Critic, for training and pipeline inference: each stage is split
    # Megatron-style over tp consecutive ranks (`rlhfuse.runtime.tensor_parallel`). Must divide the heads and
    # the intermediate size (and the kv heads, or be a multiple of them). The two may differ when the smaller
    # divides the larger: the smaller-tp model's consecutive stages merge onto the larger-tp groups (docs/
    # distributed.md, "Merged stages"). World size: the fused group's width times the data-parallel groups.
    actor_tp: int = 1
    critic_tp: int = 1
    # Micro-batches per mini-batch and data-parallel group (0 = data.mini_batch_size / data.micro_batch_size /
    # data-parallel groups). Must be a multiple of the smaller model's replicas.
    microbatches: int = 0
    # Schedule search budget in seconds on rank 0 after the profiling step (0 = the paper's greedy schedule).
    search_budget_s: float = 2.0
    # Split each mini-batch over data-parallel groups and micro-batches by token cost (Karmarkar-Karp);
    # false = contiguous equal-count chunks.
    balance: bool = True
    # Receives are posted this many compute ops before their consumer.
    prefetch: int = 1
    # Split backward (zero-bubble): each backward as I (input gradient, sent upstream at once) and W (weight
    # gradients, run later in a bubble). true plans F/I/W schedules, false F/B, auto both, keeping the shorter
    # predicted makespan from the profiling step's measured F, B, I and W times (docs/runtime.md).
    split_backward: SplitBackward = "auto"
    # pipeline=fsdp: the weight shards, and with them the gradients and optimizer states, in host memory (each
    # layer's gather copies its shard to the device; the optimizer steps on the host).
    cpu_offload: bool = False
    # pipeline=fsdp: a layer frees its gathered weights after its forward and gathers them again for backward
    # (true, ZeRO-3's memory) or keeps them until its backward (false: less communication, more memory).
    reshard_after_forward: bool = True

    def problems(self) -> list[str]:
        problems = self.optim.problems()
        need(
            problems,
            self.split_backward in ("auto", True, False),
            f"pipeline.split_backward={self.split_backward!r} is not one of auto, true, false: set "
            "pipeline.split_backward=auto",
        )
        return problems


@dataclass
class DistributedConfig:
    # Local processes to launch (Lightning Fabric's launcher; 1 = this process only). Under torchrun, each
    # process is one rank and this must equal torchrun's --nproc-per-node (or stay 1).
    nproc_per_node: int = 1
    # auto (nccl on CUDA, gloo on CPU) | gloo | nccl.
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # Seconds a rank waits for another (a failed rank makes the others stop with a clear error after this).
    timeout_s: float = 300.0

    def problems(self) -> list[str]:
        """Problems of the distributed.* keys themselves (process count, backend, timeout)."""
        problems = choice_problems(self, "distributed")
        need(
            problems,
            self.nproc_per_node >= 1,
            f"distributed.nproc_per_node={self.nproc_per_node} must be >= 1",
        )
        positive(problems, "distributed.timeout_s", self.timeout_s)
        return problems


def launched_world_size(nproc_per_node: int) -> int:
    """World size of this run: torchrun's WORLD_SIZE when set, else nproc_per_node."""
    from rlhfuse.distributed import launched_world

    launched = launched_world()
    return nproc_per_node if launched is None else launched


@dataclass(frozen=True)
class PipelineRun:
    """What the pipeline runtime reads of a run's configuration (`RLHFConfig.pipeline_run()`): the strategy's
    keys, the launch, the batch sizes, whether the algorithm trains a Critic (an unknown algorithm: assumed so,
    its own check names it) and the layers of a model built from config (None: read from a checkpoint)."""

    pipeline: PipelineConfig
    nproc_per_node: int
    mini_batch_size: int
    micro_batch_size: int
    critic: bool
    num_layers: int | None

    @property
    def world(self) -> int:
        """The processes the layout spans: torchrun's WORLD_SIZE, else distributed.nproc_per_node."""
        return launched_world_size(max(self.nproc_per_node, 1))

    def layout(self) -> ParallelLayout:
        """The layout the strategy runs (its tp keys read as at least 1: smaller values are reported by
        `validate_runtime`); raises `ParallelLayout`'s ValueError. A run derives it once (`Topology.stages`)."""
        from rlhfuse.trainer.strategies.pipelines.training import pipeline_layout

        p = self.pipeline
        sizes = dataclasses.replace(p, actor_tp=max(p.actor_tp, 1), critic_tp=max(p.critic_tp, 1))
        return pipeline_layout(
            sizes, self.world, self.mini_batch_size, self.micro_batch_size, critic=self.critic
        )


def validate_runtime(run: PipelineRun, derive: Callable[[], ParallelLayout] | None = None) -> list[str]:
    """Problems of pipeline=fused / serial_1f1b and distributed.* (each naming the override and the fix).
    `derive`: the run's layout as already derived (`Topology.stages`); by default `run.layout()`."""
    from rlhfuse.runtime.plan import PLANNERS  # the runtime's pipeline schedules, by name
    from rlhfuse.trainer.strategies.pipelines.training import data_parallel_sizes  # what the strategy runs

    problems: list[str] = []
    p = run.pipeline
    world = run.world
    if p.name not in PLANNERS:
        if world > 1:
            problems.append(
                f"pipeline={p.name} runs in one process but distributed.nproc_per_node={world}: use "
                "pipeline=fused or pipeline=serial_1f1b, or distributed.nproc_per_node=1"
            )
        return problems
    # a critic-free algorithm pipelines the Actor alone (`actor_only_layout`): pipeline.critic_pp is unused
    critic, layers = run.critic, run.num_layers
    keys = ("actor_pp", "critic_pp", "actor_tp", "critic_tp") if critic else ("actor_pp", "actor_tp")
    for key in keys:
        value = getattr(p, key)
        if value < 1:
            problems.append(f"pipeline.{key}={value} must be >= 1")
            continue
        if key.endswith("_tp"):
            continue
        if layers is not None and value > layers:
            problems.append(
                f"pipeline.{key}={value} exceeds model.num_layers={layers} (every stage holds a layer): "
                f"set pipeline.{key}<={layers}"
            )
    if p.prefetch < 0:
        problems.append(f"pipeline.prefetch={p.prefetch} must be >= 0")
    if p.search_budget_s < 0:
        problems.append(f"pipeline.search_budget_s={p.search_budget_s} must be >= 0 (0 = greedy)")
    mini, micro_size = run.mini_batch_size, run.micro_batch_size
    try:  # the layout the strategy will build
        (derive or run.layout)()
    except ValueError as err:
        lines = str(err).splitlines()[1:]
        problems += [
            f"pipeline={p.name} with distributed.nproc_per_node={world}: {line.strip()[2:]}" for line in lines
        ]
    dp, micro = data_parallel_sizes(p, world, mini, micro_size, critic=critic)
    if micro >= 1 and mini < dp * micro:
        problems.append(
            f"data.mini_batch_size={mini} < data-parallel groups * pipeline micro-batches "
            f"= {dp} * {micro}: raise data.mini_batch_size or lower pipeline.microbatches"
        )
    return problems
