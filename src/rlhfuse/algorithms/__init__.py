"""RL mathematics as small pure functions: GAE, critic-free advantages (GRPO, RLOO, REINFORCE++), clipped losses,
KL estimators, whitening, entropy, log-probs.

Each function cites its equation in its docstring; `docs/algorithms.md` gathers them with the conventions.
"""

from rlhfuse.algorithms.gae import (
    compute_gae,
    compute_gae_loop,
    compute_gae_matrix,
    compute_gae_numba,
    compute_gae_scan,
)
from rlhfuse.algorithms.kl import kl_estimate, kl_penalty_rewards
from rlhfuse.algorithms.logits import chosen_logprobs_torch, entropy_from_logits, logprobs_from_logits
from rlhfuse.algorithms.losses import (
    PolicyLossStats,
    ValueLossStats,
    ppo_policy_loss,
    reduce_loss,
    value_loss,
)
from rlhfuse.algorithms.masked import masked_mean, masked_var, whiten
from rlhfuse.algorithms.outcome import (
    discounted_returns,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_to_tokens,
    zero_std_fraction,
)

__all__ = [
    "PolicyLossStats",
    "ValueLossStats",
    "chosen_logprobs_torch",
    "compute_gae",
    "compute_gae_loop",
    "compute_gae_matrix",
    "compute_gae_numba",
    "compute_gae_scan",
    "discounted_returns",
    "entropy_from_logits",
    "grpo_advantages",
    "kl_estimate",
    "kl_penalty_rewards",
    "logprobs_from_logits",
    "masked_mean",
    "masked_var",
    "ppo_policy_loss",
    "reduce_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sequence_to_tokens",
    "zero_std_fraction",
    "value_loss",
    "whiten",
]
