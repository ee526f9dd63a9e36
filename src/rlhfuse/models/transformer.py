"""One decoder-only transformer for the LLaMA, Qwen2, Qwen3 and Mistral families (`rlhfuse.models.model_config.
ARCHITECTURES`), with an LM head or a scalar value head.

Legend: B batch rows, T new tokens per row, S key positions attended over, D model width (hidden_size),
H query heads, K kv heads, E head channels (head_dim), V vocabulary, F MLP width (intermediate_size).

Module names match Hugging Face's (`layers.3.self_attn.q_proj`, ...), so checkpoint keys map one to one. Under
attention_backend="exact" (`ModelConfig.batch_invariant`) the linear layers are `InvariantLinear`s and the gate
activations the batch-invariant ones (`rlhfuse.models.exact`): the same parameters, computed row by row alike.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from rlhfuse.models.attention import AttentionSpec, PackedAttentionFn, get_attention, get_packed_attention
from rlhfuse.models.cache import CacheCall, KVCache
from rlhfuse.models.exact import GATE_ACTIVATIONS as INVARIANT_GATE_ACTIVATIONS
from rlhfuse.models.exact import InvariantLinear
from rlhfuse.models.masks import Padding, padding_of
from rlhfuse.models.model_config import SUPPORTED_HEADS, ModelConfig
from rlhfuse.models.packing import PackedSequences

CheckpointingMode = Literal["none", "full", "selective"]
"""What a training forward keeps for backward: none = every activation; full = each layer's input only (the
layer is recomputed in backward, activations ~1/L); selective = recompute the attention kernel and the MLP (their
score-matrix- and intermediate_size-wide activations), keep the projections' and norms' outputs."""

CHECKPOINTING_MODES: tuple[str, ...] = ("none", "full", "selective")


def _recompute(fn: nn.Module | object, *args: object) -> Tensor:
    out = torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)  # type: ignore[arg-type]
    assert isinstance(out, Tensor)
    return out


class RMSNorm(nn.Module):
    """x / rms(x) scaled per channel. offset 0: by the weight, in the input dtype (LLaMA); offset 1: by 1 + the
    stored weight, in fp32, then cast (Gemma, whose checkpoints store the scale minus one; fresh weights are 0)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x_BTD: Tensor) -> Tensor:
        # normalise in fp32 at least (bf16 mean squares lose too much; float64 stays float64)
        wide_BTD = x_BTD.to(torch.promote_types(x_BTD.dtype, torch.float32))
        normed_BTD = F.rms_norm(wide_BTD, (x_BTD.shape[-1],), eps=self.eps)
        if self.offset:
            return (normed_BTD * (self.offset + self.weight.to(normed_BTD.dtype))).to(x_BTD.dtype)
        return self.weight * normed_BTD.to(x_BTD.dtype)


def make_norm(config: ModelConfig, dim: int) -> RMSNorm:
    """The family's RMSNorm over `dim` channels (Gemma's stores its scale as an offset from 1)."""
    return RMSNorm(dim, config.rms_norm_eps, offset=1.0 if config.family.gemma else 0.0)


def rope_inv_freq(config: ModelConfig, device: torch.device | None = None) -> Tensor:
    """Rotary frequencies [R/2] in fp32 (R = config.rotary_dim), with the "linear", "llama3" or "yarn"
    rescaling when configured."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling or {}
    if config.rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif config.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif config.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(config, inv_freq)
    return inv_freq


def _yarn_factor(config: ModelConfig) -> float:
    scaling = config.rope_scaling or {}
    factor = scaling.get("factor")
    if factor is None:  # DeepSeek-V3's spelling: the ratio of the context lengths
        return config.max_position_embeddings / float(scaling["original_max_position_embeddings"])
    return float(factor)


def _yarn_inv_freq(config: ModelConfig, inv_freq: Tensor) -> Tensor:
    """YaRN (Peng et al. 2023): frequencies that turn fewer than beta_slow times over the original context are
    interpolated (divided by `factor`), those that turn more than beta_fast times kept, a linear ramp between."""
    scaling = config.rope_scaling or {}
    dim, base = config.rotary_dim, config.rope_theta
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def channel_of(turns: float) -> float:
        """The channel whose frequency turns `turns` times over the original context."""
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = channel_of(beta_fast), channel_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(
        0, 1
    )
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / _yarn_factor(config) * (1 - keep) + inv_freq * keep


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor YaRN scales cos and sin by (so q.k by its square): `attention_factor`, or 0.1 ln(factor) + 1
    (with DeepSeek's mscale / mscale_all_dim when both are given); 1 for the other rope types."""
    if config.rope_type != "yarn":
        return 1.0
    scaling = config.rope_scaling or {}
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(config)

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


