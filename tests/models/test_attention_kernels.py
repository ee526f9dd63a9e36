"""Which SDPA kernel each attention call reaches (`rlhfuse.models.attention.sdpa_call`), and that every kv layout
the call chooses gives the same numbers.

On CPU the model's calls run under `sdpa_kernel` restricted to exactly the kernels the call claims (MATH
disabled), so a call that would fall back to the math kernel raises instead of passing. The CUDA calls' layouts
(repeated and folded kv heads) are checked for exactness here on CPU tensors, and against the CUDA kernels by the
gpu-marked test.

Legend: B batch, H query heads, K kv heads, T query tokens, S keys, D head channels, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rlhfuse.models import KVCache, ModelConfig, Transformer
from rlhfuse.models.attention import sdpa_as_called, sdpa_attention, sdpa_call
from rlhfuse.models.packing import pack_rows

CPU_KERNELS = [SDPBackend.FLASH_ATTENTION]
"""What `sdpa_call` claims for every CPU call (torch's CPU flash kernel, which takes masks and GQA)."""


def reference_attention(q_BHTD, k_BKSD, v_BKSD, allowed_B1TS):
    """Softmax attention written out in float64 with the kv heads repeated (the definition, no kernel)."""
    group = q_BHTD.shape[1] // k_BKSD.shape[1]
    k_BHSD = k_BKSD.double().repeat_interleave(group, dim=1)
    v_BHSD = v_BKSD.double().repeat_interleave(group, dim=1)
    scores_BHTS = q_BHTD.double() @ k_BHSD.transpose(-1, -2) / q_BHTD.shape[-1] ** 0.5
    if allowed_B1TS is None:
        t, s = q_BHTD.shape[2], k_BKSD.shape[2]
        allowed_B1TS = torch.ones(t, s, dtype=torch.bool, device=q_BHTD.device).tril()[None, None]
    scores_BHTS = scores_BHTS.masked_fill(~allowed_B1TS, float("-inf"))
    return (scores_BHTS.softmax(-1) @ v_BHSD).to(q_BHTD.dtype)


def _qkv(heads: int, kv_heads: int, t: int, s: int, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, t, 16, generator=gen, dtype=dtype)
    k = torch.randn(2, kv_heads, s, 16, generator=gen, dtype=dtype)
    v = torch.randn(2, kv_heads, s, 16, generator=gen, dtype=dtype)
    return q, k, v


def _padding_mask(t: int, s: int) -> torch.Tensor:
    """[2, 1, T, S]: causal over the last T of S keys, row 1's first two keys padding (queries keep themselves)."""
    allowed_TS = torch.ones(t, s, dtype=torch.bool).tril(s - t)
    allowed_BTS = allowed_TS.expand(2, t, s).clone()
    allowed_BTS[1, :, :2] = False
    allowed_BTS[1, torch.arange(t), torch.arange(s - t, s)] = True
    return allowed_BTS[:, None]


CUDA_SHAPES = [
    # (masked, heads, kv heads, queries, keys)
    (False, 4, 4, 8, 8),
    (False, 4, 2, 8, 8),
    (True, 4, 4, 8, 8),
    (True, 4, 2, 8, 8),
    (True, 4, 2, 1, 9),  # decode step with a KV cache
    (True, 4, 2, 3, 9),  # speculative verify: 3 new positions against the cache
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masked,heads,kv_heads,t,s", CUDA_SHAPES)
def test_cuda_plans_never_name_the_math_kernel(dtype, masked, heads, kv_heads, t, s):
    call = sdpa_call(
        "cuda", dtype, masked=masked, num_heads=heads, num_kv_heads=kv_heads, num_queries=t, head_dim=64
    )
    assert SDPBackend.MATH not in call.kernels
    if kv_heads < heads and SDPBackend.FLASH_ATTENTION not in call.kernels:
        # the memory-efficient kernel takes no grouped-query K / V: they reach it repeated or folded
        assert call.kv in ("repeat", "fold")


def test_cuda_plan_table():
    def call(dtype, masked, kv_heads=8, t=1):
        return sdpa_call(
            "cuda", dtype, masked=masked, num_heads=32, num_kv_heads=kv_heads, num_queries=t, head_dim=128
        )

    bf16 = torch.bfloat16
    assert call(bf16, False, t=2048) == call(bf16, False, kv_heads=32, t=2048)  # flash takes GQA natively
    assert (
        call(bf16, False, t=2048).kv == "native" and SDPBackend.FLASH_ATTENTION in call(bf16, False).kernels
    )
    assert call(torch.float32, False, t=2048).kv == "repeat"  # fp32: memory-efficient, no GQA
    assert call(bf16, True, t=1).kv == "fold"  # decode: no copy of the cache
    assert call(bf16, True, t=5).kv == "fold"  # speculative verify
    assert call(bf16, True, t=4096).kv == "repeat"  # long padded prefill: 4 x [T, S] mask > K, V at 32 heads
    assert call(bf16, True, kv_heads=32, t=4096).kv == "native"
    assert SDPBackend.EFFICIENT_ATTENTION in call(bf16, True).kernels
    assert call(torch.float64, True).kernels == (SDPBackend.MATH,)  # no fused CUDA kernel takes float64
    other = sdpa_call("mps", bf16, masked=True, num_heads=32, num_kv_heads=8, num_queries=1, head_dim=128)
    assert other.kv == "native" and other.kernels == ()  # no claim where the rules were not read


@pytest.mark.parametrize("layout_of", ["cuda", "cpu"])
@pytest.mark.parametrize("masked,heads,kv_heads,t,s", CUDA_SHAPES)
def test_every_kv_layout_is_exact(layout_of, masked, heads, kv_heads, t, s):
    """The layouts the CUDA calls choose (repeat, fold), run here on CPU tensors, equal the definition."""
    q, k, v = _qkv(heads, kv_heads, t, s)
    allowed = _padding_mask(t, s) if masked else None
    if not masked and t != s:
        pytest.skip("causal calls have T == S")
    call = sdpa_call(
        layout_of, q.dtype, masked=masked, num_heads=heads, num_kv_heads=kv_heads, num_queries=t, head_dim=16
    )
    with sdpa_kernel(CPU_KERNELS):
        got = sdpa_as_called(q, k, v, allowed, call)
    torch.testing.assert_close(got, reference_attention(q, k, v, allowed), atol=1e-12, rtol=0)


def test_fold_with_many_queries_repeats_the_mask_rows():
    q, k, v = _qkv(6, 2, 5, 7)
    allowed = _padding_mask(5, 7)
    fold = sdpa_call(
        "cuda", torch.float32, masked=True, num_heads=6, num_kv_heads=2, num_queries=5, head_dim=16
    )
    assert fold.kv == "fold"
    torch.testing.assert_close(
        sdpa_as_called(q, k, v, allowed, fold), reference_attention(q, k, v, allowed), atol=1e-12, rtol=0
    )


def _model(dtype: torch.dtype, kv_heads: int) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.tiny(num_kv_heads=kv_heads)).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_model_calls_on_cpu_reach_only_the_claimed_kernel(dtype, kv_heads):
    """No mask / causal, padding mask, prefill and decode with a KV cache, packed: under sdpa_kernel restricted to
    the CPU call's kernels (MATH off), so a fallback raises; outputs equal the unrestricted run."""
    model = _model(dtype, kv_heads)
    gen = torch.Generator().manual_seed(1)
    ids_BT = torch.randint(1, 128, (3, 7), generator=gen)
    mask_BT = torch.ones_like(ids_BT)
    mask_BT[0, :3] = 0  # left padding: a real mask
    mask_BT[2, 5:] = 0
    q_dtypes = []

    def calls():
        outs = [model(ids_BT), model(ids_BT, attention_mask_BT=mask_BT)]
        cache = KVCache.allocate(model.config, 3, 9, dtype=dtype)
        outs.append(model(ids_BT, attention_mask_BT=mask_BT, cache=cache))
        outs.append(model(ids_BT[:, :1], cache=cache))  # one decode step per row
        packed = pack_rows(mask_BT)
        outs.append(model.packed_hidden_states(ids_BT.flatten()[packed.source_N], packed))
        return outs

    for layer in model.layers:  # record what each call hands the kernel
        attend = layer.self_attn.attend

        def recording(q, k, v, allowed, attend=attend):
            q_dtypes.append(q.dtype)
            return attend(q, k, v, allowed)

        layer.self_attn.attend = recording
    with torch.no_grad():
        free = calls()
        with sdpa_kernel(CPU_KERNELS):
            restricted = calls()
    assert set(q_dtypes) == {dtype}
    for a, b in zip(free, restricted, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def _record_attention_dtypes(model: Transformer) -> list[tuple[torch.dtype, torch.dtype, torch.dtype]]:
    """The (q, k, v) dtypes every layer of `model` hands its attention, appended as the model runs."""
    seen: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []
    for layer in model.layers:
        attend = layer.self_attn.attend

        def recording(q, k, v, allowed, attend=attend):
            seen.append((q.dtype, k.dtype, v.dtype))
            return attend(q, k, v, allowed)

        layer.self_attn.attend = recording
    return seen


def test_rotary_tables_follow_autocast_so_q_k_v_share_a_dtype():
    model = _model(torch.float32, 2)
    seen = _record_attention_dtypes(model)
    ids_BT = torch.randint(1, 128, (2, 6))
    mask_BT = torch.ones_like(ids_BT)
    mask_BT[0, :2] = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids_BT)
        model(ids_BT, attention_mask_BT=mask_BT)
        cache = KVCache.allocate(model.config, 2, 8)  # an fp32 cache: reads come back in q's dtype
        model(ids_BT, attention_mask_BT=mask_BT, cache=cache)
    assert len(seen) == 3 * len(model.layers)
    assert set(seen) == {(torch.bfloat16,) * 3}
    seen.clear()
    with torch.no_grad():  # without autocast: the weights' dtype, as before
        model(ids_BT)
    assert set(seen) == {(torch.float32,) * 3}


@pytest.mark.parametrize("architecture", ["qwen3", "gemma3_text"])
def test_qk_norm_models_hand_attention_one_dtype_under_bf16_autocast(architecture):
    """Qwen3 and Gemma 3 normalise q and k per head: under `bf16-mixed` (fp32 weights, bf16 autocast) the norm's
    fp32 weight must not promote q and k to fp32 while v stays bf16 (flash-attn and Transformer Engine refuse
    mixed dtypes; SDPA would cast them back silently)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(architecture=architecture)).eval()
    assert model.layers[0].self_attn.qk_norm
    seen = _record_attention_dtypes(model)
    ids_BT = torch.randint(1, 128, (2, 6))
    mask_BT = torch.ones_like(ids_BT)
    mask_BT[0, :2] = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids_BT)
        model(ids_BT, attention_mask_BT=mask_BT)
        model(ids_BT, attention_mask_BT=mask_BT, cache=KVCache.allocate(model.config, 2, 8))
    assert set(seen) == {(torch.bfloat16,) * 3}, set(seen)
    seen.clear()
    with torch.no_grad():  # without autocast: the weights' dtype
        model(ids_BT)
    assert set(seen) == {(torch.float32,) * 3}


def test_sdpa_attention_on_cpu_equals_the_definition_in_float64():
    q, k, v = _qkv(4, 2, 6, 6)
    allowed = _padding_mask(6, 6)
    torch.testing.assert_close(
        sdpa_attention(q, k, v, allowed), reference_attention(q, k, v, allowed), atol=1e-12, rtol=0
    )
    torch.testing.assert_close(
        sdpa_attention(q, k, v, None), reference_attention(q, k, v, None), atol=1e-12, rtol=0
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masked,heads,kv_heads,t,s", CUDA_SHAPES)
def test_cuda_calls_reach_only_the_claimed_kernels(dtype, masked, heads, kv_heads, t, s):
    if not masked and t != s:
        pytest.skip("causal calls have T == S")
    q, k, v = (x.to("cuda", dtype) for x in _qkv(heads, kv_heads, t, s, dtype=torch.float32))
    q, k, v = (F.pad(x, (0, 48)) for x in (q, k, v))  # head_dim 64
    allowed = _padding_mask(t, s).cuda() if masked else None
    call = sdpa_call(
        "cuda", dtype, masked=masked, num_heads=heads, num_kv_heads=kv_heads, num_queries=t, head_dim=64
    )
    with sdpa_kernel(list(call.kernels)):
        got = sdpa_as_called(q, k, v, allowed, call)
    atol = 1e-3 if dtype == torch.float32 else 2e-2  # fp32 may run on TF32 tensor cores
    torch.testing.assert_close(
        got.double(), reference_attention(q.double(), k.double(), v.double(), allowed), atol=atol, rtol=0
    )
