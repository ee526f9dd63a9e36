"""The exported `actor_hf/` is a complete Hugging Face checkpoint: transformers' AutoTokenizer and
AutoModelForCausalLM load it with pad/eos, the chat template and the stop tokens of the source checkpoint."""

import json

import pytest

from rlhfuse.data import Tokenizer
from rlhfuse.trainer import build_trainer, compose_config

transformers = pytest.importorskip("transformers")


def test_embedded_tiny_model_export_loads_with_pad_eos_and_no_template(tmp_path):
    cfg = compose_config(
        [
            "experiment=smoke",
            f"model.warmstart.cache_dir={tmp_path / 'cache'}",
            "checkpoint.export_hf=true",
            "iterations=1",
        ]
    )
    build_trainer(cfg, run_dir=tmp_path / "run", log=lambda _: None).fit()
    folder = tmp_path / "run" / "actor_hf"
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "generation_config.json" in names
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert (hf.pad_token, hf.eos_token, hf.bos_token) == ("<pad>", "<eos>", "<bos>")
    assert (hf.pad_token_id, hf.eos_token_id) == (0, 2)
    assert hf.chat_template is None  # the embedded word-level tasks are plain text
    ours = Tokenizer.from_dir(folder)
    assert hf("animals : cat", add_special_tokens=False)["input_ids"] == ours.encode(
        "animals : cat", add_bos=False
    )
    generation = transformers.GenerationConfig.from_pretrained(folder)
    assert (generation.eos_token_id, generation.pad_token_id) == (2, 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.eos_token_id == 2


def test_hf_checkpoint_with_chat_template_round_trips_template_and_stop_tokens(
    tmp_path, chat_checkpoint, hf_local_grpo
):
    sft, tok, end = chat_checkpoint.path, chat_checkpoint.tokenizer, chat_checkpoint.end_id
    prompts = tmp_path / "p.jsonl"
    rows = [{"messages": [{"role": "user", "content": "7 + 5 ="}], "answer": "12"}] * 2 + [
        {"prompt": "5 + 7 =", "answer": "12"}
    ] * 2
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        "data.micro_batch_size=4",
        "inferencer.reward_fn=numeric_match",
        "generator.max_new_tokens=4",
    ]
    cfg = compose_config(hf_local_grpo(sft, prompts, *overrides, "iterations=1"))
    trainer = build_trainer(cfg, run_dir=tmp_path / "run", log=lambda _: None)
    assert (
        end in trainer.generator.params.stop_token_ids
    )  # generation_config.json's second eos id stops generation
    (row,) = trainer.fit()
    assert row["response_length/max"] <= 4
    folder = tmp_path / "run" / "actor_hf"
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert hf.chat_template == tok.chat_template and (hf.eos_token, hf.pad_token) == ("<eos>", "<pad>")
    messages = [{"role": "user", "content": "7 + 5 ="}]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert Tokenizer.from_dir(folder).encode_chat(messages) == list(expected)
    assert list(expected).count(tok.bos_id) == 1
    generation = transformers.GenerationConfig.from_pretrained(folder)
    assert generation.eos_token_id == [tok.eos_id, end]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.tie_word_embeddings and model.config.num_key_value_heads == 1
