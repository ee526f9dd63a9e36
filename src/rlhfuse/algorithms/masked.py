"""Statistics over the valid tokens of a batch: masked mean, masked variance, whitening.

Legend: B batch rows, T time (tokens). `mask_BT` is 1 (or True) on valid tokens and 0 elsewhere; it may be
bool, integer or floating point and is compared with 0.
"""

from __future__ import annotations

import torch


def _valid(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if mask.shape != like.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal the tensor's shape {tuple(like.shape)}")
    return mask != 0


def _select(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # torch.where rather than x * mask: garbage (inf/NaN) at padded positions must not leak into the sums.
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is set: Σ m·x / Σ m (over `dim`, or over everything if None).

    An empty selection (Σ m = 0) gives 0 rather than NaN, so fully padded rows do not poison a batch statistic.
    """
    valid = _valid(mask, x)
    count = valid.to(x.dtype)
    if dim is None:
        return _select(x, valid).sum() / count.sum().clamp_min(1.0)
    return _select(x, valid).sum(dim) / count.sum(dim).clamp_min(1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over all positions where `mask` is set: Σ m·(x − μ)² / (n − 1) (or / n if not unbiased).

    μ is `masked_mean(x, mask)` and n = Σ m. Raises ValueError when n < 2 (unbiased) or n < 1, where the variance
    is undefined.
    """
    valid = _valid(mask, x)
    count = int(valid.sum().item())
    if count < (2 if unbiased else 1):
        raise ValueError(
            f"masked_var needs at least {2 if unbiased else 1} valid element(s) (got {count}); "
            "pass more valid tokens or unbiased=False"
        )
    mean = _select(x, valid).sum() / count
    squared_error = _select((x - mean) ** 2, valid)
    return squared_error.sum() / (count - 1 if unbiased else count)


def whiten(
    x_BT: torch.Tensor, mask_BT: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise over the valid tokens: (x − μ)/√(σ² + ε), plus μ back if not `shift_mean`; masked positions → 0.

    μ and σ² (unbiased) are `masked_mean` / `masked_var` over all valid tokens of the batch (PPO advantage
    normalisation, as in OpenAI's lm-human-preferences `whiten`).
    """
    valid_BT = _valid(mask_BT, x_BT)
    mean = masked_mean(x_BT, mask_BT)
    var = masked_var(x_BT, mask_BT, unbiased=True)
    whitened_BT = (x_BT - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened_BT = whitened_BT + mean
    return _select(whitened_BT, valid_BT)
