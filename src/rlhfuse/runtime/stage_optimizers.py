"""The optimizers of a pipeline rank: AdamW with its LR schedule per model, over the trained parameters of the
stages placed on this rank (`RankStages.parameters`; a LoRA Actor's adapters only); `step` is what the
executor's OPTIMIZER_STEP calls."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from rlhfuse.core.errors import NonFiniteError
from rlhfuse.core.optim import OptimConfig, build_optimizer, set_peak_lr
from rlhfuse.models.lora import trainable
from rlhfuse.runtime.partition import RankStages


class StageOptimizers:
    def __init__(self, stages: RankStages, config: OptimConfig, total_steps: int) -> None:
        self.stages, self.grad_clip = stages, config.grad_clip
        # peak learning rates; they replace a loaded checkpoint's (a resume may change them)
        self.lrs = {"actor": config.actor_lr, "critic": config.critic_lr}
        self.optims: dict[str, torch.optim.Optimizer] = {}
        self.scheds: dict[str, torch.optim.lr_scheduler.LambdaLR] = {}
        self.models = stages.layout.trained  # no Critic optimizer for a critic-free algorithm
        for m in self.models:
            self.optims[m], self.scheds[m] = build_optimizer(
                trainable(stages.parameters(m)), self.lrs[m], config, total_steps
            )

    @property
    def lr(self) -> float:
        """The Actor's current learning rate."""
        return float(self.scheds["actor"].get_last_lr()[0])

    def step(self, model: str, norm: float) -> None:
        """Clip `model`'s gradients to the global norm `norm` (the same on every rank) and step; a non-finite
        norm drops every gradient and raises before any weight changes."""
        if not math.isfinite(norm):
            for optim in self.optims.values():
                optim.zero_grad(set_to_none=True)
            raise NonFiniteError(f"{model}/grad_norm is {norm}")
        if self.grad_clip > 0:
            coef = min(1.0, self.grad_clip / (norm + 1e-6))
            if coef < 1.0:
                for p in self.stages.parameters(model):
                    if p.grad is not None:
                        p.grad.mul_(coef)
        self.optims[model].step()
        self.scheds[model].step()
        self.optims[model].zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {
            **{f"{m}_optim": self.optims[m].state_dict() for m in self.models},
            **{f"{m}_sched": self.scheds[m].state_dict() for m in self.models},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for m in self.models:
            self.optims[m].load_state_dict(state[f"{m}_optim"])
            self.scheds[m].load_state_dict(state[f"{m}_sched"])
            set_peak_lr(self.optims[m], self.scheds[m], self.lrs[m])
