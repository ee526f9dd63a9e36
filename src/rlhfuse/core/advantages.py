"""Step 2 of an iteration: from the rollout's scores, log-probs and values to advantages, per algorithm.

Every algorithm is one entry of the `ALGORITHMS` registry (`algorithm=ppo|grpo|rloo|reinforce_pp`, Hydra group
`conf/algorithm/`): a pure advantage function over `rlhfuse.algorithms`, plus what the algorithm needs of the
trainer (a Critic or not, several samples per prompt or not).

PPO:          r_t = -kl_coef * KL_t  (+ score on the last response token)          (InstructGPT, eq. 2)
              A_t = sum_l (gamma * lam)^l delta_{t+l},  delta_t = r_t + gamma V_{t+1} - V_t   (GAE, Schulman 2016)
GRPO / RLOO:  the outcome o_i = score_i - kl_coef * sum_t KL_t, baselined within the group of samples of the
              same prompt; the same advantage on every token of response i (`grpo_advantages`, `rloo_advantages`)
REINFORCE++:  the PPO token rewards, reward-to-go normalised over the whole batch (`reinforce_pp_advantages`)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from rlhfuse.algorithms import (
    compute_gae,
    grpo_advantages,
    kl_estimate,
    kl_penalty_rewards,
    masked_mean,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_to_tokens,
    whiten,
    zero_std_fraction,
)
from rlhfuse.core.config_checks import choice_problems, need, non_negative, positive
from rlhfuse.core.registry import Registry
from rlhfuse.core.types import Experience, TrainBatch


@dataclass
class AlgorithmConfig:
    # Registered algorithm (ALGORITHMS): ppo | grpo | rloo | reinforce_pp (or your own 'package.module:name'
    # holding an `Algorithm`). grpo / rloo need data.samples_per_prompt >= 2; all but ppo train no Critic.
    name: str = "ppo"
    # Passes over each iteration's samples.
    ppo_epochs: int = 2
    # Discount (GAE for ppo; the reward-to-go of reinforce_pp) and GAE lambda (ppo only).
    gamma: float = 1.0
    lam: float = 0.95
    # KL to the Ref model in the reward: per-token penalty coefficient (0 = none) and estimator k1 | k2 | k3.
    # grpo / rloo subtract it from the outcome (kl_coef * sum_t KL_t) before the group baseline.
    kl_coef: float = 0.05
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    # KL to the Ref model as a loss term instead (or as well): coefficient (0 = off) and estimator (k3 is
    # common), reduced over tokens like the policy loss; logged as loss/kl when on.
    kl_loss_coef: float = 0.0
    kl_loss_estimator: Literal["k1", "k2", "k3"] = "k3"
    # Ratio clip, optional asymmetric upper clip (clip-higher, null = same as clip_eps) and dual clip (null =
    # off); every algorithm trains with this clipped surrogate.
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    # Critic value clip around the old values (ppo only).
    value_clip_eps: float = 0.2
    # Normalise advantages to zero mean / unit variance over the iteration's response tokens (ppo only; the
    # other algorithms normalise by their own rule).
    whiten_advantages: bool = True
    # grpo: divide by the group's standard deviation (false = Dr. GRPO, mean-centred only).
    std_norm: bool = True
    # Loss reduction: token (mean over all tokens of the mini-batch) | sequence (mean of per-sequence means) |
    # sequence_sum (each sequence's token sum over a constant length, mean over sequences: Dr. GRPO).
    loss_reduction: Literal["token", "sequence", "sequence_sum"] = "token"
    # The constant length of loss_reduction=sequence_sum, in tokens (0 = generator.max_new_tokens).
    loss_constant_length: int = 0
    # Entropy bonus coefficient (0 = off).
    entropy_coef: float = 0.0

    def problems(self) -> list[str]:
        problems = choice_problems(self, "algorithm")
        need(problems, self.name in ALGORITHMS, ALGORITHMS.unknown_message(self.name))
        positive(problems, "algorithm.ppo_epochs", self.ppo_epochs)
        need(problems, 0 < self.gamma <= 1, f"algorithm.gamma={self.gamma} must be in (0, 1]")
        need(problems, 0 <= self.lam <= 1, f"algorithm.lam={self.lam} must be in [0, 1]")
        non_negative(problems, "algorithm.kl_coef", self.kl_coef, "0 = no KL penalty")
        non_negative(problems, "algorithm.kl_loss_coef", self.kl_loss_coef, "0 = no KL loss term")
        non_negative(
            problems,
            "algorithm.loss_constant_length",
            self.loss_constant_length,
            "0 = generator.max_new_tokens",
        )
        positive(problems, "algorithm.clip_eps", self.clip_eps)
        need(
            problems,
            self.clip_eps_high is None or self.clip_eps_high >= 0,
            f"algorithm.clip_eps_high={self.clip_eps_high} must be >= 0 or null (= algorithm.clip_eps)",
        )
        need(
            problems,
            self.dual_clip is None or self.dual_clip > 1,
            f"algorithm.dual_clip={self.dual_clip} must be > 1 (typically 3) or null",
        )
        return problems


class Advantages(NamedTuple):
    """An algorithm's output over one iteration's samples, float32 [B, R], 0 at padding: the advantages the
    policy loss weighs, the returns (the Critic's targets for ppo; the baselined quantity for the others) and
    the token rewards including any KL penalty (the reward/with_kl_mean statistic)."""

    advantages_BR: Tensor
    returns_BR: Tensor
    rewards_BR: Tensor


AdvantageFn = Callable[[Experience, Tensor, Tensor, AlgorithmConfig], Advantages]
"""(experience, kl_BR, mask_BR, config) -> Advantages; kl_BR is the per-token KL estimate, 0 at padding."""


@dataclass(frozen=True)
class Algorithm:
    """A registered algorithm: its advantage function, whether it trains a Critic, and the fewest samples per
    prompt it needs (2 for a group baseline)."""

    advantages: AdvantageFn
    uses_critic: bool
    min_samples_per_prompt: int = 1


def ppo_advantages(
    experience: Experience, kl_BR: Tensor, mask_BR: Tensor, config: AlgorithmConfig
) -> Advantages:
    """PPO: KL-shaped token rewards, GAE over the Critic's values, optionally whitened."""
    rewards_BR = kl_penalty_rewards(experience.scores_B, kl_BR, mask_BR, config.kl_coef)
    advantages_BR, returns_BR = compute_gae(
        rewards_BR, experience.values_BR, mask_BR, config.gamma, config.lam
    )
    if config.whiten_advantages:
        advantages_BR = whiten(advantages_BR, mask_BR) * mask_BR
    return Advantages(advantages_BR, returns_BR, rewards_BR)


def grpo(experience: Experience, kl_BR: Tensor, mask_BR: Tensor, config: AlgorithmConfig) -> Advantages:
    """GRPO (Dr. GRPO with std_norm=false): the group-normalised outcome on every token of the response."""
    rewards_BR = kl_penalty_rewards(experience.scores_B, kl_BR, mask_BR, config.kl_coef)
    outcome_B = rewards_BR.sum(dim=1)
    advantages_B = grpo_advantages(outcome_B, experience.rollout.prompt_index_B, std_norm=config.std_norm)
    return Advantages(
        sequence_to_tokens(advantages_B, mask_BR), sequence_to_tokens(outcome_B, mask_BR), rewards_BR
    )


def rloo(experience: Experience, kl_BR: Tensor, mask_BR: Tensor, config: AlgorithmConfig) -> Advantages:
    """RLOO: the outcome minus the mean outcome of the prompt's other samples, on every token."""
    rewards_BR = kl_penalty_rewards(experience.scores_B, kl_BR, mask_BR, config.kl_coef)
    outcome_B = rewards_BR.sum(dim=1)
    advantages_B = rloo_advantages(outcome_B, experience.rollout.prompt_index_B)
    return Advantages(
        sequence_to_tokens(advantages_B, mask_BR), sequence_to_tokens(outcome_B, mask_BR), rewards_BR
    )


def reinforce_pp(
    experience: Experience, kl_BR: Tensor, mask_BR: Tensor, config: AlgorithmConfig
) -> Advantages:
    """REINFORCE++: KL-shaped token rewards, reward-to-go normalised over the batch."""
    rewards_BR = kl_penalty_rewards(experience.scores_B, kl_BR, mask_BR, config.kl_coef)
    advantages_BR, returns_BR = reinforce_pp_advantages(rewards_BR, mask_BR, config.gamma)
    return Advantages(advantages_BR, returns_BR, rewards_BR)


# The registry table: every name algorithm.name may take (one YAML each in conf/algorithm/).
ALGORITHMS: Registry[Algorithm] = Registry(
    "algorithm",
    "algorithm.name",
    {
        "ppo": Algorithm(ppo_advantages, uses_critic=True),
        "grpo": Algorithm(grpo, uses_critic=False, min_samples_per_prompt=2),
        "rloo": Algorithm(rloo, uses_critic=False, min_samples_per_prompt=2),
        "reinforce_pp": Algorithm(reinforce_pp, uses_critic=False),
    },
)


def algorithm_of(config: AlgorithmConfig) -> Algorithm:
    """The registered `Algorithm` that `config.name` selects (an unknown name is a config problem first)."""
    found = ALGORITHMS.get(config.name)
    if not isinstance(found, Algorithm):
        raise KeyError(
            f"algorithm.name={config.name!r} names {type(found).__name__}, not an rlhfuse Algorithm"
        )
    return found


def uses_critic(config: AlgorithmConfig) -> bool:
    """Whether the configured algorithm trains a Critic (then the trainer builds, infers, trains and saves one)."""
    return algorithm_of(config).uses_critic


def compute_train_batch(
    experience: Experience, config: AlgorithmConfig
) -> tuple[TrainBatch, dict[str, float]]:
    """Rewards, KL and the configured algorithm's advantages for one iteration's experience; returns the
    training batch and statistics (value/* only for an algorithm with a Critic)."""
    algorithm = algorithm_of(config)
    rollout = experience.rollout
    mask_BR = rollout.response_mask_BR.float()
    kl_BR = (
        kl_estimate(experience.logprobs_BR, experience.ref_logprobs_BR, kind=config.kl_estimator) * mask_BR
    )
    advantages_BR, returns_BR, rewards_BR = algorithm.advantages(experience, kl_BR, mask_BR, config)
    batch = TrainBatch(
        input_ids_BT=rollout.input_ids_BT,
        attention_mask_BT=rollout.attention_mask_BT,
        response_mask_BR=mask_BR,
        old_logprobs_BR=experience.logprobs_BR,
        old_values_BR=experience.values_BR,
        advantages_BR=advantages_BR.detach(),
        returns_BR=returns_BR.detach(),
        ref_logprobs_BR=experience.ref_logprobs_BR if config.kl_loss_coef > 0 else None,
    )
    stats = {
        "kl/mean": float(masked_mean(kl_BR, mask_BR)),
        "kl/seq_mean": float((kl_BR * mask_BR).sum(dim=1).mean()),
        "reward/mean": float(experience.scores_B.mean()),
        "reward/std": float(experience.scores_B.std()) if len(experience) > 1 else 0.0,
        "reward/with_kl_mean": float((rewards_BR * mask_BR).sum(dim=1).mean()),
    }
    if (
        algorithm.min_samples_per_prompt > 1
    ):  # a group baseline: groups whose samples all scored alike train nothing
        stats["reward/zero_std_groups"] = zero_std_fraction(experience.scores_B, rollout.prompt_index_B)
    if algorithm.uses_critic:
        stats["value/mean"] = float(masked_mean(experience.values_BR, mask_BR))
        stats["value/explained_variance"] = _explained_variance(experience.values_BR, returns_BR, mask_BR)
    return batch, stats


def _explained_variance(values_BR: torch.Tensor, returns_BR: torch.Tensor, mask_BR: torch.Tensor) -> float:
    residual_var = masked_mean(
        (returns_BR - values_BR - masked_mean(returns_BR - values_BR, mask_BR)) ** 2, mask_BR
    )
    returns_var = masked_mean((returns_BR - masked_mean(returns_BR, mask_BR)) ** 2, mask_BR)
    return float(1.0 - residual_var / returns_var) if float(returns_var) > 0 else 0.0
