"""Training stage without pipelines: Actor (PPO clipped loss) and Critic (clipped value loss) updates.

One `train_step` is one optimizer step of each model on one mini-batch, accumulated over micro-batches
(by samples, or packed up to a token budget). Precision and backward go through Lightning Fabric's precision
plugin (bf16 autocast on GPU, fp32 on CPU).

Data-parallel over a process group (`generator.instances=N`: one rank per generation instance, each holding a
full Actor and Critic): every rank receives the same mini-batch, keeps its share (Karmarkar-Karp by sequence
cost, the same split on every rank), weights each micro-batch by its share of the *whole* mini-batch's tokens
(or samples) and all-reduces (sums) the gradients, so every rank steps with the gradient of the whole mini-batch
— the single-process update up to floating-point reassociation. Identical gradients and optimizer states keep the
weights identical on every rank: the Actor copy each rank generates with is in sync without any broadcast.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import Tensor

from rlhfuse.models import Transformer
from rlhfuse.trainer import losses
from rlhfuse.trainer.advantages import AlgorithmConfig
from rlhfuse.trainer.types import TrainBatch


class NonFiniteError(FloatingPointError):
    """A loss or gradient norm became NaN/inf; raised before the optimizer step, so weights stay finite."""


@dataclass
class StrategyConfig:
    # Registered strategy name: plain (single process, Actor then Critic, no pipeline).
    name: str = "plain"
    # Peak learning rates (AdamW).
    actor_lr: float = 5e-4
    critic_lr: float = 5e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    # Linear warmup from 0 over this many optimizer steps, then the schedule: constant | linear | cosine.
    warmup_steps: int = 4
    lr_schedule: str = "cosine"
    # Floor of the linear/cosine decay, as a fraction of the peak LR.
    min_lr_ratio: float = 0.1
    # Clip each model's gradient norm to this value (0 = off).
    grad_clip: float = 1.0
    # auto (bf16-mixed on CUDA, 32-true on CPU) | 32-true | bf16-mixed.
    precision: str = "auto"


def lr_lambda(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def build_optimizer(
    params: Any, lr: float, config: StrategyConfig, total_steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `params` at peak `lr`, with the config's warmup + decay schedule over `total_steps`."""
    optim = torch.optim.AdamW(
        params, lr=lr, betas=(config.betas[0], config.betas[1]), weight_decay=config.weight_decay
    )

    def schedule(step: int) -> float:
        return lr_lambda(
            step,
            warmup=config.warmup_steps,
            total=total_steps,
            schedule=config.lr_schedule,
            min_ratio=config.min_lr_ratio,
        )

    return optim, torch.optim.lr_scheduler.LambdaLR(optim, schedule)


def micro_batches(batch: TrainBatch, *, samples: int, tokens: int) -> list[TrainBatch]:
    """Split a mini-batch by sample count, or greedily pack consecutive samples up to a token budget."""
    if tokens <= 0:
        return [
            batch.select(torch.arange(s, min(s + samples, len(batch)))) for s in range(0, len(batch), samples)
        ]
    lengths = batch.attention_mask_BT.sum(dim=1).tolist()
    groups: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if groups[-1] and used + n > tokens:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return [batch.select(torch.tensor(g)) for g in groups]