def apply_rope(x_BTHE: Tensor, cos_BT1e: Tensor, sin_BT1e: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + R/2) of the first R = 2 x cos's channels by the position's angles (LLaMA's
    half-split layout; the channels past R, where partial_rotary_factor < 1, pass unrotated), written on the
    halves so that it costs no negated copy; the arithmetic is the same as `x*cos + rotate_half(x)*sin`."""
    rotary = 2 * cos_BT1e.shape[-1]
    rotated, passed = (
        (x_BTHE, None)
        if rotary == x_BTHE.shape[-1]
        else x_BTHE.split([rotary, x_BTHE.shape[-1] - rotary], dim=-1)
    )
    first, second = rotated.chunk(2, dim=-1)
    halves = (first * cos_BT1e - second * sin_BT1e, second * cos_BT1e + first * sin_BT1e)
    return torch.cat(halves if passed is None else (*halves, passed), dim=-1)


def rotary_tables(cos_BTe: Tensor, sin_BTe: Tensor) -> tuple[Tensor, Tensor]:
    """`apply_rope`'s tables laid out for `apply_rotary`: (cos_BT1R, signed_sin_BT1R) = ([cos, cos], [-sin, sin])
    over the R rotated channels, a head axis of 1 (made once per call, shared by every layer)."""
    cos_BT1e, sin_BT1e = cos_BTe[:, :, None], sin_BTe[:, :, None]
    return torch.cat((cos_BT1e, cos_BT1e), dim=-1), torch.cat((-sin_BT1e, sin_BT1e), dim=-1)


def apply_rotary(x_BTHE: Tensor, cos_BT1R: Tensor, signed_sin_BT1R: Tensor) -> Tensor:
    """`apply_rope` on `rotary_tables`' tables in 3 element-wise ops instead of 7, with the same bits forward and
    backward: each output is the same two correctly rounded products, added (a - b is a + (-b) exactly, and
    (-s) * x = -(s * x)), and each input's gradient the same two products summed (commutative)."""
    rotary = cos_BT1R.shape[-1]
    if rotary != x_BTHE.shape[-1]:
        rotated, passed = x_BTHE.split([rotary, x_BTHE.shape[-1] - rotary], dim=-1)
        return torch.cat((apply_rotary(rotated, cos_BT1R, signed_sin_BT1R), passed), dim=-1)
    first, second = x_BTHE.chunk(2, dim=-1)
    return x_BTHE * cos_BT1R + torch.cat((second, first), dim=-1) * signed_sin_BT1R


@dataclass
class AttentionContext:
    """What every layer of one forward call shares: rotary tables, the attention mask and cache addressing."""

    cos_BTe: Tensor
    """cos of the rotary angles, [B, T, R/2] (R = config.rotary_dim channels rotated, R/2 frequencies; YaRN's
    attention factor included)."""
    sin_BTe: Tensor
    allowed_B1TS: Tensor | None
    """True where query t may attend to key s; None = causal over the T new tokens, no padding (fast path)."""
    local_rope: tuple[Tensor, Tensor] | None = None
    """(cos, sin) of the sliding-window layers when their RoPE base differs (Gemma 3's local layers); None =
    every layer uses cos_BTe / sin_BTe."""
    windowed_B1TS: dict[int, Tensor] = field(default_factory=dict)
    """Per sliding window w of the model's layers, allowed_B1TS narrowed to the last w real tokens (set when
    allowed_B1TS is; a plain causal call leaves the window to the kernel)."""
    cache: KVCache | None = None
    call: CacheCall | None = None
    """The call's cache addressing (slots, write positions, positions read back), made on the host."""
    valid_BT: Tensor | None = None
    """Which new tokens are real (recorded in the cache once every layer has run)."""
    selective: bool = False
    """Recompute the attention kernel and the MLP in backward (activation_checkpointing="selective")."""
    packed: PackedSequences | None = None
    """Set for packed sequences: the call's one row [1, N] is the stream of N tokens of packed.batch sequences."""
    rotary: dict[bool, tuple[Tensor, Tensor]] = field(default_factory=dict)
    """`rotary_for`'s tables, made at the first layer that asks (key: local rope)."""

    def rotary_for(self, window: int | None) -> tuple[Tensor, Tensor]:
        """`rotary_tables` of `rope_for(window)`, made once per call and shared by the layers."""
        local = window is not None and self.local_rope is not None
        tables = self.rotary.get(local)
        if tables is None:
            tables = self.rotary[local] = rotary_tables(*self.rope_for(window))
        return tables

    def rope_for(self, window: int | None) -> tuple[Tensor, Tensor]:
        """(cos, sin) of a layer attending through `window` keys (None: a full-attention layer)."""
        if window is not None and self.local_rope is not None:
            return self.local_rope
        return self.cos_BTe, self.sin_BTe

    def allowed_for(self, window: int | None) -> Tensor | None:
        """The mask of a layer attending through `window` keys (None: full attention)."""
        if window is None or self.allowed_B1TS is None:
            return self.allowed_B1TS
        return self.windowed_B1TS[window]


