"""The families past LLaMA against `transformers`, in float64: Qwen3 (q/k norms), Mistral (a sliding window on
every layer), Qwen2 and Qwen3 with windowed layers after full ones, Phi-3 (fused qkv and gate_up weights, a
window, partial rotary), Llama with YaRN; plain, left-padded, packed and KV-cached calls, inputs longer than the
window and than max_position_embeddings, and the export transformers loads.

Legend: B batch rows, T tokens, V vocabulary, D width.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hf_helpers import HF_COMMON, exact_norms_, float64_softmax, randomize_, write_hf

from rlhfuse.models import KVCache, ModelConfig, Transformer, from_pretrained, save_pretrained
from rlhfuse.models.model_config import ARCHITECTURES
from rlhfuse.models.packing import pack_rows

transformers = pytest.importorskip("transformers")

ATOL = 1e-10  # float64: the differences measured are <= 1e-13 (the issue asks <= 1e-6)
WINDOW = 4
LONG = 24  # past the window and past max_position_embeddings (16)
SMALL = {**HF_COMMON, "max_position_embeddings": 16}


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, head_dim=32, rope_theta=1e6))


def _qwen3_windowed():
    config = transformers.Qwen3Config(
        **SMALL, head_dim=32, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )
    return transformers.Qwen3ForCausalLM(config)


def _qwen3_bias():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, attention_bias=True))


def _mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=WINDOW))


def _qwen2_windowed():
    config = transformers.Qwen2Config(
        **SMALL, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )
    return transformers.Qwen2ForCausalLM(config)


def _phi3():
    return transformers.Phi3ForCausalLM(
        transformers.Phi3Config(**SMALL, sliding_window=WINDOW, pad_token_id=0)
    )


def _phi3_partial_rotary():
    return transformers.Phi3ForCausalLM(
        transformers.Phi3Config(**SMALL, partial_rotary_factor=0.5, pad_token_id=0)
    )


def _llama_yarn():
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8}
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, rope_parameters=rope))


def _qwen3_yarn_deepseek_mscale():
    rope = {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
    }  # fmt: skip
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, rope_parameters=rope))


def _gemma2():
    config = transformers.Gemma2Config(
        **SMALL, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, pad_token_id=0,
    )  # fmt: skip
    return transformers.Gemma2ForCausalLM(config)


def _gemma3():
    rope = {
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    config = transformers.Gemma3TextConfig(
        **SMALL, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, rope_parameters=rope,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
    )  # fmt: skip
    return transformers.Gemma3ForCausalLM(config)


MOE = dict(num_experts_per_tok=2, pad_token_id=0)


def _qwen3_moe():
    config = transformers.Qwen3MoeConfig(
        **SMALL, **MOE, head_dim=16, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1], router_aux_loss_coef=0.01,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(config)


def _mixtral():
    config = transformers.MixtralConfig(**SMALL, **MOE, num_local_experts=4, sliding_window=WINDOW)
    return transformers.MixtralForCausalLM(config)


FAMILIES: dict[str, Callable[[], torch.nn.Module]] = {
    "qwen3_moe": _qwen3_moe,
    "mixtral_window": _mixtral,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3_window": _phi3,
    "phi3_partial_rotary": _phi3_partial_rotary,
    "llama_yarn": _llama_yarn,
    "qwen3_yarn": _qwen3_yarn_deepseek_mscale,
    "qwen3": _qwen3,
    "qwen3_window": _qwen3_windowed,
    "qwen3_bias": _qwen3_bias,
    "mistral_window": _mistral,
    "qwen2_window": _qwen2_windowed,
}


# transformers' Mixtral router takes its softmax of `logits.float()`: its routing weights round through float32
LOOSER = {"mixtral_window": 1e-6}


@pytest.fixture
def atol(request) -> float:
    return LOOSER.get(request.node.callspec.params["family"], ATOL)


@pytest.fixture(scope="module", autouse=True)
def _float64_softmax():
    with float64_softmax():
        yield


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[torch.nn.Module, Path, Transformer]:
    torch.manual_seed(0)
    hf_model = FAMILIES[request.param]()
    randomize_(hf_model, seed=7)
    path = write_hf(hf_model, tmp_path_factory.mktemp(request.param))
    hf_model = hf_model.double().eval()
    if hf_model.config.model_type in ("qwen3_moe", "mixtral"):
        hf_model.set_experts_implementation("eager")  # its grouped matmul has no float64
    # the float64 reference: transformers' eager attention takes its softmax in float32, and its norms round
    # through float32; its sdpa attention and float64 norms do not
    hf_model.config._attn_implementation = "eager" if request.param == "gemma2" else "sdpa"
    exact_norms_(hf_model)
    return hf_model, path, from_pretrained(path, dtype=torch.float64).eval()


def _rows(lengths: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (n,), generator=gen) for n in lengths]


def _left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids_BT = torch.zeros(len(rows), width, dtype=torch.long)
    mask_BT = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids_BT[b, width - len(row) :] = row
        mask_BT[b, width - len(row) :] = 1
    return ids_BT, mask_BT


def test_the_config_reads_as_transformers_does(family):
    hf_model, _, model = family
    hf = hf_model.config
    assert model.config.architecture == hf.model_type
    expected = [getattr(layer.self_attn, "sliding_window", None) or None for layer in hf_model.model.layers]
    if hf.model_type in ("mistral", "phi3", "mixtral", "qwen3_moe"):  # attention reads it off the config
        expected = [hf.sliding_window] * hf.num_hidden_layers
    assert [model.config.window_of(i) for i in range(model.config.num_layers)] == expected
    assert model.config.qk_norm == (hf.model_type in ("qwen3", "gemma3_text", "qwen3_moe"))


def test_logits_equal_transformers_past_the_window_and_the_context(family, atol):
    hf_model, _, model = family
    ids_BT = torch.randint(0, 128, (2, LONG), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected_BTV = hf_model(ids_BT).logits
        logits_BTV = model(ids_BT)
    torch.testing.assert_close(logits_BTV, expected_BTV, atol=atol, rtol=0)


def test_left_padded_rows_equal_each_row_alone_in_transformers(family, atol):
    hf_model, _, model = family
    rows = _rows([LONG, 9, 3], seed=2)
    ids_BT, mask_BT = _left_padded(rows)
    with torch.no_grad():
        padded_BTV = model(ids_BT, attention_mask_BT=mask_BT)
        for b, row in enumerate(rows):
            expected_TV = hf_model(row[None]).logits[0]
            torch.testing.assert_close(padded_BTV[b][mask_BT[b].bool()], expected_TV, atol=atol, rtol=0)


def test_inner_padding_keeps_the_window_in_real_tokens(family, atol):
    """Padding between a row's tokens (a migrated or spliced row) does not shorten its window."""
    hf_model, _, model = family
    (row,) = _rows([12], seed=3)
    ids_BT = torch.zeros(1, 16, dtype=torch.long)
    mask_BT = torch.zeros(1, 16, dtype=torch.long)
    cols = [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13]  # two pads after the sixth token, two at the end
    ids_BT[0, cols], mask_BT[0, cols] = row, 1
    with torch.no_grad():
        got_TV = model(ids_BT, attention_mask_BT=mask_BT)[0, cols]
        torch.testing.assert_close(got_TV, hf_model(row[None]).logits[0], atol=atol, rtol=0)