class PlainStrategy:
    def __init__(
        self,
        actor: Transformer,
        critic: Transformer,
        config: StrategyConfig,
        algorithm: AlgorithmConfig,
        *,
        fabric: Fabric,
        total_steps: int,
        micro_batch_size: int,
        micro_batch_tokens: int = 0,
        temperature: float = 1.0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.actor, self.critic = actor, critic
        # data-parallel ranks (None = this process alone trains on every sample)
        self.group = group
        self.config, self.algorithm = config, algorithm
        self.fabric = fabric
        self.micro_batch_size, self.micro_batch_tokens = micro_batch_size, micro_batch_tokens
        self.temperature = temperature if temperature > 0 else 1.0
        self.actor_optim, self.actor_sched = build_optimizer(
            actor.parameters(), config.actor_lr, config, total_steps
        )
        self.critic_optim, self.critic_sched = build_optimizer(
            critic.parameters(), config.critic_lr, config, total_steps
        )

    def actor_weights(self) -> Mapping[str, Tensor]:
        return self.actor.state_dict()

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        self.actor.train(), self.critic.train()
        total_tokens = float(batch.response_mask_BR.sum().clamp(min=1))
        sums: dict[str, float] = {}
        failure: str | None = None
        for micro in micro_batches(
            self.share(batch), samples=self.micro_batch_size, tokens=self.micro_batch_tokens
        ):
            weight = self._weight(micro, batch, total_tokens)
            stats, failure = self._micro_step(micro, weight)
            if failure is not None:
                break
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value * weight
        if self.group is not None:
            # every rank learns of a non-finite loss on any rank here, so all raise together (none waits)
            sums, failure = self._all_reduce(sums, failure)
        if failure is not None:
            self.actor_optim.zero_grad(set_to_none=True)
            self.critic_optim.zero_grad(set_to_none=True)
            raise NonFiniteError(failure)
        # Both norms are checked before either model steps: a NaN never reaches the weights.
        stats = {
            "actor/grad_norm": self._clip(self.actor, self.actor_optim, "actor/grad_norm"),
            "critic/grad_norm": self._clip(self.critic, self.critic_optim, "critic/grad_norm"),
        }
        for optim, sched in ((self.actor_optim, self.actor_sched), (self.critic_optim, self.critic_sched)):
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
        return {**sums, **stats, "lr": float(self.actor_sched.get_last_lr()[0])}

    def share(self, batch: TrainBatch) -> TrainBatch:
        """This rank's samples of the mini-batch: parts of near-equal cost (tokens + attention), the same
        partition on every rank; the whole batch in a single process."""
        if self.group is None:
            return batch
        from rlhfuse.runtime.balance import karmarkar_karp, sample_costs  # (runtime imports this module)

        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if len(batch) < world:
            raise ValueError(
                f"a mini-batch of {len(batch)} samples cannot give each of {world} data-parallel ranks a "
                f"sample: raise data.mini_batch_size to >= {world}"
            )
        costs = sample_costs(batch.attention_mask_BT.sum(dim=1).tolist())
        return batch.select(torch.tensor(karmarkar_karp(costs, world)[rank]))

    def _all_reduce(self, sums: dict[str, float], failure: str | None) -> tuple[dict[str, float], str | None]:
        """Sum gradients and weighted statistics over the ranks (each is already its share of the mini-batch);
        first agree on whether any rank saw a non-finite loss (then nothing else is exchanged)."""
        failed = torch.tensor([float(failure is not None)], dtype=torch.float64)
        dist.all_reduce(failed, group=self.group)
        if failed.item() > 0:
            return sums, failure or "a loss is non-finite on another data-parallel rank"
        params = [p for model in (self.actor, self.critic) for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for dtype in sorted({p.dtype for p in params}, key=str):  # one flat buffer per dtype
            same = [p for p in params if p.dtype == dtype]
            flat = torch.cat([p.grad.reshape(-1) for p in same if p.grad is not None])
            dist.all_reduce(flat, group=self.group)
            for p, chunk in zip(same, flat.split([p.numel() for p in same]), strict=True):
                assert p.grad is not None
                p.grad.copy_(chunk.view_as(p))
        keys = sorted(sums)  # every rank ran >= 1 micro-batch, hence the same keys
        values = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(values, group=self.group)
        return dict(zip(keys, values.tolist(), strict=True)), None

    def _weight(self, micro: TrainBatch, batch: TrainBatch, total_tokens: float) -> float:
        # Token-mean losses over the whole mini-batch: weight each micro-batch by its share of response tokens.
        if self.algorithm.loss_reduction == "token":
            return float(micro.response_mask_BR.sum()) / total_tokens
        return len(micro) / len(batch)

    def _micro_step(self, micro: TrainBatch, weight: float) -> tuple[dict[str, float], str | None]:
        """Forward and backward of one micro-batch: its statistics, or the non-finite loss (no backward)."""
        device = next(self.actor.parameters()).device
        micro = TrainBatch(**{k: v.to(device) for k, v in vars(micro).items()})
        with self.fabric.autocast():
            logits_BTV = self.actor(micro.input_ids_BT, attention_mask_BT=micro.attention_mask_BT)
            values_BT = self.critic(micro.input_ids_BT, attention_mask_BT=micro.attention_mask_BT)
        policy_loss, policy_stats = losses.actor_loss(logits_BTV, micro, self.algorithm, self.temperature)
        critic_loss, critic_stats = losses.critic_loss(values_BT, micro, self.algorithm)
        for name, value in (("loss/policy", policy_loss), ("loss/value", critic_loss)):
            if not torch.isfinite(value):
                return {}, f"{name} is {float(value.detach())}"
        self.fabric.backward(policy_loss * weight)
        self.fabric.backward(critic_loss * weight)
        return {**policy_stats, **critic_stats}, None

    def _clip(self, model: torch.nn.Module, optim: torch.optim.Optimizer, name: str) -> float:
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        if not math.isfinite(norm):
            self.actor_optim.zero_grad(set_to_none=True)
            self.critic_optim.zero_grad(set_to_none=True)
            raise NonFiniteError(f"{name} is {norm}")
        return norm

    def state_dict(self) -> dict[str, Any]:
        return {
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict(),
            "actor_optim": self.actor_optim.state_dict(),
            "critic_optim": self.critic_optim.state_dict(),
            "actor_sched": self.actor_sched.state_dict(),
            "critic_sched": self.critic_sched.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        self.actor_optim.load_state_dict(state["actor_optim"])
        self.critic_optim.load_state_dict(state["critic_optim"])
        self.actor_sched.load_state_dict(state["actor_sched"])
        self.critic_sched.load_state_dict(state["critic_sched"])
