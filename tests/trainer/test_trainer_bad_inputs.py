"""Bad inputs end in one error naming the file or key and the fix (issue 18, classes 4-6): damaged model,
tokenizer, prompt and checkpoint files; missing context-length, optimizer and KV-memory checks; unknown keys."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhfuse.core.checkpoint import PlainCheckpointer, load_checkpoint, save_checkpoint
from rlhfuse.core.errors import CheckpointError
from rlhfuse.data.prompts import DatasetError, read_prompt_file
from rlhfuse.data.synthetic import build_tokenizer
from rlhfuse.data.tokenizer import Tokenizer
from rlhfuse.models import CheckpointError as ModelCheckpointError
from rlhfuse.models import ModelConfig, Transformer, from_pretrained, save_pretrained
from rlhfuse.trainer import build_trainer, compose_config
from rlhfuse.trainer.train_command import USER_ERRORS
from rlhfuse.trainer.validate import check_context, validate


@pytest.fixture()
def hf_dir(tmp_path):
    path = tmp_path / "sft"
    save_pretrained(Transformer(ModelConfig.tiny(max_position_embeddings=96)), path)
    build_tokenizer().save(path)
    return path


def test_damaged_model_and_tokenizer_files_name_the_file(hf_dir):
    weights = hf_dir / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:40])
    with pytest.raises(ModelCheckpointError, match=rf"{weights} is not a readable safetensors file.*copy it"):
        from_pretrained(hf_dir)
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(ModelCheckpointError, match=rf"{weights}.*truncated or corrupt"):
        from_pretrained(hf_dir)
    config = hf_dir / "config.json"
    text = config.read_text()
    config.write_text(text[:-5])
    with pytest.raises(ModelCheckpointError, match=rf"{config} is not valid JSON \(.* line \d+ column \d+\)"):
        from_pretrained(hf_dir)
    with pytest.raises(ValueError, match=rf"{config} is not valid JSON"):
        Tokenizer.from_dir(hf_dir)
    config.write_text(text)
    (hf_dir / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=rf"{hf_dir / 'tokenizer.json'} is not a readable tokenizer file"):
        Tokenizer.from_dir(hf_dir)


def test_damaged_prompt_files_name_the_file_and_line(tmp_path, monkeypatch):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DatasetError, match=rf"{path}:2: not UTF-8 text"):
        read_prompt_file(path)
    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    with pytest.raises(DatasetError, match=r"p\.parquet: not a readable Parquet file") as err:
        read_prompt_file(tmp_path / "p.parquet")
    assert isinstance(err.value, USER_ERRORS)  # the CLI prints it as one line, exit 2


def _plain_state():
    return {"actor": {"w": torch.ones(2, 3)}, "critic": {"w": torch.ones(2)}}


def test_damaged_or_mismatched_checkpoints_name_the_file_and_the_key(tmp_path):
    path = save_checkpoint(tmp_path, 1, _plain_state())
    (path / "meta.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=rf"{path / 'meta.json'} is malformed \(a JSON object expected"):
        load_checkpoint(path)
    path = save_checkpoint(tmp_path, 2, _plain_state())
    model = torch.nn.Linear(4, 2)  # this run's model: another shape than the saved [2, 3]

    def restore(state):
        model.load_state_dict({"weight": state["actor"]["w"], "bias": torch.zeros(2)})

    with pytest.raises(
        CheckpointError, match=r"1 tensor\(s\) differ in shape, first weight: saved .*\[2, 3\]"
    ):
        PlainCheckpointer(_plain_state, restore).load(path)


def test_a_state_file_without_the_trainer_entry_names_the_folder(tmp_path):
    trainer = build_trainer(
        compose_config(["experiment=smoke", f"model.warmstart.cache_dir={tmp_path / 'cache'}"]),
        run_dir=tmp_path / "a",
        log=lambda _: None,
    )
    path = save_checkpoint(tmp_path / "elsewhere", 1, trainer.strategy.state_dict())  # no 'trainer' entry
    trainer.config.resume = str(path)
    with pytest.raises(CheckpointError, match=rf"{path} holds no 'trainer' entry"):
        trainer.resume()


def _problems(*overrides):
    with pytest.raises(ValueError) as err:
        validate(compose_config(list(overrides)))
    return str(err.value)


def test_optimizer_values_are_checked_before_any_model_is_built():
    msg = _problems("pipeline.actor_lr=inf", "pipeline.critic_lr=nan", "pipeline.betas=[1.5,0.9]",
                    "pipeline.weight_decay=-0.1", "pipeline.weight_sync_bucket_mb=0")  # fmt: skip
    assert "5 problem(s)" in msg
    for part in ("pipeline.actor_lr=inf must be a finite number > 0", "pipeline.critic_lr=nan",
                 "pipeline.betas=[1.5, 0.9] must be two numbers in [0, 1)",
                 "pipeline.weight_decay=-0.1 must be a finite number >= 0",
                 "pipeline.weight_sync_bucket_mb=0.0 must be a number > 0"):  # fmt: skip
        assert part in msg, msg


def test_context_length_and_kv_memory_are_checked(hf_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "sports : " + "ball " * 60}) + "\n")
    overrides = ["experiment=hf_local", f"model.sft_path={hf_dir}", f"model.reward_path={hf_dir}",
                 f"data.path={prompts}"]  # fmt: skip
    # the shipped hf_local experiment generates 128 tokens: more than this model's 96 positions
    assert "generator.max_new_tokens=128 exceeds max_position_embeddings=96" in _problems(*overrides)
    cfg = compose_config([*overrides, "generator.max_new_tokens=48"])
    validate(cfg)
    with pytest.raises(ValueError, match=r"longest prompt \(62 tokens\) \+ generator\.max_new_tokens=48"):
        check_context(cfg, 62)
    with pytest.raises(ValueError, match=r"the longest prompt"):  # build_trainer reads the data first
        build_trainer(cfg, run_dir=tmp_path / "run", log=lambda _: None)
    msg = _problems("generator.max_new_tokens=100000000")
    assert "generator.max_new_tokens=100000000: the KV cache of 128 samples" in msg and "fits)" in msg


def test_unknown_keys_are_all_listed_with_the_closest_known_key():
    with pytest.raises(ValueError) as err:
        compose_config(["+data.batchsize=4", "+generator.max_tokens=3"])
    msg = str(err.value)
    assert "2 problem(s)" in msg
    assert "data.batchsize is not a configuration key (did you mean data.mini_batch_size?" in msg
    assert "generator.max_tokens is not a configuration key (did you mean generator.max_new_tokens?" in msg


def test_cli_lists_every_rejected_key_in_one_error_exit_2(tmp_path):
    cmd = [sys.executable, "-m", "rlhfuse.trainer.train_command", "data.batchsize=4", "generator.max_tokens=3",
           f"hydra.run.dir={tmp_path}"]  # fmt: skip
    env = {**os.environ, "RLHFUSE_DEBUG": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "data.batchsize is not a configuration key" in proc.stderr
    assert "generator.max_tokens is not a configuration key" in proc.stderr
    assert "Traceback" not in proc.stderr and not Path(tmp_path, "metrics.jsonl").exists()


def test_error_line_prints_brackets_in_the_message_as_text():
    import io

    from rich.console import Console

    from rlhfuse.trainer.train_command import print_error

    out = io.StringIO()
    print_error(Console(file=out, width=200), "rank 1 died [/x] at [/__w/pytorch/pair.cc:553]")
    assert out.getvalue().strip() == "rlhfuse-train: error: rank 1 died [/x] at [/__w/pytorch/pair.cc:553]"