def _windowed(
    config: ModelConfig, allowed_BTS: Tensor, query_index_BT: Tensor, key_index_BS: Tensor
) -> dict[int, Tensor]:
    """allowed_BTS narrowed to each of the model's sliding windows, [B, 1, T, S] each. The indices count real
    tokens (the n-th real token of a row has index n - 1), so padding between tokens does not shorten a window:
    query t keeps the keys fewer than w real tokens behind it."""
    if not config.windows:
        return {}
    distance_BTS = query_index_BT[:, :, None] - key_index_BS[:, None, :]
    return {w: (allowed_BTS & (distance_BTS < w))[:, None] for w in config.windows}


def packed_context(config: ModelConfig, packed: PackedSequences, dtype: torch.dtype) -> AttentionContext:
    """Rotary tables of the stream's per-sequence positions (restarting at 0 for every sequence), no mask."""
    return _with_rope(config, packed.position_ids_N[None], dtype, None, packed=packed)


def build_context(
    config: ModelConfig,
    batch: int,
    num_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
    attention_mask_BT: Tensor | None,
    position_ids_BT: Tensor | None,
    cache: KVCache | None = None,
    cache_slots_B: Tensor | Sequence[int] | None = None,
    padding: Padding | None = None,
) -> AttentionContext:
    """Positions, rotary tables and attention mask for one call (the cache itself is not modified here).

    padding: the mask's padding kind when the caller knows it (`rlhfuse.models.masks.MaskLayout`, worked out on
    the host); None: read from the mask (two host syncs)."""
    valid_BT = None if attention_mask_BT is None else attention_mask_BT.to(device=device, dtype=torch.bool)
    if cache is None:
        return _uncached_context(config, batch, num_tokens, device, dtype, valid_BT, position_ids_BT, padding)
    return _cached_context(
        config, batch, num_tokens, device, dtype, valid_BT, position_ids_BT, cache, cache_slots_B
    )


def _uncached_context(
    config: ModelConfig,
    batch: int,
    num_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
    valid_BT: Tensor | None,
    position_ids_BT: Tensor | None,
    padding: Padding | None = None,
) -> AttentionContext:
    t_T = torch.arange(num_tokens, device=device)
    if valid_BT is not None and padding is None:
        padding = padding_of(valid_BT)  # reads the mask: two host syncs (callers that know it pass it)
    if valid_BT is None or padding == "none":
        if position_ids_BT is None:
            position_ids_BT = t_T.expand(batch, num_tokens)
        return _with_rope(config, position_ids_BT, dtype, None)
    if position_ids_BT is None:
        position_ids_BT = (valid_BT.long().cumsum(-1) - 1).clamp(min=0)
    allowed_B1TS = None
    # pad after a real token (0 -> 1 along T) means left or inner padding; right padding alone needs no mask:
    # causally, real queries never reach the pad keys behind them (pad queries' outputs are meaningless)
    if padding == "inner":
        causal_TT = t_T[:, None] >= t_T[None, :]
        # the diagonal keeps pad query rows from having no key at all (NaN softmax); real rows include it anyway
        eye_TT = torch.eye(num_tokens, dtype=torch.bool, device=device)
        allowed_BTS = (causal_TT & valid_BT[:, None, :]) | eye_TT
        windowed: dict[int, Tensor] = {}
        if config.windows:
            index_BT = valid_BT.long().cumsum(-1) - 1
            windowed = _windowed(config, allowed_BTS, index_BT, index_BT)
        return _with_rope(config, position_ids_BT, dtype, allowed_BTS[:, None], windowed_B1TS=windowed)
    return _with_rope(config, position_ids_BT, dtype, allowed_B1TS)


