"""Step 2 of an iteration: rewards (score + per-token KL penalty), GAE advantages and returns.

r_t = -kl_coef * KL_t  (+ score on the last response token)          (InstructGPT, eq. 2)
A_t = sum_l (gamma * lam)^l delta_{t+l},  delta_t = r_t + gamma V_{t+1} - V_t   (GAE, Schulman 2016)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rlhfuse.algorithms import compute_gae, kl_estimate, kl_penalty_rewards, masked_mean, whiten
from rlhfuse.core.config import choice_problems, need, non_negative, positive
from rlhfuse.core.types import Experience, TrainBatch


@dataclass
class AlgorithmConfig:
    # Registered algorithm name: ppo.
    name: Literal["ppo"] = "ppo"
    # Passes over each iteration's samples.
    ppo_epochs: int = 2
    # GAE discount and lambda.
    gamma: float = 1.0
    lam: float = 0.95
    # Per-token KL penalty coefficient (0 = no KL penalty) and estimator: k1 | k2 | k3.
    kl_coef: float = 0.05
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    # PPO ratio clip, optional asymmetric upper clip (null = same as clip_eps) and dual clip (null = off).
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    # Critic value clip around the old values.
    value_clip_eps: float = 0.2
    # Normalise advantages to zero mean / unit variance over the iteration's response tokens.
    whiten_advantages: bool = True
    # Loss reduction over tokens: token (mean over all tokens of the mini-batch) | sequence.
    loss_reduction: Literal["token", "sequence"] = "token"
    # Entropy bonus coefficient (0 = off).
    entropy_coef: float = 0.0

    def problems(self) -> list[str]:
        problems = choice_problems(self, "algorithm")
        positive(problems, "algorithm.ppo_epochs", self.ppo_epochs)
        need(problems, 0 < self.gamma <= 1, f"algorithm.gamma={self.gamma} must be in (0, 1]")
        need(problems, 0 <= self.lam <= 1, f"algorithm.lam={self.lam} must be in [0, 1]")
        non_negative(problems, "algorithm.kl_coef", self.kl_coef, "0 = no KL penalty")
        positive(problems, "algorithm.clip_eps", self.clip_eps)
        need(
            problems,
            self.dual_clip is None or self.dual_clip > 1,
            f"algorithm.dual_clip={self.dual_clip} must be > 1 (typically 3) or null",
        )
        return problems


def compute_train_batch(
    experience: Experience, config: AlgorithmConfig
) -> tuple[TrainBatch, dict[str, float]]:
    """Rewards, KL and GAE for one iteration's experience; returns the training batch and statistics."""
    rollout = experience.rollout
    mask_BR = rollout.response_mask_BR.float()
    kl_BR = (
        kl_estimate(experience.logprobs_BR, experience.ref_logprobs_BR, kind=config.kl_estimator) * mask_BR
    )
    rewards_BR = kl_penalty_rewards(experience.scores_B, kl_BR, mask_BR, config.kl_coef)
    advantages_BR, returns_BR = compute_gae(
        rewards_BR, experience.values_BR, mask_BR, config.gamma, config.lam
    )
    if config.whiten_advantages:
        advantages_BR = whiten(advantages_BR, mask_BR) * mask_BR
    batch = TrainBatch(
        input_ids_BT=rollout.input_ids_BT,
        attention_mask_BT=rollout.attention_mask_BT,
        response_mask_BR=mask_BR,
        old_logprobs_BR=experience.logprobs_BR,
        old_values_BR=experience.values_BR,
        advantages_BR=advantages_BR.detach(),
        returns_BR=returns_BR.detach(),
    )
    stats = {
        "kl/mean": float(masked_mean(kl_BR, mask_BR)),
        "kl/seq_mean": float((kl_BR * mask_BR).sum(dim=1).mean()),
        "reward/mean": float(experience.scores_B.mean()),
        "reward/std": float(experience.scores_B.std()) if len(experience) > 1 else 0.0,
        "reward/with_kl_mean": float((rewards_BR * mask_BR).sum(dim=1).mean()),
        "value/mean": float(masked_mean(experience.values_BR, mask_BR)),
        "value/explained_variance": _explained_variance(experience.values_BR, returns_BR, mask_BR),
    }
    return batch, stats


def _explained_variance(values_BR: torch.Tensor, returns_BR: torch.Tensor, mask_BR: torch.Tensor) -> float:
    residual_var = masked_mean(
        (returns_BR - values_BR - masked_mean(returns_BR - values_BR, mask_BR)) ** 2, mask_BR
    )
    returns_var = masked_mean((returns_BR - masked_mean(returns_BR, mask_BR)) ** 2, mask_BR)
    return float(1.0 - residual_var / returns_var) if float(returns_var) > 0 else 0.0
