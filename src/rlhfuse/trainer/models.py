"""The four models of RLHF and where they come from.

Actor and Ref load from the SFT checkpoint (Ref frozen), the Reward model from the RM checkpoint (frozen), the
Critic (only for an algorithm that trains one) from the Critic checkpoint or, by default, from the Reward model.
With no paths configured, the embedded
tiny model is warm-started first (`rlhfuse.trainer.warmstart`: SFT on the synthetic task, Bradley–Terry reward
model on its preference pairs) and cached.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from rlhfuse.core.config_checks import choice_problems, need
from rlhfuse.data.tokenizer import Tokenizer
from rlhfuse.models import Transformer, from_pretrained, to_device
from rlhfuse.models.attention import AttentionBackend
from rlhfuse.models.convert import real_model_dir
from rlhfuse.models.lora import LoraConfig, apply_lora
from rlhfuse.models.model_config import ARCHITECTURES, ArchitectureName


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


@dataclass
class Models:
    actor: Transformer
    # under model.lora the Actor itself: its log-probs with the adapters switched off (`adapters_disabled`) are
    # the SFT model's
    ref: Transformer
    # None when the score is a rule alone (inferencer.use_reward_model=false, checkpoints given)
    reward: Transformer | None
    # None for a critic-free algorithm (grpo, rloo, reinforce_pp): no Critic is loaded, trained or saved
    critic: Transformer | None
    tokenizer: Tokenizer
    sft_path: Path
    # the full Actor the generator starts from when it is not the trained `actor` itself: under sharded
    # construction (the trained `actor` holds only this rank's stages), or in another dtype (bf16-mixed: a bf16
    # copy, `trainer.build.prepare_generation_copy`); None otherwise. Dropped once the generator holds its copy.
    generation: Transformer | None = None

    def for_generation(self) -> Transformer:
        """The full Actor a generator copies: the generation copy when the trained Actor is sharded."""
        return self.generation if self.generation is not None else self.actor


def _require_checkpoint(path: str, key: str) -> Path:
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file() and folder == real_model_dir():
        raise FileNotFoundError(
            f"{key}={path!r}: the real pretrained model (SmolLM2-135M-Instruct) is not converted yet: run "
            "`make real-model` (or `python -m rlhfuse.models.convert --install`), which writes this folder"
        )
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{key}={path!r}: no config.json in {folder} (expected a Hugging Face checkpoint folder with "
            "config.json and model.safetensors); fix the path, or unset it to warm-start the embedded model"
        )
    return folder


def load_tokenizer(tokenizer_path: str | None, sft_path: str | Path) -> Tokenizer:
    """The tokenizer of model.tokenizer_path (default model.sft_path), with the special and stop ids of the SFT
    checkpoint's config.json / generation_config.json."""
    sft = Path(sft_path).expanduser()
    if tokenizer_path is None:
        _require_checkpoint(str(sft_path), "model.sft_path")
    return Tokenizer.from_dir(Path(tokenizer_path).expanduser() if tokenizer_path else sft, model_dir=sft)


def _frozen(model: Transformer) -> Transformer:
    return model.eval().requires_grad_(False)


def load_models(
    config: ModelsConfig,
    *,
    sft_path: str,
    reward_path: str | None,
    device: torch.device,
    critic: bool = True,
    reward: bool = True,
    shard: Mapping[str, tuple[int, Collection[int]]] | None = None,
    seed: int = 0,
) -> Models:
    """Actor, Ref, and on `device` the Reward model (when `reward`: the score uses it) and the Critic (when
    `critic`, i.e. the algorithm trains one; from model.critic_path, else from the reward checkpoint).

    `shard`: role ("actor", "ref", "critic", "reward") -> (pipeline stages, stages held here): sharded
    construction (meta-device init, only the held stages' tensors read from the safetensors files); a full
    Actor for generation is loaded too (`Models.generation`). `seed`: the LoRA adapters' start (model.lora)."""
    sft = _require_checkpoint(sft_path, "model.sft_path")
    reward_dir = _require_checkpoint(reward_path, "model.reward_path") if reward_path is not None else None
    if reward and reward_dir is None:
        raise FileNotFoundError("the reward model is used but model.reward_path is not set: set it")
    critic_dir = None
    if critic:
        critic_dir = (
            _require_checkpoint(config.critic_path, "model.critic_path") if config.critic_path else reward_dir
        )
        if critic_dir is None:
            raise FileNotFoundError("the Critic needs model.critic_path or model.reward_path: set one")
    tokenizer = load_tokenizer(config.tokenizer_path, sft)
    shard = shard or {}

    backend = config.attention_backend

    def load(path: Path, head: str, role: str) -> Transformer:
        model = from_pretrained(path, head=head, stages=shard.get(role), attention_backend=backend)
        return model.to(device) if role not in shard else to_device(model, device)  # type: ignore[return-value]

    actor = load(sft, "lm", "actor")
    # the generators' plain copy of a sharded Actor: the whole SFT model
    generation = (
        _frozen(from_pretrained(sft, head="lm", attention_backend=backend).to(device)) if shard else None
    )
    if config.lora.enabled:
        if generation is None:  # or the SFT Actor as loaded (its adapters start at B = 0: the same model)
            generation = _frozen(copy.deepcopy(actor))
        # the Reference is the Actor itself, its adapters switched off for its log-probs: no Ref copy (a sharded
        # Actor: adapters on its held stages only, the others' meta like their weights)
        ref = apply_lora(actor, config.lora, seed=seed)
    else:
        ref = _frozen(load(sft, "lm", "ref"))
    return Models(
        actor=actor,
        ref=ref,
        reward=_frozen(load(reward_dir, "value", "reward")) if reward and reward_dir else None,
        critic=None if critic_dir is None else load(critic_dir, "value", "critic"),
        tokenizer=tokenizer,
        sft_path=sft,
        generation=generation,
    )