def test_packed_sequences_equal_each_row_alone_in_transformers(family, atol):
    hf_model, _, model = family
    rows = _rows([LONG, 5, 11], seed=4)
    width = max(len(r) for r in rows)
    mask_BT = torch.zeros(len(rows), width, dtype=torch.long)
    ids_BT = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids_BT[b, : len(row)], mask_BT[b, : len(row)] = row, 1
    packed = pack_rows(mask_BT)
    with torch.no_grad():
        hidden_ND = model.packed_hidden_states(ids_BT.flatten()[packed.source_N], packed)
        expected_ND = torch.cat([hf_model.model(row[None]).last_hidden_state[0] for row in rows])
    torch.testing.assert_close(hidden_ND, expected_ND, atol=atol, rtol=0)


def test_kv_cache_decoding_equals_transformers_on_the_whole_sequence(family, atol):
    """Left-padded prefill, then single-token steps past the window: each step's logits equal transformers'
    forward over the whole sequence."""
    hf_model, _, model = family
    prompts = _rows([6, 2], seed=5)
    ids_BT, mask_BT = _left_padded(prompts)
    cache = KVCache.allocate(model.config, num_slots=2, max_len=32, dtype=torch.float64)
    sequences = [p.tolist() for p in prompts]
    steps: list[list[torch.Tensor]] = [[], []]
    with torch.no_grad():
        logits_BTV = model(ids_BT, attention_mask_BT=mask_BT, cache=cache)
        for _ in range(2 * WINDOW + 1):
            for b in range(2):
                steps[b].append(logits_BTV[b, -1])
                sequences[b].append(int(logits_BTV[b, -1].argmax()))
            next_B1 = torch.tensor([[s[-1]] for s in sequences])
            logits_BTV = model(next_B1, cache=cache)
        for b, seq in enumerate(sequences):
            full_TV = hf_model(torch.tensor([seq[:-1]])).logits[0]
            n = len(prompts[b])
            torch.testing.assert_close(torch.stack(steps[b]), full_TV[n - 1 :], atol=atol, rtol=0)


