"""KL divergence between the policy and the reference model, per token, and the KL-shaped PPO rewards.

Legend: B batch rows, T time (tokens).

Tokens are sampled from the policy π, so these estimate KL(π ‖ π_ref) = E_π[log π − log π_ref]. With
log r = log π(y_t) − log π_ref(y_t) (Schulman, "Approximating KL Divergence", 2020, whose ratio is the inverse,
π_ref/π, hence the signs below):

    k1 = log r                      unbiased, high variance, can be negative
    k2 = ½·(log r)²                 biased, low variance, ≥ 0
    k3 = (r⁻¹ − 1) + log r          unbiased, low variance, ≥ 0
"""

from __future__ import annotations

import torch

from rlhfuse.algorithms.masked import _valid

_KL_KINDS = ("k1", "k2", "k3")


def kl_estimate(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate `kl_BT` of KL(π ‖ π_ref): k1, k2 or k3 of this module's docstring (Schulman 2020)."""
    if logprobs_BT.shape != ref_logprobs_BT.shape:
        raise ValueError(
            f"logprobs shape {tuple(logprobs_BT.shape)} != ref_logprobs shape {tuple(ref_logprobs_BT.shape)}"
        )
    log_ratio_BT = logprobs_BT - ref_logprobs_BT
    if kind == "k1":
        return log_ratio_BT
    if kind == "k2":
        return 0.5 * log_ratio_BT**2
    if kind == "k3":
        # expm1(−x) = r⁻¹ − 1 without the cancellation of exp(−x) − 1 near x = 0.
        return torch.expm1(-log_ratio_BT) + log_ratio_BT
    raise ValueError(f"kind must be one of {_KL_KINDS}, got {kind!r}")


def kl_penalty_rewards(
    scores_B: torch.Tensor, kl_BT: torch.Tensor, mask_BT: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Token rewards r_t = −β·KL_t on valid tokens, plus the sequence score on each row's last valid token.

    r_t = −β·KL_t·m_t + s_b·[t = last valid token of row b]   (Ziegler et al. 2019, eq. 2; Ouyang et al. 2022)
    with β = `kl_coef`. Masked positions get 0. Every row needs at least one valid token to carry its score;
    otherwise ValueError (dropping a score silently would bias training).
    """
    if kl_BT.shape != mask_BT.shape or kl_BT.dim() != 2:
        raise ValueError(
            f"kl_BT and mask_BT must share one 2-D shape, got {tuple(kl_BT.shape)} and {tuple(mask_BT.shape)}"
        )
    if scores_B.shape != kl_BT.shape[:1]:
        raise ValueError(f"scores_B shape {tuple(scores_B.shape)} must be ({kl_BT.shape[0]},)")
    valid_BT = _valid(mask_BT, kl_BT)
    has_valid_B = valid_BT.any(dim=1)
    if not bool(has_valid_B.all()):
        empty_rows = torch.nonzero(~has_valid_B).flatten().tolist()
        raise ValueError(
            f"rows {empty_rows} have no valid token to receive their score; every response needs at least one "
            "policy token in mask_BT"
        )
    rewards_BT = torch.where(
        valid_BT, -kl_coef * kl_BT, torch.zeros((), dtype=kl_BT.dtype, device=kl_BT.device)
    )
    T = kl_BT.shape[1]
    # Index of the last valid token: T − 1 − (first True of the row read backwards).
    last_valid_B = T - 1 - torch.argmax(valid_BT.flip(1).to(torch.int8), dim=1)
    return rewards_BT.scatter_add(1, last_valid_B[:, None], scores_B.to(kl_BT.dtype)[:, None])
