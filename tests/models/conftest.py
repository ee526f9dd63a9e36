"""Tiny random Hugging Face checkpoints written to temp dirs, shared by the models tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

HF_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention: 2 query heads per kv head
    max_position_embeddings=256,
)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """HF initialises biases to 0 and norms to 1; random values make every mapped tensor count in parity."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


def write_hf(model: torch.nn.Module, path: Path, **save_kwargs) -> Path:
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return path


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    config = transformers.LlamaConfig(**HF_COMMON, rope_theta=5000.0, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    randomize_(model, seed=0)
    return model, write_hf(model, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def hf_qwen2_tied(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    config = transformers.Qwen2Config(**HF_COMMON, rope_theta=1e6, tie_word_embeddings=True)
    model = transformers.Qwen2ForCausalLM(config).eval()
    randomize_(model, seed=1)
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model, write_hf(model, tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="session")
def hf_llama_reward(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    config = transformers.LlamaConfig(**HF_COMMON, num_labels=1, pad_token_id=0)
    model = transformers.LlamaForSequenceClassification(config).eval()
    randomize_(model, seed=2)
    return model, write_hf(model, tmp_path_factory.mktemp("llama_rw"))
