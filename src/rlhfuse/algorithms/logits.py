"""Per-token quantities of a categorical policy computed from logits, chunked over rows to bound memory.

Legend: B batch rows, T time (tokens), V vocabulary, N = B·T flattened rows, C rows of one chunk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def _row_blocks_NV(logits_BTV: torch.Tensor) -> list[torch.Tensor]:
    """Views of the logits as (rows, V) blocks covering every row in order, never copying the logits.

    `reshape(-1, V)` silently copies a non-viewable tensor, e.g. the response slice `logits[:, P - 1 : -1]` of a
    full forward pass; that copy is as large as the log_softmax this module avoids. Such inputs are split along
    their leading dimension instead, whose (T, V) slices are views.
    """
    vocab = logits_BTV.shape[-1]
    try:
        return [logits_BTV.view(-1, vocab)]
    except RuntimeError:
        return [block for row in logits_BTV.unbind(0) for block in _row_blocks_NV(row)]


def _entropy_rows_C(logits_CV: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(x) − Σ_v softmax(x)_v·x_v for each row (entropy of a categorical, in nats), fp32."""
    logits_f_CV = logits_CV.float()
    log_normaliser_C = torch.logsumexp(logits_f_CV, dim=-1)
    probs_CV = torch.softmax(logits_f_CV, dim=-1)
    return log_normaliser_C - (probs_CV * logits_f_CV).sum(dim=-1)


def entropy_from_logits(logits_BTV: torch.Tensor, *, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy H_t = −Σ_v p_t(v)·log p_t(v) = logsumexp(x_t) − Σ_v p_t(v)·x_t(v) of each token's distribution.

    Works on rows of the flattened (B·T, V) logits `chunk_size` at a time, in fp32, returning `entropy_BT` in fp32.
    Under autograd each chunk is checkpointed, so the backward pass keeps only the logits, not one fp32
    softmax per chunk.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    *batch_shape, _ = logits_BTV.shape
    needs_grad = torch.is_grad_enabled() and logits_BTV.requires_grad
    pieces_N = []
    for logits_NV in _row_blocks_NV(logits_BTV):
        for start in range(0, logits_NV.shape[0], chunk_size):
            chunk_CV = logits_NV[start : start + chunk_size]
            if needs_grad:
                pieces_N.append(checkpoint(_entropy_rows_C, chunk_CV, use_reentrant=False))
            else:
                pieces_N.append(_entropy_rows_C(chunk_CV))
    if not pieces_N:
        return logits_BTV.new_zeros(batch_shape, dtype=torch.float32)
    return torch.cat(pieces_N).reshape(batch_shape)


class _ChunkedChosenLogprobs(torch.autograd.Function):
    """log softmax(x/τ)[label] per row, forward and backward chunked over rows (no full log_softmax copy).

    Forward per chunk: one fused log_softmax of C×V (bounded by the chunk), then the chosen column; the
    log-normaliser lse = x_y/τ − log p(y) is kept for the backward pass, which recomputes softmax chunk by chunk.
    """

    @staticmethod
    def forward(
        ctx: Any, logits_NV: torch.Tensor, labels_N: torch.Tensor, temperature: float, chunk_size: int
    ) -> torch.Tensor:
        N = logits_NV.shape[0]
        log_normaliser_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
        logprobs_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
        for start in range(0, N, chunk_size):
            stop = start + chunk_size
            scaled_CV = logits_NV[start:stop].float()
            if temperature != 1.0:
                scaled_CV = scaled_CV / temperature
            labels_C1 = labels_N[start:stop, None]
            logprobs_N[start:stop] = torch.log_softmax(scaled_CV, dim=-1).gather(1, labels_C1).squeeze(1)
            log_normaliser_N[start:stop] = scaled_CV.gather(1, labels_C1).squeeze(1) - logprobs_N[start:stop]
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
    """∂/∂x_v of g·log softmax(x/τ)[y] = g·(1[v = y] − exp(x_v/τ − lse))/τ per row, chunked over rows.

    Shared by the PyTorch reference and the Triton kernel's autograd Function. For fp32 logits each chunk is
    computed in place inside the gradient buffer, so the only B·T·V allocation is the gradient itself.
    """
    grad_logits_NV = torch.empty_like(logits_NV)
    in_place = logits_NV.dtype == torch.float32
    for start in range(0, logits_NV.shape[0], chunk_size):
        stop = start + chunk_size
        if in_place:
            work_CV = grad_logits_NV[start:stop]
            work_CV.copy_(logits_NV[start:stop])
        else:
            work_CV = logits_NV[start:stop].float()
        if temperature != 1.0:
            work_CV.div_(temperature)
        work_CV.sub_(log_normaliser_N[start:stop, None]).exp_().neg_()
        work_CV.scatter_add_(1, labels_N[start:stop, None], torch.ones_like(work_CV[:, :1]))
        work_CV.mul_(grad_logprobs_N[start:stop, None].float() / temperature)
        if not in_place:
            grad_logits_NV[start:stop] = work_CV
    return grad_logits_NV


def chosen_logprobs_torch(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, temperature: float = 1.0, *, chunk_size: int = 1024
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
    chunk_size: int = 1024,
    backend: str | None = None,
) -> torch.Tensor:
    """Log-probability of each chosen token, log softmax(x_t/τ)[y_t] = x_t(y_t)/τ − logsumexp_v(x_t(v)/τ).

    Never materialises a full log_softmax copy: rows of the flattened (B·T, V) logits are processed `chunk_size`
    at a time, and the backward pass recomputes softmax per chunk from the saved logits. Returns `logprobs_BT` in
    fp32. Dispatches through `rlhfuse.algorithms.ops.chosen_logprobs` (Triton on CUDA, `chosen_logprobs_torch` elsewhere).
    """
    from rlhfuse.algorithms import ops  # deferred: ops imports this module for the reference

    *batch_shape, _ = logits_BTV.shape
    if labels_BT.shape != tuple(batch_shape):
        raise ValueError(
            f"labels shape {tuple(labels_BT.shape)} must equal the logits' leading shape {tuple(batch_shape)}"
        )
    labels_N = labels_BT.reshape(-1)
    pieces_N, start = [], 0
    for logits_NV in _row_blocks_NV(logits_BTV):
        stop = start + logits_NV.shape[0]
        pieces_N.append(
            ops.chosen_logprobs(
                logits_NV, labels_N[start:stop], temperature, chunk_size=chunk_size, backend=backend
            )
        )
        start = stop
    return torch.cat(pieces_N).reshape(batch_shape)
