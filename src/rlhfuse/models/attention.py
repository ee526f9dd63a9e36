"""Attention kernels behind one switch point: `ATTENTION_BACKENDS[config.attention_backend]`.

Legend: B batch, H query heads, K kv heads, G = H // K query heads per kv head, T query tokens, S key tokens,
D head channels.

Every backend takes q_BHTD, k_BKSD, v_BKSD (K <= H; grouped-query attention shares each kv head among G
consecutive query heads, as in LLaMA) and either `allowed_B1TS` (bool, True = may attend) or None, which means
plain causal attention over T == S tokens with no padding: the fast path. A layer whose attention differs from
that (`AttentionSpec`: a sliding window, a score scale other than head_dim ** -0.5, a tanh soft-cap on the
scores) gets `get_attention(name, spec)`: its plain causal calls attend to the last `window` keys only
(flash-attn's `window_size`, a band mask for sdpa); a masked call carries its window in the mask already (the
model builds it from the tokens' positions), so the kernel's window is not applied to it again. Soft-capped
scores have no fused SDPA kernel: sdpa computes them explicitly (`softcapped_attention`, [B, H, T, S] scores),
flash-attn in its kernel (`softcap`).

Packed sequences (`rlhfuse.models.packing`, N tokens of B sequences end to end, no padding) go through
`PACKED_ATTENTION_BACKENDS[config.attention_backend]`: q_NHE, k_NKE, v_NKE (K kv heads, E head channels) and the
`PackedSequences`, causal inside each sequence, nothing across sequences.

exact (`rlhfuse.models.exact.exact_attention`) gives each query the same bits whatever the call's batch, padding
or cache layout: it sums over the query's allowed keys alone, in position order (a compiled pass on the CPU, a
Triton kernel of fixed blocks on CUDA), with the model's linears made batch-invariant too
(`ModelConfig.batch_invariant`).

Which torch SDPA kernel each call reaches is decided by `sdpa_call` (a pure function of the call's shape, dtype
and device; docs/models.md, "Precision and attention kernels", has the table). The point is that no call of the
model reaches SDPA's math kernel in bf16 / fp16 / fp32, which materialises the [B, H, T, S] scores (and, for
grouped-query attention, K and V repeated to H heads). The one exception is a soft-capped layer (Gemma 2) under
sdpa, whose capped scores no fused kernel computes: `softcapped_attention` materialises them (flash-attn does not).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend

from rlhfuse._optional import require
from rlhfuse.models.exact import exact_attention
from rlhfuse.models.masks import band_mask
from rlhfuse.models.model_config import AttentionBackend as AttentionBackend  # importable from here too

if TYPE_CHECKING:
    from rlhfuse.models.packing import PackedSequences

log = logging.getLogger(__name__)

AttentionFn = Callable[[Tensor, Tensor, Tensor, "Tensor | None"], Tensor]

KvLayout = Literal["native", "repeat", "fold"]
"""How grouped-query K / V reach the kernel: native = as they are, K heads (enable_gqa=True where K < H);
repeat = `repeat_interleave` to H heads (costs [B, H, S, D] per call, never [B, H, T, S]); fold = the G query
heads of each kv head stacked along the query axis, q [B, K, G*T, D] against the K kv heads (no copy of K / V:
the mask's rows repeat G times instead)."""


@dataclass(frozen=True)
class SdpaCall:
    """How one SDPA call is made: the kv layout, and the kernels torch may pick for it (in torch's order; empty
    where no claim is made)."""

    kv: KvLayout
    kernels: tuple[SDPBackend, ...]


# fp16 / bf16: what CUDA's flash kernel takes (sm80+); the memory-efficient kernel also takes fp32
_HALF = (torch.float16, torch.bfloat16)


def sdpa_call(
    device_type: str,
    dtype: torch.dtype,
    *,
    masked: bool,
    num_heads: int,
    num_kv_heads: int,
    num_queries: int,
    head_dim: int,
) -> SdpaCall:
    """The kv layout and the kernels of one SDPA call (torch 2.13's dispatch rules, `sdp_utils.cpp`):

    CPU: the CPU flash kernel (`SDPBackend.FLASH_ATTENTION`) takes every call the model makes: masks ([B, 1, T, S]
    bool), grouped-query K / V (enable_gqa=True), fp32 / bf16 / fp16 and float64.

    CUDA: the flash kernel takes no mask and fp16 / bf16 only, but grouped-query K / V natively; the
    memory-efficient kernel takes a mask and fp32 too, but not grouped-query K / V; anything neither takes falls to
    math. So: unmasked fp16 / bf16 = flash, native K / V; unmasked fp32 with K < H = memory-efficient on repeated
    K / V; masked = memory-efficient, with K < H folded (few queries: a decode step, the mask's rows are cheap) or
    repeated (many: a padded prefill, where G copies of the [T, S] mask would outweigh K / V). cuDNN's kernel comes
    first where torch ranks it first (Hopper / Blackwell with cuDNN > 9.15) and it accepts the call; float64 has
    no fused CUDA kernel (math). Other devices (mps, xpu, ...): native K / V and no claim (`kernels` empty)."""
    gqa = num_kv_heads != num_heads
    if device_type == "cpu":
        return SdpaCall("native", (SDPBackend.FLASH_ATTENTION,))
    if device_type != "cuda":
        return SdpaCall("native", ())  # another accelerator: torch's own choice, no claim made
    if dtype not in (*_HALF, torch.float32):
        return SdpaCall("native", (SDPBackend.MATH,))
    if not masked and dtype in _HALF:
        return SdpaCall("native", (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION))
    fused = (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
    if not gqa:
        return SdpaCall("native", fused)
    group = num_heads // num_kv_heads
    # elements each layout materialises per batch row and key: fold repeats the mask's T rows G times, repeat
    # copies K and V to H heads of D channels; causal calls have no mask to fold
    if masked and group * num_queries <= 2 * num_heads * head_dim:
        return SdpaCall("fold", fused)
    return SdpaCall("repeat", fused)


def sdpa_call_of(q_BHTD: Tensor, k_BKSD: Tensor, allowed_B1TS: Tensor | None) -> SdpaCall:
    return sdpa_call(
        q_BHTD.device.type,
        q_BHTD.dtype,
        masked=allowed_B1TS is not None,
        num_heads=q_BHTD.shape[1],
        num_kv_heads=k_BKSD.shape[1],
        num_queries=q_BHTD.shape[2],
        head_dim=q_BHTD.shape[3],
    )


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer's attention computes past plain causal softmax(q k^T / sqrt(E)) v."""

    window: int | None = None
    """Keys a query attends to, itself included (a sliding window); None = every earlier key."""
    scale: float | None = None
    """The scores' scale; None = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)."""
    softcap: float | None = None
    """Scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2); None = uncapped."""

    def scale_for(self, head_dim: int) -> float:
        """The scores' scale for heads of `head_dim` channels (`scale`, else head_dim ** -0.5)."""
        return self.scale if self.scale is not None else head_dim**-0.5


PLAIN = AttentionSpec()


def sdpa_as_called(
    q_BHTD: Tensor,
    k_BKSD: Tensor,
    v_BKSD: Tensor,
    allowed_B1TS: Tensor | None,
    call: SdpaCall,
    scale: float | None = None,
) -> Tensor:
    """One SDPA call laid out as `call` says (the same numbers whatever the layout: each is exact)."""
    b, h, t, d = q_BHTD.shape
    kv_heads = k_BKSD.shape[1]
    causal = allowed_B1TS is None
    if call.kv == "repeat":
        group = h // kv_heads
        k_BHSD = k_BKSD.repeat_interleave(group, dim=1)
        v_BHSD = v_BKSD.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(
            q_BHTD, k_BHSD, v_BHSD, attn_mask=allowed_B1TS, is_causal=causal, scale=scale
        )
    if call.kv == "fold":
        assert allowed_B1TS is not None, "fold needs a mask (causal calls repeat)"
        group = h // kv_heads
        # query head h = k * G + g: row g * T + t of kv head k (a view when T == 1)
        q_BKXD = q_BHTD.reshape(b, kv_heads, group * t, d)
        allowed_B1XS = allowed_B1TS if t == 1 else allowed_B1TS.repeat(1, 1, group, 1)
        out_BKXD = F.scaled_dot_product_attention(q_BKXD, k_BKSD, v_BKSD, attn_mask=allowed_B1XS, scale=scale)
        return out_BKXD.reshape(b, h, t, d)
    gqa = kv_heads != h
    return F.scaled_dot_product_attention(
        q_BHTD, k_BKSD, v_BKSD, attn_mask=allowed_B1TS, is_causal=causal, enable_gqa=gqa, scale=scale
    )


def softcapped_attention(
    q_BHTD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, allowed_B1TS: Tensor | None, spec: AttentionSpec
) -> Tensor:
    """Attention with tanh soft-capped scores, computed explicitly (no fused SDPA kernel caps them): the
    [B, H, T, S] scores in q's dtype, the softmax in at least fp32."""
    assert spec.softcap is not None
    group = q_BHTD.shape[1] // k_BKSD.shape[1]
    k_BHSD, v_BHSD = k_BKSD.repeat_interleave(group, 1), v_BKSD.repeat_interleave(group, 1)
    scores_BHTS = torch.matmul(q_BHTD, k_BHSD.transpose(-1, -2)) * spec.scale_for(q_BHTD.shape[-1])
    scores_BHTS = torch.tanh(scores_BHTS / spec.softcap) * spec.softcap
    if allowed_B1TS is None:  # plain causal over T == S
        allowed_B1TS = band_mask(q_BHTD.shape[2], q_BHTD.shape[2], q_BHTD.device)
    scores_BHTS = scores_BHTS.masked_fill(~allowed_B1TS, float("-inf"))
    wide = torch.promote_types(scores_BHTS.dtype, torch.float32)
    weights_BHTS = scores_BHTS.softmax(-1, dtype=wide).to(q_BHTD.dtype)
    return torch.matmul(weights_BHTS, v_BHSD)


def sdpa_attention(
    q_BHTD: Tensor,
    k_BKSD: Tensor,
    v_BKSD: Tensor,
    allowed_B1TS: Tensor | None,
    spec: AttentionSpec = PLAIN,
) -> Tensor:
    """torch's fused scaled-dot-product attention, laid out by `sdpa_call`; with no mask it runs the causal
    kernel, building nothing (a window narrower than the call becomes a band mask; soft-capped scores go through
    `softcapped_attention`)."""
    window = spec.window
    if allowed_B1TS is None and window is not None and q_BHTD.shape[2] > window:
        allowed_B1TS = band_mask(q_BHTD.shape[2], window, q_BHTD.device)
    if spec.softcap is not None:
        return softcapped_attention(q_BHTD, k_BKSD, v_BKSD, allowed_B1TS, spec)
    call = sdpa_call_of(q_BHTD, k_BKSD, allowed_B1TS)
    return sdpa_as_called(q_BHTD, k_BKSD, v_BKSD, allowed_B1TS, call, spec.scale)


_warned_fallback: set[str] = set()


def _fallback_for_masks(name: str) -> None:
    if name not in _warned_fallback:
        _warned_fallback.add(name)
        log.warning(
            "attention_backend=%r handles unpadded causal batches only; padded or cached calls%s use sdpa",
            name,
            " and layers past plain attention (windows, scales, soft-caps)" if name == "te" else "",
        )


def _flash_kwargs(spec: AttentionSpec) -> dict[str, object]:
    """flash-attn's arguments for `spec`: `window_size=(left, right)` (query t attends to keys t - left .. t +
    right; >= 2.3), `softmax_scale`, `softcap` (>= 2.6); only those the layer needs, so older versions still
    run plain models."""
    kwargs: dict[str, object] = {}
    if spec.window is not None:
        kwargs["window_size"] = (spec.window - 1, 0)
    if spec.scale is not None:
        kwargs["softmax_scale"] = spec.scale
    if spec.softcap is not None:
        kwargs["softcap"] = spec.softcap
    return kwargs


def flash_attention(
    q_BHTD: Tensor,
    k_BHSD: Tensor,
    v_BHSD: Tensor,
    allowed_B1TS: Tensor | None,
    spec: AttentionSpec = PLAIN,
) -> Tensor:
    """flash-attn's causal kernel (CUDA, fp16/bf16) for unpadded batches; other calls go through sdpa."""
    flash_attn = require("flash_attn")
    if allowed_B1TS is not None:
        _fallback_for_masks("flash")
        return sdpa_attention(q_BHTD, k_BHSD, v_BHSD, allowed_B1TS, spec)
    # flash-attn wants [B, T, H, D] and does grouped-query attention natively
    out_BTHD = flash_attn.flash_attn_func(
        q_BHTD.transpose(1, 2),
        k_BHSD.transpose(1, 2),
        v_BHSD.transpose(1, 2),
        causal=True,
        **_flash_kwargs(spec),
    )
    return out_BTHD.transpose(1, 2)


_te_modules: dict[tuple[int, int, int], torch.nn.Module] = {}


def te_attention(
    q_BHTD: Tensor,
    k_BHSD: Tensor,
    v_BHSD: Tensor,
    allowed_B1TS: Tensor | None,
    spec: AttentionSpec = PLAIN,
) -> Tensor:
    """Transformer Engine's fused causal attention (CUDA) for unpadded batches; other calls, and layers past plain
    attention (windows, scales, soft-caps: not wired to TE, untested without a GPU here), go through sdpa."""
    te = require("transformer_engine.pytorch")
    if allowed_B1TS is not None or spec != PLAIN:
        _fallback_for_masks("te")
        return sdpa_attention(q_BHTD, k_BHSD, v_BHSD, allowed_B1TS, spec)
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


class LayerAttentionFn(Protocol):
    """A backend's kernel: `AttentionFn` with the layer's `AttentionSpec`."""

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, /, spec: AttentionSpec = PLAIN
    ) -> Tensor: ...


ATTENTION_BACKENDS: dict[str, LayerAttentionFn] = {
    "sdpa": sdpa_attention,
    "flash": flash_attention,
    "te": te_attention,
    "exact": exact_attention,
}


# Backends whose calls with a KV cache take several new positions per row under an arbitrary [T, S] mask (what a
# speculative verify step of k+1 positions needs): flash and te hand masked calls to sdpa; exact takes any mask.
# A backend added to ATTENTION_BACKENDS that handles one cached position per row only must stay out of this set.
MULTI_POSITION_BACKENDS: frozenset[str] = frozenset({"sdpa", "flash", "te", "exact"})


PackedAttentionFn = Callable[[Tensor, Tensor, Tensor, "PackedSequences"], Tensor]


class LayerPackedAttentionFn(Protocol):
    """A backend's packed kernel: `PackedAttentionFn` with the layer's `AttentionSpec`."""

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, packed: PackedSequences, /, spec: AttentionSpec = PLAIN
    ) -> Tensor: ...


