"""Triton kernels of the exact (batch-invariant) forward on CUDA (`rlhfuse.models.exact`): a row's results are the
same bits whatever else is in the call, because every reduction has one fixed shape and order.

Loaded at runtime with `rlhfuse._resources.load_kernel_module("exact")`; on the CPU the same module runs under
TRITON_INTERPRET=1 (tests/models/test_models_exact.py, `make gpu-check`'s dry run), where the claims below are
tested as far as the interpreter can show them. Not yet run on a GPU.

Legend: N rows (tokens) of a linear, I input features, O output features; for attention B batch, H query heads,
K kv heads, T queries, S key positions, E head channels (EB: E rounded up to a power of two), J a query's allowed
keys, compacted (the j-th allowed key in position order).

- `invariant_matmul(x_NI, weight_OI)`: x @ weight.T in [BLOCK_M, BLOCK_N] output tiles, the I reduction in
  BLOCK_K steps, one `tl.dot` per step accumulated in order in fp32 (IEEE fp32 products for fp32 inputs, no
  TF32). The tile shapes are constants and there is no split over I, so the reduction a row's output sees is the
  same for every row count, and, as the tensor cores compute every element of a tile alike, for every place of
  the row in its tile (cuBLAS picks algorithms, split-K among them, by shape: its bits change with N). Under the
  interpreter `tl.dot` is numpy's BLAS, whose bits may change with the place in a tile: the tests there hold a
  row at a tile's first place; the gpu-check row `exact kernels` checks a row inside a tile on a GPU.
- `exact_attention(...)`: one program per (row, head, query). The query's allowed keys are compacted to the
  left in position order (`index_BTJ`, count_BT) and read in blocks of BLOCK_J from the first: a score is
  `tl.sum` over EB channels (one tree), the max over blocks, then exp, the denominator and p . v summed over a
  block (one tree of BLOCK_J) and the blocks added first to last. Slots past the query's count weigh exactly 0,
  and x + 0.0 == x anywhere in a tree: a query's result depends only on its own keys' values, in order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 32, 32, 32
"""The linear's tile: rows, output features, input features per step."""
BLOCK_J = 32
"""Keys per block of the attention's sums."""
NUM_WARPS = 4
"""Fixed: the reduction trees' layout is part of the bits."""


@triton.jit
def _matmul_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rows_n,
    features,
    out_features,
    stride_xn,
    stride_xi,
    stride_wo,
    stride_wi,
    stride_yn,
    stride_yo,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, features, BLOCK_K):
        k = start + inner
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xn + k[None, :] * stride_xi,
            mask=(rows[:, None] < rows_n) & (k[None, :] < features),
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[None, :].to(tl.int64) * stride_wo + k[:, None] * stride_wi,
            mask=(cols[None, :] < out_features) & (k[:, None] < features),
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(
        y_ptr + rows[:, None].to(tl.int64) * stride_yn + cols[None, :] * stride_yo,
        acc.to(y_ptr.dtype.element_ty),
        mask=(rows[:, None] < rows_n) & (cols[None, :] < out_features),
    )


def invariant_matmul(x_NI: torch.Tensor, weight_OI: torch.Tensor) -> torch.Tensor:
    """x @ weight.T ([N, O], x's dtype) in fixed tiles: a row's bits do not depend on N or on the other rows."""
    n, features = x_NI.shape
    out_features = weight_OI.shape[0]
    y_NO = torch.empty(n, out_features, dtype=x_NI.dtype, device=x_NI.device)
    if n == 0:
        return y_NO
    grid = (triton.cdiv(n, BLOCK_M), triton.cdiv(out_features, BLOCK_N))
    _matmul_kernel[grid](
        x_NI,
        weight_OI,
        y_NO,
        n,
        features,
        out_features,
        x_NI.stride(0),
        x_NI.stride(1),
        weight_OI.stride(0),
        weight_OI.stride(1),
        y_NO.stride(0),
        y_NO.stride(1),
        IEEE=x_NI.dtype == torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS,
    )
    return y_NO


