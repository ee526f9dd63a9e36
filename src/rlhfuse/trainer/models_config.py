"""`model.*`: where the four models come from (`rlhfuse.trainer.models` loads them). No torch, so that the command
line composes the configuration without it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlhfuse.core.config_checks import choice_problems, need
from rlhfuse.models.lora_config import LoraConfig
from rlhfuse.models.model_config import ARCHITECTURES, ArchitectureName, AttentionBackend


@dataclass
class WarmStartConfig:
    # Supervised fine-tuning of the embedded actor: examples, optimizer steps, batch (samples), peak LR.
    sft_examples: int = 4096
    sft_steps: int = 400
    sft_lr: float = 3e-3
    # Bradley–Terry reward model on preference pairs.
    rm_pairs: int = 4096
    rm_steps: int = 400
    rm_lr: float = 1e-3
    batch_size: int = 32
    # Cache folder for the warm-started checkpoints (null = $RLHFUSE_CACHE or ~/.cache/rlhfuse).
    cache_dir: str | None = None


@dataclass
class ModelsConfig:
    # Registered model setup name: tiny (embedded, warm-started) | hf (local Hugging Face checkpoints).
    name: Literal["tiny", "hf"] = "tiny"
    # Local Hugging Face checkpoint folders (config.json + *.safetensors). null = warm-start the embedded model.
    sft_path: str | None = None
    reward_path: str | None = None
    # Critic initialisation (null = from the reward model).
    critic_path: str | None = None
    # Folder holding tokenizer.json (null = sft_path, or the embedded word-level tokenizer).
    tokenizer_path: str | None = None
    # Architecture of the embedded tiny model (ignored when loading checkpoints): llama | qwen2 | qwen3 (q/k norms)
    # | mistral | phi3 | gemma2 | gemma3_text (docs/models.md, "Architectures").
    architecture: ArchitectureName = "llama"
    # The embedded model's sliding window (keys each layer attends to, itself included; mistral, qwen2 and qwen3
    # only), null = full attention. A checkpoint's own window comes from its config.json.
    sliding_window: int | None = None
    hidden_size: int = 64
    intermediate_size: int = 192
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    head_dim: int = 32
    # The embedded Reward model's (and so the Critic's) own size, larger than the Actor as in the paper's
    # settings; 0 = the Actor's value.
    reward_hidden_size: int = 0
    reward_intermediate_size: int = 0
    reward_num_layers: int = 0
    # Attention kernel of every model (the generation copy's too): sdpa (torch's scaled_dot_product_attention,
    # any device; which of its kernels each call reaches: docs/models.md, "Precision and attention kernels") |
    # flash (flash-attn: CUDA, bf16, so pipeline.precision bf16-mixed or bf16-true) | te (Transformer Engine:
    # CUDA). flash and te run unpadded causal calls themselves and hand masked ones (padding, KV cache) to sdpa;
    # both need `pip install 'rlhfuse[gpu]'`. Checked before any model is built (`trainer.validate`).
    attention_backend: AttentionBackend = "sdpa"
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    # LoRA adapters on the Actor (peft; docs/models.md, "LoRA"): model.lora.rank > 0 trains the adapters only,
    # and the Reference is the Actor with them switched off (no Ref copy). pipeline=plain only.
    lora: LoraConfig = field(default_factory=LoraConfig)

    def problems(self) -> list[str]:
        """This config's own problems; whether model.sft_path also needs model.reward_path depends on the
        algorithm and the inferencer (`rlhfuse.trainer.validate`)."""
        problems = choice_problems(self, "model") + self.lora.problems()
        for key in ("reward_hidden_size", "reward_intermediate_size", "reward_num_layers"):
            value = getattr(self, key)
            need(problems, value >= 0, f"model.{key}={value} must be >= 0 (0 = the Actor's)")
        need(problems, self.sft_path is not None or self.reward_path is None, self.paths_problem())
        window = self.sliding_window
        need(
            problems,
            window is None or (isinstance(window, int) and window > 0),
            f"model.sliding_window={window!r} must be a positive number of keys, or null for full attention",
        )
        need(
            problems,
            window is None or ARCHITECTURES[self.architecture].window != "none",
            f"model.sliding_window={window}: model.architecture={self.architecture} has no sliding-window layers; "
            f"use one of {[n for n, a in ARCHITECTURES.items() if a.window != 'none']}, or set "
            "model.sliding_window=null",
        )
        return problems

    def paths_problem(self) -> str:
        return (
            f"model.sft_path={self.sft_path!r}, model.reward_path={self.reward_path!r}: set both (the Critic starts "
            "from the reward model unless model.critic_path is given), or neither to warm-start the embedded model"
        )
