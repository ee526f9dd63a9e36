"""`pipeline=fsdp`: sharded data parallelism (FSDP2, `rlhfuse.distributed.fsdp`) over one process per generation
instance, the launch and the rollout of `pipeline=plain`.

Each rank keeps 1/world of the Actor's, the Critic's, the Ref's and the Reward's weights, of the trained models'
gradients and of their optimizer states (`memory/param_bytes`, `memory/optimizer_bytes`), instead of whole copies.
The update is `PlainStrategy`'s (every rank trains its Karmarkar-Karp share of each mini-batch, each micro-batch
weighted by its share of the whole mini-batch; the gradient is the sum over ranks), with FSDP's reduce-scatter in
place of the bucketed all-reduce: each layer's gradients are reduced during the last micro-batch's backward as
soon as they are final. A layer's weights are gathered for its forward and backward and freed after, so every
training forward is collective: a rank with fewer micro-batches runs its last one again with weight 0, and a
non-finite loss does not skip a backward (every rank runs the same reductions; the step is then dropped on all).

The rollout keeps the models sharded (`ShardedInference`): each rank is one generation instance with a whole
Actor copy (the long tail migrates between them as under pipeline=plain), the samples are gathered on every rank,
then every rank infers its share with the sharded models in lockstep (their forwards gather one layer at a time,
so every rank runs as many). Inference does not overlap the generation tail here (no inter-stage fusion): the
price of never holding a whole Ref, Reward or Critic. The weight sync gathers the Actor on every rank (each rank
is a whole generation instance: it needs all of it) into the generator's copy.

Checkpoints (`rlhfuse.trainer.strategies.fsdp.checkpoint.FSDPCheckpointer`): the sharded model and optimizer states through torch.distributed.checkpoint
(every rank writes its shards; the files load on any world size), the schedulers and the trainer's state written
by rank 0, sealed by rank 0's meta.json (kind "fsdp") once every rank's part is written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from rlhfuse import distributed
from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.core.buckets import merged_weight_buckets
from rlhfuse.core.optim import OptimConfig, cast_to, set_peak_lr
from rlhfuse.core.protocols import Checkpointer, FabricLike
from rlhfuse.core.stats import TrainStats
from rlhfuse.core.types import TrainBatch
from rlhfuse.distributed.fsdp import (
    ShardingPolicy,
    set_gradient_sync,
    set_sharded_state,
    shard_model,
    sharded_state,
    whole_state_buckets,
    whole_tensor,
)
from rlhfuse.models import Transformer, joined, metered
from rlhfuse.models.lora import LoraConfig
from rlhfuse.trainer.strategies.fsdp.checkpoint import FSDPCheckpointer
from rlhfuse.trainer.strategies.plain.training import PlainStrategy


class ShardedReduceScatter:
    """`GradientSync` of sharded models: FSDP reduce-scatters each layer's gradients in the last backward, as soon
    as they are final; the earlier backwards accumulate unreduced. Every pass gathers weights, so every rank runs
    as many: a rank with fewer micro-batches repeats its last one with weight 0 (it adds nothing)."""

    def __init__(self, models: Sequence[torch.nn.Module], group: Any) -> None:
        self.models, self.group = list(models), group

    def align(
        self, micros: list[TrainBatch], weights: list[float], most: Callable[[], int]
    ) -> tuple[list[TrainBatch], list[float]]:
        extra = most() - len(micros)  # worked out alike on every rank: nothing to exchange
        return micros + [micros[-1]] * extra, weights + [0.0] * extra

    def before_backward(self, last: bool) -> None:
        set_gradient_sync(self.models, last)

    def finish(self) -> None:
        """Nothing left: the last backward reduced every layer (FSDP waits for them before `step`)."""

    def wait(self) -> None:
        """FSDP's reductions complete inside the backward's end."""


class ShardedStrategy:
    """`pipeline=fsdp`'s `Strategy`: the four models sharded in place over the world, the update
    `PlainStrategy`'s over the shards (its optimizers are built over the sharded parameters: their states are
    sharded too), with `ShardedReduceScatter` in place of the bucketed all-reduce."""

    def __init__(
        self,
        actor: Transformer,
        critic: Transformer | None,
        config: OptimConfig,
        algorithm: AlgorithmConfig,
        *,
        frozen: Sequence[Transformer | None],
        policy: ShardingPolicy,
        fabric: FabricLike,
        total_steps: int,
        micro_batch_size: int,
        micro_batch_tokens: int = 0,
        temperature: float = 1.0,
        packing: bool = False,
        lora: LoraConfig | None = None,
        group: Any = None,
    ) -> None:
        """`group`: the processes the models are sharded over (the world by default)."""
        self.lora = lora  # the Actor's adapters (model.lora), None for a fully trained Actor
        # the Ref and the Reward (frozen: sharded weights, no gradients or optimizer)
        self.frozen = [m for m in frozen if m is not None and m is not actor and m is not critic]
        self.policy, self.config = policy, config
        device_type = fabric.device.type  # the models may still be in host memory: sharding moves them
        trained = [actor] if critic is None else [actor, critic]
        for model in (*trained, *self.frozen):
            shard_model(
                model, model.layers, policy, device_type=device_type, forward_methods=("packed_outputs",)
            )
        group = distributed.WorldGroups.current().world if group is None else group
        self.update = PlainStrategy(
            actor,
            critic,
            config,
            algorithm,
            fabric=fabric,
            total_steps=total_steps,
            micro_batch_size=micro_batch_size,
            micro_batch_tokens=micro_batch_tokens,
            temperature=temperature,
            group=group,
            packing=packing,
            sync=ShardedReduceScatter(trained, group),
        )
        self.group = group
        self.checkpointer: Checkpointer = FSDPCheckpointer(self)
        self.weight_sync_bytes = 0.0
        self.weight_sync_extra_bytes = 0.0

    @property
    def actor(self) -> Transformer:
        return self.update.actor

    @property
    def critic(self) -> Transformer | None:
        return self.update.critic

    @property
    def algorithm(self) -> AlgorithmConfig:
        return self.update.algorithm

    def train_step(self, batch: TrainBatch) -> TrainStats:
        return self.update.train_step(batch)

    def optimizers_in_use(self) -> list[torch.optim.Optimizer]:
        return self.update.optimizers

    def actor_weights(self) -> Mapping[str, Tensor]:
        """Collective: `actor_weight_buckets()` all at once (the whole Actor on every rank)."""
        return joined(self.actor_weight_buckets())

    def actor_weight_buckets(self) -> Iterator[Mapping[str, Tensor]]:
        """Collective: the Actor's whole weights on every rank (each rank's generator copy is a whole instance),
        gathered bucket by bucket (pipeline.weight_sync_bucket_mb) in the generator's dtype (each shard cast
        before the gather): each rank receives the shards it lacks and holds one bucket of gathered tensors at a
        time. A LoRA Actor: only its adapted projections, each merged on the shards (W + scale B A on this
        rank's rows of W and B, the small A gathered) and then gathered whole; the copies' frozen rest never
        changes."""
        cap = self.config.weight_sync_bucket_bytes
        dtype = self.config.weight_sync_dtype(self.update.fabric.device.type)  # bf16: half the bytes
        if self.lora is None:
            buckets: Iterator[Mapping[str, Tensor]] = whole_state_buckets(self.actor, cap, dtype)
        else:
            buckets = (
                {n: whole_tensor(t.to(cast_to(t.dtype, dtype))) for n, t in b.items()}
                for b in merged_weight_buckets(self.actor, cap)
            )
        world = distributed.world_size(self.group)
        total = 0
        for bucket, peak in metered(buckets, self.actor):
            total += sum(t.numel() * t.element_size() for t in {id(t): t for t in bucket.values()}.values())
            self.weight_sync_bytes = float(total * (world - 1) / world)
            self.weight_sync_extra_bytes = float(peak)
            yield bucket

    def sharded_state(self) -> dict[str, Any]:
        """The trained models' and optimizers' states (DTensors: this rank's shards)."""
        return sharded_state(self.trained, self.trained_optimizers)

    def scheduler_state(self) -> dict[str, Any]:
        return {f"{name}_sched": sched.state_dict() for name, sched in self.schedulers.items()}

    def state_dict(self) -> dict[str, Any]:
        """The sharded weights and optimizer states, and the LR schedulers' states."""
        return {**self.sharded_state(), **self.scheduler_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s entries; the configured learning rates replace the checkpoint's."""
        set_sharded_state(state, self.trained, self.trained_optimizers)
        peaks = {"actor": self.config.actor_lr, "critic": self.config.critic_lr}
        for name, sched in self.schedulers.items():
            sched.load_state_dict(state[f"{name}_sched"])
            set_peak_lr(self.trained_optimizers[name], sched, peaks[name])  # a resume may change it

    @property
    def trained(self) -> dict[str, torch.nn.Module]:
        """The trained models by checkpoint name."""
        return dict(zip(("actor", "critic"), self.update.models, strict=False))

    @property
    def trained_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return dict(zip(self.trained, self.update.optimizers, strict=True))

    @property
    def schedulers(self) -> dict[str, torch.optim.lr_scheduler.LambdaLR]:
        found = {"actor": self.update.actor_sched}
        if self.update.critic_sched is not None:
            found["critic"] = self.update.critic_sched
        return found