def _cached_context(
    config: ModelConfig,
    batch: int,
    num_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
    valid_BT: Tensor | None,
    position_ids_BT: Tensor | None,
    cache: KVCache,
    cache_slots_B: Tensor | Sequence[int] | None,
) -> AttentionContext:
    # the slots, lengths and room are checked on the host (`KVCache.begin`): addressing never waits for the device
    slots = list(range(batch)) if cache_slots_B is None else cache_slots_B
    if len(slots) != batch:
        raise ValueError(f"cache_slots_B must have one slot per row: {len(slots)} slots, batch {batch}")
    call = cache.begin(slots, num_tokens)
    if valid_BT is None:
        valid_BT = torch.ones(batch, num_tokens, dtype=torch.bool, device=device)
    if position_ids_BT is None:
        earlier_valid_B = cache.valid_ST[call.slots_B].sum(-1)
        position_ids_BT = (earlier_valid_B[:, None] + valid_BT.long().cumsum(-1) - 1).clamp(min=0)
    write_pos_BT = call.write_pos_BT
    # which keys are real tokens: the slot's stored validity, with the new tokens' own written over it
    key_valid_BS = cache.valid_ST[call.slots_B, : call.num_keys]  # advanced indexing: a copy
    key_valid_BS.scatter_(1, write_pos_BT, valid_BT)
    s_S = torch.arange(call.num_keys, device=device)
    not_future_BTS = s_S[None, None, :] <= write_pos_BT[:, :, None]
    is_self_BTS = s_S[None, None, :] == write_pos_BT[:, :, None]
    allowed_BTS = (not_future_BTS & key_valid_BS[:, None, :]) | is_self_BTS
    windowed: dict[int, Tensor] = {}
    if config.windows:  # the real-token indices only narrow windows: a full-attention model skips them
        key_index_BS = key_valid_BS.long().cumsum(-1) - 1
        windowed = _windowed(config, allowed_BTS, key_index_BS.gather(1, write_pos_BT), key_index_BS)
    return _with_rope(
        config,
        position_ids_BT,
        dtype,
        allowed_BTS[:, None],
        windowed_B1TS=windowed,
        cache=cache,
        call=call,
        valid_BT=valid_BT,
    )


