"""Policy and value losses: the clipped surrogate (PPO, with optional dual clip; DAPO's decoupled clip range;
GSPO's sequence-level ratio), CISPO's clipped importance-sampling weight, and the clipped value loss.

Legend: B batch rows, T time (tokens). `mask_BT` is nonzero on the tokens that enter the loss.

Reductions: "token" averages over every valid token of the batch; "sequence" averages each row over its valid
tokens first, then averages those means over the rows that have at least one valid token; "sequence_sum" sums
each row's valid tokens, divides by a constant length L (`constant_length`, the same for every row and every
batch: Dr. GRPO, Liu et al. 2025, eq. 3) and averages over the rows: (1/B)·Σ_b (1/L)·Σ_t m_bt·l_bt (L = 1: the
plain mean over rows of each row's token sum).

Ratio levels: "token" is each token's own ratio r_t = π_θ(y_t)/π_old(y_t); "sequence" is GSPO's length-normalised
sequence ratio s_b = exp((1/|y_b|)·Σ_t log r_t), in its GSPO-token form (`sequence_log_ratio`): every token of row
b carries the value s_b, and its gradient is s_b·∇log π_θ(y_t).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlhfuse.algorithms.choices import RatioLevel
from rlhfuse.algorithms.masked import _valid, masked_mean

_REDUCTIONS = ("token", "sequence", "sequence_sum")


class PolicyLossStats(NamedTuple):
    """Diagnostics of `ppo_policy_loss`, detached 0-d tensors averaged over valid tokens."""

    clip_fraction: torch.Tensor  # share of tokens where the clipped term is the one used
    approx_kl: torch.Tensor  # k3 estimate of KL(π_old ‖ π_θ): (r − 1) − log r, r = π_θ/π_old (token ratios)
    ratio_mean: torch.Tensor  # mean of the ratio the loss weighs (r_t, or GSPO's s_b on each of its tokens)
    # clip_fraction split by side: clipped at 1 − ε_low (PPO: A < 0; CISPO: r < 1 − ε_low) and at 1 + ε_high
    clip_fraction_low: torch.Tensor
    clip_fraction_high: torch.Tensor


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


def sequence_log_ratio(
    logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, valid_BT: torch.Tensor
) -> torch.Tensor:
    """GSPO-token's log-ratio (Zheng et al. 2025, arXiv 2507.18071, §4.3), per token:

        log s_b = (1/|y_b|)·Σ_t (log π_θ(y_t) − log π_old(y_t))        (the sequence ratio's log, §4.1)
        log s_bt = sg[log s_b] + log π_θ(y_t) − sg[log π_θ(y_t)]

    so exp gives every valid token of row b the value s_b, with gradient s_b·∇log π_θ(y_t). Masked positions
    (`valid_BT` false) are left out of |y_b| and the sum, and read as 0 (any garbage there has no effect)."""
    zero = torch.zeros((), dtype=logprobs_BT.dtype, device=logprobs_BT.device)
    token_BT = torch.where(valid_BT, logprobs_BT - old_logprobs_BT, zero)
    lengths_B = valid_BT.sum(dim=-1).clamp_min(1).to(logprobs_BT.dtype)
    sequence_B = token_BT.sum(dim=-1) / lengths_B
    own_BT = torch.where(valid_BT, logprobs_BT, zero)
    return own_BT - own_BT.detach() + sequence_B.detach()[:, None]


def policy_log_ratio(
    logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, valid_BT: torch.Tensor, level: RatioLevel
) -> torch.Tensor:
    """log r_t (`level="token"`) or GSPO-token's log s_bt (`"sequence"`, `sequence_log_ratio`)."""
    if level == "token":
        return logprobs_BT - old_logprobs_BT
    if level == "sequence":
        return sequence_log_ratio(logprobs_BT, old_logprobs_BT, valid_BT)
    raise ValueError(f"ratio level must be 'token' or 'sequence', got {level!r}")


def _check_clip(clip_eps: float, clip_eps_high: float) -> None:
    if clip_eps < 0 or clip_eps_high < 0:
        raise ValueError(f"clip_eps and clip_eps_high must be >= 0, got {clip_eps} and {clip_eps_high}")


def ppo_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    ratio_level: RatioLevel = "token",
    reduction: str = "token",
    constant_length: int | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO clipped surrogate loss (Schulman et al. 2017, eq. 7), negated for minimisation, per token:

        r_t = exp(log π_θ − log π_old),  L_t = max(−A_t·r_t, −A_t·clip(r_t, 1 − ε, 1 + ε_high))

    with ε_high = `clip_eps_high` or ε (asymmetric "clip-higher" when set: DAPO, Yu et al. 2025, arXiv
    2503.14476, eq. 8 is this loss with ε_low = 0.2, ε_high = 0.28 and reduction="token"). Dual clip (Ye et al.
    2020, eq. 5): for A_t < 0, L_t = min(L_t, −c·A_t) with c = `dual_clip` > 1, bounding the loss when r_t ≫ 1.
    `ratio_level="sequence"` puts GSPO's sequence ratio in place of r_t (`gspo_policy_loss`). The per-token losses
    are reduced by `reduction` ("token", "sequence" or "sequence_sum" over `constant_length`, see the module
    docstring).
    """
    _check_same_shape(
        logprobs_BT=logprobs_BT, old_logprobs_BT=old_logprobs_BT, advantages_BT=advantages_BT, mask_BT=mask_BT
    )
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    _check_clip(clip_eps, eps_high)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (typically 3), got {dual_clip}; or pass dual_clip=None")
    valid_BT = _valid(mask_BT, logprobs_BT)
    log_ratio_BT = policy_log_ratio(logprobs_BT, old_logprobs_BT, valid_BT, ratio_level)
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
        # the clipped term is the larger one: at 1 + ε_high when A > 0, at 1 − ε when A < 0
        active_BT = clipped_BT > unclipped_BT
        token_log_ratio_BT = logprobs_BT - old_logprobs_BT
        stats = PolicyLossStats(
            clip_fraction=masked_mean(active_BT.to(ratio_BT.dtype), valid_BT),
            approx_kl=masked_mean((torch.exp(token_log_ratio_BT) - 1.0) - token_log_ratio_BT, valid_BT),
            ratio_mean=masked_mean(ratio_BT, valid_BT),
            clip_fraction_low=masked_mean((active_BT & (advantages_BT < 0)).to(ratio_BT.dtype), valid_BT),
            clip_fraction_high=masked_mean((active_BT & (advantages_BT > 0)).to(ratio_BT.dtype), valid_BT),
        )
    return loss, PolicyLossStats(*(s.detach() for s in stats))


def gspo_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_eps: float = 3e-4,
    clip_eps_high: float | None = 4e-4,
    reduction: str = "sequence",
    constant_length: int | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071, §4), negated for minimisation:

        s_b = (π_θ(y_b)/π_old(y_b))^(1/|y_b|) = exp((1/|y_b|)·Σ_t log r_t)
        L = (1/B)·Σ_b max(−A_b·s_b, −A_b·clip(s_b, 1 − ε, 1 + ε_high))

    computed in its GSPO-token form (§4.3: each token carries s_b, `sequence_log_ratio`, and its own advantage),
    which with a per-sequence advantage and reduction="sequence" equals the sequence form in value and gradient:
    the clipped PPO surrogate of `ppo_policy_loss` at `ratio_level="sequence"`. The defaults are the paper's clip
    range (3e-4, 4e-4: sequence ratios stay much nearer 1 than token ratios) and its aggregation.
    """
    return ppo_policy_loss(
        logprobs_BT,
        old_logprobs_BT,
        advantages_BT,
        mask_BT,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        ratio_level="sequence",
        reduction=reduction,
        constant_length=constant_length,
    )


def cispo_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_eps: float = 1.0,
    clip_eps_high: float | None = 5.0,
    ratio_level: RatioLevel = "token",
    reduction: str = "token",
    constant_length: int | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, §3.1, eqs. 4–5), negated for minimisation, per token:

        r̂_t = clip(r_t, 1 − ε_low, 1 + ε_high),   L_t = −sg(r̂_t)·A_t·log π_θ(y_t)

    The importance-sampling weight is clipped and detached, not the update: every token keeps its gradient
    −r̂_t·A_t·∇log π_θ(y_t), however far its ratio moved (PPO's clip drops the tokens outside the range). The paper
    aggregates over all tokens (reduction="token") and sets no lower bound (ε_low = 1 here); ε_high = `clip_eps_high`
    or ε. `ratio_level="sequence"` weighs each token by GSPO's sequence ratio s_b instead. The loss value holds
    log π_θ, so it is not a surrogate's value; its gradient is what matters.
    """
    _check_same_shape(
        logprobs_BT=logprobs_BT, old_logprobs_BT=old_logprobs_BT, advantages_BT=advantages_BT, mask_BT=mask_BT
    )
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    _check_clip(clip_eps, eps_high)
    valid_BT = _valid(mask_BT, logprobs_BT)
    zero = torch.zeros((), dtype=logprobs_BT.dtype, device=logprobs_BT.device)
    with torch.no_grad():
        ratio_BT = torch.exp(policy_log_ratio(logprobs_BT, old_logprobs_BT, valid_BT, ratio_level))
        weight_BT = torch.clamp(ratio_BT, 1.0 - clip_eps, 1.0 + eps_high)
        coefficient_BT = torch.where(valid_BT, weight_BT * advantages_BT, zero)
    # padding keeps no gradient even when it holds garbage: log π_θ is read there as 0
    per_token_BT = -coefficient_BT * torch.where(valid_BT, logprobs_BT, zero)
    loss = reduce_loss(per_token_BT, valid_BT, reduction, constant_length)
    with torch.no_grad():
        low_BT = ratio_BT < 1.0 - clip_eps
        high_BT = ratio_BT > 1.0 + eps_high
        token_log_ratio_BT = logprobs_BT - old_logprobs_BT
        stats = PolicyLossStats(
            clip_fraction=masked_mean((low_BT | high_BT).to(ratio_BT.dtype), valid_BT),
            approx_kl=masked_mean((torch.exp(token_log_ratio_BT) - 1.0) - token_log_ratio_BT, valid_BT),
            ratio_mean=masked_mean(ratio_BT, valid_BT),
            clip_fraction_low=masked_mean(low_BT.to(ratio_BT.dtype), valid_BT),
            clip_fraction_high=masked_mean(high_BT.to(ratio_BT.dtype), valid_BT),
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