def per_sequence_attention(
    attend: LayerAttentionFn,
    q_NHE: Tensor,
    k_NKE: Tensor,
    v_NKE: Tensor,
    packed: PackedSequences,
    spec: AttentionSpec = PLAIN,
) -> Tensor:
    """Packed attention as one batched per-sequence call of `attend`: each sequence moved to its own row of a
    right-padded [B, L] layout, where plain causal attention is exact (a real query never reaches the pad keys
    after it), and so is a sliding window (row positions are each sequence's own)."""
    batch, longest = packed.batch, packed.max_seqlen

    def dense_BHLE(x_NHE: Tensor) -> Tensor:
        # in place into the fresh zeros: the out-of-place index_copy would clone them first (same values, same
        # gradient: index_select of the output's gradient)
        flat = x_NHE.new_zeros(batch * longest, *x_NHE.shape[1:]).index_copy_(0, packed.dense_N, x_NHE)
        return flat.view(batch, longest, *x_NHE.shape[1:]).transpose(1, 2)

    out_BHLE = attend(dense_BHLE(q_NHE), dense_BHLE(k_NKE), dense_BHLE(v_NKE), None, spec=spec)
    # index_select, not x[index]: the same rows (and the same gradient: one addition onto zeros per row, the
    # indices being distinct), gathered several times faster than advanced indexing on the CPU
    return out_BHLE.transpose(1, 2).reshape(batch * longest, *q_NHE.shape[1:]).index_select(0, packed.dense_N)