def projection_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype q, k and v leave their projections in, for weights (and activations) of `dtype`: autocast's
    dtype when autocast is on and casts `dtype` (it leaves float64 alone), else `dtype` itself."""
    if torch.is_autocast_enabled(device_type) and dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.get_autocast_dtype(device_type)
    return dtype


def _with_rope(
    config: ModelConfig,
    position_ids_BT: Tensor,
    dtype: torch.dtype,
    allowed_B1TS: Tensor | None,
    **fields: Any,
) -> AttentionContext:
    """A call's context: the rotary tables of `position_ids_BT` (and of the local layers' base, where it
    differs), the mask, and `fields`."""
    local = None
    if config.local_rope_theta is not None and config.windows:
        local_config = replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
        local = _rope_tables(local_config, position_ids_BT, dtype)
    cos_BTe, sin_BTe = _rope_tables(config, position_ids_BT, dtype)
    return AttentionContext(cos_BTe, sin_BTe, allowed_B1TS, local_rope=local, **fields)


_INV_FREQ: dict[tuple[object, ...], Tensor] = {}
"""`rope_inv_freq` per frequency-defining field and device: the same arithmetic on the same numbers each call,
so made once (a handful of small ops every forward, every decode step among them, otherwise)."""


def _cached_inv_freq(config: ModelConfig, device: torch.device) -> Tensor:
    key = (
        config.rotary_dim,
        config.rope_theta,
        repr(config.rope_scaling),
        config.max_position_embeddings,
        device,
    )
    inv_freq = _INV_FREQ.get(key)
    if inv_freq is None:
        # a plain tensor even when first asked for under inference_mode (it is only ever read)
        with torch.inference_mode(False):
            inv_freq = _INV_FREQ[key] = rope_inv_freq(config, device)
    return inv_freq


def _rope_tables(config: ModelConfig, position_ids_BT: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    inv_freq = _cached_inv_freq(config, position_ids_BT.device)
    # fp32 angles: bf16 positions above 256 would round
    angles_BTe = position_ids_BT.float()[:, :, None] * inv_freq[None, None, :]
    # tables in q's dtype: under bf16 autocast fp32 tables would promote the rotated q and k to fp32 while v stays
    # bf16, which flash-attn and Transformer Engine reject (and SDPA would cast back)
    table_dtype = projection_dtype(position_ids_BT.device.type, dtype)
    cos_BTe, sin_BTe = angles_BTe.cos(), angles_BTe.sin()
    factor = rope_attention_factor(config)
    if factor != 1.0:
        cos_BTe, sin_BTe = cos_BTe * factor, sin_BTe * factor
    return cos_BTe.to(table_dtype), sin_BTe.to(table_dtype)


def linear_type(config: ModelConfig) -> type[nn.Linear]:
    """The class of the model's linear layers: `InvariantLinear` for a batch-invariant model, else nn.Linear."""
    return InvariantLinear if config.batch_invariant else nn.Linear


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.resolved_head_dim
        d, e, bias = config.hidden_size, self.head_dim, config.qkv_bias
        linear = linear_type(config)
        self.q_proj = linear(d, self.num_heads * e, bias=bias)
        self.k_proj = linear(d, self.num_kv_heads * e, bias=bias)
        self.v_proj = linear(d, self.num_kv_heads * e, bias=bias)
        # LLaMA's and Qwen3's attention_bias also puts a bias on o_proj; Qwen2 has q/k/v biases only
        self.o_proj = linear(self.num_heads * e, d, bias=config.o_bias)
        if config.qk_norm:
            # Qwen3, Gemma 3: each head's q and k RMS-normalised over its E channels (one weight for the heads)
            self.q_norm = make_norm(config, e)
            self.k_norm = make_norm(config, e)
        self.qk_norm = config.qk_norm
        self.window = config.window_of(layer_idx)
        """Keys this layer attends to (a sliding window), or None for full causal attention."""
        scalar = config.query_pre_attn_scalar
        self.spec = AttentionSpec(
            window=self.window,
            scale=None if scalar is None else scalar**-0.5,
            softcap=config.attn_logit_softcapping,
        )
        """What this layer's attention computes past plain causal attention (window, scale, soft-cap)."""
        self.attend = get_attention(config.attention_backend, self.spec)
        self.backend = config.attention_backend
        self._attend_packed: tuple[str, PackedAttentionFn] | None = None
        """(backend, its packed kernel for this layer), looked up at the first packed call (a model whose
        backend cannot pack is refused there, not when built) and again if `backend` changes."""

    def forward(self, x_BTD: Tensor, ctx: AttentionContext) -> Tensor:
        b, t, _ = x_BTD.shape
        q_BTHE = self.q_proj(x_BTD).view(b, t, self.num_heads, self.head_dim)
        k_BTKE = self.k_proj(x_BTD).view(b, t, self.num_kv_heads, self.head_dim)
        v_BTKE = self.v_proj(x_BTD).view(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            # back to the projections' dtype: under bf16 autocast the norm's fp32 weight promotes q and k to fp32
            # while v stays bf16, a mix flash-attn and Transformer Engine refuse (and SDPA would cast back)
            q_BTHE = self.q_norm(q_BTHE).to(v_BTKE.dtype)
            k_BTKE = self.k_norm(k_BTKE).to(v_BTKE.dtype)
        cos_BT1R, signed_sin_BT1R = ctx.rotary_for(self.window)
        q_BTHE = apply_rotary(q_BTHE, cos_BT1R, signed_sin_BT1R)
        k_BTKE = apply_rotary(k_BTKE, cos_BT1R, signed_sin_BT1R)
        if ctx.packed is not None:
            # packed stream: B = 1 row of N tokens, attention per sequence of the stream
            if self._attend_packed is None or self._attend_packed[0] != self.backend:
                self._attend_packed = (self.backend, get_packed_attention(self.backend, self.spec))
            attend_packed = self._attend_packed[1]
            if ctx.selective:
                out_NHE = _recompute(attend_packed, q_BTHE[0], k_BTKE[0], v_BTKE[0], ctx.packed)
            else:
                out_NHE = attend_packed(q_BTHE[0], k_BTKE[0], v_BTKE[0], ctx.packed)
            return self.o_proj(out_NHE.reshape(b, t, self.num_heads * self.head_dim))
        q_BHTE = q_BTHE.transpose(1, 2)
        if ctx.cache is None:
            k_BKSE, v_BKSE = k_BTKE.transpose(1, 2), v_BTKE.transpose(1, 2)
        else:
            assert ctx.call is not None
            ctx.cache.store(self.layer_idx, ctx.call, k_BTKE, v_BTKE)
            k_BKSE, v_BKSE = ctx.cache.keys_values(self.layer_idx, ctx.call)
            k_BKSE, v_BKSE = k_BKSE.to(q_BHTE.dtype), v_BKSE.to(q_BHTE.dtype)
        allowed_B1TS = ctx.allowed_for(self.window)
        if ctx.selective:
            out_BHTE = _recompute(self.attend, q_BHTE, k_BKSE, v_BKSE, allowed_B1TS)
        else:
            out_BHTE = self.attend(q_BHTE, k_BKSE, v_BKSE, allowed_B1TS)
        return self.o_proj(out_BHTE.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


GATE_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh}
"""ModelConfig.hidden_act -> the gate's activation: SwiGLU (silu) or GeGLU (Gemma's tanh-approximated gelu)."""


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU, or GeGLU for Gemma."""

    def __init__(self, config: ModelConfig, width: int | None = None) -> None:
        super().__init__()
        d, f = config.hidden_size, width or config.intermediate_size
        linear = linear_type(config)
        self.gate_proj = linear(d, f, bias=False)
        self.up_proj = linear(d, f, bias=False)
        self.down_proj = linear(f, d, bias=False)
        activations = INVARIANT_GATE_ACTIVATIONS if config.batch_invariant else GATE_ACTIVATIONS
        self.act = activations[config.hidden_act]

    def forward(self, x_BTD: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x_BTD)) * self.up_proj(x_BTD))


class MoEBlock(nn.Module):
    """A mixture of experts (Qwen3-MoE, Mixtral): a bias-free router picks each token's top-k experts by softmax
    probability (renormalised over the k when config.norm_topk_prob), each a gated MLP; the token's output is the
    probability-weighted sum of its experts' outputs.

    Every expert runs on its tokens, an empty batch included, so every expert's weights get a gradient (zero when
    no token chose it) and the set of gradients never depends on the routing. Grouping the tokens by expert reads
    the per-expert counts on the host: one sync per block and call.

    Legend: N tokens (B x T flattened), X experts, K experts per token."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = linear_type(config)(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(config, config.expert_intermediate_size) for _ in range(config.num_experts)
        )
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.recorded: list[Tensor] | None = None
        """Where this block appends its router logits [N, X] while `record_router_logits` is on."""

    def route(self, x_ND: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(router logits [N, X], the top-k experts [N, K], their weights [N, K] in x's dtype)."""
        logits_NX = self.gate(x_ND)
        probs_NX = logits_NX.softmax(-1, dtype=torch.promote_types(logits_NX.dtype, torch.float32))
        weights_NK, experts_NK = probs_NX.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights_NK = weights_NK / weights_NK.sum(-1, keepdim=True)
        return logits_NX, experts_NK, weights_NK.to(x_ND.dtype)

    def forward(self, x_BTD: Tensor) -> Tensor:
        return self.expert_sum(x_BTD, range(len(self.experts)))

    def expert_sum(self, x_BTD: Tensor, experts: range) -> Tensor:
        """The probability-weighted sum of the outputs of `experts` (every expert: the block's output; a tensor-
        parallel block runs the ones its rank holds, `rlhfuse.runtime.tensor_parallel`), each run on the tokens
        routed to it, an empty batch included; the routing is over every expert."""
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        logits_NX, experts_NK, weights_NK = self.route(x_ND)
        if self.recorded is not None:
            self.recorded.append(logits_NX)
        # (token, slot) pairs grouped by expert: pair p = n * K + k; expert e's are [starts[e], starts[e + 1])
        order_P = experts_NK.flatten().argsort(stable=True)
        counts = torch.bincount(
            experts_NK.flatten(), minlength=len(self.experts)
        ).tolist()  # the one host read
        starts = [0, *itertools.accumulate(counts)]
        out_ND = torch.zeros_like(x_ND)
        for e in experts:
            pairs = order_P[starts[e] : starts[e + 1]]
            tokens = pairs // self.top_k
            y_MD = self.experts[e](x_ND[tokens]) * weights_NK.flatten()[pairs, None]
            out_ND = out_ND.index_add(0, tokens, y_MD)
        return out_ND.view_as(x_BTD)


@contextlib.contextmanager
def record_router_logits(model: nn.Module) -> Iterator[list[Tensor]]:
    """Collect the router logits [N, X] of every mixture-of-experts block of `model` during the forward calls
    made inside (in layer order), for `load_balancing_loss`."""
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    recorded: list[Tensor] = []
    for block in blocks:
        block.recorded = recorded
    try:
        yield recorded
    finally:
        for block in blocks:
            block.recorded = None


def load_balancing_loss(
    router_logits: Sequence[Tensor], num_experts: int, top_k: int, valid_N: Tensor | None = None
) -> Tensor:
    """The Switch Transformer's load-balancing loss, as transformers computes it for Qwen3-MoE and Mixtral:
    X x sum over experts of (the share of top-k assignments it got) x (its mean router probability), both over
    every layer's real tokens (`valid_N`: which of the N rows are tokens, None = all). 1 x top_k when the routing
    is uniform; larger the more it concentrates."""
    if not router_logits:
        raise ValueError(
            "load_balancing_loss needs the router logits of at least one mixture-of-experts block"
        )
    assignments_X = router_logits[0].new_zeros(num_experts, dtype=torch.float32)
    probs_X = torch.zeros_like(assignments_X)
    rows = router_logits[0].new_zeros((), dtype=torch.float32)
    for logits_NX in router_logits:
        probs_NX = logits_NX.softmax(-1, dtype=torch.promote_types(logits_NX.dtype, torch.float32))
        chosen_NK = probs_NX.topk(top_k, dim=-1).indices
        weight_N = probs_NX.new_ones(probs_NX.shape[0]) if valid_N is None else valid_N.to(probs_NX.dtype)
        assignments_X = assignments_X.to(probs_NX.dtype).scatter_add(
            0, chosen_NK.flatten(), weight_N.repeat_interleave(top_k)
        )
        probs_X = probs_X.to(probs_NX.dtype) + (probs_NX * weight_N[:, None]).sum(0)
        rows = rows.to(probs_NX.dtype) + weight_N.sum()
    return num_experts * (assignments_X / rows * probs_X / rows).sum()


class DecoderLayer(nn.Module):
    """A pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). Gemma's sandwich also normalises each branch's
    output (post_attention_layernorm, post_feedforward_layernorm), the MLP's input by pre_feedforward_layernorm."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.sandwich = config.family.gemma
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(config, config.hidden_size)
            self.post_feedforward_layernorm = make_norm(config, config.hidden_size)
        self.mlp: nn.Module = MoEBlock(config) if config.is_moe_layer(layer_idx) else GatedMLP(config)

    def _mlp(self, normed_BTD: Tensor, ctx: AttentionContext) -> Tensor:
        return _recompute(self.mlp, normed_BTD) if ctx.selective else self.mlp(normed_BTD)

    def forward(self, x_BTD: Tensor, ctx: AttentionContext) -> Tensor:
        attended_BTD = self.self_attn(self.input_layernorm(x_BTD), ctx)
        if not self.sandwich:
            x_BTD = x_BTD + attended_BTD
            return x_BTD + self._mlp(self.post_attention_layernorm(x_BTD), ctx)
        x_BTD = x_BTD + self.post_attention_layernorm(attended_BTD)
        mlp_BTD = self._mlp(self.pre_feedforward_layernorm(x_BTD), ctx)
        return x_BTD + self.post_feedforward_layernorm(mlp_BTD)


def run_layers(
    layers: nn.ModuleList, x_BTD: Tensor, ctx: AttentionContext, *, checkpointed: bool | CheckpointingMode
) -> Tensor:
    """Run `layers`; checkpointed = the model's activation_checkpointing mode (True = "full"), applied only
    when autograd records (training) and no KV cache is written."""
    mode = "full" if checkpointed is True else "none" if checkpointed is False else checkpointed
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(
            f"activation_checkpointing={mode!r} is unknown: use one of {', '.join(CHECKPOINTING_MODES)} "
            "(pipeline.activation_checkpointing)"
        )
    active = torch.is_grad_enabled() and ctx.cache is None
    ctx.selective = active and mode == "selective"
    for layer in layers:
        if active and mode == "full":
            x_BTD = _recompute(layer, x_BTD, ctx)
        else:
            x_BTD = layer(x_BTD, ctx)
    return x_BTD


class Transformer(nn.Module):
    """Decoder-only transformer. head="lm" returns logits_BTV (Actor, Ref); head="value" returns values_BT
    (Critic, Reward): one scalar per token from a bias-free linear layer over the final hidden state."""

    def __init__(self, config: ModelConfig, head: str = "lm") -> None:
        super().__init__()
        config.validate()
        if head not in SUPPORTED_HEADS:
            raise ValueError(f"head={head!r} is unknown: use one of {SUPPORTED_HEADS}")
        self.config = config
        self.head = head
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = make_norm(config, config.hidden_size)
        linear = linear_type(config)
        if head == "lm":
            self.lm_head = linear(config.hidden_size, config.vocab_size, bias=False)
        else:
            self.value_head = linear(config.hidden_size, 1, bias=False)
        self.activation_checkpointing: bool | CheckpointingMode = "none"
        """What training keeps for backward: "none" | "full" (recompute each layer, memory ~1/L) | "selective"
        (recompute attention kernels and MLPs); True means "full" (`CheckpointingMode`)."""
        self.packing = False
        """Pipeline stages of this model (`Stage`) run packed sequences between padded edges (data.packing)."""
        self.apply(self._init_weights)
        if head == "lm" and config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def _is_tied(self, name: str) -> bool:
        """True for the LM head's weight when it is the embedding table's (stored once in checkpoints)."""
        return (
            name == "lm_head.weight" and self.head == "lm" and self.lm_head.weight is self.embed_tokens.weight
        )

    def cache_config(self) -> ModelConfig:
        """The shape a KV cache for this module is allocated with: the kv heads its attention computes (a
        tensor-parallel shard's own, `rlhfuse.runtime.tensor_parallel.shard_transformer`)."""
        attention: Any = self.layers[0].self_attn
        return replace(self.config, num_kv_heads=int(attention.num_kv_heads))

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token embeddings; Gemma scales them by sqrt(hidden_size) (rounded to the weights' dtype, as HF does)."""
        x = self.embed_tokens(input_ids)
        if not self.config.family.gemma:
            return x
        # the scale rounded to x's dtype on the host (a Python number: no host tensor meets a device one)
        scale = float(torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).to(x.dtype))
        return x * scale

    def apply_head(self, hidden_BTD: Tensor) -> Tensor:
        if self.head == "value":
            return self.value_head(hidden_BTD).squeeze(-1)
        logits_BTV = self.lm_head(hidden_BTD)
        cap = self.config.final_logit_softcapping
        return logits_BTV if cap is None else torch.tanh(logits_BTV / cap) * cap

    def hidden_states(
        self,
        input_ids_BT: Tensor,
        *,
        attention_mask_BT: Tensor | None = None,
        position_ids_BT: Tensor | None = None,
        cache: KVCache | None = None,
        cache_slots_B: Tensor | Sequence[int] | None = None,
        padding: Padding | None = None,
    ) -> Tensor:
        """Final-norm output hidden_BTD, before the head (for chunked log-probs over a large vocabulary);
        `padding`: the mask's padding kind, worked out on the host (`forward`)."""
        if cache is not None and torch.is_grad_enabled() and self.embed_tokens.weight.requires_grad:
            # cached keys/values are written into engine-owned buffers, outside autograd
            raise RuntimeError(
                "forward with a KV cache is for inference: wrap it in torch.no_grad() or torch.inference_mode()"
            )
        x_BTD = self.embed(input_ids_BT)
        b, t = input_ids_BT.shape
        ctx = build_context(
            self.config,
            b,
            t,
            x_BTD.device,
            x_BTD.dtype,
            attention_mask_BT,
            position_ids_BT,
            cache,
            cache_slots_B,
            padding,
        )
        x_BTD = run_layers(self.layers, x_BTD, ctx, checkpointed=self.activation_checkpointing)
        if cache is not None:
            assert ctx.call is not None and ctx.valid_BT is not None
            # only now, with every layer's k/v written, do the new positions become part of their slots
            cache.commit(ctx.call, ctx.valid_BT)
        return self.norm(x_BTD)

    def packed_hidden_states(self, input_ids_N: Tensor, packed: PackedSequences) -> Tensor:
        """Final-norm output hidden_ND of packed sequences (`rlhfuse.models.packing`): each of the
        packed.batch sequences attends causally within itself, with positions restarting at 0."""
        if input_ids_N.shape != (packed.num_tokens,):
            raise ValueError(
                f"input_ids_N must hold the {packed.num_tokens} packed tokens, got shape {tuple(input_ids_N.shape)}"
            )
        x_1ND = self.embed(input_ids_N)[None]
        ctx = packed_context(self.config, packed.to(x_1ND.device), x_1ND.dtype)
        x_1ND = run_layers(self.layers, x_1ND, ctx, checkpointed=self.activation_checkpointing)
        return self.norm(x_1ND)[0]

    def packed_outputs(self, input_ids_N: Tensor, packed: PackedSequences, picked_M: Tensor) -> Tensor:
        """The head's outputs (logits [M, V] or values [M]) at the packed positions `picked_M`: the packed
        forward whole, in one call (a sharded model gathers its root weights once for it, as for `forward`)."""
        hidden_ND = self.packed_hidden_states(input_ids_N, packed)
        # index_select: x[picked_M]'s rows and gradient (distinct indices), gathered faster
        return self.apply_head(hidden_ND.index_select(0, picked_M)[None])[0]

    def forward(
        self,
        input_ids_BT: Tensor,
        *,
        attention_mask_BT: Tensor | None = None,
        position_ids_BT: Tensor | None = None,
        cache: KVCache | None = None,
        cache_slots_B: Tensor | Sequence[int] | None = None,
        padding: Padding | None = None,
    ) -> Tensor:
        """logits_BTV (head="lm") or values_BT (head="value").

        attention_mask_BT: 1 = token, 0 = padding (left or right). With `cache`, row b's tokens are appended to
        slot cache_slots_B[b] (default b) and attend to that slot's earlier valid positions. padding: the mask's
        padding kind when the caller worked it out on the host (`rlhfuse.models.masks.MaskLayout`); None: read
        from the mask (host syncs).
        """
        hidden_BTD = self.hidden_states(
            input_ids_BT,
            attention_mask_BT=attention_mask_BT,
            position_ids_BT=position_ids_BT,
            cache=cache,
            cache_slots_B=cache_slots_B,
            padding=padding,
        )
        return self.apply_head(hidden_BTD)
