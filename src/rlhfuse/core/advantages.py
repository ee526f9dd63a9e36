"""Step 2 of an iteration: from the rollout's scores, log-probs and values to advantages, per algorithm.

Every algorithm is one entry of the `ALGORITHMS` registry (`algorithm=ppo|grpo|rloo|reinforce_pp`, Hydra group
`conf/algorithm/`): a pure advantage function over `rlhfuse.algorithms`, plus what the algorithm needs of the
trainer (a Critic or not, several samples per prompt or not).

PPO:          r_t = -kl_coef * KL_t  (+ score on the last response token)          (InstructGPT, eq. 2)
              A_t = sum_l (gamma * lam)^l delta_{t+l},  delta_t = r_t + gamma V_{t+1} - V_t   (GAE, Schulman 2016)
GRPO / RLOO:  the outcome o_i = score_i - kl_coef * sum_t KL_t, baselined within the group of samples of the
              same prompt; the same advantage on every token of response i (`grpo_advantages`, `rloo_advantages`)
REINFORCE++:  the PPO token rewards, reward-to-go normalised over the whole batch (`reinforce_pp_advantages`)

Before any of them, DAPO's overlong reward shaping (`algorithm.overlong_buffer`) adds `overlong_penalty` to the
scores. Step 3's policy loss is chosen here too, from the `POLICY_LOSSES` table (`algorithm.policy_loss=ppo|cispo`,
with `ratio_level`, the clip range and `loss_agg`: `LOSS_AGGREGATIONS`), so that every algorithm trains with any
of them (docs/algorithms.md, "Policy losses").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from rlhfuse.algorithms import (
    PolicyLossStats,
    cispo_policy_loss,
    compute_gae,
    grpo_advantages,
    kl_estimate,
    kl_penalty_rewards,
    masked_mean,
    overlong_penalty,
    ppo_policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_to_tokens,
    whiten,
    zero_std_fraction,
)
from rlhfuse.algorithms.off_policy import OFF_POLICY_CORRECTIONS
from rlhfuse.core.algorithm_config import LOSS_AGGREGATIONS as LOSS_AGGREGATIONS  # importable from here too
from rlhfuse.core.algorithm_config import RENAMED_KEYS as RENAMED_KEYS
from rlhfuse.core.algorithm_config import AlgorithmConfig as AlgorithmConfig
from rlhfuse.core.algorithm_config import LossAgg as LossAgg
from rlhfuse.core.algorithm_config import LossAggregation as LossAggregation
from rlhfuse.core.registry import Registry
from rlhfuse.core.types import Experience, TrainBatch


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


PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, AlgorithmConfig], tuple[Tensor, PolicyLossStats]]
"""(logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, config) -> (loss, stats), reduced by `config.loss_agg`."""


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss (`algorithm.policy_loss`): its function, and whether it is a clipped surrogate a
    dual clip can bound."""

    loss: PolicyLossFn
    dual_clip: bool = False


def _shared_keys(config: AlgorithmConfig) -> dict[str, Any]:
    """The keys every policy loss reads: the clip range, the ratio's level and the aggregation."""
    return dict(
        clip_eps=config.clip_eps_low,
        clip_eps_high=config.clip_eps_high,
        ratio_level=config.ratio_level,
        reduction=config.loss_reduction,
        constant_length=config.constant_length,
    )


def clipped_surrogate(
    logprobs_BR: Tensor,
    old_logprobs_BR: Tensor,
    advantages_BR: Tensor,
    mask_BR: Tensor,
    config: AlgorithmConfig,
) -> tuple[Tensor, PolicyLossStats]:
    """PPO's clipped surrogate (`ppo_policy_loss`): DAPO with clip_eps_high, GSPO with ratio_level=sequence."""
    return ppo_policy_loss(
        logprobs_BR,
        old_logprobs_BR,
        advantages_BR,
        mask_BR,
        dual_clip=config.dual_clip,
        **_shared_keys(config),
    )