def sdpa_packed_attention(
    q_NHE: Tensor, k_NKE: Tensor, v_NKE: Tensor, packed: PackedSequences, spec: AttentionSpec = PLAIN
) -> Tensor:
    """Packed attention through SDPA, per sequence (`per_sequence_attention`)."""
    return per_sequence_attention(sdpa_attention, q_NHE, k_NKE, v_NKE, packed, spec)


def exact_packed_attention(
    q_NHE: Tensor, k_NKE: Tensor, v_NKE: Tensor, packed: PackedSequences, spec: AttentionSpec = PLAIN
) -> Tensor:
    """Packed attention through `exact_attention`, per sequence: a sequence's keys are the same list as in its
    padded row or its KV cache, so a packed forward gives the padded one's bits."""
    return per_sequence_attention(exact_attention, q_NHE, k_NKE, v_NKE, packed, spec)


def flash_packed_attention(
    q_NHE: Tensor, k_NKE: Tensor, v_NKE: Tensor, packed: PackedSequences, spec: AttentionSpec = PLAIN
) -> Tensor:
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
        **_flash_kwargs(spec),
    )


# Backends that run packed sequences. te is absent: its THD format is not wired (untested without a GPU here),
# so packing with attention_backend=te is refused with `packing_problem`'s fix rather than run untested.
PACKED_ATTENTION_BACKENDS: dict[str, LayerPackedAttentionFn] = {
    "sdpa": sdpa_packed_attention,
    "flash": flash_packed_attention,
    "exact": exact_packed_attention,
}


