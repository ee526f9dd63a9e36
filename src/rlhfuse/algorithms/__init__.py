"""PPO mathematics as small pure functions: GAE, clipped losses, KL estimators, whitening, entropy, log-probs.

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
from rlhfuse.algorithms.losses import PolicyLossStats, ValueLossStats, ppo_policy_loss, value_loss
from rlhfuse.algorithms.masked import masked_mean, masked_var, whiten

__all__ = [
    "PolicyLossStats",
    "ValueLossStats",
    "chosen_logprobs_torch",
    "compute_gae",
    "compute_gae_loop",
    "compute_gae_matrix",
    "compute_gae_numba",
    "compute_gae_scan",
    "entropy_from_logits",
    "kl_estimate",
    "kl_penalty_rewards",
    "logprobs_from_logits",
    "masked_mean",
    "masked_var",
    "ppo_policy_loss",
    "value_loss",
    "whiten",
]
