"""PPO losses: the clipped surrogate policy loss (with optional dual clip) and the clipped value loss.

Legend: B batch rows, T time (tokens). `mask_BT` is nonzero on the tokens that enter the loss.

Reductions: "token" averages over every valid token of the batch; "sequence" averages each row over its valid
tokens first, then averages those means over the rows that have at least one valid token; "sequence_sum" sums
each row's valid tokens, divides by a constant length L (`constant_length`, the same for every row and every
batch: Dr. GRPO, Liu et al. 2025, eq. 3) and averages over the rows: (1/B)·Σ_b (1/L)·Σ_t m_bt·l_bt.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlhfuse.algorithms.masked import _valid, masked_mean

_REDUCTIONS = ("token", "sequence", "sequence_sum")


class PolicyLossStats(NamedTuple):
    """Diagnostics of `ppo_policy_loss`, detached 0-d tensors averaged over valid tokens."""

    clip_fraction: torch.Tensor  # share of tokens where the clipped term is the one used
    approx_kl: torch.Tensor  # k3 estimate of KL(π_old ‖ π_θ): (r − 1) − log r, r = π_θ/π_old
    ratio_mean: torch.Tensor  # mean of r = π_θ/π_old


class ValueLossStats(NamedTuple):
    """Diagnostics of `value_loss`, detached 0-d tensors over valid tokens."""

    clip_fraction: torch.Tensor  # share of tokens where the clipped error is the larger one
    explained_variance: torch.Tensor  # 1 − Var[R − V]/Var[R]; 1 is perfect, ≤ 0 no better than a constant


def reduce_loss(
    per_token_BT: torch.Tensor, valid_BT: torch.Tensor, reduction: str, constant_length: int | None = None
) -> torch.Tensor:
    """Per-token losses to one loss by `reduction` (module docstring); "sequence_sum" needs `constant_length`."""
    if reduction == "token":
        return masked_mean(per_token_BT, valid_BT)
    if reduction == "sequence":
        row_means_B = masked_mean(per_token_BT, valid_BT, dim=-1)
        nonempty_B = valid_BT.any(dim=-1)
        return masked_mean(row_means_B, nonempty_B)
    if reduction == "sequence_sum":
        if constant_length is None or constant_length <= 0:
            raise ValueError(f"reduction='sequence_sum' needs constant_length > 0, got {constant_length}")
        row_sums_B = torch.where(valid_BT, per_token_BT, torch.zeros_like(per_token_BT)).sum(dim=-1)
        return row_sums_B.sum() / (constant_length * max(per_token_BT.shape[0], 1))
    raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"all inputs must have the same shape, got {shapes}")


def ppo_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    reduction: str = "token",
    constant_length: int | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO clipped surrogate loss (Schulman et al. 2017, eq. 7), negated for minimisation, per token:

        r_t = exp(log π_θ − log π_old),  L_t = max(−A_t·r_t, −A_t·clip(r_t, 1 − ε, 1 + ε_high))

    with ε_high = `clip_eps_high` or ε (asymmetric "clip-higher" when set). Dual clip (Ye et al. 2020, eq. 5):
    for A_t < 0, L_t = min(L_t, −c·A_t) with c = `dual_clip` > 1, bounding the loss when r_t ≫ 1.
    The per-token losses are reduced by `reduction` ("token", "sequence" or "sequence_sum" over
    `constant_length`, see the module docstring).
    """
    _check_same_shape(
        logprobs_BT=logprobs_BT, old_logprobs_BT=old_logprobs_BT, advantages_BT=advantages_BT, mask_BT=mask_BT
    )
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if clip_eps < 0 or eps_high < 0:
        raise ValueError(f"clip_eps and clip_eps_high must be >= 0, got {clip_eps} and {clip_eps_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (typically 3), got {dual_clip}; or pass dual_clip=None")
    valid_BT = _valid(mask_BT, logprobs_BT)
    log_ratio_BT = logprobs_BT - old_logprobs_BT
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * torch.clamp(ratio_BT, 1.0 - clip_eps, 1.0 + eps_high)
    per_token_BT = torch.maximum(unclipped_BT, clipped_BT)
    if dual_clip is not None:
        dual_bound_BT = -dual_clip * advantages_BT
        per_token_BT = torch.where(
            advantages_BT < 0, torch.minimum(per_token_BT, dual_bound_BT), per_token_BT
        )
    loss = reduce_loss(per_token_BT, valid_BT, reduction, constant_length)
    with torch.no_grad():
        stats = PolicyLossStats(
            clip_fraction=masked_mean((clipped_BT > unclipped_BT).to(ratio_BT.dtype), valid_BT),
            approx_kl=masked_mean((ratio_BT - 1.0) - log_ratio_BT, valid_BT),
            ratio_mean=masked_mean(ratio_BT, valid_BT),
        )
    return loss, PolicyLossStats(*(s.detach() for s in stats))


def value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_eps: float | None = 0.2,
    reduction: str = "token",
    constant_length: int | None = None,
) -> tuple[torch.Tensor, ValueLossStats]:
    """Clipped value loss (PPO2 baselines; Ouyang et al. 2022 / Ziegler et al. 2019 critic), per token:

        V^clip_t = V_old,t + clip(V_t − V_old,t, −ε, ε),  L_t = ½·max((V_t − R_t)², (V^clip_t − R_t)²)

    and L_t = ½·(V_t − R_t)² when `clip_eps` is None. Reduced by `reduction` (module docstring).
    """
    _check_same_shape(
        values_BT=values_BT, old_values_BT=old_values_BT, returns_BT=returns_BT, mask_BT=mask_BT
    )
    if clip_eps is not None and clip_eps < 0:
        raise ValueError(f"clip_eps must be >= 0 or None (no clipping), got {clip_eps}")
    valid_BT = _valid(mask_BT, values_BT)
    unclipped_error_BT = (values_BT - returns_BT) ** 2
    if clip_eps is None:
        per_token_BT = 0.5 * unclipped_error_BT
        clipped_more_BT = torch.zeros_like(valid_BT)
    else:
        clipped_values_BT = old_values_BT + torch.clamp(values_BT - old_values_BT, -clip_eps, clip_eps)
        clipped_error_BT = (clipped_values_BT - returns_BT) ** 2
        per_token_BT = 0.5 * torch.maximum(unclipped_error_BT, clipped_error_BT)
        clipped_more_BT = clipped_error_BT > unclipped_error_BT
    loss = reduce_loss(per_token_BT, valid_BT, reduction, constant_length)
    with torch.no_grad():
        residual_var = masked_mean((returns_BT - values_BT) ** 2, valid_BT) - (
            masked_mean(returns_BT - values_BT, valid_BT) ** 2
        )
        returns_var = masked_mean(returns_BT**2, valid_BT) - masked_mean(returns_BT, valid_BT) ** 2
        stats = ValueLossStats(
            clip_fraction=masked_mean(clipped_more_BT.to(values_BT.dtype), valid_BT),
            explained_variance=1.0 - residual_var / returns_var.clamp_min(1e-12),
        )
    return loss, ValueLossStats(*(s.detach() for s in stats))
