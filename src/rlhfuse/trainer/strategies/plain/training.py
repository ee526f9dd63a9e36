"""Training stage without pipelines: Actor (clipped policy loss) and Critic (clipped value loss) updates; a
critic-free algorithm (`critic=None`) trains the Actor alone: no Critic forward, optimizer or checkpoint entry.

One `train_step` is one optimizer step of each model on one mini-batch, accumulated over micro-batches
(by samples, or packed up to a token budget). Precision and backward go through the run's Fabric
(`FabricLike`: bf16 autocast on GPU, fp32 on CPU).

Data-parallel over a process group (`generator.instances=N`: one rank per generation instance, each holding a
full Actor and Critic): every rank receives the same mini-batch, keeps its share (Karmarkar-Karp by sequence
cost, the same split on every rank), weights each micro-batch by its share of the *whole* mini-batch's tokens
(or samples) and all-reduces (sums) the gradients, so every rank steps with the gradient of the whole mini-batch
— the single-process update up to floating-point reassociation. Identical gradients and optimizer states keep the
weights identical on every rank: the Actor copy each rank generates with is in sync without any broadcast.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from typing import Any, Protocol

import torch
import torch.distributed as dist  # the ProcessGroup type only: collectives go through rlhfuse.distributed
from torch import Tensor

from rlhfuse import distributed
from rlhfuse.core import step_losses as losses
from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.core.balance import batch_costs, karmarkar_karp, microbatch_weights
from rlhfuse.core.buckets import merged_weight_buckets
from rlhfuse.core.checkpoint import PlainCheckpointer
from rlhfuse.core.errors import CheckpointError, NonFiniteError
from rlhfuse.core.optim import OptimConfig, build_optimizer, micro_batch_count, micro_batches, set_peak_lr
from rlhfuse.core.protocols import Checkpointer, FabricLike
from rlhfuse.core.stats import LossStats, LossTensors, TrainStats, scale_stats, sum_stats
from rlhfuse.core.types import TrainBatch
from rlhfuse.distributed.fsdp import whole_tensor
from rlhfuse.distributed.grad_buckets import GradReducer
from rlhfuse.models import Transformer, joined, load_balancing_loss, metered, record_router_logits
from rlhfuse.models.lora import adapted_layers, load_trained_state, trainable, trained_state
from rlhfuse.models.masks import mask_layout
from rlhfuse.models.packing import check_packing


class PlainStrategy:
    def __init__(
        self,
        actor: Transformer,
        critic: Transformer | None,
        config: OptimConfig,
        algorithm: AlgorithmConfig,
        *,
        fabric: FabricLike,
        total_steps: int,
        micro_batch_size: int,
        micro_batch_tokens: int = 0,
        temperature: float = 1.0,
        group: dist.ProcessGroup | None = None,
        packing: bool = False,
        sync: GradientSync | None = None,
    ) -> None:
        self.actor, self.critic = actor, critic
        # data-parallel ranks (None = this process alone trains on every sample)
        self.group = group
        self.config, self.algorithm = config, algorithm
        self.fabric = fabric
        self.micro_batch_size, self.micro_batch_tokens = micro_batch_size, micro_batch_tokens
        self.temperature = temperature if temperature > 0 else 1.0
        # packed micro-batches (rlhfuse.models.packing): the models run on real tokens only
        self.packing = packing
        if packing:
            check_packing([actor, critic])
        for trained in (actor, critic):
            if trained is not None:
                trained.activation_checkpointing = config.activation_checkpointing
        # the trained weights: a LoRA Actor's adapters only (`rlhfuse.models.lora`), every weight otherwise
        self.actor_optim, self.actor_sched = build_optimizer(
            trainable(actor.parameters()), config.actor_lr, config, total_steps
        )
        # the Critic's optimizer, LR schedule and checkpoint entries exist only for an algorithm with a Critic
        self.critic_optim: torch.optim.Optimizer | None = None
        self.critic_sched: torch.optim.lr_scheduler.LambdaLR | None = None
        if critic is not None:
            self.critic_optim, self.critic_sched = build_optimizer(
                critic.parameters(), config.critic_lr, config, total_steps
            )
        # data-parallel ranks hold the same state: rank 0 writes it
        self.checkpointer: Checkpointer = PlainCheckpointer(
            self.state_dict, self.load_state_dict, writer=fabric.is_global_zero
        )
        self.weight_sync_bytes = 0.0  # the generator copies the Actor in process: nothing crosses ranks
        self.weight_sync_extra_bytes = 0.0
        # how the ranks' gradients meet: whole replicas sum them in buckets (the default over a group)
        self.sync: GradientSync | None = sync
        if sync is None and group is not None:
            params = [trainable(m.parameters()) for m in self.models]
            self.sync = BucketedAllReduce(GradReducer(params, group, bucket_mb=config.grad_bucket_mb))

    def actor_weights(self) -> Mapping[str, Tensor]:
        """What the generators' plain copies load, all at once: the Actor's state, or a LoRA Actor's merged
        projections."""
        return joined(self.actor_weight_buckets())

    def actor_weight_buckets(self) -> Iterator[Mapping[str, Tensor]]:
        """`actor_weights()` streamed: the Actor's own tensors (no copy) in one bucket, or a LoRA Actor's merged
        projections merged bucket by bucket."""
        cap = self.config.weight_sync_bucket_bytes
        adapted = bool(adapted_layers(self.actor))
        buckets = merged_weight_buckets(self.actor, cap) if adapted else [self.actor.state_dict()]
        for bucket, peak in metered(buckets, self.actor):
            self.weight_sync_extra_bytes = float(peak)
            yield bucket

    @property
    def models(self) -> list[torch.nn.Module]:
        """The trained models: the Actor, and the Critic when the algorithm has one."""
        return [self.actor] if self.critic is None else [self.actor, self.critic]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.actor_optim] if self.critic_optim is None else [self.actor_optim, self.critic_optim]

    def optimizers_in_use(self) -> list[torch.optim.Optimizer]:
        return self.optimizers

    def train_step(self, batch: TrainBatch) -> TrainStats:
        """One optimizer step of each trained model on `batch`, with one host read: the micro-batches are split,
        weighted and laid out from the batch's host mask (carried from the trainer; a batch without one is read
        once here), and the statistics, every micro-batch's losses and both gradient norms are read together
        at the end, before either model steps: a non-finite loss or norm never reaches the weights."""
        for model in self.models:
            model.train()
        batch = batch.with_host_mask()
        parts, losses_L, names = self._accumulate(batch)
        # any non-finite loss on this rank, summed over the ranks with the statistics: every rank learns of it
        vector = torch.cat([sum_stats(parts).vector(), (~torch.isfinite(losses_L)).any().double()[None]])
        if self.group is not None:
            vector = self._all_reduce(vector)
        norms = [self._clipped_norm(model) for model in self.models]
        read = torch.cat(
            [vector, losses_L, *(norm.double()[None] for norm in norms)]
        ).tolist()  # the one read
        stats, failed_anywhere = read[: len(LossStats._fields)], read[len(LossStats._fields)] > 0
        losses, norm_values = read[len(vector) : len(vector) + len(names)], read[len(vector) + len(names) :]
        failure = next(
            (f"{name} is {value}" for name, value in zip(names, losses) if not math.isfinite(value)), None
        )
        if failure is None and failed_anywhere:
            failure = "a loss is non-finite on another data-parallel rank"
        if failure is None:
            failure = next(
                (
                    f"{name} is {norm}"
                    for name, norm in zip(_NORM_NAMES, norm_values)
                    if not math.isfinite(norm)
                ),
                None,
            )
        if failure is not None:
            self._zero_grad()
            raise NonFiniteError(failure)
        steps: list[tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]] = [
            (self.actor_optim, self.actor_sched)
        ]
        if self.critic_optim is not None and self.critic_sched is not None:
            steps.append((self.critic_optim, self.critic_sched))
        for optim, sched in steps:
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
        critic_norm = None if self.critic is None else norm_values[1]
        return TrainStats(
            LossStats(*stats), norm_values[0], critic_norm, float(self.actor_sched.get_last_lr()[0])
        )

    def _accumulate(self, batch: TrainBatch) -> tuple[list[LossTensors], Tensor, list[str]]:
        """Forward and backward of this rank's micro-batches of the mini-batch, each weighted by its share of the
        *whole* mini-batch (token-mean or sequence-mean losses), gradients accumulated: their weighted
        statistics, every pass's losses (float64, on the device: read with the step's statistics) and their
        names. Every pass runs, a non-finite loss's too: whether one was is known only at the step's read, and
        the step is then dropped on every rank."""
        parts: list[LossTensors] = []
        losses: list[Tensor] = []
        names: list[str] = []
        own, rows = self._own_rows(batch)
        micros = micro_batches(own, samples=self.micro_batch_size, tokens=self.micro_batch_tokens)
        weights = microbatch_weights(micros, batch, self.algorithm.loss_reduction)
        if self.sync is not None:
            micros, weights = self.sync.align(micros, weights, lambda: self._most_micro_batches(batch, rows))
        for i, (micro, weight) in enumerate(zip(micros, weights, strict=True)):
            if self.sync is not None:
                self.sync.before_backward(last=i == len(micros) - 1)
            named, stats = self._losses(micro)
            for name, value, _ in named:
                self.fabric.backward(value * weight)
                losses.append(value.detach().double())
                names.append(name)
            parts.append(scale_stats(stats, weight))
        return parts, torch.stack(losses), names

    def _zero_grad(self) -> None:
        for optim in self.optimizers:
            optim.zero_grad(set_to_none=True)

    def _own_rows(self, batch: TrainBatch) -> tuple[TrainBatch, list[list[int]] | None]:
        """This rank's samples of the mini-batch and every rank's row indices: parts of near-equal cost
        (tokens + attention, from the host mask), the same partition on every rank; the whole batch and None
        in a single process."""
        if self.group is None:
            return batch, None
        world, rank = distributed.world_size(self.group), distributed.rank(self.group)
        if len(batch) < world:
            raise ValueError(
                f"a mini-batch of {len(batch)} samples cannot give each of {world} data-parallel ranks a "
                f"sample: raise data.mini_batch_size to >= {world}"
            )
        rows = karmarkar_karp(batch_costs(batch), world)
        return batch.select(torch.tensor(rows[rank])), rows

    def _most_micro_batches(self, batch: TrainBatch, rows: list[list[int]] | None) -> int:
        """The largest number of micro-batches any rank makes of its share (every rank works it out alike)."""
        lengths = batch.host_lengths()
        shares = [list(range(len(batch)))] if rows is None else rows
        return max(
            micro_batch_count(
                [lengths[i] for i in share], samples=self.micro_batch_size, tokens=self.micro_batch_tokens
            )
            for share in shares
        )

    def _all_reduce(self, vector: Tensor) -> Tensor:
        """Sum gradients and the weighted statistics (with the non-finite count) over the ranks, each already its
        share of the mini-batch; the gradient buckets the last backward did not launch are launched first, so
        every rank issues the same reductions in the same order."""
        assert self.sync is not None
        self.sync.finish()
        device = next(self.actor.parameters()).device  # the gradients' device: the one the group reduces on
        values = vector.to(device=device, dtype=torch.float64)
        distributed.all_reduce(values, group=self.group)
        self.sync.wait()
        return values

    def _losses(self, micro: TrainBatch) -> tuple[list[tuple[str, Tensor, LossTensors]], LossTensors]:
        """Forward of one micro-batch on the models' device, its mask layout worked out from its host mask: each
        trained model's named loss with its statistics, and their sum."""
        device = next(self.actor.parameters()).device
        layout = mask_layout(micro.host_mask(), packed=self.packing).to(device)
        micro = micro.to(device)
        coef = self.config.router_aux_loss_coef
        dest_M: Tensor | None = None  # the logits: [B, R, V], or packed [M, V] at the window's real rows
        with self.fabric.autocast():
            with record_router_logits(self.actor) if coef > 0 else nullcontext() as router_logits:
                if self.packing:
                    actor_logits, dest_M = losses.packed_response_rows(self.actor, micro, layout)
                else:
                    actor_logits = losses.model_response_outputs(
                        self.actor, micro, packing=False, layout=layout
                    )
            values_BR = (
                None
                if self.critic is None
                else losses.model_response_outputs(self.critic, micro, packing=self.packing, layout=layout)
            )
        policy_loss, policy_stats = losses.response_actor_loss(
            actor_logits, micro, self.algorithm, self.temperature, dest_M=dest_M
        )
        if router_logits:
            # packed: the router saw the real tokens only; padded: every position, the pads masked out
            valid_N = None if self.packing else micro.attention_mask_BT.flatten()
            config = self.actor.config
            aux = load_balancing_loss(router_logits, config.num_experts, config.num_experts_per_tok, valid_N)
            policy_loss = policy_loss + coef * aux
            policy_stats = policy_stats._replace(router_aux_loss=aux.detach().double())
        named = [("loss/policy", policy_loss, policy_stats)]
        if values_BR is not None:
            named.append(("loss/value", *losses.response_critic_loss(values_BR, micro, self.algorithm)))
        return named, sum_stats([stats for _, _, stats in named])

    def _clipped_norm(self, model: torch.nn.Module) -> Tensor:
        """Clip `model`'s gradients (`optim.grad_clip`; none when 0) and return their norm before clipping, on the
        device (a sharded model's is reduced over its shards): not read here."""
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        return whole_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    def state_dict(self) -> dict[str, Any]:
        """Weights, optimizer and scheduler states; the 'critic*' entries only for an algorithm with a Critic."""
        state: dict[str, Any] = {
            "actor": trained_state(self.actor),  # a LoRA Actor's adapters only: its base is the SFT model
            "actor_optim": self.actor_optim.state_dict(),
            "actor_sched": self.actor_sched.state_dict(),
        }
        if self.critic is not None and self.critic_optim is not None and self.critic_sched is not None:
            state["critic"] = self.critic.state_dict()
            state["critic_optim"] = self.critic_optim.state_dict()
            state["critic_sched"] = self.critic_sched.state_dict()
        return {key: state[key] for key in _STATE_ORDER if key in state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s entries; the configured learning rates replace the checkpoint's."""
        has_critic = "critic" in state
        if has_critic != (self.critic is not None):
            raise CheckpointError(
                f"this checkpoint was written by a run {'with' if has_critic else 'without'} a Critic, but "
                f"algorithm.name={self.algorithm.name} {'trains none' if self.critic is None else 'needs one'}: "
                "resume it with the algorithm that wrote it"
            )
        load_trained_state(self.actor, state["actor"])
        self.actor_optim.load_state_dict(state["actor_optim"])
        self.actor_sched.load_state_dict(state["actor_sched"])
        set_peak_lr(self.actor_optim, self.actor_sched, self.config.actor_lr)  # a resume may change it
        if self.critic is not None and self.critic_optim is not None and self.critic_sched is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_optim.load_state_dict(state["critic_optim"])
            self.critic_sched.load_state_dict(state["critic_sched"])
            set_peak_lr(self.critic_optim, self.critic_sched, self.config.critic_lr)


class GradientSync(Protocol):
    """How the data-parallel ranks' gradients of one optimizer step are summed over its micro-batches."""

    def align(
        self, micros: list[TrainBatch], weights: list[float], most: Callable[[], int]
    ) -> tuple[list[TrainBatch], list[float]]:
        """This rank's micro-batches and weights as the passes run them; `most()`: the largest count of any rank
        (worked out on the host when called: a sync that does not pad never pays for it)."""
        ...

    def before_backward(self, last: bool) -> None:
        """Called before each micro-batch's passes; `last`: its backward finishes the step's gradients."""
        ...

    def finish(self) -> None:
        """After the last backward: launch every reduction not launched yet."""
        ...

    def wait(self) -> None:
        """Complete the reductions: every gradient is the sum over the ranks."""
        ...


class BucketedAllReduce:
    """Whole replicas on every rank (`pipeline=plain` data parallel): the gradients summed in buckets, each
    launched as soon as its gradients are final in the last backward (`GradReducer`)."""

    def __init__(self, reducer: GradReducer) -> None:
        self.reducer = reducer

    def align(
        self, micros: list[TrainBatch], weights: list[float], most: Callable[[], int]
    ) -> tuple[list[TrainBatch], list[float]]:
        return micros, weights

    def before_backward(self, last: bool) -> None:
        if last:
            self.reducer.arm()

    def finish(self) -> None:
        self.reducer.finish()

    def wait(self) -> None:
        self.reducer.wait("data-parallel gradient reduction")


_NORM_NAMES = ("actor/grad_norm", "critic/grad_norm")
_STATE_ORDER = ("actor", "critic", "actor_optim", "critic_optim", "actor_sched", "critic_sched")
