"""rlhfuse.models against `transformers` on tiny random checkpoints: logits, values, padding, KV cache, I/O.

Legend: B batch rows, T tokens, V vocabulary.
"""

from __future__ import annotations

import logging

import pytest
import torch

from rlhfuse.models import KVCache, ModelConfig, Transformer, from_pretrained, save_pretrained

transformers = pytest.importorskip("transformers")

ATOL = 1e-5


@pytest.fixture(params=["hf_llama", "hf_qwen2_tied"])
def hf_causal(request):
    return request.getfixturevalue(request.param)


def test_logits_match_transformers(hf_causal):
    hf_model, path = hf_causal
    model = from_pretrained(path)
    input_ids_BT = torch.randint(0, 128, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected_BTV = hf_model(input_ids_BT).logits
        logits_BTV = model(input_ids_BT)
    assert logits_BTV.shape == (3, 11, 128)
    torch.testing.assert_close(logits_BTV, expected_BTV, atol=ATOL, rtol=0)


def test_tied_checkpoint_loads_tied(hf_qwen2_tied):
    model = from_pretrained(hf_qwen2_tied[1])
    assert model.config.tie_word_embeddings and model.config.attention_bias
    assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.parametrize("side", ["left", "right", "both"])
def test_padded_rows_equal_unpadded_runs(hf_llama, side):
    model = from_pretrained(hf_llama[1])
    gen = torch.Generator().manual_seed(1)
    lengths = [9, 4, 6]
    width = max(lengths)
    rows = [torch.randint(1, 128, (n,), generator=gen) for n in lengths]
    input_ids_BT = torch.zeros(len(rows), width, dtype=torch.long)
    mask_BT = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        start = {"left": width - len(row), "right": 0, "both": (width - len(row)) // 2}[side]
        cols = slice(start, start + len(row))
        input_ids_BT[b, cols] = row
        mask_BT[b, cols] = 1
    with torch.no_grad():
        padded_BTV = model(input_ids_BT, attention_mask_BT=mask_BT)
        for b, row in enumerate(rows):
            alone_TV = model(row[None])[0]
            torch.testing.assert_close(padded_BTV[b][mask_BT[b].bool()], alone_TV, atol=ATOL, rtol=0)
    assert torch.isfinite(padded_BTV).all(), "pad query rows must not produce NaN"


def test_kv_cache_decoding_matches_full_forward(hf_qwen2_tied):
    """Left-padded prefill into non-default slots, then single-token steps with one row leaving early."""
    model = from_pretrained(hf_qwen2_tied[1])
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 128, (n,), generator=gen) for n in (5, 2, 7)]
    slots_B = torch.tensor([3, 0, 1])
    cache = KVCache.allocate(model.config, num_slots=4, max_len=16)
    width = max(len(p) for p in prompts)
    prompt_ids_BT = torch.zeros(3, width, dtype=torch.long)
    prompt_mask_BT = torch.zeros(3, width, dtype=torch.long)
    for b, p in enumerate(prompts):
        prompt_ids_BT[b, width - len(p) :] = p
        prompt_mask_BT[b, width - len(p) :] = 1
    sequences = [p.tolist() for p in prompts]
    step_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    with torch.no_grad():
        logits_BTV = model(
            prompt_ids_BT, attention_mask_BT=prompt_mask_BT, cache=cache, cache_slots_B=slots_B
        )
        for b in range(3):
            step_logits[b].append(logits_BTV[b, -1])
        active = [0, 1, 2]
        for step in range(4):
            if step == 2:
                active = [0, 2]  # row 1 finished: continuous batching keeps decoding the others
            next_ids_B1 = torch.tensor([[step_logits[b][-1].argmax().item()] for b in active])
            for b, tok in zip(active, next_ids_B1[:, 0].tolist()):
                sequences[b].append(tok)
            logits_BTV = model(next_ids_B1, cache=cache, cache_slots_B=slots_B[active])
            for i, b in enumerate(active):
                step_logits[b].append(logits_BTV[i, -1])
        assert cache.lengths_S.tolist() == [width + 2, width + 4, 0, width + 4]
        for b, seq in enumerate(sequences):
            full_TV = model(torch.tensor([seq]))[0]
            n_prompt = len(prompts[b])
            expected = full_TV[n_prompt - 1 : n_prompt - 1 + len(step_logits[b])]
            torch.testing.assert_close(torch.stack(step_logits[b]), expected, atol=ATOL, rtol=0)


def test_sharded_checkpoint_loads(hf_llama, tmp_path):
    hf_model, _ = hf_llama
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = from_pretrained(tmp_path)
    input_ids_BT = torch.arange(10)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids_BT), hf_model(input_ids_BT).logits, atol=ATOL, rtol=0)


