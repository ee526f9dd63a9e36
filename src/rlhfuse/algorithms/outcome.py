"""Critic-free advantages: group baselines over the samples of one prompt, and batch-normalised returns.

Legend: B batch rows (samples), T time (tokens). `group_B` is any integer label per sample (the prompt's dataset
id, `Rollout.prompt_index_B`): samples with the same label form one group. Scores are sequence-level outcome
rewards, one per sample.
"""

from __future__ import annotations

import torch

from rlhfuse.algorithms.gae import compute_gae
from rlhfuse.algorithms.masked import _valid, whiten


def _groups(scores_B: torch.Tensor, group_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inverse_B, count_G): each sample's group position 0..G-1 and the size of every group."""
    if scores_B.dim() != 1 or group_B.shape != scores_B.shape:
        raise ValueError(
            f"scores_B and group_B must share one 1-D shape, got {tuple(scores_B.shape)} and "
            f"{tuple(group_B.shape)}"
        )
    _, inverse_B, count_G = torch.unique(group_B, return_inverse=True, return_counts=True)
    return inverse_B.to(scores_B.device), count_G.to(scores_B.device)


def _uniform_groups(scores_B: torch.Tensor, group_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniform_G, inverse_B): whether every sample of each group has the same score, and each sample's group."""
    inverse_B, count_G = _groups(scores_B, group_B)
    x_B = scores_B.to(torch.promote_types(scores_B.dtype, torch.float32))
    groups = len(count_G)
    high_G = torch.full((groups,), float("-inf"), dtype=x_B.dtype, device=x_B.device)
    high_G = high_G.scatter_reduce(0, inverse_B, x_B, reduce="amax")
    low_G = torch.full_like(high_G, float("inf")).scatter_reduce(0, inverse_B, x_B, reduce="amin")
    return high_G == low_G, inverse_B


def zero_std_fraction(scores_B: torch.Tensor, group_B: torch.Tensor) -> float:
    """The fraction of groups in which every sample has the same score: their group-baselined advantages are 0,
    so they train with zero gradient (TRL's frac_reward_zero_std)."""
    uniform_G, _ = _uniform_groups(scores_B, group_B)
    return float(uniform_G.float().mean()) if len(uniform_G) else 0.0


def varied_groups(scores_B: torch.Tensor, group_B: torch.Tensor) -> torch.Tensor:
    """bool [B]: the samples whose group's scores are not all equal (non-zero variance). DAPO's dynamic sampling
    (Yu et al. 2025, arXiv 2503.14476, eq. 11: 0 < |{o_i : o_i correct}| < G) keeps only these groups: a group whose
    samples all scored alike has zero group-baselined advantage and trains nothing."""
    uniform_G, inverse_B = _uniform_groups(scores_B, group_B)
    return ~uniform_G[inverse_B]


def overlong_penalty(
    lengths_B: torch.Tensor, max_length: int, buffer: float, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), scaled by `penalty`, one per
    sample of response length |y| (float32 [B]):

        R_length(y) = 0                                      |y| <= L_max − L_cache
                    = ((L_max − L_cache) − |y|) / L_cache · p  L_max − L_cache < |y| <= L_max
                    = −p                                     |y| > L_max

    with L_max = `max_length` (the generator's max_new_tokens), L_cache = `buffer` (> 0) and p = `penalty`; the
    penalty grows linearly over the last L_cache tokens before the limit, reaching −p at L_max."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong buffer must be in (0, max_length={max_length}], got {buffer}")
    length_B = lengths_B.to(torch.float32)
    start = float(max_length - buffer)
    ramp_B = (start - length_B) / float(buffer) * penalty
    zero_B = torch.zeros_like(length_B)
    return torch.where(
        length_B <= start, zero_B, torch.where(length_B <= max_length, ramp_B, zero_B - penalty)
    )


def _group_sum(x_B: torch.Tensor, inverse_B: torch.Tensor, groups: int) -> torch.Tensor:
    return torch.zeros(groups, dtype=x_B.dtype, device=x_B.device).index_add_(0, inverse_B, x_B)


