"""Attention kernels behind one switch point: `ATTENTION_BACKENDS[config.attention_backend]`.

Legend: B batch, H query heads, T query tokens, S key tokens, D head channels.

Every backend takes q_BHTD, k_BHSD, v_BHSD (k/v with H_kv <= H heads; grouped-query attention shares each kv
head among H // H_kv consecutive query heads, as in LLaMA) and either `allowed_B1TS` (bool, True = may attend)
or None, which means plain causal attention over T == S tokens with no padding: the fast path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhfuse._optional import require

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


def get_attention(name: str) -> AttentionFn:
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"attention_backend={name!r} is unknown: use one of {sorted(ATTENTION_BACKENDS)}"
        ) from None