def test_reward_checkpoint_values_match_score_layer(hf_llama_reward):
    hf_model, path = hf_llama_reward
    model = from_pretrained(path, head="value")
    input_ids_BT = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        values_BT = model(input_ids_BT)
        expected_BT = hf_model.score(hf_model.model(input_ids_BT).last_hidden_state)[..., 0]
        pooled_B = hf_model(input_ids_BT).logits[:, 0]  # HF pools the last non-pad token
    assert values_BT.shape == (2, 8)
    torch.testing.assert_close(values_BT, expected_BT, atol=ATOL, rtol=0)
    torch.testing.assert_close(values_BT[:, -1], pooled_B, atol=ATOL, rtol=0)


def test_value_head_from_causal_checkpoint_is_fresh_and_logged(hf_llama, caplog):
    hf_model, path = hf_llama
    with caplog.at_level(logging.WARNING, logger="rlhfuse.models.hf_checkpoint"):
        critic = from_pretrained(path, head="value")
    assert "value_head initialised fresh" in caplog.text
    input_ids_BT = torch.arange(6)[None]
    with torch.no_grad():
        expected_BTD = hf_model.model(input_ids_BT).last_hidden_state
        torch.testing.assert_close(critic.hidden_states(input_ids_BT), expected_BTD, atol=ATOL, rtol=0)
    assert critic.value_head.weight.abs().sum() > 0


@pytest.mark.parametrize(
    "architecture,tied,bias", [("llama", False, False), ("qwen2", True, True), ("llama", True, True)]
)
def test_save_pretrained_round_trip_through_transformers(tmp_path, architecture, tied, bias):
    torch.manual_seed(4)
    config = ModelConfig.tiny(architecture=architecture, tie_word_embeddings=tied, attention_bias=bias)
    model = Transformer(config).eval()
    for name, param in model.named_parameters():
        if name.endswith("bias"):  # fresh biases are zero; random ones make the round trip check them
            torch.nn.init.normal_(param, std=0.1)
    save_pretrained(model, tmp_path / "ckpt")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    assert type(hf_model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[architecture]
    input_ids_BT = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids_BT), hf_model(input_ids_BT).logits, atol=ATOL, rtol=0)
        reloaded = from_pretrained(tmp_path / "ckpt")
        torch.testing.assert_close(reloaded(input_ids_BT), model(input_ids_BT), atol=0, rtol=0)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_save_value_model_loads_as_sequence_classification(tmp_path, architecture):
    torch.manual_seed(5)
    critic = Transformer(ModelConfig.tiny(architecture=architecture), head="value").eval()
    save_pretrained(critic, tmp_path / "critic")
    save_pretrained(
        critic, tmp_path / "critic"
    )  # overwriting an existing checkpoint goes through the rename too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["critic"], "no temp dirs left behind"
    hf_model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "critic").eval()
    assert type(hf_model).__name__.lower().startswith(architecture)
    assert hf_model.config.num_labels == 1
    input_ids_BT = torch.randint(0, 128, (2, 5))
    with torch.no_grad():
        expected_BT = hf_model.score(hf_model.model(input_ids_BT).last_hidden_state)[..., 0]
        torch.testing.assert_close(critic(input_ids_BT), expected_BT, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    ],
    ids=["llama3", "linear"],
)  # fmt: skip
def test_rope_scaling_matches_transformers(tmp_path, rope_parameters):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_parameters=rope_parameters,
    )  # fmt: skip
    hf_model = transformers.LlamaForCausalLM(config).eval()
    model = Transformer(ModelConfig.from_hf_dict(config.to_dict())).eval()
    model.load_state_dict({k.removeprefix("model."): v for k, v in hf_model.state_dict().items()})
    input_ids_BT = torch.randint(0, 128, (1, 40))
    save_pretrained(model, tmp_path / "scaled")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "scaled").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids_BT), hf_model(input_ids_BT).logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(
            reloaded(input_ids_BT).logits, hf_model(input_ids_BT).logits, atol=ATOL, rtol=0
        )


def test_bf16_load_runs_close_to_fp32(hf_llama):
    _, path = hf_llama
    model_fp32, model_bf16 = from_pretrained(path), from_pretrained(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model_bf16.parameters()} == {torch.bfloat16}
    input_ids_BT = torch.arange(12)[None]
    with torch.no_grad():
        logits_bf16 = model_bf16(input_ids_BT)
        logits_fp32 = model_fp32(input_ids_BT)
    assert logits_bf16.dtype == torch.bfloat16
    # bf16 keeps ~3 significant digits; logits here are O(1)
    torch.testing.assert_close(logits_bf16.float(), logits_fp32, atol=0.1, rtol=0.05)
