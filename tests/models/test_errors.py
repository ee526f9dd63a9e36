"""Bad checkpoints and configs fail with messages that name the file, the tensor and the fix."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlhfuse._optional import MissingDependencyError
from rlhfuse.models import CheckpointError, ModelConfig, Transformer, from_pretrained, save_pretrained


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    save_pretrained(Transformer(ModelConfig.tiny()), path)
    return path


def rewrite_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(checkpoint):
    rewrite_tensors(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors.*missing tensors \['model\.layers\.1\.mlp\.up_proj"
    ):
        from_pretrained(checkpoint)


def test_unexpected_tensor_is_named(checkpoint):
    rewrite_tensors(checkpoint, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(1)}))
    with pytest.raises(
        CheckpointError,
        match=r"unexpected tensors \['model\.layers\.2\.mlp\.up_proj\.weight'\].*num_hidden_layers",
    ):
        from_pretrained(checkpoint)


def test_wrong_shape_names_file_tensor_and_shapes(checkpoint):
    rewrite_tensors(checkpoint, lambda t: t.update({"model.norm.weight": torch.ones(32)}))
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has shape \(32,\).*\(64,\)"
    ):
        from_pretrained(checkpoint)


def test_unknown_architecture_lists_supported(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match=r"config\.json: architectures=\['GPT2LMHeadModel'\].*LlamaForCausalLM"
    ):
        from_pretrained(checkpoint)


def test_missing_config_and_missing_weights(tmp_path, checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"ckpt/config\.json is missing"):
        from_pretrained(checkpoint)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(ModelConfig.tiny().to_hf_dict("lm")))
    (empty / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files in .*empty.*pytorch_model\.bin"):
        from_pretrained(empty)


def test_sequence_classifier_needs_value_head_and_one_label(tmp_path):
    path = tmp_path / "rw"
    save_pretrained(Transformer(ModelConfig.tiny(), head="value"), path)
    with pytest.raises(CheckpointError, match="load it with head='value'"):
        from_pretrained(path, head="lm")
    config = json.loads((path / "config.json").read_text())
    config.update(num_labels=2)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="num_labels=2"):
        from_pretrained(path, head="value")


def test_config_validation_collects_every_problem():
    with pytest.raises(ValueError) as err:
        ModelConfig.tiny(num_kv_heads=3, architecture="gpt2", attention_backend="xformers")
    text = str(err.value)
    assert "num_kv_heads=3 must divide num_heads=4" in text
    assert "architecture='gpt2'" in text
    assert "attention_backend='xformers'" in text


def test_unsupported_rope_scaling_is_refused():
    hf = ModelConfig.tiny().to_hf_dict("lm")
    hf["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ValueError, match=r"rope_scaling type 'longrope' is not supported"):
        ModelConfig.from_hf_dict(hf)
    hf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ValueError, match=r"of type 'yarn' needs 'original_max_position_embeddings'"):
        ModelConfig.from_hf_dict(hf)


def test_hf_dict_round_trip_keeps_every_field():
    config = ModelConfig.tiny(architecture="qwen2", rope_theta=1e6, tie_word_embeddings=True, eos_token_id=7)
    back = ModelConfig.from_hf_dict(config.to_hf_dict("lm"))
    assert back == ModelConfig.from_hf_dict(back.to_hf_dict("lm"))
    for name in (
        "architecture",
        "rope_theta",
        "tie_word_embeddings",
        "attention_bias",
        "eos_token_id",
        "num_kv_heads",
    ):
        assert getattr(back, name) == getattr(config, name), name


@pytest.mark.parametrize("backend,module", [("flash", "flash_attn"), ("te", "transformer_engine")])
def test_gpu_backends_name_the_extra_when_missing(backend, module):
    try:
        __import__(module)
        pytest.skip(f"{module} is installed here")
    except ImportError:
        pass
    model = Transformer(ModelConfig.tiny(attention_backend=backend))
    with pytest.raises(MissingDependencyError, match=r"rlhfuse\[gpu\]"):
        model(torch.zeros(1, 3, dtype=torch.long))


def test_config_without_architectures_loads_by_model_type(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    del config["architectures"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert from_pretrained(checkpoint).config.architecture == "llama"
