"""attention_backend="exact": a row's outputs are the same bits whatever else is in the call, so the sampler's
per-token log-probs equal the trainer's bit for bit (rlhfuse.models.exact).

Every test runs twice: with "exact" the values are equal (torch.equal), and its negative twin, the same check with
the default backend "sdpa", must find them different: the check can fail, and the mode is what makes it pass.
Single-threaded, as the suite runs (OMP_NUM_THREADS=1): the measured facts are single-threaded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlhfuse._resources import load_kernel_module
from rlhfuse.algorithms import logprobs_from_logits, ppo_policy_loss
from rlhfuse.core.inference import response_logprobs
from rlhfuse.core.step_losses import model_response_outputs
from rlhfuse.core.types import PromptBatch, TrainBatch
from rlhfuse.generation import GenerationEngine, SamplingParams, requests_for, to_rollout
from rlhfuse.models import (
    ATTENTION_BACKENDS,
    MULTI_POSITION_BACKENDS,
    KVCache,
    ModelConfig,
    Transformer,
)
from rlhfuse.models.attention import PACKED_ATTENTION_BACKENDS, AttentionSpec, packing_problem
from rlhfuse.models.exact import (
    TILE_ROWS,
    InvariantLinear,
    cpu_exact_attention,
    cuda_exact_attention,
    exact_attention,
    gelu_tanh,
    invariant_linear,
    probed_least,
    silu,
)

PAD, SEED, VOCAB = 0, 11, 128
BACKENDS = pytest.mark.parametrize("backend,same", [("exact", True), ("sdpa", False)])
"""The mode under test and whether it must give equal bits (exact) or differing ones (the negative twin)."""


def _model(backend: str, head: str = "lm", seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig.tiny(attention_backend=backend, **overrides), head=head).eval()


def _random_prompts(count: int, shortest: int, longest: int, seed: int) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=rng).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=rng).tolist() for n in lengths]


def _prompt_batch(prompts: list[list[int]], ids: list[int]) -> PromptBatch:
    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), PAD)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        input_ids[b, width - len(prompt) :] = torch.tensor(prompt)
        mask[b, width - len(prompt) :] = 1
    return PromptBatch(input_ids, mask, torch.tensor(ids))


# ------------------------------------------------------------------ the ops


@pytest.fixture(params=["probed", "tiles"])
def least_rows(request, monkeypatch):
    """Both forms of the exact gemms: the machine's probed least row count, and fixed tiles (what a machine
    whose probe finds none runs)."""
    if request.param == "tiles":
        monkeypatch.setattr("rlhfuse.models.exact.least_rows", lambda key, device_type, probe: None)
    return request.param


@pytest.mark.parametrize("features,out_features", [(64, 128), (576, 1536), (128, 1)])
@pytest.mark.parametrize("exact", [True, False])
def test_a_row_of_a_linear_does_not_depend_on_the_other_rows(features, out_features, exact, least_rows):
    """A row alone (M = 1), among 1, 16, 299 other rows at any place (a later tile included), gives the same bits
    through `invariant_linear`: F.linear over at least the probed least row count, or whole TILE_ROWS-row tiles
    in bmm; one output feature (the value head) included. The twin, F.linear, changes with M (MKL's
    matrix-vector path at M = 1, other kernels for a few rows)."""
    linear = invariant_linear if exact else F.linear
    rng = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, features, generator=rng)
    bias = torch.randn(out_features, generator=rng)
    row = torch.randn(1, features, generator=rng)
    alone = linear(row, weight, bias)[0]
    results = []
    for rows, place in ((2, 1), (17, 16), (300, 137), (TILE_ROWS, 5)):
        x = torch.randn(rows, features, generator=rng)
        x[place] = row[0]
        results.append(torch.equal(linear(x, weight, bias)[place], alone))
    assert all(results) if exact else not all(results)


def test_the_probe_finds_the_least_row_count_from_which_a_row_keeps_its_bits():
    """`probed_least` on calls whose row results are known: one that changes below 5 rows (the least count
    of LEAST_ROWS from there is 8), one exact from a single row, one that changes with every row count and one
    whose row depends on its place: none."""

    def below_five(x):
        return [x * 2.0 if x.shape[0] >= 5 else x * 2.0 + 1e-3]

    assert probed_least(below_five, torch.ones(3), 1) == 8
    assert probed_least(lambda x: [x * 2.0], torch.ones(3), 1) == 1
    assert probed_least(lambda x: [x * x.shape[0]], torch.ones(3), 1) is None
    assert probed_least(lambda x: [x * torch.arange(len(x))[:, None]], torch.ones(3), 1) is None
    # a shape too large to probe past MIN_PROBED_ROWS calls is not trusted
    assert probed_least(lambda x: [x * 2.0], torch.ones(3), 1 << 24) is None


def test_the_invariant_linear_is_nn_linear_with_its_parameters():
    layer = InvariantLinear(64, 32, bias=True)
    assert isinstance(layer, torch.nn.Linear) and set(layer.state_dict()) == {"weight", "bias"}
    x = torch.randn(3, 5, 64, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias))
    assert layer(x[:, :0]).shape == (3, 0, 32)
    grad_y = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, layer.weight, layer.bias), grad_y)
    expected = torch.autograd.grad(
        F.linear(x, layer.weight, layer.bias), (x, layer.weight, layer.bias), grad_y
    )
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("exact", [True, False])
def test_gate_activations_give_an_element_the_same_bits_wherever_it_sits(exact):
    """F.silu and tanh-gelu round a tail shorter than a vector differently (a scalar path); the exact ones are
    written from exp / tanh, which do not."""
    x = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 3
    torch.testing.assert_close(silu(x), F.silu(x))
    torch.testing.assert_close(gelu_tanh(x), F.gelu(x, approximate="tanh"))
    activations = (silu, gelu_tanh) if exact else (F.silu, lambda x: F.gelu(x, approximate="tanh"))
    same = []
    for act in activations:
        whole = act(x)
        same += [
            torch.equal(act(x[i : i + n].clone()), whole[i : i + n])
            for i in range(0, 70, 7)
            for n in (1, 5, 17)
        ]
    assert all(same) if exact else not all(same)


@BACKENDS
def test_a_query_attends_alike_alone_left_padded_and_from_a_padded_cache(backend, same):
    """One row's causal attention over 100 keys (two blocks of 64) computed alone; in a batch with left padding
    (random pad keys, an inner mask); and query by query against a cache layout whose padding slots sit between
    its keys (a left-padded prefill followed by decode steps)."""
    attend = ATTENTION_BACKENDS[backend]
    rng = torch.Generator().manual_seed(0)
    heads, kv_heads, t, e, pad = 4, 2, 100, 16, 7
    q, k, v = (torch.randn(1, n, t, e, generator=rng) for n in (heads, kv_heads, kv_heads))
    alone_HTE = attend(q, k, v, None)[0]
    results = []

    def padded(x):
        return torch.cat([torch.randn(1, x.shape[1], pad, e, generator=rng), x], 2)

    valid_S = torch.arange(t + pad) >= pad
    causal_TS = torch.ones(t + pad, t + pad, dtype=torch.bool).tril()
    allowed_TS = (causal_TS & valid_S) | torch.eye(t + pad, dtype=torch.bool)
    out_HTE = attend(padded(q), padded(k), padded(v), allowed_TS[None, None])[0, :, pad:]
    results.append(torch.equal(out_HTE, alone_HTE))
    # the cache: pad slots, then keys 0..n, then stale slots past them (masked); query n decodes alone
    k_cache, v_cache = padded(k), padded(v)
    for n in (0, 40, 63, 64, 99):
        allowed_S = valid_S & (torch.arange(t + pad) <= pad + n)
        out_HE = attend(q[:, :, n : n + 1], k_cache, v_cache, allowed_S[None, None, None])[0, :, 0]
        results.append(torch.equal(out_HE, alone_HTE[:, n]))
    torch.testing.assert_close(alone_HTE, ATTENTION_BACKENDS["sdpa"](q, k, v, None)[0])
    assert all(results) if same else not all(results)


def test_long_calls_run_in_query_chunks_with_the_same_bits(monkeypatch):
    """The CUDA form (its Triton kernel in the interpreter): queries are independent, so masked calls in chunks
    of 7 queries give the bits of the whole call."""
    rng = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 20, 16, generator=rng) for n in (4, 2, 2))
    allowed_B1TS = torch.ones(20, 20, dtype=torch.bool).tril().expand(2, 1, 20, 20).clone()
    allowed_B1TS[1, :, :, :9] = False  # left padding on the second row
    allowed_B1TS[1, :, :9, :9] = torch.eye(9, dtype=torch.bool)
    whole = cuda_exact_attention(q, k, v, allowed_B1TS, None)
    monkeypatch.setattr("rlhfuse.models.exact.QUERY_CHUNK", 7)
    assert torch.equal(cuda_exact_attention(q, k, v, allowed_B1TS, None), whole)


def test_the_cuda_linear_kernel_gives_a_row_the_same_bits_in_any_call():
    """`kernels/exact.py`'s fixed-tile matmul (interpreter): a row alone and at the first place of a later tile
    among 40 and 99 other rows gives the same bits, close to F.linear. (The interpreter's dot is numpy's BLAS,
    whose bits may change with a row's place inside a tile; on a GPU the tensor cores' do not, which the gpu-check
    row `exact kernels` checks.)"""
    kernels = load_kernel_module("exact")
    rng = torch.Generator().manual_seed(0)
    weight = torch.randn(45, 70, generator=rng)
    row = torch.randn(1, 70, generator=rng)
    alone = kernels.invariant_matmul(row, weight)
    torch.testing.assert_close(alone, F.linear(row, weight))
    for rows, place in ((41, kernels.BLOCK_M), (100, 3 * kernels.BLOCK_M)):
        x = torch.randn(rows, 70, generator=rng)
        x[place] = row[0]
        assert torch.equal(kernels.invariant_matmul(x, weight)[place, None], alone)


def _reference_attention(q_BHTE, k_BKSE, v_BKSE, allowed_B1TS, spec=None):
    """Plain masked softmax attention with autograd (the gradients the exact forward's sums have)."""
    h, t, e = q_BHTE.shape[1:]
    kv_heads = k_BKSE.shape[1]
    window, scale, softcap = (None, None, None) if spec is None else (spec.window, spec.scale, spec.softcap)
    if allowed_B1TS is None:
        distance_TT = torch.arange(t)[:, None] - torch.arange(t)[None, :]
        allowed_B1TS = ((distance_TT >= 0) & (distance_TT < (window or t)))[None, None]
    k_BHSE, v_BHSE = (x.repeat_interleave(h // kv_heads, dim=1) for x in (k_BKSE, v_BKSE))
    scores_BHTS = q_BHTE @ k_BHSE.transpose(-1, -2) * (scale if scale is not None else e**-0.5)
    if softcap is not None:
        scores_BHTS = torch.tanh(scores_BHTS / softcap) * softcap
    weights_BHTS = torch.softmax(scores_BHTS.masked_fill(~allowed_B1TS, float("-inf")), dim=-1)
    return weights_BHTS @ v_BHSE


def _random_masks(rng: torch.Generator, b: int, t: int, s: int) -> dict[str, torch.Tensor]:
    """[B, 1, T, S] masks as the transformer builds them: left (and right, inner) padding over T == S keys with
    the pad queries' diagonal; a cache of S slots holding pad slots before and between a row's keys, the T new
    queries written at its end; each also narrowed to a sliding window of real tokens."""
    masks = {}
    if t == s:
        valid_BT = torch.ones(b, t, dtype=torch.bool)
        for row in range(b):
            start = int(torch.randint(0, t, (1,), generator=rng))
            end = int(torch.randint(start + 1, t + 1, (1,), generator=rng)) if row % 3 == 1 else t
            valid_BT[row, :start] = False
            valid_BT[row, end:] = False
            if row % 5 == 4 and end - start > 4:  # inner padding
                valid_BT[row, start + 2] = False
        causal_TT = torch.ones(t, t, dtype=torch.bool).tril()
        allowed_BTS = (causal_TT & valid_BT[:, None]) | torch.eye(t, dtype=torch.bool)
        index_BT = valid_BT.long().cumsum(-1) - 1
        query_index_BT = key_index_BS = index_BT
    else:
        key_valid_BS = torch.rand(b, s, generator=rng) > 0.3
        for row in range(b):  # mostly left padding, then the row's keys in a run
            start = int(torch.randint(0, s - t, (1,), generator=rng))
            if row % 2 == 0:
                key_valid_BS[row, :start] = False
                key_valid_BS[row, start:] = True
        write_pos_BT = torch.arange(s - t, s).expand(b, t)
        s_S = torch.arange(s)
        allowed_BTS = (s_S <= write_pos_BT[..., None]) & key_valid_BS[:, None]
        allowed_BTS |= s_S == write_pos_BT[..., None]
        key_index_BS = key_valid_BS.long().cumsum(-1) - 1
        query_index_BT = key_index_BS.gather(1, write_pos_BT)
    masks["padded" if t == s else "cache"] = allowed_BTS[:, None]
    window = int(torch.randint(2, 40, (1,), generator=rng))
    distance_BTS = query_index_BT[:, :, None] - key_index_BS[:, None, :]
    masks["window"] = (allowed_BTS & (distance_BTS < window))[:, None]
    return masks


@pytest.mark.parametrize(
    "form,heads,kv_heads,e,dtype",
    [
        ("cpu", 2, 2, 32, torch.float32),
        ("cpu", 4, 2, 16, torch.float32),
        ("cpu", 8, 2, 8, torch.float32),
        ("cpu", 4, 2, 16, torch.bfloat16),
        ("cuda", 4, 2, 16, torch.float32),
    ],
)
def test_a_query_gets_the_bits_of_a_call_holding_its_keys_alone(form, heads, kv_heads, e, dtype):
    """Each device's exact attention (the CPU's compiled pass; the CUDA Triton kernel, in the interpreter, on
    the smaller calls): a query in a call with random masks of every kind the model builds (left, right and
    inner padding with the pad queries' diagonal; caches with pad slots; sliding windows; plain causal), with a
    scale and a soft-cap, one query (decode) to 130, up to 150 keys, equals bit for bit the call of that query
    alone over its allowed keys alone; float32 (close to plain attention) and bfloat16."""
    attend = cpu_exact_attention if form == "cpu" else cuda_exact_attention
    rng = torch.Generator().manual_seed(0)
    specs = [None, AttentionSpec(scale=0.3, softcap=5.0)]
    checked = 0
    shapes = ((3, 1, 1), (5, 1, 90), (4, 3, 70), (6, 7, 7), (7, 40, 40), (3, 20, 150), (4, 130, 130))
    if form == "cuda":  # the interpreter runs a program per query: the smaller calls
        shapes = ((5, 1, 90), (3, 6, 6), (2, 3, 40))
    for b, t, s in shapes:
        q, k, v = (
            (torch.randn(b, n, m, e, generator=rng) * 2).to(dtype)
            for n, m in ((heads, t), (kv_heads, s), (kv_heads, s))
        )
        masks = _random_masks(rng, b, t, s) if s > 1 else {}
        masks["causal"] = None
        cases = [(name, mask, spec) for name, mask in masks.items() for spec in specs]
        if t == s:
            cases.append(("window", None, AttentionSpec(window=5)))
        for name, allowed_B1TS, spec in cases:
            if allowed_B1TS is None and t != s:
                continue
            got_BHTE = attend(q, k, v, allowed_B1TS, spec)
            window = None if spec is None else spec.window
            mask_BTS = (_reference_mask(t, window) if allowed_B1TS is None else allowed_B1TS[:, 0]).expand(
                b, t, s
            )
            for row, query in zip(
                torch.randint(0, b, (6,), generator=rng), torch.randint(0, t, (6,), generator=rng)
            ):
                keys_S = mask_BTS[row, query].nonzero()[:, 0]
                alone_H1E = attend(
                    q[row, None, :, query, None],
                    k[row, None][:, :, keys_S],
                    v[row, None][:, :, keys_S],
                    torch.ones(1, 1, 1, len(keys_S), dtype=torch.bool),
                    spec,
                )[0]
                assert torch.equal(got_BHTE[row, :, query, None], alone_H1E), (
                    b,
                    t,
                    s,
                    name,
                    spec,
                    row,
                    query,
                )
                checked += 1
            if dtype == torch.float32:  # and it is attention
                torch.testing.assert_close(got_BHTE, _reference_attention(q, k, v, allowed_B1TS, spec))
    assert checked > (100 if form == "cpu" else 10)


def test_the_cpu_kernel_reads_strided_views_as_their_contiguous_copies():
    """The CPU pass reads q, k and v where they lie (the cache's keys are a transposed slice of its blocks, the
    queries a transpose of the projection's output): views of every layout the model hands it, rows sliced out
    of wider ones (copied first: their strides are not whole rows), expanded heads and empty calls give the bits
    of their contiguous copies, and the result is [B, H, T, E] over a [B, T, H, E] tensor."""
    rng = torch.Generator().manual_seed(0)
    b, h, kv, t, s, e = 3, 4, 2, 5, 9, 16
    q_BTHE = torch.randn(b, t, h, e, generator=rng)
    k_BSKE, v_BSKE = (torch.randn(b, s + 4, kv, e, generator=rng)[:, :s] for _ in range(2))
    wide_BKSF = torch.randn(b, kv, s, e + 3, generator=rng)
    allowed_B1TS = torch.rand(b, 1, t, s, generator=rng) < 0.7
    views = {
        "transposed": (q_BTHE.transpose(1, 2), k_BSKE.transpose(1, 2), v_BSKE.transpose(1, 2)),
        "sliced rows": (q_BTHE.transpose(1, 2), wide_BKSF[..., :e], wide_BKSF[..., 3:]),
        "expanded": (
            q_BTHE.transpose(1, 2),
            k_BSKE[:, :, :1].transpose(1, 2).expand(b, kv, s, e),
            v_BSKE.transpose(1, 2),
        ),
    }
    for name, (q, k, v) in views.items():
        got = cpu_exact_attention(q, k, v, allowed_B1TS, None)
        assert torch.equal(
            got, cpu_exact_attention(q.contiguous(), k.contiguous(), v.contiguous(), allowed_B1TS, None)
        ), name
        assert got.shape == (b, h, t, e) and got.transpose(1, 2).is_contiguous(), name
    empty = cpu_exact_attention(
        q_BTHE[:0].transpose(1, 2),
        k_BSKE[:0].transpose(1, 2),
        v_BSKE[:0].transpose(1, 2),
        allowed_B1TS[:0],
        None,
    )
    assert empty.shape == (0, h, t, e)


def _reference_mask(t: int, window: int | None) -> torch.Tensor:
    distance_TT = torch.arange(t)[:, None] - torch.arange(t)[None, :]
    return ((distance_TT >= 0) & (distance_TT < (window or t)))[None]


@pytest.mark.parametrize("spec", [None, AttentionSpec(scale=0.3, softcap=5.0), AttentionSpec(window=4)])
@pytest.mark.parametrize("mask", ["padded", "causal"])
def test_the_attention_backward_gives_the_gradients_of_its_sums(spec, mask):
    """`exact_attention`'s backward is plain attention's (recomputed probabilities): q, k and v get the gradients
    autograd finds through the per-query sums, with left and right padding (pad queries, trailing pad queries),
    a scale and a soft-cap, a window, and plain causal calls."""
    rng = torch.Generator().manual_seed(0)
    t = 40
    q, k, v = (
        torch.randn(3, n, t, 16, generator=rng, dtype=torch.float64, requires_grad=True) for n in (4, 2, 2)
    )
    valid_BT = torch.ones(3, t, dtype=torch.bool)
    valid_BT[1, : t // 3] = False
    valid_BT[2, -(t // 3) :] = False
    allowed_BTS = (torch.ones(t, t, dtype=torch.bool).tril() & valid_BT[:, None]) | torch.eye(
        t, dtype=torch.bool
    )
    allowed_B1TS = allowed_BTS[:, None] if mask == "padded" else None
    grad_out = torch.randn(3, 4, t, 16, generator=rng, dtype=torch.float64)
    got = torch.autograd.grad(exact_attention(q, k, v, allowed_B1TS, spec), (q, k, v), grad_out)
    want = torch.autograd.grad(_reference_attention(q, k, v, allowed_B1TS, spec), (q, k, v), grad_out)
    for got_x, want_x in zip(got, want, strict=True):
        torch.testing.assert_close(got_x, want_x)


def test_exact_runs_packed_sequences_and_speculative_steps():
    assert "exact" in PACKED_ATTENTION_BACKENDS and packing_problem("exact") is None
    assert "exact" in MULTI_POSITION_BACKENDS


# ------------------------------------------------------------------ the model

# MLP widths that are no multiple of the vector width: a decode step's activations end in a scalar-path tail
FAMILIES = {
    "llama": dict(intermediate_size=120),
    "qwen3_window": dict(
        architecture="qwen3", sliding_window=5, layer_types=("full_attention", "sliding_attention")
    ),
    "gemma2": dict(
        architecture="gemma2",
        intermediate_size=100,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=24.0,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        sliding_window=6,
        layer_types=("sliding_attention", "full_attention"),
    ),
    "mixtral": dict(architecture="mixtral", num_experts=4, num_experts_per_tok=2),
    "llama_value_head": dict(),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@BACKENDS
def test_a_row_gets_the_same_outputs_alone_in_a_padded_batch_and_through_the_cache(family, same, backend):
    """Each family's layers (windows, a soft-capped, rescaled Gemma 2 with GeGLU, a mixture of experts, a value
    head): a row's outputs at every position alone; left-padded in a batch of 7 random rows; and produced through
    a KV cache as a left-padded prefill of 9 tokens, a chunk of 20, then one token per step."""
    head = "value" if family.endswith("value_head") else "lm"
    model = _model(backend, head, **FAMILIES[family])
    row = torch.tensor(_random_prompts(1, 40, 40, seed=1)[0])
    others = _random_prompts(7, 12, 45, seed=2)
    with torch.no_grad():
        alone = model(row[None])[0]
        batch = _prompt_batch([*others[:3], row.tolist(), *others[3:]], list(range(8)))
        batched = model(batch.input_ids_BP, attention_mask_BT=batch.attention_mask_BP)[3, -len(row) :]
        cache = KVCache.allocate(model.cache_config(), 2, 64)
        chunk_BT = torch.stack([F.pad(row[:9], (3, 0), value=PAD), torch.tensor(others[0][:12])])
        mask_BT = torch.ones_like(chunk_BT)
        mask_BT[0, :3] = 0
        pieces = [model(chunk_BT, attention_mask_BT=mask_BT, cache=cache, cache_slots_B=[1, 0])[0, 3:]]
        pieces.append(model(row[None, 9:29], cache=cache, cache_slots_B=[1])[0])
        pieces += [model(row[None, n : n + 1], cache=cache, cache_slots_B=[1])[0] for n in range(29, 40)]
        cached = torch.cat(pieces)
    torch.testing.assert_close(batched, alone)
    torch.testing.assert_close(cached, alone)
    assert (torch.equal(batched, alone) and torch.equal(cached, alone)) == same


# ------------------------------------------------------------------ the sampler and the trainer

TEMPERATURE = 0.8
TARGET_PROMPT = _random_prompts(1, 50, 50, seed=5)[0]
MAX_NEW = 24  # the target's keys reach 74: two blocks of 64


def _target_run(model, others: list[list[int]], *, slots: int) -> GenerationEngine:
    """An engine holding the 50-token target prompt (prompt id 0: its own sampling stream) after `others`."""
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=TEMPERATURE)
    engine = GenerationEngine(model, params, num_slots=slots, max_len=50 + MAX_NEW)
    prompts = _prompt_batch([*others, TARGET_PROMPT], [*range(1, len(others) + 1), 0])
    engine.add(requests_for(prompts, samples_per_prompt=1, seed=SEED, iteration=0))
    return engine


def _finish(engine: GenerationEngine) -> list:
    finished = []
    while engine.has_work():
        finished += engine.step()
    return finished


@torch.no_grad()
def _chunked_prefill_logprobs(model, tokens: list[int], split: int) -> list[float]:
    """The target's per-step log-probs for `tokens` through the model's cache by hand: its prompt prefilled in two
    chunks (the first left-padded), then one token per step."""
    prompt = torch.tensor(TARGET_PROMPT)
    cache = KVCache.allocate(model.cache_config(), 1, 64 + MAX_NEW)
    first = F.pad(prompt[None, :split], (4, 0), value=PAD)
    model(first, attention_mask_BT=(first != PAD).long(), cache=cache)  # the prompt holds no PAD token
    logits_V = model(prompt[None, split:], cache=cache)[0, -1]
    logprobs = []
    for n, token in enumerate(tokens):
        logprob_1 = logprobs_from_logits(logits_V[None], torch.tensor([token]), temperature=TEMPERATURE)
        logprobs.append(float(logprob_1[0]))
        if n + 1 < len(tokens):
            logits_V = model(torch.tensor([[token]]), cache=cache)[0, -1]
    return logprobs


@BACKENDS
def test_a_prompt_decodes_to_the_same_logprobs_alone_batched_chunked_and_migrated(backend, same):
    """The target prompt's per-step log-probs (`SampleRequest.logprobs`, sampled at temperature 0.8 from its own
    stream) decoded alone; among 64 random prompts (prefilled together, left-padded, decoded together); prefilled
    in two chunks by hand; and migrated mid-way by re-prefill (`evict(with_kv=False)` then `admit`: prompt +
    tokens[:-1] prefilled on another engine)."""
    model = _model(backend)
    (alone,) = _finish(_target_run(model, [], slots=1))
    assert len(alone.tokens) == MAX_NEW
    batched = next(
        r
        for r in _finish(_target_run(model, _random_prompts(64, 2, 50, seed=6), slots=65))
        if r.prompt_index == 0
    )
    chunked = _chunked_prefill_logprobs(model, alone.tokens, split=21)
    source = _target_run(model, _random_prompts(5, 2, 50, seed=7), slots=6)
    for _ in range(9):
        source.step()
    (moving,) = source.evict(1, with_kv=False)  # the target holds the highest slot
    assert moving.request.prompt_index == 0 and moving.kv is None
    destination = GenerationEngine(model, source.params, num_slots=2, max_len=50 + MAX_NEW)
    destination.admit([moving])
    _finish(destination)
    migrated = moving.request
    for other in (batched, migrated):
        assert other.tokens == alone.tokens or not same
        torch.testing.assert_close(torch.tensor(other.logprobs), torch.tensor(alone.logprobs))
    runs = [batched.logprobs, chunked, migrated.logprobs]
    assert all(run == alone.logprobs for run in runs) == same, [run == alone.logprobs for run in runs]


@pytest.fixture(scope="module", params=["exact", "sdpa"])
def sampled(request):
    """A rollout of 24 prompts of 2 to 60 tokens x 2 samples, stop tokens ending responses at varied lengths,
    generated by an engine of 16 slots (continuous batching, prefix sharing): (backend, model, rollout)."""
    model = _model(request.param)
    params = SamplingParams(max_new_tokens=20, temperature=TEMPERATURE, stop_token_ids=(2, 5, 9, 17))
    engine = GenerationEngine(model, params, num_slots=16, max_len=80)
    prompts = _prompt_batch(_random_prompts(24, 2, 60, seed=8), list(range(24)))
    requests = requests_for(prompts, samples_per_prompt=2, seed=SEED, iteration=0)
    engine.run(requests)
    rollout = to_rollout(requests, PAD)
    assert len(set(rollout.response_lengths_B.tolist())) > 5
    return request.param, model, rollout


@pytest.mark.parametrize("packing", [False, True])
def test_the_trainer_recomputes_the_sampler_logprobs_bit_for_bit(sampled, packing):
    """`response_logprobs` over the left-padded whole sequences (or packed) equals the engine's per-token
    log-probs on every response token."""
    backend, model, rollout = sampled
    with torch.no_grad():
        recomputed_BR = response_logprobs(model, rollout, TEMPERATURE, packing=packing)
    mask_BR = rollout.response_mask_BR.bool()
    assert rollout.sampler_logprobs_BR is not None
    sampler_M, recomputed_M = rollout.sampler_logprobs_BR[mask_BR], recomputed_BR[mask_BR]
    torch.testing.assert_close(recomputed_M, sampler_M)
    assert torch.equal(recomputed_M, sampler_M) == (backend == "exact")


def test_the_first_ppo_step_has_a_ratio_of_exactly_one(sampled):
    """The training forward (autograd on, shuffled micro-batches of 3 compositions, trailing response columns
    trimmed by `TrainBatch.select`) against the sampler's log-probs as the old ones: exp(new - old) is 1.0 on
    every response token, so the clipped objective starts at -A with nothing clipped."""
    backend, model, rollout = sampled
    assert rollout.sampler_logprobs_BR is not None
    rng = torch.Generator().manual_seed(0)
    mask_BR = rollout.response_mask_BR.float()
    batch = TrainBatch(
        input_ids_BT=rollout.input_ids_BT,
        attention_mask_BT=rollout.attention_mask_BT,
        response_mask_BR=mask_BR,
        old_logprobs_BR=rollout.sampler_logprobs_BR,
        old_values_BR=torch.zeros_like(mask_BR),
        advantages_BR=torch.randn(mask_BR.shape, generator=rng),
        returns_BR=torch.zeros_like(mask_BR),
    )
    model.train()
    ratios, clipped = [], []
    try:
        for index_B in torch.randperm(len(batch), generator=rng).split((5, 19, 24)):
            micro = batch.select(index_B)
            logits_BRV = model_response_outputs(model, micro, packing=False)
            response_BR = micro.input_ids_BT[:, -micro.response_length :]
            new_BR = logprobs_from_logits(logits_BRV, response_BR, temperature=TEMPERATURE)
            loss, stats = ppo_policy_loss(
                new_BR, micro.old_logprobs_BR, micro.advantages_BR, micro.response_mask_BR
            )
            loss.backward()
            ratios.append(torch.exp(new_BR - micro.old_logprobs_BR).detach()[micro.response_mask_BR.bool()])
            clipped.append(float(stats.clip_fraction))
    finally:
        model.eval()
        model.zero_grad()
    ratio_M = torch.cat(ratios)
    torch.testing.assert_close(ratio_M, torch.ones_like(ratio_M))
    assert clipped == [0.0, 0.0, 0.0]
    assert bool((ratio_M == 1.0).all()) == (backend == "exact")