def packing_problem(name: str) -> str | None:
    """Why attention_backend=`name` cannot run packed sequences (with the fix), or None when it can."""
    if name in PACKED_ATTENTION_BACKENDS:
        return None
    return (
        f"attention_backend={name!r} cannot run packed sequences (data.packing=true): set data.packing=false to "
        f"keep padded micro-batches, or use an attention backend that packs ({', '.join(sorted(PACKED_ATTENTION_BACKENDS))})"
    )


def get_packed_attention(name: str, spec: AttentionSpec = PLAIN) -> PackedAttentionFn:
    """The packed kernel of backend `name` for a layer attending as `spec` says."""
    problem = packing_problem(name)
    if problem is not None:
        raise ValueError(problem)
    fn = PACKED_ATTENTION_BACKENDS[name]
    return fn if spec == PLAIN else functools.partial(fn, spec=spec)


def get_attention(name: str, spec: AttentionSpec = PLAIN) -> AttentionFn:
    """The kernel of backend `name` for a layer attending as `spec` says; its window applies to the plain causal
    calls (masked calls carry theirs)."""
    try:
        fn = ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"attention_backend={name!r} is unknown: use one of {sorted(ATTENTION_BACKENDS)}"
        ) from None
    return fn if spec == PLAIN else functools.partial(fn, spec=spec)
