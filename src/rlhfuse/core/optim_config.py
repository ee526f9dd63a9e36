"""The optimizer settings of every training strategy (`rlhfuse.core.optim` builds the optimizers). No torch, so
that the command line composes the configuration without it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from rlhfuse.core.config_checks import choice_problems, need, non_negative

if TYPE_CHECKING:
    import torch


@dataclass
class OptimConfig:
    """The optimizer settings of every training strategy (keys `pipeline.*`, composed into `PipelineConfig`)."""

    # Peak learning rates (AdamW).
    actor_lr: float = 5e-4
    critic_lr: float = 5e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    # Linear warmup from 0 over this many optimizer steps, then the schedule: constant | linear | cosine.
    warmup_steps: int = 4
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    # Floor of the linear/cosine decay, as a fraction of the peak LR.
    min_lr_ratio: float = 0.1
    # Clip each model's gradient norm to this value (0 = off).
    grad_clip: float = 1.0
    # Data-parallel gradient reduction: buckets of this many MiB, each all-reduced asynchronously as soon as its
    # gradients are final in the last micro-batch's backward (rlhfuse.distributed.grad_buckets; DDP's bucket_cap_mb).
    grad_bucket_mb: float = 25.0
    # The weight sync into the generator streams the Actor in buckets of this many MiB (whole tensors, a larger
    # one alone): each is gathered or resharded, loaded by the generator and freed before the next, so a sync
    # holds one bucket beside the models, not a whole Actor (`Strategy.actor_weight_buckets`).
    weight_sync_bucket_mb: float = 256.0
    # auto (bf16-mixed on CUDA, 32-true on CPU) | 32-true | bf16-mixed (fp32 weights and optimizer states,
    # bf16 autocast of training and inference compute, generation in a bf16 copy with a bf16 KV cache) |
    # bf16-true (bf16 weights in every model, the generator's too; the optimizer steps fp32 master copies with
    # fp32 states and writes the rounded weights back). `resolve_precision`, `generation_dtype`.
    precision: Literal["auto", "32-true", "bf16-mixed", "bf16-true"] = "auto"
    # What a training forward keeps for backward: none | full (each layer recomputed in backward: activation
    # memory ~1/layers) | selective (attention kernels and MLPs recomputed; projections and norms kept).
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    # A mixture-of-experts Actor's load-balancing loss (Switch Transformer's, as transformers computes it) is added
    # to its loss with this weight (0 = off; checkpoints suggest one in config.json's router_aux_loss_coef, e.g.
    # 0.001). pipeline=plain only; logged as loss/router_aux.
    router_aux_loss_coef: float = 0.0

    def problems(self) -> list[str]:
        problems = choice_problems(self, "pipeline")
        need(
            problems,
            math.isfinite(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0,
            f"pipeline.router_aux_loss_coef={self.router_aux_loss_coef} must be a finite number >= 0 (0 = off)",
        )
        for key in ("actor_lr", "critic_lr"):
            value = getattr(self, key)
            need(
                problems,
                math.isfinite(value) and value > 0,
                f"pipeline.{key}={value} must be a finite number > 0, e.g. pipeline.{key}=1e-5",
            )
        need(
            problems,
            len(self.betas) == 2 and all(math.isfinite(b) and 0 <= b < 1 for b in self.betas),
            f"pipeline.betas={self.betas} must be two numbers in [0, 1), e.g. pipeline.betas=[0.9,0.95]",
        )
        need(
            problems,
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            f"pipeline.weight_decay={self.weight_decay} must be a finite number >= 0 (0 = off)",
        )
        need(
            problems,
            math.isfinite(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1,
            f"pipeline.min_lr_ratio={self.min_lr_ratio} must be in [0, 1] (a fraction of the peak LR)",
        )
        non_negative(problems, "pipeline.warmup_steps", self.warmup_steps, "0 = no warmup")
        need(
            problems,
            math.isfinite(self.grad_clip) and self.grad_clip >= 0,
            f"pipeline.grad_clip={self.grad_clip} must be a finite number >= 0 (0 = off)",
        )
        need(
            problems,
            math.isfinite(self.grad_bucket_mb) and self.grad_bucket_mb > 0,
            f"pipeline.grad_bucket_mb={self.grad_bucket_mb} must be a number > 0 (MiB per gradient bucket, e.g. 25)",
        )
        need(
            problems,
            math.isfinite(self.weight_sync_bucket_mb) and self.weight_sync_bucket_mb > 0,
            f"pipeline.weight_sync_bucket_mb={self.weight_sync_bucket_mb} must be a number > 0 (MiB per weight-sync "
            "bucket, e.g. 256)",
        )
        return problems

    @property
    def weight_sync_bucket_bytes(self) -> int:
        return max(1, int(self.weight_sync_bucket_mb * (1 << 20)))

    def weight_sync_dtype(self, device_type: str) -> torch.dtype | None:
        """What a weight sync that moves tensors between ranks sends floating-point weights in on `device_type`:
        bf16 for a bf16 generator (`generation_dtype`; under bf16-mixed half the bytes of the fp32 training
        weights), None (as trained) otherwise."""
        from rlhfuse.core.optim import LOW_PRECISION, generation_dtype, resolve_precision  # torch's dtypes

        dtype = generation_dtype(resolve_precision(self.precision, device_type))
        return dtype if dtype in LOW_PRECISION else None
