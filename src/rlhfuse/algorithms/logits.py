"""Per-token quantities of a categorical policy computed from logits, chunked over rows to bound memory.

Legend: B batch rows, T time (tokens), V vocabulary, N = B·T flattened rows, C rows of one chunk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def _entropy_rows_C(logits_CV: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(x) − Σ_v softmax(x)_v·x_v for each row (entropy of a categorical, in nats), fp32."""
    logits_f_CV = logits_CV.float()
    log_normaliser_C = torch.logsumexp(logits_f_CV, dim=-1)
    probs_CV = torch.softmax(logits_f_CV, dim=-1)
    return log_normaliser_C - (probs_CV * logits_f_CV).sum(dim=-1)


def entropy_from_logits(logits_BTV: torch.Tensor, *, chunk_size: int = 4096) -> torch.Tensor:
    """Entropy H_t = −Σ_v p_t(v)·log p_t(v) = logsumexp(x_t) − Σ_v p_t(v)·x_t(v) of each token's distribution.

    Works on rows of the flattened (B·T, V) logits `chunk_size` at a time, in fp32, returning `entropy_BT` in fp32.
    Under autograd each chunk is checkpointed, so the backward pass keeps only the logits, not one fp32
    softmax per chunk.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    *batch_shape, vocab = logits_BTV.shape
    logits_NV = logits_BTV.reshape(-1, vocab)
    needs_grad = torch.is_grad_enabled() and logits_NV.requires_grad
    pieces_N = []
    for start in range(0, logits_NV.shape[0], chunk_size):
        chunk_CV = logits_NV[start : start + chunk_size]
        if needs_grad:
            pieces_N.append(checkpoint(_entropy_rows_C, chunk_CV, use_reentrant=False))
        else:
            pieces_N.append(_entropy_rows_C(chunk_CV))
    if not pieces_N:
        return logits_NV.new_zeros(batch_shape, dtype=torch.float32)
    return torch.cat(pieces_N).reshape(batch_shape)


class _ChunkedChosenLogprobs(torch.autograd.Function):
    """log softmax(x/τ)[label] per row, forward and backward chunked over rows (no full log_softmax copy).

    Backward: ∂/∂x_v log softmax(x/τ)[y] = (1[v = y] − softmax(x/τ)_v)/τ, recomputed chunk by chunk from the saved
    logits and the saved log-normaliser.
    """

    @staticmethod
    def forward(
        ctx: Any, logits_NV: torch.Tensor, labels_N: torch.Tensor, temperature: float, chunk_size: int
    ) -> torch.Tensor:
        log_normaliser_N = logits_NV.new_empty(logits_NV.shape[0], dtype=torch.float32)
        logprobs_N = logits_NV.new_empty(logits_NV.shape[0], dtype=torch.float32)
        for start in range(0, logits_NV.shape[0], chunk_size):
            stop = start + chunk_size
            scaled_CV = logits_NV[start:stop].float() / temperature
            log_normaliser_N[start:stop] = torch.logsumexp(scaled_CV, dim=-1)
            chosen_C = scaled_CV.gather(1, labels_N[start:stop, None]).squeeze(1)
            logprobs_N[start:stop] = chosen_C - log_normaliser_N[start:stop]
        ctx.save_for_backward(logits_NV, labels_N, log_normaliser_N)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return logprobs_N

    @staticmethod
    def backward(ctx: Any, grad_logprobs_N: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits_NV, labels_N, log_normaliser_N = ctx.saved_tensors
        return (
            chosen_logprobs_backward(
                logits_NV, labels_N, log_normaliser_N, grad_logprobs_N, ctx.temperature, ctx.chunk_size
            ),
            None,
            None,
            None,
        )


def chosen_logprobs_backward(
    logits_NV: torch.Tensor,
    labels_N: torch.Tensor,
    log_normaliser_N: torch.Tensor,
    grad_logprobs_N: torch.Tensor,
    temperature: float,
    chunk_size: int,
) -> torch.Tensor:
    """grad_x = g·(onehot(y) − exp(x/τ − lse))/τ per row (derivative of log softmax(x/τ)[y]), chunked over rows."""
    grad_logits_NV = torch.empty_like(logits_NV)
    for start in range(0, logits_NV.shape[0], chunk_size):
        stop = start + chunk_size
        scaled_CV = logits_NV[start:stop].float() / temperature
        probs_CV = torch.exp(scaled_CV - log_normaliser_N[start:stop, None])
        grad_CV = -probs_CV
        grad_CV.scatter_add_(1, labels_N[start:stop, None], torch.ones_like(grad_CV[:, :1]))
        grad_CV *= grad_logprobs_N[start:stop, None].float() / temperature
        grad_logits_NV[start:stop] = grad_CV.to(logits_NV.dtype)
    return grad_logits_NV


def chosen_logprobs_torch(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, temperature: float = 1.0, *, chunk_size: int = 4096
) -> torch.Tensor:
    """log p(y) = x_y/τ − logsumexp(x/τ) per row, in fp32, chunked over rows; the PyTorch reference of the kernel."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    result = _ChunkedChosenLogprobs.apply(logits_NV, labels_N.long(), float(temperature), int(chunk_size))
    assert isinstance(result, torch.Tensor)
    return result


def logprobs_from_logits(
    logits_BTV: torch.Tensor,
    labels_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 4096,
    backend: str | None = None,
) -> torch.Tensor:
    """Log-probability of each chosen token, log softmax(x_t/τ)[y_t] = x_t(y_t)/τ − logsumexp_v(x_t(v)/τ).

    Never materialises a full log_softmax copy: rows of the flattened (B·T, V) logits are processed `chunk_size`
    at a time, and the backward pass recomputes softmax per chunk from the saved logits. Returns `logprobs_BT` in
    fp32. Dispatches through `rlhfuse.ops.chosen_logprobs` (Triton on CUDA, `chosen_logprobs_torch` elsewhere).
    """
    from rlhfuse import ops  # deferred: ops imports this module for the reference

    *batch_shape, vocab = logits_BTV.shape
    if labels_BT.shape != tuple(batch_shape):
        raise ValueError(
            f"labels shape {tuple(labels_BT.shape)} must equal the logits' leading shape {tuple(batch_shape)}"
        )
    logprobs_N = ops.chosen_logprobs(
        logits_BTV.reshape(-1, vocab),
        labels_BT.reshape(-1),
        temperature,
        chunk_size=chunk_size,
        backend=backend,
    )
    return logprobs_N.reshape(batch_shape)
