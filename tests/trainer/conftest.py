"""Fixtures of the trainer tests: a tiny random-weight Llama checkpoint whose tokenizer has a chat template, a
callback that simulates a kill, and `rlhfuse-train` run as a subprocess."""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlhfuse.core.protocols import Callback
from rlhfuse.data import Tokenizer

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {{ eos_token }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT_WORDS = ["<|user|>", "<|assistant|>", "<|end|>", "7", "+", "5", "=", "12", "2", "4", "answer", ":"]


@dataclass(frozen=True)
class ChatCheckpoint:
    path: Path
    tokenizer: Tokenizer
    end_id: int  # generation_config.json's second eos id


FAMILY_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}


@pytest.fixture
def chat_checkpoint_of(tmp_path):
    """A factory: transformers' <family>ForCausalLM (1 layer, hidden 32 unless `overrides` say otherwise) saved
    with a word-level tokenizer and CHAT_TEMPLATE in tmp_path/<family>."""
    transformers = pytest.importorskip("transformers")

    def make(family: str = "llama", **overrides) -> ChatCheckpoint:
        tok = Tokenizer.from_words(CHAT_WORDS)
        tok.chat_template = CHAT_TEMPLATE
        end = tok.token_to_id("<|end|>")
        sft = tmp_path / family
        config_class, model_class = (getattr(transformers, name) for name in FAMILY_CLASSES[family])
        shape = dict(
            vocab_size=tok.vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            pad_token_id=tok.pad_id,
            bos_token_id=tok.bos_id,
            eos_token_id=tok.eos_id,
        )
        model_class(config_class(**(shape | overrides))).save_pretrained(sft)
        tok.save(sft)
        (sft / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_id, end]}))
        return ChatCheckpoint(sft, tok, end)

    return make


def hf_local_grpo(sft: Path, prompts: Path, *extra: str) -> list[str]:
    """The overrides of a tiny GRPO run on a local checkpoint and prompt file (`experiment=hf_local`: 2 prompts of
    2 samples, a rule reward, the export on), then `extra`."""
    return [
        "experiment=hf_local", "algorithm=grpo", f"model.sft_path={sft}", f"data.path={prompts}",
        "data.max_prompt_length=16", "data.prompts_per_iteration=2", "data.samples_per_prompt=2",
        "data.mini_batch_size=4", "inferencer.use_reward_model=false", "checkpoint.export_hf=true",
        "logger=quiet", *extra,
    ]  # fmt: skip


@pytest.fixture(name="hf_local_grpo")
def hf_local_grpo_fixture():
    """`hf_local_grpo`, for the tests of this folder."""
    return hf_local_grpo


@pytest.fixture
def chat_checkpoint(chat_checkpoint_of) -> ChatCheckpoint:
    """transformers' LlamaForCausalLM (1 layer, hidden 32) saved with a word-level tokenizer and CHAT_TEMPLATE."""
    return chat_checkpoint_of("llama")


class CrashAfter(Callback):
    """A trainer callback that raises KeyboardInterrupt (a simulated kill) at the end of iteration `at`."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_iteration_end(self, trainer, iteration, metrics):
        if iteration == self.at:
            raise KeyboardInterrupt(f"simulated kill after iteration {iteration}")


@pytest.fixture
def crash_after():
    """`CrashAfter`, for the resume tests of this folder."""
    return CrashAfter


def run_train(run_dir: Path, *overrides: str, timeout: float) -> list[dict[str, float]]:
    """`rlhfuse-train *overrides` in a subprocess writing to `run_dir` (its own launch: no WORLD_SIZE from this
    process, one OpenMP thread per rank), which must succeed; the rows of its metrics.jsonl."""
    cmd = [sys.executable, "-m", "rlhfuse.trainer.train_command", *overrides, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=run_dir.parent)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def train_cli():
    """`run_train`, for the command-line tests of this folder."""
    return run_train