def grpo_advantages(
    scores_B: torch.Tensor, group_B: torch.Tensor, *, std_norm: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised outcome advantages (GRPO: Shao et al. 2024, DeepSeekMath §4.1.2), one per sample:

        A_i = (r_i − mean_g r) / (std_g r + ε)      std_norm=True  (GRPO)
        A_i =  r_i − mean_g r                        std_norm=False (Dr. GRPO: Liu et al. 2025, eq. 5)

    over the group g of sample i (the samples with its `group_B` label); std_g is the unbiased (n − 1) standard
    deviation, as torch.std. A group of one sample has no baseline: its advantage is 0.
    """
    inverse_B, count_G = _groups(scores_B, group_B)
    x_B = scores_B.to(torch.promote_types(scores_B.dtype, torch.float32))
    n_G = count_G.to(x_B.dtype)
    mean_G = _group_sum(x_B, inverse_B, len(count_G)) / n_G
    centred_B = x_B - mean_G[inverse_B]
    alone_B = (count_G == 1)[inverse_B]
    if std_norm:
        var_G = _group_sum(centred_B**2, inverse_B, len(count_G)) / (n_G - 1).clamp_min(1)
        centred_B = centred_B / (var_G.sqrt()[inverse_B] + eps)
    return torch.where(alone_B, torch.zeros_like(centred_B), centred_B)


def rloo_advantages(scores_B: torch.Tensor, group_B: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out advantages (RLOO: Kool et al. 2019; Ahmadian et al. 2024, eq. 6), one per sample:

        A_i = r_i − (Σ_{j≠i, j∈g} r_j) / (n_g − 1)  =  n_g/(n_g − 1) · (r_i − mean_g r)

    Every group needs at least two samples (ValueError otherwise: the baseline of a lone sample is undefined).
    """
    inverse_B, count_G = _groups(scores_B, group_B)
    if bool((count_G < 2).any()):
        raise ValueError(
            f"rloo_advantages needs >= 2 samples per group, got group sizes {sorted(set(count_G.tolist()))}"
        )
    x_B = scores_B.to(torch.promote_types(scores_B.dtype, torch.float32))
    n_B = count_G.to(x_B.dtype)[inverse_B]
    others_B = _group_sum(x_B, inverse_B, len(count_G))[inverse_B] - x_B
    return x_B - others_B / (n_B - 1)


def discounted_returns(rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Reward-to-go over the valid tokens of each row: G_t = Σ_{k ≥ t, k valid} γ^(valid steps from t to k) r_k;
    0 at masked positions. (GAE with V = 0 and λ = 1: δ_t = r_t, so `compute_gae` computes it.)"""
    valid_BT = _valid(mask_BT, rewards_BT)
    returns_BT, _ = compute_gae(rewards_BT, torch.zeros_like(rewards_BT), valid_BT, gamma, 1.0)
    return returns_BT


def reinforce_pp_advantages(
    rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, eqs. 4-5): token rewards carry the KL penalty (`kl_penalty_rewards`:
    r_t = −β·KL_t + s·[t last]), returns are the reward-to-go and advantages are the returns normalised over every
    valid token of the whole batch (no Critic, no group baseline):

        G_t = Σ_{k ≥ t} γ^(k−t) r_k,      A_t = (G_t − mean_batch G) / std_batch G

    Returns (advantages_BT, returns_BT); 0 at masked positions.
    """
    returns_BT = discounted_returns(rewards_BT, mask_BT, gamma)
    return whiten(returns_BT, mask_BT), returns_BT


def sequence_to_tokens(values_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """The per-sample value on every valid token of its row (an outcome advantage for each response token);
    0 at masked positions."""
    valid_BT = mask_BT != 0
    x_B = values_B.to(torch.promote_types(values_B.dtype, torch.float32))
    return torch.where(valid_BT, x_B[:, None], torch.zeros((), dtype=x_B.dtype, device=x_B.device))
