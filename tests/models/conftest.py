"""Tiny random Hugging Face checkpoints written to temp dirs, shared by the models tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_helpers import HF_COMMON, randomize_, write_hf  # noqa: E402


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
