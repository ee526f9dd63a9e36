"""`algorithm.*`: the RL algorithm and its policy loss (`rlhfuse.core.advantages` holds the registries and
computes them). No torch, so that the command line composes the configuration without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

from rlhfuse.algorithms.choices import OffPolicyCorrection, RatioLevel
from rlhfuse.core.config_checks import choice_problems, need, non_negative, positive

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
    # Correction of the gap between the sampler's policy and the trainer's old log-probs (the sampler's
    # per-token log-probs, `rollout/logprob_abs_diff`; rlhfuse.algorithms.off_policy): auto (tis when generation
    # runs ahead of training, async.max_staleness > 0; none otherwise) | none | tis (truncated
    # importance sampling: each token's loss weighted by min(pi_old / pi_sampler, is_cap)) | token_mask (IcePop:
    # tokens whose ratio is outside [is_low, is_high] leave the loss, the others weighted by it) | sequence_mask
    # (responses whose geometric-mean ratio is outside [is_low, is_high] leave the loss). Logged when on:
    # off_policy/is_weight_mean, off_policy/corrected_fraction.
    off_policy_correction: OffPolicyCorrection = "auto"
    is_cap: float = 2.0
    is_low: float = 0.5
    is_high: float = 2.0

    def problems(self) -> list[str]:
        from rlhfuse.core.advantages import ALGORITHMS, POLICY_LOSSES  # registries of torch functions

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
        need(problems, self.is_cap >= 1, f"algorithm.is_cap={self.is_cap} must be >= 1 (typically 2)")
        need(
            problems,
            0 <= self.is_low <= 1 <= self.is_high,
            f"algorithm.is_low={self.is_low} and is_high={self.is_high} must bracket 1 (0 <= is_low <= 1 <= "
            "is_high; typically 0.5 and 2)",
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
