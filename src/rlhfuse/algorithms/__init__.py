"""RL mathematics as small pure functions: GAE, critic-free advantages (GRPO, RLOO, REINFORCE++), policy losses
(PPO's clipped surrogate with DAPO's decoupled range, GSPO, CISPO), the value loss, DAPO's overlong reward shaping
and dynamic-sampling filter, KL estimators, whitening, entropy, log-probs.

Each function cites its equation in its docstring; `docs/algorithms.md` gathers them with the conventions.
"""

from typing import TYPE_CHECKING

from rlhfuse._lazy import lazy_package

if TYPE_CHECKING:
    from rlhfuse.algorithms.choices import RatioLevel
    from rlhfuse.algorithms.gae import (
        compute_gae,
        compute_gae_loop,
        compute_gae_matrix,
        compute_gae_numba,
        compute_gae_scan,
        compute_gae_steps,
    )
    from rlhfuse.algorithms.kl import kl_estimate, kl_penalty_rewards
    from rlhfuse.algorithms.logits import chosen_logprobs_torch, entropy_from_logits, logprobs_from_logits
    from rlhfuse.algorithms.losses import (
        PolicyLossStats,
        ValueLossStats,
        cispo_policy_loss,
        gspo_policy_loss,
        policy_log_ratio,
        ppo_policy_loss,
        reduce_loss,
        sequence_log_ratio,
        value_loss,
    )
    from rlhfuse.algorithms.masked import masked_mean, masked_var, whiten
    from rlhfuse.algorithms.outcome import (
        discounted_returns,
        grpo_advantages,
        overlong_penalty,
        reinforce_pp_advantages,
        rloo_advantages,
        sequence_to_tokens,
        varied_groups,
        zero_std_fraction,
    )

# The public names are imported from their modules on first use (rlhfuse._lazy): importing one module of
# the package does not load the others (`rlhfuse-train --help` reads the configs without torch).
_PUBLIC: dict[str, tuple[str, ...]] = {
    "rlhfuse.algorithms.choices": ("RatioLevel",),
    "rlhfuse.algorithms.gae": (
        "compute_gae",
        "compute_gae_loop",
        "compute_gae_matrix",
        "compute_gae_numba",
        "compute_gae_scan",
        "compute_gae_steps",
    ),
    "rlhfuse.algorithms.kl": ("kl_estimate", "kl_penalty_rewards"),
    "rlhfuse.algorithms.logits": ("chosen_logprobs_torch", "entropy_from_logits", "logprobs_from_logits"),
    "rlhfuse.algorithms.losses": (
        "PolicyLossStats",
        "ValueLossStats",
        "cispo_policy_loss",
        "gspo_policy_loss",
        "policy_log_ratio",
        "ppo_policy_loss",
        "reduce_loss",
        "sequence_log_ratio",
        "value_loss",
    ),
    "rlhfuse.algorithms.masked": ("masked_mean", "masked_var", "whiten"),
    "rlhfuse.algorithms.outcome": (
        "discounted_returns",
        "grpo_advantages",
        "overlong_penalty",
        "reinforce_pp_advantages",
        "rloo_advantages",
        "sequence_to_tokens",
        "varied_groups",
        "zero_std_fraction",
    ),
}
lazy_package(__name__, _PUBLIC)

__all__ = [
    "PolicyLossStats",
    "RatioLevel",
    "ValueLossStats",
    "chosen_logprobs_torch",
    "cispo_policy_loss",
    "compute_gae",
    "compute_gae_loop",
    "compute_gae_matrix",
    "compute_gae_numba",
    "compute_gae_scan",
    "compute_gae_steps",
    "discounted_returns",
    "entropy_from_logits",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl_estimate",
    "kl_penalty_rewards",
    "logprobs_from_logits",
    "masked_mean",
    "masked_var",
    "overlong_penalty",
    "policy_log_ratio",
    "ppo_policy_loss",
    "reduce_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sequence_log_ratio",
    "sequence_to_tokens",
    "value_loss",
    "varied_groups",
    "whiten",
    "zero_std_fraction",
]
