"""Attention kernels behind one switch point: `ATTENTION_BACKENDS[config.attention_backend]`.

Legend: B batch, H query heads, T query tokens, S key tokens, D head channels.

Every backend takes q_BHTD, k_BHSD, v_BHSD (k/v with H_kv <= H heads; grouped-query attention shares each kv
head among H // H_kv consecutive query heads, as in LLaMA) and either `allowed_B1TS` (bool, True = may attend)
or None, which means plain causal attention over T == S tokens with no padding: the fast path.

Packed sequences (`rlhfuse.models.packing`, N tokens of B sequences end to end, no padding) go through
`PACKED_ATTENTION_BACKENDS[config.attention_backend]`: q_NHE, k_NKE, v_NKE (K kv heads, E head channels) and the
`PackedSequences`, causal inside each sequence, nothing across sequences.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhfuse._optional import require

if TYPE_CHECKING:
    from rlhfuse.models.packing import PackedSequences

log = logging.getLogger(__name__)

AttentionFn = Callable[[Tensor, Tensor, Tensor, "Tensor | None"], Tensor]


def sdpa_attention(q_BHTD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, allowed_B1TS: Tensor | None) -> Tensor:
    """torch's fused scaled-dot-product attention; with no mask it runs the causal kernel, building nothing."""
    gqa = k_BHSD.shape[1] != q_BHTD.shape[1]
    if allowed_B1TS is None:
        return F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, attn_mask=allowed_B1TS, enable_gqa=gqa)


_warned_fallback: set[str] = set()


def _fallback_for_masks(name: str) -> None:
    if name not in _warned_fallback:
        _warned_fallback.add(name)
        log.warning(
            "attention_backend=%r handles unpadded causal batches only; padded or cached calls use sdpa", name
        )


def flash_attention(q_BHTD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, allowed_B1TS: Tensor | None) -> Tensor:
    """flash-attn's causal kernel (CUDA, fp16/bf16) for unpadded batches; other calls go through sdpa."""
    flash_attn = require("flash_attn")
    if allowed_B1TS is not None:
        _fallback_for_masks("flash")
        return sdpa_attention(q_BHTD, k_BHSD, v_BHSD, allowed_B1TS)
    # flash-attn wants [B, T, H, D] and does grouped-query attention natively
    out_BTHD = flash_attn.flash_attn_func(
        q_BHTD.transpose(1, 2), k_BHSD.transpose(1, 2), v_BHSD.transpose(1, 2), causal=True
    )
    return out_BTHD.transpose(1, 2)


_te_modules: dict[tuple[int, int, int], torch.nn.Module] = {}


def te_attention(q_BHTD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, allowed_B1TS: Tensor | None) -> Tensor:
    """Transformer Engine's fused causal attention (CUDA) for unpadded batches; other calls go through sdpa."""
    te = require("transformer_engine.pytorch")
    if allowed_B1TS is not None:
        _fallback_for_masks("te")
        return sdpa_attention(q_BHTD, k_BHSD, v_BHSD, allowed_B1TS)
    _, num_heads, _, head_dim = q_BHTD.shape
    num_kv_heads = k_BHSD.shape[1]
    key = (num_heads, num_kv_heads, head_dim)
    if key not in _te_modules:
        # DotProductAttention holds no weights, only kernel choices, so one per shape is shared by all layers
        _te_modules[key] = te.DotProductAttention(
            num_heads, head_dim, num_gqa_groups=num_kv_heads, qkv_format="bshd", attn_mask_type="causal"
        )
    out_BTX = _te_modules[key](q_BHTD.transpose(1, 2), k_BHSD.transpose(1, 2), v_BHSD.transpose(1, 2))
    return out_BTX.view(q_BHTD.shape[0], q_BHTD.shape[2], num_heads, head_dim).transpose(1, 2)


ATTENTION_BACKENDS: dict[str, AttentionFn] = {
    "sdpa": sdpa_attention,
    "flash": flash_attention,
    "te": te_attention,
}


# Backends whose calls with a KV cache take several new positions per row under an arbitrary [T, S] mask (what a
# speculative verify step of k+1 positions needs): flash and te hand masked calls to sdpa. A backend added to
# ATTENTION_BACKENDS that handles one cached position per row only must stay out of this set.
MULTI_POSITION_BACKENDS: frozenset[str] = frozenset({"sdpa", "flash", "te"})


PackedAttentionFn = Callable[[Tensor, Tensor, Tensor, "PackedSequences"], Tensor]


def sdpa_packed_attention(q_NHE: Tensor, k_NKE: Tensor, v_NKE: Tensor, packed: PackedSequences) -> Tensor:
    """Packed attention as one batched per-sequence call: each sequence moved to its own row of a right-padded
    [B, L] layout, where plain causal SDPA is exact (a real query never reaches the pad keys after it)."""
    batch, longest = packed.batch, packed.max_seqlen

    def dense_BHLE(x_NHE: Tensor) -> Tensor:
        flat = x_NHE.new_zeros(batch * longest, *x_NHE.shape[1:]).index_copy(0, packed.dense_N, x_NHE)
        return flat.view(batch, longest, *x_NHE.shape[1:]).transpose(1, 2)

    out_BHLE = sdpa_attention(dense_BHLE(q_NHE), dense_BHLE(k_NKE), dense_BHLE(v_NKE), None)
    return out_BHLE.transpose(1, 2).reshape(batch * longest, *q_NHE.shape[1:])[packed.dense_N]


def flash_packed_attention(q_NHE: Tensor, k_NKE: Tensor, v_NKE: Tensor, packed: PackedSequences) -> Tensor:
    """flash-attn's varlen kernel (CUDA, fp16/bf16): causal per sequence of the stream, no padding computed."""
    flash_attn = require("flash_attn")
    cu_seqlens = packed.cu_seqlens_B1.to(device=q_NHE.device, dtype=torch.int32)
    return flash_attn.flash_attn_varlen_func(
        q_NHE,
        k_NKE,
        v_NKE,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=packed.max_seqlen,
        max_seqlen_k=packed.max_seqlen,
        causal=True,
    )


# Backends that run packed sequences. te is absent: its THD format is not wired (untested without a GPU here),
# so packing with attention_backend=te is refused with `packing_problem`'s fix rather than run untested.
PACKED_ATTENTION_BACKENDS: dict[str, PackedAttentionFn] = {
    "sdpa": sdpa_packed_attention,
    "flash": flash_packed_attention,
}


def packing_problem(name: str) -> str | None:
    """Why attention_backend=`name` cannot run packed sequences (with the fix), or None when it can."""
    if name in PACKED_ATTENTION_BACKENDS:
        return None
    return (
        f"attention_backend={name!r} cannot run packed sequences (data.packing=true): set data.packing=false to "
        f"keep padded micro-batches, or use an attention backend that packs ({', '.join(sorted(PACKED_ATTENTION_BACKENDS))})"
    )


def get_packed_attention(name: str) -> PackedAttentionFn:
    problem = packing_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return PACKED_ATTENTION_BACKENDS[name]


def get_attention(name: str) -> AttentionFn:
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"attention_backend={name!r} is unknown: use one of {sorted(ATTENTION_BACKENDS)}"
        ) from None