def clipped_weight(
    logprobs_BR: Tensor,
    old_logprobs_BR: Tensor,
    advantages_BR: Tensor,
    mask_BR: Tensor,
    config: AlgorithmConfig,
) -> tuple[Tensor, PolicyLossStats]:
    """CISPO's clipped, detached importance weight on every token's log-prob (`cispo_policy_loss`)."""
    return cispo_policy_loss(logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, **_shared_keys(config))


# The registry table of algorithm.policy_loss (its Literal lists the same names).
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": PolicyLoss(clipped_surrogate, dual_clip=True),
    "cispo": PolicyLoss(clipped_weight),
}


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


def _behaviour_logprobs(experience: Experience, config: AlgorithmConfig) -> Tensor | None:
    """The sampler's log-probs the loss corrects with (algorithm.off_policy_correction), None when it does not."""
    if not OFF_POLICY_CORRECTIONS[config.off_policy_correction].corrects:
        return None
    sampled_BR = experience.rollout.sampler_logprobs_BR
    if sampled_BR is None:
        raise ValueError(
            f"algorithm.off_policy_correction={config.off_policy_correction} needs the sampler's log-probs, which "
            "this generator did not record (generator=vllm records none with top-k / top-p at a temperature "
            "other than 1): set algorithm.off_policy_correction=none, or sample without top-k / top-p"
        )
    return sampled_BR.to(experience.logprobs_BR.device)


def compute_train_batch(
    experience: Experience, config: AlgorithmConfig, *, max_new_tokens: int | None = None
) -> tuple[TrainBatch, dict[str, float]]:
    """Rewards, KL and the configured algorithm's advantages for one iteration's experience; returns the
    training batch and statistics (value/* only for an algorithm with a Critic; reward/overlong_fraction only
    with overlong shaping, which needs the response length limit `max_new_tokens`)."""
    algorithm = algorithm_of(config)
    rollout = experience.rollout
    # the model's own tokens (not a multi-turn episode's environment's)
    mask_BR = rollout.loss_mask_BR.float()
    kl_BR = (
        kl_estimate(experience.logprobs_BR, experience.ref_logprobs_BR, kind=config.kl_estimator) * mask_BR
    )
    scored = experience
    shaping: dict[str, float] = {}
    if config.overlong_buffer > 0:
        if max_new_tokens is None:
            raise ValueError("algorithm.overlong_buffer > 0 needs compute_train_batch(max_new_tokens=...)")
        buffer = config.overlong_tokens(max_new_tokens)
        penalty_B = overlong_penalty(
            rollout.response_lengths_B, max_new_tokens, buffer, config.overlong_penalty
        ).to(experience.scores_B.device)
        scored = dataclasses.replace(experience, scores_B=experience.scores_B + penalty_B)
        shaping["reward/overlong_fraction"] = float(
            (rollout.response_lengths_B > max_new_tokens - buffer).float().mean()
        )
    advantages_BR, returns_BR, rewards_BR = algorithm.advantages(scored, kl_BR, mask_BR, config)
    batch = TrainBatch(
        input_ids_BT=rollout.input_ids_BT,
        attention_mask_BT=rollout.attention_mask_BT,
        response_mask_BR=mask_BR,
        old_logprobs_BR=experience.logprobs_BR,
        old_values_BR=experience.values_BR,
        advantages_BR=advantages_BR.detach(),
        returns_BR=returns_BR.detach(),
        ref_logprobs_BR=experience.ref_logprobs_BR if config.kl_loss_coef > 0 else None,
        behaviour_logprobs_BR=_behaviour_logprobs(experience, config),
    )
    stats = {
        "kl/mean": float(masked_mean(kl_BR, mask_BR)),
        "kl/seq_mean": float((kl_BR * mask_BR).sum(dim=1).mean()),
        "reward/mean": float(experience.scores_B.mean()),
        "reward/std": float(experience.scores_B.std()) if len(experience) > 1 else 0.0,
        "reward/with_kl_mean": float((rewards_BR * mask_BR).sum(dim=1).mean()),
        **shaping,
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
