"""model.attention_backend: a typed key checked before any model is built (the extra, CUDA, the precision,
packing), that reaches every loaded model's attention."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rlhfuse.data.synthetic import SyntheticTask
from rlhfuse.models import ModelConfig, Transformer, save_pretrained
from rlhfuse.models.attention import ATTENTION_BACKENDS
from rlhfuse.trainer import build_trainer, compose_config, validate
from rlhfuse.trainer.models import ModelsConfig, load_models


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(ValueError) as err:
        validate(compose_config(list(overrides)))
    return [line.removeprefix("  - ") for line in str(err.value).splitlines()[1:]]


def test_the_default_is_sdpa_and_validates_on_cpu():
    cfg = compose_config(["device=cpu"])
    assert cfg.model.attention_backend == "sdpa"
    validate(cfg)


@pytest.mark.parametrize("backend,module", [("flash", "flash_attn"), ("te", "transformer_engine")])
def test_gpu_backends_on_cpu_name_the_key_and_the_fix(backend, module):
    problems = _problems("device=cpu", f"model.attention_backend={backend}")
    assert all("model.attention_backend" in p for p in problems)
    assert any(
        f"model.attention_backend={backend} runs on CUDA only" in p
        and "set model.attention_backend=sdpa" in p
        for p in problems
    )
    if importlib.util.find_spec(module) is None:
        assert any("not installed" in p and "pip install 'rlhfuse[gpu]'" in p for p in problems)


def test_flash_needs_a_bf16_precision():
    problems = _problems("device=cuda", "model.attention_backend=flash", "pipeline.precision=32-true")
    assert any(
        "pipeline.precision=32-true" in p and "set pipeline.precision=bf16-mixed" in p for p in problems
    ), problems
    problems = _problems("device=cuda", "model.attention_backend=flash", "pipeline.precision=bf16-mixed")
    assert not any("pipeline.precision" in p for p in problems)


def test_te_with_packing_is_refused_at_validation():
    problems = _problems("device=cuda", "model.attention_backend=te", "data.packing=true")
    assert any(p.startswith("model.attention_backend='te' cannot run packed sequences") for p in problems)


def test_an_unknown_backend_lists_the_choices():
    problems = _problems("model.attention_backend=xformers")
    assert any("model.attention_backend='xformers' is not one of" in p for p in problems), problems


def test_build_fails_before_any_model_is_built(tmp_path, monkeypatch):
    def no_models(*args, **kwargs):
        raise AssertionError("a model was loaded before validation failed")

    monkeypatch.setattr("rlhfuse.trainer.build.load_models", no_models)
    monkeypatch.setattr("rlhfuse.trainer.build.warm_start", no_models)
    cfg = compose_config(["experiment=smoke", "device=cpu", "model.attention_backend=flash"])
    with pytest.raises(ValueError, match=r"model\.attention_backend=flash runs on CUDA only"):
        build_trainer(cfg, run_dir=tmp_path, log=lambda _: None)


@pytest.mark.parametrize("backend", sorted(ATTENTION_BACKENDS))
@pytest.mark.parametrize("sharded", [False, True])
def test_the_key_reaches_every_loaded_model(tmp_path, backend, sharded):
    torch.manual_seed(0)
    config = ModelConfig.tiny(num_layers=2)
    save_pretrained(Transformer(config, "lm"), tmp_path / "sft")
    save_pretrained(Transformer(config, "value"), tmp_path / "rm")
    SyntheticTask(seed=0).tokenizer().save(tmp_path / "sft")
    shard = {role: (2, {0}) for role in ("actor", "ref", "critic", "reward")} if sharded else None
    models = load_models(
        ModelsConfig(attention_backend=backend),
        sft_path=str(tmp_path / "sft"),
        reward_path=str(tmp_path / "rm"),
        device=torch.device("cpu"),
        shard=shard,
    )
    assert (models.generation is not None) == sharded
    loaded = [models.actor, models.ref, models.critic, models.reward, models.generation]
    for model in (m for m in loaded if m is not None):
        assert model.config.attention_backend == backend
        assert all(layer.self_attn.attend is ATTENTION_BACKENDS[backend] for layer in model.layers)
