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
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from rlhfuse.algorithms import (
    PolicyLossStats,
    RatioLevel,
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
from rlhfuse.core.config_checks import choice_problems, need, non_negative, positive
from rlhfuse.core.registry import Registry
from rlhfuse.core.types import Experience, TrainBatch

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
"""`algorithm.loss_agg`: how a mini-batch's per-token losses become one loss (`LOSS_AGGREGATIONS`)."""


class LossAggregation(NamedTuple):
    """What a `loss_agg` choice is in `rlhfuse.algorithms.reduce_loss`'s terms: the reduction and, for
    "sequence_sum", the constant length it divides by (0 = `algorithm.loss_constant_length`)."""

    reduction: str
    length: int = 0


LOSS_AGGREGATIONS: dict[str, LossAggregation] = {
    # (1/N)·Σ_b Σ_t l_bt over the N valid tokens (DAPO, Yu et al. 2025, eq. 8)
    "token-mean": LossAggregation("token"),
    # (1/B)·Σ_b (1/|y_b|)·Σ_t l_bt (GRPO, Shao et al. 2024, eq. 3; GSPO)
    "seq-mean-token-mean": LossAggregation("sequence"),
    # (1/B)·Σ_b Σ_t l_bt
    "seq-mean-token-sum": LossAggregation("sequence_sum", 1),
    # (1/B)·Σ_b (1/L)·Σ_t l_bt, L a constant (Dr. GRPO, Liu et al. 2025, eq. 3)
    "seq-mean-token-sum-norm": LossAggregation("sequence_sum"),
}


RENAMED_KEYS: dict[str, tuple[str, dict[str, str]]] = {
    "clip_eps": ("clip_eps_low", {}),
    "loss_reduction": (
        "loss_agg",
        {"token": "token-mean", "sequence": "seq-mean-token-mean", "sequence_sum": "seq-mean-token-sum-norm"},
    ),
}
"""`algorithm.*` keys renamed with the 2026 policy losses: old name -> (new name, old value -> new value). An old
key in an override or a YAML file is refused with one line naming the new key and value
(`rlhfuse.trainer.hydra.unknown_keys`); a run recorded under the old names resumes as the new ones
(`rlhfuse.trainer.resume`)."""


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
    # The policy loss (POLICY_LOSSES), the same for every algorithm: ppo (the clipped surrogate; DAPO and GSPO are
    # it with the keys below) | cispo (MiniMax-M1: the importance weight clipped and detached, every token keeps
    # its gradient).
    policy_loss: Literal["ppo", "cispo"] = "ppo"
    # The importance ratio the loss weighs: token (each token's own, PPO) | sequence (GSPO: the geometric mean of
    # the response's token ratios, the same on each of its tokens).
    ratio_level: RatioLevel = "token"
    # The ratio's clip range [1 - clip_eps_low, 1 + clip_eps_high]; clip_eps_high null = clip_eps_low (symmetric;
    # e.g. 0.28 with 0.2 for DAPO's clip-higher). Dual clip (null = off; ppo only): a bound of dual_clip * |A| on
    # the loss of a token with a negative advantage.
    clip_eps_low: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    # Critic value clip around the old values (ppo only).
    value_clip_eps: float = 0.2
    # Normalise advantages to zero mean / unit variance over the iteration's response tokens (ppo only; the
    # other algorithms normalise by their own rule).
    whiten_advantages: bool = True
    # grpo: divide by the group's standard deviation (false = Dr. GRPO, mean-centred only).
    std_norm: bool = True
    # How the per-token losses of a mini-batch become one (LOSS_AGGREGATIONS): token-mean (over every token:
    # DAPO) | seq-mean-token-mean (each sequence's mean, averaged over sequences: GRPO, GSPO) | seq-mean-token-sum
    # (each sequence's sum, averaged over sequences) | seq-mean-token-sum-norm (each sequence's sum over a constant
    # length, averaged over sequences: Dr. GRPO).
    loss_agg: LossAgg = "token-mean"
    # The constant length of loss_agg=seq-mean-token-sum-norm, in tokens (0 = generator.max_new_tokens).
    loss_constant_length: int = 0
    # DAPO's overlong reward shaping (eq. 13): a response reaching into the last overlong_buffer tokens before
    # generator.max_new_tokens loses up to overlong_penalty of its score, linearly (all of it at the limit).
    # overlong_buffer: tokens (>= 1) or that fraction of generator.max_new_tokens (< 1); 0 = off.
    overlong_buffer: float = 0.0
    overlong_penalty: float = 1.0
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
        positive(problems, "algorithm.clip_eps_low", self.clip_eps_low)
        need(
            problems,
            self.clip_eps_high is None or self.clip_eps_high >= 0,
            f"algorithm.clip_eps_high={self.clip_eps_high} must be >= 0 or null (= algorithm.clip_eps_low)",
        )
        need(
            problems,
            self.dual_clip is None or self.dual_clip > 1,
            f"algorithm.dual_clip={self.dual_clip} must be > 1 (typically 3) or null",
        )
        loss = POLICY_LOSSES.get(self.policy_loss)  # an unknown one is a choice problem above
        need(
            problems,
            self.dual_clip is None or loss is None or loss.dual_clip,
            f"algorithm.dual_clip={self.dual_clip}: algorithm.policy_loss={self.policy_loss} has no clipped "
            "surrogate to bound (it clips the importance weight): set algorithm.dual_clip=null",
        )
        non_negative(problems, "algorithm.overlong_buffer", self.overlong_buffer, "0 = no overlong shaping")
        non_negative(
            problems, "algorithm.overlong_penalty", self.overlong_penalty, "the score lost at the limit"
        )
        return problems

    def overlong_tokens(self, max_new_tokens: int) -> float:
        """`overlong_buffer` in tokens (L_cache): itself from 1 up, else that fraction of `max_new_tokens`."""
        buffer = self.overlong_buffer
        return buffer if buffer >= 1 else buffer * max_new_tokens

    @property
    def loss_reduction(self) -> str:
        """`loss_agg` as `rlhfuse.algorithms.reduce_loss` names it: token | sequence | sequence_sum."""
        return LOSS_AGGREGATIONS[self.loss_agg].reduction

    @property
    def constant_length(self) -> int | None:
        """The length L a "sequence_sum" reduction divides each sequence's sum by: the aggregation's own (1 for
        seq-mean-token-sum), else `loss_constant_length` (None while 0: the trainer resolves it to
        generator.max_new_tokens before validation)."""
        return LOSS_AGGREGATIONS[self.loss_agg].length or self.loss_constant_length or None


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


def compute_train_batch(
    experience: Experience, config: AlgorithmConfig, *, max_new_tokens: int | None = None
) -> tuple[TrainBatch, dict[str, float]]:
    """Rewards, KL and the configured algorithm's advantages for one iteration's experience; returns the
    training batch and statistics (value/* only for an algorithm with a Critic; reward/overlong_fraction only
    with overlong shaping, which needs the response length limit `max_new_tokens`)."""
    algorithm = algorithm_of(config)
    rollout = experience.rollout
    mask_BR = rollout.response_mask_BR.float()
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
