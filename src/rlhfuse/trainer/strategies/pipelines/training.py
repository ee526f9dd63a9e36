"""`PipelineStrategy`: the `Strategy` of `RLHFTrainer` over the distributed runtime.

Each rank materialises only the stages the layout places on it (sharded construction, the default: the other
stages' tensors are meta) and trains them; with full copies on every rank (a per-rank inferencer reads whole
models) it still trains only its stages and brings the copies back in sync after each update. One `train_step`: rank 0's mini-batch is broadcast, split over data-parallel
groups and micro-batches by token cost, and the rank's instruction stream runs it (compute, async p2p,
gradient reduction, one optimizer step per model).

The strategy composes one part per job: planning is pure (`rlhfuse.runtime.plan`: profile -> `StepSchedule`,
by the planning function of `schedule`, `plan_fused` or `plan_serial_1f1b`), `PlanExecutor` runs a plan,
`StageOptimizers` steps the rank's stages, `ShardedCheckpointer` saves and loads its shard. The first step runs
serial 1F1B and profiles the stages; every micro-batch count is then planned once from the profile (rank 0
searches the fused schedule and broadcasts it) and cached in `plans`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from rlhfuse import distributed
from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.core.buckets import merged_weight_buckets
from rlhfuse.core.stats import PipelineStats, TrainStats
from rlhfuse.core.types import TrainBatch
from rlhfuse.models import Transformer, joined, metered, stage_of
from rlhfuse.models.lora import adapted_layers
from rlhfuse.pipeline.colocation import Colocation
from rlhfuse.pipeline.ir import Schedule
from rlhfuse.runtime.batch_split import budget_microbatches, microbatch_imbalance, split_minibatch
from rlhfuse.runtime.executor import PlanExecutor, StepResult, StepWork, ppo_losses
from rlhfuse.runtime.layout import (
    ModelParallel,
    ParallelLayout,
    actor_only_layout,
    build_process_groups,
)
from rlhfuse.runtime.partition import RankStages
from rlhfuse.runtime.plan import (
    PlanOptions,
    StageProfile,
    StepSchedule,
    lowered_plan,
    planner_for,
    replay,
    unprofiled_plan,
)
from rlhfuse.runtime.reshard import Resharder
from rlhfuse.runtime.stage_optimizers import StageOptimizers
from rlhfuse.runtime.tensor_parallel import shard_transformer
from rlhfuse.trainer.strategies.pipelines.checkpoint import ShardedCheckpointer
from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig


def data_parallel_sizes(
    config: PipelineConfig, world: int, mini_batch_size: int, micro_batch_size: int, *, critic: bool = True
) -> tuple[int, int]:
    """(data-parallel fused groups, micro-batches per fused group and mini-batch) of `config` on `world` ranks:
    the fused group's width from the co-location (`Colocation.group_ranks`), pipeline.microbatches or
    mini_batch_size / micro_batch_size / dp. Pure; defined for sizes the layout refuses (each read as at least 1),
    so that validation can report them. `critic=False`: the Actor's pipeline alone (the critic slot mirrors it)."""
    critic_pp = config.critic_pp if critic else config.actor_pp
    critic_tp = config.critic_tp if critic else config.actor_tp
    sizes = Colocation(max(config.actor_pp, 1), max(config.actor_tp, 1), max(critic_pp, 1), max(critic_tp, 1))
    dp = max(world // sizes.group_ranks, 1)
    micro = config.microbatches or max(1, mini_batch_size // max(micro_batch_size, 1) // dp)
    return dp, micro


def pipeline_layout(
    config: PipelineConfig,
    world: int,
    mini_batch_size: int,
    micro_batch_size: int,
    device: torch.device | str = "cpu",
    *,
    critic: bool = True,
) -> ParallelLayout:
    """The layout of `config` on `world` ranks, the one derivation: a run derives it once before any model is
    built (`PipelineRun.layout`, cached as `Topology.stages`) for validation, the resume check, the stages each
    rank loads and the strategy; a strategy built without it derives it here. Pure; raises `ParallelLayout`'s ValueError. `critic=False` (a
    critic-free algorithm): the Actor's pipeline alone (`actor_only_layout`; pipeline.critic_pp unused)."""
    dp, micro = data_parallel_sizes(config, world, mini_batch_size, micro_batch_size, critic=critic)
    actor = ModelParallel(config.actor_pp, config.actor_tp)
    if not critic:
        return actor_only_layout(actor, dp, world, micro, device=str(device))
    return ParallelLayout(
        actor, ModelParallel(config.critic_pp, config.critic_tp), dp, world, micro, device=str(device)
    )


class PipelineStrategy:
    """The trainer's `Strategy` over the pipeline runtime. `schedule` names the planning function in `PLANNERS`
    (fused | serial_1f1b); the rest is the layout (from `config` and the world size) and the update's settings.
    `critic=None` (a critic-free algorithm): the Actor's pipeline alone, 1F1B under both names (nothing to fuse
    it with); no Critic stage, optimizer or checkpoint entry.

    Parts: `shards` (this rank's stages), `optimizers`, `executor` (runs a plan), `checkpointer` (sharded);
    state: `profile` (None until the profiling step ran), `plans` (one per micro-batch count), `plan` (the
    next step's).
    """

    def __init__(
        self,
        actor: Transformer,
        critic: Transformer | None,
        config: PipelineConfig,
        algorithm: AlgorithmConfig,
        *,
        total_steps: int,
        mini_batch_size: int,
        micro_batch_size: int,
        micro_batch_tokens: int = 0,
        temperature: float = 1.0,
        schedule: str = "fused",
        timeout_s: float = 300.0,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        log: Callable[[str], None] = print,
        generation_tp: int = 1,
        layout: ParallelLayout | None = None,
        groups: distributed.WorldGroups | None = None,
    ) -> None:
        """`layout`: the run's layout as already derived (`Topology.stages`), placed here on this rank's device;
        derived from `config` and the world size otherwise. `groups`: the run's owner of its process groups
        (`Topology.groups`; this process's `WorldGroups` by default)."""
        self.planner = planner_for(schedule)
        self.generation_tp = generation_tp
        if not distributed.is_initialized():
            raise ValueError(
                f"pipeline={schedule} needs torch.distributed: launch with distributed.nproc_per_node=N "
                "(or torchrun), or use pipeline=plain"
            )
        self.models = {"actor": actor} if critic is None else {"actor": actor, "critic": critic}
        for model in self.models.values():
            model.activation_checkpointing = config.optim.activation_checkpointing
        self.config, self.algorithm, self.log = config, algorithm, log
        self.rank, self.world = distributed.rank(), distributed.world_size()
        self.device = distributed.rank_device()
        for name, model in self.models.items():
            where = next(p for p in model.parameters() if not p.is_meta).device
            if where != self.device:
                raise ValueError(
                    f"the {name} is on {where} but this rank's collectives run on {self.device} (backend "
                    f"{distributed.backend()}): use distributed.backend=nccl with device=cuda, or gloo with "
                    "device=cpu"
                )
        if layout is None:
            layout = pipeline_layout(
                config, self.world, mini_batch_size, micro_batch_size, critic=critic is not None
            )
        self.layout = dataclasses.replace(layout, device=str(self.device))
        micro = self.layout.microbatches
        # micro-batches per group: the layout's, or per step from a token budget (each count planned once)
        self.micro_batch_tokens = micro_batch_tokens
        self.groups = build_process_groups(self.layout, timeout_s, groups)
        vocab = None
        # this rank's tensor-parallel shard of its stages (Megatron-style), each model over its own tp group
        self.models = {m: self.tp_shard(model, m) for m, model in self.models.items()}
        if self.layout.model_tp("actor") > 1:
            vocab = self.models["actor"].vocab_shard
        self.shards = RankStages(
            self.layout, self.rank, self.models, self.groups.tp, tp_groups=self.groups.model_tp
        )
        self.stages = self.shards.local
        self.optimizers = StageOptimizers(self.shards, config.optim, total_steps)
        self.executor = PlanExecutor(
            self.rank,
            self.world,
            self.stages,
            self.groups,
            losses=ppo_losses(
                algorithm, temperature if temperature > 0 else 1.0, vocab, self.groups.tp_of("actor")
            ),
            timeout_s=timeout_s,
            autocast=autocast,
            model_tp={m: self.layout.model_tp(m) for m in self.layout.trained},
            grad_bucket_mb=config.optim.grad_bucket_mb,
        )
        self.checkpointer = ShardedCheckpointer(self.shards, self._shard_state, self._restore_shard)
        # the stage times measured on the profiling step (None until it ran), the plans made from them per
        # micro-batch count, and the plan the next step runs
        self.profile: StageProfile | None = None
        self.plan_options = PlanOptions(config.prefetch, config.search_budget_s, config.split_backward)
        self.plans: dict[int, StepSchedule] = {}
        self.plan = self._unprofiled(micro)
        self.steps = 0
        self.weight_sync_bytes = 0.0
        self.weight_sync_extra_bytes = 0.0
        self.last_result: StepResult | None = None
        if self.rank == 0:
            log(f"rlhfuse: pipeline={schedule}: {self.layout.describe()}; {micro} micro-batches per group")

    def tp_shard(self, model: Transformer, like: str = "actor") -> Transformer:
        """This rank's tensor-parallel shard of `model` over the tp group of the trained model it is placed like
        (`like`: "actor" or "critic"; `shard_transformer`; the model itself when that tp is 1): the trainer
        shards the Ref (like the Actor) and the Reward (like the Critic) with it for pipeline inference."""
        tp = self.layout.model_tp(like)
        if tp == 1:
            return model
        return shard_transformer(model, self.layout.tp_rank(self.rank, like), tp, self.groups.tp_of(like))

    @property
    def schedule(self) -> Schedule:
        """The schedule the current plan runs."""
        return self.plan.schedule

    # --- Strategy protocol ---------------------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> TrainStats:
        batch = self._broadcast_batch(batch)
        if self.micro_batch_tokens > 0:
            lengths = batch.host_lengths()
            k = self.layout.replicas(self.layout.smaller)
            self.plan = self._plan_for(
                budget_microbatches(lengths, self.layout.dp, self.micro_batch_tokens, k)
            )
        micro, weights, skew = split_minibatch(
            batch,
            self.layout.dp,
            self.plan.microbatches,
            balance=self.config.balance,
            loss_reduction=self.algorithm.loss_reduction,
        )
        micro_skew = microbatch_imbalance(micro)
        step = self.executor.run(self.plan, StepWork(micro, weights), self.optimizers.step)
        self.last_result = step.result
        predicted = self.plan.predicted_s
        if self.profile is None:  # the profiling step: plan this count from its stage times
            self.profile = self.executor.profile(step.result, self.layout, self.plan.microbatches)
            self.plan = self._planned(self.plan.microbatches)
            predicted = self.plan.predicted_serial_s
        self.steps += 1
        return TrainStats(
            loss=step.result.stats,
            actor_grad_norm=step.result.grad_norm["actor"],
            critic_grad_norm=step.result.grad_norm.get("critic"),
            lr=self.optimizers.lr,
            pipeline=PipelineStats(
                predicted_makespan_s=predicted,
                measured_makespan_s=step.measured_s,
                bubble_ratio=step.bubble_ratio,
                dp_imbalance=skew,
                microbatches=float(self.plan.microbatches),
                microbatch_imbalance=micro_skew,
            ),
        )

    def optimizers_in_use(self) -> list[torch.optim.Optimizer]:
        """The optimizers of this rank's stages, one per trained model."""
        return list(self.optimizers.optims.values())

    def actor_weights(self) -> Mapping[str, Tensor]:
        """Collective: `actor_weight_buckets()` all at once."""
        return joined(self.actor_weight_buckets())

    def actor_weight_buckets(self) -> Iterator[Mapping[str, Tensor]]:
        """Collective (every rank consumes every bucket): this rank's generation shard of the Actor
        (generator.tp = g: position rank % g of instance rank // g; g = 1: the whole Actor), resharded from the
        training layout by `resharder` (`rlhfuse.runtime.reshard`) bucket by bucket (pipeline.
        weight_sync_bucket_mb): each rank receives, point to point from the stage owners, exactly the parts of
        its shard it does not hold, for any training tp and any g dividing the world, and holds one bucket of
        them at a time. A LoRA Actor (tp = 1, g = 1): only its adapted projections, merged (W + scale B A) on the
        stages that hold them and sent to the other ranks stage by stage, in runs of at most a bucket
        (`_adapted_by_stage`); the copies' frozen rest never changes.
        Full copies on every rank (a per-rank inferencer reads whole models): both models' copies are first
        brought up to date in place (`RankStages.gather`), then the shard is cut locally. `weight_sync_bytes`:
        the most bytes any rank received (known once the last bucket is consumed)."""
        actor = self.models["actor"]
        cap = self.config.optim.weight_sync_bucket_bytes
        buckets: Iterable[Mapping[str, Tensor]]
        lora, gathered = bool(adapted_layers(actor)), 0
        if lora:  # a LoRA Actor: its adapted projections merged on their stages and sent, run by run
            buckets = (
                self.shards.full_state("actor", merged)
                for merged in merged_weight_buckets(actor, cap, self._adapted_by_stage(actor))
            )
        elif self.shards.sharded:
            buckets = self.resharder.buckets(cap)
        else:  # full copies: brought up to date in place, then handed on (g = 1) or cut locally
            self.shards.gather()
            gathered = self.shards.received_bytes
            buckets = [actor.state_dict()] if self.generation_tp == 1 else self.resharder.buckets(cap)
        received = 0  # what this rank received: the merged runs', the resharder's or the in-place gather's
        for bucket, peak in metered(buckets, actor):
            self.weight_sync_extra_bytes = float(peak)
            received += self.shards.received_bytes if lora else 0  # the run's exchange just ran
            yield bucket
        if not lora:
            received = self.resharder.received_bytes if self.shards.sharded else gathered
        total = torch.tensor([float(received)], dtype=torch.float64, device=self.device)
        distributed.all_reduce(total, op="max")
        self.weight_sync_bytes = float(total)

    def _adapted_by_stage(self, actor: Transformer) -> list[list[str]]:
        """A LoRA Actor's adapted layers per pipeline stage, the groups its merged projections are sent in (each
        run merged on the stages that hold it, meta elsewhere, and sent by `RankStages.full_state`)."""
        names = list(adapted_layers(actor))
        stages, depth = self.layout.stages("actor"), actor.config.num_layers
        return [[n for n in names if stage_of(f"{n}.weight", depth, stages) == s] for s in range(stages)]

    @functools.cached_property
    def resharder(self) -> Resharder:
        """The Actor's resharding to generation instances of generator.tp ranks (planned once)."""
        return Resharder(
            self.layout,
            self.rank,
            self.models["actor"],
            self.generation_tp,
            everywhere=not self.shards.sharded,
            dtype=self.config.optim.weight_sync_dtype(self.device.type),  # sent as the generator holds them
        )

    def state_dict(self) -> dict[str, Any]:
        trained = self.layout.trained  # no 'critic' entry for a critic-free algorithm
        if self.shards.sharded:
            full = {m: self.shards.full_state(m) for m in trained}
        else:
            self.shards.gather()
            full = {m: self.models[m].state_dict() for m in trained}
        return {
            **full,
            "rank": self.rank,
            "world_size": self.world,
            **self.optimizers.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("world_size") != self.world or state.get("rank") != self.rank:
            raise ValueError(
                f"this pipeline state was saved by rank {state.get('rank')} of {state.get('world_size')}; "
                f"this is rank {self.rank} of {self.world}: resume with the same layout"
            )
        for m in self.layout.trained:
            self.shards.load_resident(m, state[m])
        self.optimizers.load_state_dict(state)

    def replay_makespan(self) -> float:
        """Collective: the makespan the simulator gives the current schedule with the compute times of the last
        step's own ops (gathered from every rank of fused group 0). Measured / replayed - 1 is the share of
        communication, bookkeeping and waiting not explained by compute."""
        assert self.last_result is not None
        return replay(self.plan, self.executor.action_seconds(self.last_result))

    # --- planning ------------------------------------------------------------------------------------------------
    def _plan_for(self, microbatches: int) -> StepSchedule:
        """Collective (same count on every rank): the plan for `microbatches` micro-batches per group, planned
        from the profile the first time it is needed (cached); before profiling, the serial 1F1B stand-in."""
        if microbatches == self.plan.microbatches:
            return self.plan
        if microbatches in self.plans:
            return self.plans[microbatches]
        if self.profile is None:  # not profiled yet: this step runs serial 1F1B and profiles
            return self._unprofiled(microbatches)
        return self._planned(microbatches)

    def _unprofiled(self, microbatches: int) -> StepSchedule:
        """The profiling step's plan: serial 1F1B, with split backwards where F/I/W may be planned (it then
        measures I and W too)."""
        return unprofiled_plan(
            self.layout,
            microbatches,
            prefetch=self.config.prefetch,
            split_backward=self.config.split_backward,
        )

    def _planned(self, microbatches: int) -> StepSchedule:
        """Collective: a new plan from the profile, cached."""
        assert self.profile is not None
        plan = self.planner(self.layout, self.profile, microbatches, self.plan_options, self._from_rank0)
        if self.rank == 0 and plan.note:
            self.log(f"rlhfuse: {plan.note}")
        self.plans[microbatches] = plan
        return plan

    def _from_rank0(self, search: Callable[[], Schedule]) -> Schedule:
        """Rank 0 searches, every rank receives its schedule."""
        text = search().to_json() if self.rank == 0 else None
        return Schedule.from_json(distributed.broadcast_json(text, 0, self.device))

    def _broadcast_batch(self, batch: TrainBatch) -> TrainBatch:
        """Rank 0's mini-batch on every rank, on the device, with its host mask (rank 0's, carried from the
        trainer) sent host to host over the control group: no rank reads the device for it."""
        sent = dataclasses.replace(batch, host_mask_BT=None)
        out: TrainBatch = distributed.broadcast_dataclass(sent, TrainBatch, 0, self.device)
        shape = tuple(out.attention_mask_BT.shape)
        host = batch.host_mask().to(torch.uint8) if self.rank == 0 else torch.empty(shape, dtype=torch.uint8)
        distributed.broadcast(host, 0, group=distributed.cpu_group())
        return dataclasses.replace(out, host_mask_BT=host.bool())

    # --- the shard's state besides the stage weights (ShardedCheckpointer) ----------------------------------------
    def _shard_state(self) -> dict[str, Any]:
        """Optimizer and scheduler states, and the planned schedule (a resumed run keeps it: same op order, same
        sums)."""
        record: dict[str, Any] = {"steps": self.steps, "microbatches": self.plan.microbatches}
        if self.profile is not None:
            record.update(
                base=self.profile.to_json(),
                schedule=self.plan.schedule.to_json(),
                predicted_s=self.plan.predicted_s,
                predicted_serial_s=self.plan.predicted_serial_s,
            )
        return {**self.optimizers.state_dict(), "pipeline": record}

    def _restore_shard(self, state: Mapping[str, Any]) -> None:
        self.optimizers.load_state_dict(state)
        record = state["pipeline"]
        self.steps, micro = int(record["steps"]), int(record["microbatches"])
        self.plans, self.profile = {}, None
        if "base" not in record:  # saved before the profiling step ended
            self.plan = self._unprofiled(micro)
        else:
            self.profile = StageProfile.from_json(record["base"])
            self.plan = lowered_plan(
                self.layout,
                micro,
                Schedule.from_json(record["schedule"]),
                prefetch=self.config.prefetch,
                profile=self.profile,
                predicted_s=float(record["predicted_s"]),
                predicted_serial_s=float(record["predicted_serial_s"]),
            )
            self.plans[micro] = self.plan
