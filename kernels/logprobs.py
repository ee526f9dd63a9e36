"""Triton kernel for chosen-token log-probabilities with an online (chunked) log-sum-exp over the vocabulary.

Loaded at runtime with `rlhfuse._resources.load_kernel_module("logprobs")`; the PyTorch reference with the same
signature is `rlhfuse.algorithms.chosen_logprobs_torch` (parity test: tests/kernels/test_logprobs_kernel.py).

Legend: N rows (flattened batch × time), V vocabulary, BLOCK_V vocabulary slice one loop step reads.

    log p(y) = x_y/τ − logsumexp_v(x_v/τ)
    online log-sum-exp (Milakov & Gimelshein 2018): m' = max(m, max_b x_b), s' = s·e^(m − m') + Σ_b e^(x_b − m')
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from rlhfuse.algorithms.logits import chosen_logprobs_backward


@triton.jit
def _chosen_logprobs_kernel(
    logits_ptr,
    labels_ptr,
    logprobs_ptr,
    log_normaliser_ptr,
    V,
    stride_row,
    temperature,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    offsets = tl.arange(0, BLOCK_V)
    # Running maximum and rescaled running sum of the online log-sum-exp, kept per lane and merged at the end.
    running_max = tl.full((BLOCK_V,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        columns = start + offsets
        in_bounds = columns < V
        x = tl.load(row_ptr + columns, mask=in_bounds, other=float("-inf")).to(tl.float32) / temperature
        new_max = tl.maximum(running_max, x)
        # Lanes that have only seen -inf keep a -inf max; guard exp(-inf - -inf) = NaN with where.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - safe_max) + tl.exp(x - safe_max)
        running_max = new_max
    row_max = tl.max(running_max, axis=0)
    total = tl.sum(running_sum * tl.exp(running_max - row_max), axis=0)
    label = tl.load(labels_ptr + row).to(tl.int64)
    chosen = tl.load(row_ptr + label).to(tl.float32) / temperature
    # (x_y − max) − log Σ rather than x_y − (max + log Σ): the first difference is exact, so large logits
    # (|x| ≫ 1) keep full precision, as log_softmax does.
    tl.store(logprobs_ptr + row, (chosen - row_max) - tl.log(total))
    tl.store(log_normaliser_ptr + row, row_max + tl.log(total))


def _forward(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, temperature: float, block_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    N, V = logits_NV.shape
    logits_c_NV = logits_NV.contiguous()
    logprobs_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    log_normaliser_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    if N > 0:
        _chosen_logprobs_kernel[(N,)](
            logits_c_NV,
            labels_N.contiguous(),
            logprobs_N,
            log_normaliser_N,
            V,
            logits_c_NV.stride(0),
            temperature,
            BLOCK_V=block_v,
        )
    return logprobs_N, log_normaliser_N


class _ChosenLogprobs(torch.autograd.Function):
    """Triton forward; backward g·(onehot(y) − softmax(x/τ))/τ in PyTorch, chunked, from the saved normaliser."""

    @staticmethod
    def forward(
        ctx: Any,
        logits_NV: torch.Tensor,
        labels_N: torch.Tensor,
        temperature: float,
        block_v: int,
        backward_chunk_rows: int,
    ) -> torch.Tensor:
        logprobs_N, log_normaliser_N = _forward(logits_NV, labels_N, temperature, block_v)
        ctx.save_for_backward(logits_NV, labels_N, log_normaliser_N)
        ctx.temperature = temperature
        ctx.backward_chunk_rows = backward_chunk_rows
        return logprobs_N

    @staticmethod
    def backward(ctx: Any, grad_logprobs_N: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits_NV, labels_N, log_normaliser_N = ctx.saved_tensors
        grad_logits_NV = chosen_logprobs_backward(
            logits_NV, labels_N, log_normaliser_N, grad_logprobs_N, ctx.temperature, ctx.backward_chunk_rows
        )
        return grad_logits_NV, None, None, None, None


def chosen_logprobs(
    logits_NV: torch.Tensor,
    labels_N: torch.Tensor,
    temperature: float = 1.0,
    *,
    block_v: int = 1024,
    backward_chunk_rows: int = 1024,
) -> torch.Tensor:
    """log softmax(x/τ)[y] per row, fp32, differentiable w.r.t. `logits_NV` (online log-sum-exp, this docstring)."""
    if logits_NV.dim() != 2 or labels_N.shape != logits_NV.shape[:1]:
        raise ValueError(
            f"expected logits (N, V) and labels (N,), got {tuple(logits_NV.shape)} and {tuple(labels_N.shape)}"
        )
    block_v = min(block_v, triton.next_power_of_2(max(logits_NV.shape[1], 1)))
    result = _ChosenLogprobs.apply(
        logits_NV, labels_N.long(), float(temperature), block_v, backward_chunk_rows
    )
    assert isinstance(result, torch.Tensor)
    return result
