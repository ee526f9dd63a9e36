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
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhfuse.data.tokenizer import Tokenizer
from rlhfuse.models import Transformer, from_pretrained, to_device
from rlhfuse.models.convert import real_model_dir
from rlhfuse.models.lora import apply_lora
from rlhfuse.trainer.models_config import ModelsConfig as ModelsConfig  # importable from here too
from rlhfuse.trainer.models_config import WarmStartConfig as WarmStartConfig


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