@pytest.mark.parametrize("head", ["lm", "value"])
def test_the_export_loads_in_transformers_and_back(family, tmp_path, head, atol):
    hf_model, path, _ = family
    model = from_pretrained(path, head=head, dtype=torch.float64).eval()
    save_pretrained(model, tmp_path / "export")
    auto = (
        transformers.AutoModelForCausalLM if head == "lm" else transformers.AutoModelForSequenceClassification
    )
    loaded = auto.from_pretrained(tmp_path / "export", dtype=torch.float64).eval()
    if loaded.config.model_type in ("qwen3_moe", "mixtral"):
        loaded.set_experts_implementation("eager")
    exact_norms_(loaded)
    family = ARCHITECTURES[hf_model.config.model_type]
    assert type(loaded).__name__ == (family.lm_class if head == "lm" else family.value_head_class)
    assert family.lm_class == type(hf_model).__name__
    assert getattr(loaded.config, "layer_types", None) == getattr(hf_model.config, "layer_types", None)
    assert loaded.config.rope_parameters == hf_model.config.rope_parameters
    assert getattr(loaded.config, "sliding_window", None) == getattr(hf_model.config, "sliding_window", None)
    ids_BT = torch.randint(0, 128, (2, LONG), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        if head == "lm":
            torch.testing.assert_close(model(ids_BT), loaded(ids_BT).logits, atol=atol, rtol=0)
        else:
            expected_BT = loaded.score(loaded.model(ids_BT).last_hidden_state)[..., 0]
            torch.testing.assert_close(model(ids_BT), expected_BT, atol=atol, rtol=0)
        again = from_pretrained(tmp_path / "export", head=head, dtype=torch.float64)
        # the same numbers up to float64 rounding (BLAS may sum in another order for another allocation)
        torch.testing.assert_close(again(ids_BT), model(ids_BT), atol=1e-13, rtol=0)


def test_a_window_on_a_family_without_one_is_refused():
    with pytest.raises(ValueError, match=r"sliding_window=8: architecture='llama' has no sliding-window"):
        ModelConfig.tiny(sliding_window=8)
    with pytest.raises(ValueError, match=r"layer_types has 1 entries: give one of"):
        ModelConfig.tiny(architecture="qwen3", sliding_window=8, layer_types=("full_attention",))


def test_an_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(ValueError, match=r"model_type='gpt2' is not supported: .*'qwen3', 'mistral'"):
        ModelConfig.from_hf_dict({"model_type": "gpt2"})


def test_a_tiny_windowed_model_trains_through_its_window():
    """Gradients reach the weights through a windowed layer (the band mask is not a constant cut-off)."""
    torch.manual_seed(8)
    model = Transformer(ModelConfig.tiny(architecture="mistral", sliding_window=3))
    ids_BT = torch.randint(0, 128, (2, 10))
    model(ids_BT).logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_every_expert_gets_a_gradient_whatever_the_routing():
    """An expert no token chose still runs (on an empty batch): its weights get a zero gradient, so the set of
    gradients, and what data-parallel reduction sends, never depends on the routing."""
    torch.manual_seed(9)
    config = ModelConfig.tiny(architecture="qwen3_moe", num_experts=8, num_experts_per_tok=1, num_layers=1)
    model = Transformer(config)
    model(torch.tensor([[3, 4]])).sum().backward()  # 2 tokens, 1 expert each: at least 6 of 8 unused
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    used = [e for e in range(8) if grads[f"layers.0.mlp.experts.{e}.down_proj.weight"].abs().sum() > 0]
    assert 1 <= len(used) <= 2


def test_tensor_parallel_splits_every_expert_over_its_width_and_names_the_key():
    from rlhfuse.runtime.tensor_parallel import tp_problems

    # Mixtral: every layer a mixture, so only the experts' width must divide (the dense intermediate_size is unused)
    config = ModelConfig.tiny(
        architecture="mixtral", num_experts=4, intermediate_size=96, moe_intermediate_size=None
    )
    assert tp_problems(config, 2, "pipeline.actor_tp") == []
    (problem,) = tp_problems(config, 5, "pipeline.actor_tp")[-1:]
    assert problem.startswith("pipeline.actor_tp=5 does not divide the model's expert intermediate size=96")
    qwen = ModelConfig.tiny(architecture="qwen3_moe", num_experts=4, moe_intermediate_size=24, num_layers=2,
                            mlp_only_layers=(1,), intermediate_size=64)  # fmt: skip
    assert [p.split(" (")[0] for p in tp_problems(qwen, 5, "generator.tp")][-2:] == [
        "generator.tp=5 does not divide the model's intermediate_size=64",
        "generator.tp=5 does not divide the model's expert intermediate size=24",
    ]


def test_the_load_balancing_loss_equals_transformers(tmp_path):
    """Our router logits of a Qwen3-MoE checkpoint, through `load_balancing_loss`, give transformers' aux_loss,
    on a left-padded batch (pad rows excluded) and without a mask."""
    from rlhfuse.models.transformer import load_balancing_loss, record_router_logits

    torch.manual_seed(10)
    hf_model = _qwen3_moe()
    hf_model.config.mlp_only_layers = []  # both layers mixtures
    hf_model = transformers.Qwen3MoeForCausalLM(hf_model.config)
    randomize_(hf_model, seed=11)
    path = write_hf(hf_model, tmp_path / "moe")
    hf_model = hf_model.double().eval()
    hf_model.set_experts_implementation("eager")
    model = from_pretrained(path, dtype=torch.float64).eval()
    ids_BT, mask_BT = _left_padded(_rows([9, 4, 6], seed=12))
    for mask in (mask_BT, None):
        with torch.no_grad(), record_router_logits(model) as logits:
            model(ids_BT, attention_mask_BT=mask)
            expected = hf_model(ids_BT, attention_mask=mask, output_router_logits=True).aux_loss
        assert len(logits) == 2
        valid_N = None if mask is None else mask.flatten()
        got = load_balancing_loss(logits, 4, 2, valid_N)
        # transformers accumulates its sums in float32
        torch.testing.assert_close(got, expected.to(got.dtype), atol=0, rtol=1e-6)
    assert all(block.recorded is None for block in model.modules() if hasattr(block, "recorded"))