@triton.jit
def _scores(q, k_ptr, index_ptr, first, count, start, k_base, stride_ks, channel, E, scale, softcap,
            HAS_INDEX: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_J: tl.constexpr):  # fmt: skip
    """One block's scores ([BLOCK_J], -inf past the count) and the key positions it read."""
    j = start + tl.arange(0, BLOCK_J)
    inside = j < count
    if HAS_INDEX:
        key = tl.load(index_ptr + j, mask=inside, other=0).to(tl.int64)
    else:
        key = (first + j).to(tl.int64)
    k = tl.load(
        k_ptr + k_base + key[:, None] * stride_ks + channel[None, :],
        mask=inside[:, None] & (channel[None, :] < E),
        other=0.0,
    ).to(q.dtype)
    s = tl.sum(k * q[None, :], axis=1) * scale
    if HAS_SOFTCAP:  # tanh(y) = 1 - 2 / (exp(2 y) + 1), elementwise
        s = (1.0 - 2.0 / (tl.exp(2.0 * (s / softcap)) + 1.0)) * softcap
    return tl.where(inside, s, float("-inf")), key, inside


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    index_ptr,
    first_ptr,
    count_ptr,
    out_ptr,
    H,
    T,
    J,
    E,
    group,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_ob,
    stride_oh,
    stride_ot,
    scale,
    softcap,
    HAS_INDEX: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    WIDE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    program = tl.program_id(0)
    t = program % T
    h = (program // T) % H
    b = program // (T * H)
    kv = h // group
    channel = tl.arange(0, BLOCK_E)
    acc_dtype = tl.float64 if WIDE else tl.float32
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh + t * stride_qt + channel,
        mask=channel < E,
        other=0.0,
    ).to(acc_dtype)
    query = b.to(tl.int64) * T + t
    count = tl.load(count_ptr + query)
    first = tl.load(first_ptr + query)
    index_row = index_ptr + query * J
    k_base = b.to(tl.int64) * stride_kb + kv * stride_kh
    v_base = b.to(tl.int64) * stride_vb + kv * stride_vh
    best = tl.full([], float("-inf"), dtype=acc_dtype)
    for start in range(0, count, BLOCK_J):
        s, _, _ = _scores(q, k_ptr, index_row, first, count, start, k_base, stride_ks, channel, E, scale, softcap,
                          HAS_INDEX, HAS_SOFTCAP, BLOCK_J)  # fmt: skip
        best = tl.maximum(best, tl.max(s, axis=0))
    total = tl.zeros([], dtype=acc_dtype)
    acc = tl.zeros((BLOCK_E,), dtype=acc_dtype)
    for start in range(0, count, BLOCK_J):
        s, key, inside = _scores(q, k_ptr, index_row, first, count, start, k_base, stride_ks, channel, E, scale,
                                 softcap, HAS_INDEX, HAS_SOFTCAP, BLOCK_J)  # fmt: skip
        w = tl.where(inside, tl.exp(s - best), 0.0)
        total += tl.sum(w, axis=0)
        v = tl.load(
            v_ptr + v_base + key[:, None] * stride_vs + channel[None, :],
            mask=inside[:, None] & (channel[None, :] < E),
            other=0.0,
        ).to(acc_dtype)
        acc += tl.sum(w[:, None] * v, axis=0)
    out = acc / total
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + t * stride_ot + channel,
        out.to(out_ptr.dtype.element_ty),
        mask=channel < E,
    )


def exact_attention(
    q_BHTE: torch.Tensor,
    k_BKSE: torch.Tensor,
    v_BKSE: torch.Tensor,
    allowed_B1TS: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v over each query's allowed keys, in position order (module docstring); no mask:
    causal over T == S keys, within `window` when set. Forward only (the caller's autograd has the backward)."""
    b, h, t, e = q_BHTE.shape
    kv_heads, s = k_BKSE.shape[1], k_BKSE.shape[2]
    device = q_BHTE.device
    if allowed_B1TS is None:  # query t's keys: first_T .. t, in order
        t_T = torch.arange(t, device=device, dtype=torch.int32)
        first_BT = (t_T - (window or t) + 1).clamp(min=0).expand(b, t).contiguous()
        count_BT = (t_T + 1 - first_BT).contiguous()
        index_BTJ = first_BT  # unread
        keys = 1
    else:  # each query's allowed keys, compacted to the left in position order
        allowed_BTS = allowed_B1TS[:, 0].expand(b, t, s)
        count_BT = allowed_BTS.sum(-1, dtype=torch.int32).contiguous()
        index_BTJ = torch.argsort((~allowed_BTS).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
        keys = max(int(count_BT.max()), 1) if count_BT.numel() else 1
        index_BTJ = index_BTJ[..., :keys].contiguous()
        first_BT = count_BT  # unread
    q_BHTE, k_BKSE, v_BKSE = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_BHTE, k_BKSE, v_BKSE))
    wide = q_BHTE.dtype == torch.float64
    out_BHTE = torch.empty(b, h, t, e, dtype=q_BHTE.dtype, device=device)
    if out_BHTE.numel() == 0:
        return out_BHTE
    _attention_kernel[(b * h * t,)](
        q_BHTE,
        k_BKSE,
        v_BKSE,
        index_BTJ,
        first_BT,
        count_BT,
        out_BHTE,
        h,
        t,
        keys,
        e,
        h // kv_heads,
        *q_BHTE.stride()[:3],
        *k_BKSE.stride()[:3],
        *v_BKSE.stride()[:3],
        *out_BHTE.stride()[:3],
        scale,
        softcap or 1.0,
        HAS_INDEX=allowed_B1TS is not None,
        HAS_SOFTCAP=softcap is not None,
        WIDE=wide,
        BLOCK_E=triton.next_power_of_2(e),
        BLOCK_J=BLOCK_J,
        num_warps=NUM_WARPS,
    )
    return out_BHTE
