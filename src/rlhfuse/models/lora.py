"""LoRA adapters on a `Transformer`, through peft (`pip install 'rlhfuse[lora]'`).

peft's LoRA layers wrap the model's own `nn.Linear` projections by name (`model.lora.target_modules`): each
wrapped projection computes W x + (alpha / r) B A x, with A and B the only trained tensors. What the rest of the
library needs of an adapted model lives here, so no other module knows peft's layer types:

- `apply_lora`: wrap the projections, freeze everything but the adapters;
- `adapters_disabled` / `without_adapters`: the base model, for the Reference's log-probs (no Ref copy is built);
- `trained_state` / `load_trained_state`: what a checkpoint holds (the adapters only; the base is the SFT
  checkpoint, reloaded on resume);
- `merged_weights`: the adapted projections' merged weights W + (alpha / r) B A under the plain model's names,
  what the generators' plain copies load on a weight sync (the frozen rest never changes);
- `save_adapter` / `merged_model`: the export, a PEFT adapter folder (`PeftModel.from_pretrained` loads it onto
  the base checkpoint) and, on request, the merged model;
- `merge_state` / `merged_state` / `adapter_tensors`: the same from an adapted model's gathered tensors (a
  sharded Actor's, `pipeline=fsdp`), with no module of peft's involved.

A model without adapters passes through every function unchanged (its whole state, all of its weights), so the
strategies call them whatever the configuration.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from rlhfuse._optional import require
from rlhfuse.models.hf_checkpoint import CheckpointError, hf_layout, write_folder
from rlhfuse.models.lora_config import DEFAULT_TARGETS as DEFAULT_TARGETS  # importable from here too
from rlhfuse.models.lora_config import LoraConfig as LoraConfig
from rlhfuse.models.lora_config import LoraTarget as LoraTarget
from rlhfuse.models.model_config import ModelConfig
from rlhfuse.models.transformer import Transformer

ADAPTER = "default"  # peft's adapter name; one adapter per model
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."  # how PeftModel.save_pretrained prefixes the wrapped model's keys


def lora_problem(config: ModelConfig) -> str | None:
    """Why `config` (a ModelConfig) cannot carry adapters, or None."""
    family = config.family
    if family.moe != "none":
        return (
            f"model.lora on a mixture-of-experts model ({config.architecture}) is not supported: its experts' "
            "projections have no adapter layout; train it without model.lora (model.lora.rank=0)"
        )
    if family.fused:
        return (
            f"model.lora on {config.architecture} is not supported: its checkpoints fuse q/k/v and gate/up, so "
            "an adapter of the separate projections has no PEFT layout; set model.lora.rank=0"
        )
    return None


def _peft() -> Any:
    return require("peft")


def _peft_config(config: LoraConfig, base: str | None = None) -> Any:
    peft = _peft()
    return peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=sorted(config.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )


def apply_lora(model: Transformer, config: LoraConfig, *, seed: int = 0) -> Transformer:
    """Wrap `model`'s target projections with LoRA adapters in place (B = 0: the model computes what it did)
    and freeze every other weight. The A matrices' random start is drawn from `seed` alone (the global RNG is
    left as it was), so a run and its resume start from the same adapters."""
    if (problem := lora_problem(model.config)) is not None:
        raise ValueError(problem)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _peft().inject_adapter_in_model(_peft_config(config), model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    return model


def adapted_layers(model: nn.Module) -> dict[str, Any]:
    """Module name -> peft LoRA layer (empty for a model without adapters)."""
    if not any(".lora_" in name for name, _ in model.named_parameters()):
        return {}
    lora = require("peft.tuners.lora")
    return {name: m for name, m in model.named_modules() if isinstance(m, lora.LoraLayer)}


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """`model` computes without its adapters (the base model) inside the block."""
    layers = list(adapted_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class _BaseOnly(nn.Module):
    """`inner` computing as its base model: its adapters switched off around each forward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config  # the model config a `Stage` or `Transformer` carries, kept in view

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with adapters_disabled(self.inner):
            return self.inner(*args, **kwargs)


def without_adapters(module: nn.Module) -> nn.Module:
    """`module` itself, or for an adapted module (a LoRA Actor's pipeline stage) a module sharing its weights
    that computes as the base model: the Reference's forward on the Actor's own stages."""
    return _BaseOnly(module) if adapted_layers(module) else module


def trained_state(model: nn.Module) -> dict[str, Tensor]:
    """What a checkpoint holds of `model`: its whole state, or only its adapters' tensors."""
    state = model.state_dict()
    if not adapted_layers(model):
        return state
    return {name: t for name, t in state.items() if ".lora_" in name}


def load_trained_state(model: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Restore `trained_state(model)`'s tensors; an adapter state missing a tensor, or the whole model's state
    for an adapted model (or the other way round), is an error naming what differs."""
    adapted = bool(adapted_layers(model))
    if not adapted and not any(".lora_" in k for k in state):
        model.load_state_dict(dict(state))  # a whole model's state: torch's strict check names what differs
        return
    expected = set(trained_state(model))
    got = set(state)
    if expected != got:
        raise CheckpointError(
            f"the checkpoint holds {'no ' if not any('.lora_' in k for k in got) else ''}LoRA adapter tensors but this "
            f"run {'trains an adapter' if adapted else 'trains the whole Actor'} (model.lora.rank): missing "
            f"{sorted(expected - got)[:4]}, unexpected {sorted(got - expected)[:4]}; resume with the model.lora "
            "settings that wrote it"
        )
    model.load_state_dict(dict(state), strict=False)


def _plain_name(name: str) -> str:
    """An adapted model's parameter name -> the plain model's (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


def merged_weights(model: nn.Module, layers: Sequence[str] | None = None) -> dict[str, Tensor]:
    """The weights a plain copy of `model` loads to compute what `model` computes: its whole state for a model
    without adapters; for an adapted one, only the adapted projections' merged weights (W + scale B A), detached,
    under the plain names (`layers`: only those adapted layers', by name)."""
    adapted = adapted_layers(model)
    if not adapted:
        return model.state_dict()
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        for name in adapted if layers is None else layers:
            layer = adapted[name]
            base = layer.get_base_layer()
            out[f"{name}.weight"] = base.weight + layer.get_delta_weight(ADAPTER).to(base.weight.dtype)
    return out


def merged_model(model: Transformer) -> Transformer:
    """A plain `Transformer` (no adapter layers) with `model`'s merged weights, frozen, on `model`'s device."""
    state = model.state_dict()
    plain_state = {_plain_name(k): v for k, v in state.items() if ".lora_" not in k}
    plain_state.update(merged_weights(model))
    return plain_model(plain_state, model.config, model.head)


def merged_state(state: Mapping[str, Tensor], config: LoraConfig) -> dict[str, Tensor]:
    """A plain model's whole state from an adapted model's whole state: the adapted projections merged
    (`merge_state`), every other tensor under its plain name."""
    plain = {_plain_name(k): v for k, v in state.items() if ".lora_" not in k}
    return {**plain, **merge_state(state, config)}


def plain_model(state: Mapping[str, Tensor], model_config: ModelConfig, head: str) -> Transformer:
    """A frozen `Transformer` of `model_config` holding `state`'s tensors themselves (no copy)."""
    with torch.device("meta"):
        plain = Transformer(copy.copy(model_config), head=head)
    plain.load_state_dict(dict(state), strict=True, assign=True)
    if plain.head == "lm" and plain.config.tie_word_embeddings:
        plain.lm_head.weight = plain.embed_tokens.weight
    return plain.eval().requires_grad_(False)


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """`model`'s adapter tensors by parameter name (`layers.0.self_attn.q_proj.lora_A.default.weight`)."""
    if not adapted_layers(model):
        raise ValueError("the model has no LoRA adapters to save (model.lora.rank=0)")
    return {name: t.detach() for name, t in model.state_dict().items() if ".lora_" in name}


def adapter_tensors(state: Mapping[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """The adapters of `state` (`adapter_state`'s, or any state holding them whole) under PEFT's checkpoint keys
    (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`) for a model of `config` (a ModelConfig):
    the Hugging Face key of each adapted projection, its adapter name dropped."""
    adapters = {name: t for name, t in state.items() if ".lora_" in name}
    projections = sorted({name.split(".lora_")[0] for name in adapters})
    # the HF module path of each of our projections, from the checkpoint layout (`model.` prefix)
    hf_of = {names[0]: key for key, names in hf_layout(config, (f"{n}.weight" for n in projections)).items()}
    out: dict[str, Tensor] = {}
    for name in projections:
        module = hf_of[f"{name}.weight"].removesuffix(".weight")
        for part in ("lora_A", "lora_B"):
            weight = adapters[f"{name}.{part}.{ADAPTER}.weight"]
            out[f"{_PEFT_PREFIX}{module}.{part}.weight"] = weight.detach().contiguous().cpu()
    return out


def merge_state(state: Mapping[str, Tensor], config: LoraConfig) -> dict[str, Tensor]:
    """The adapted projections' merged weights W + (alpha / rank) B A under the plain model's names, from a state
    holding an adapted model's tensors whole (each projection's `base_layer.weight`, `lora_A` and `lora_B`): what
    `merged_weights` computes on the model, computed on its gathered tensors (a sharded Actor's)."""
    scale = config.alpha / config.rank
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        for name in sorted({k.split(".lora_")[0] for k in state if ".lora_" in k}):
            base = state[f"{name}.base_layer.weight"]
            a, b = (state[f"{name}.lora_{part}.{ADAPTER}.weight"] for part in "AB")
            out[f"{name}.weight"] = base + (b @ a * scale).to(base.dtype)
    return out


def save_adapter(
    adapters: Mapping[str, Tensor],
    model_config: ModelConfig,
    config: LoraConfig,
    path: str | os.PathLike,
    *,
    base: str,
) -> None:
    """Write the adapters of `adapters` (`adapter_state`) as a PEFT adapter folder (adapter_config.json +
    adapter_model.safetensors, `base_model_name_or_path` = `base`), atomically (`write_folder`)."""
    tensors = adapter_tensors(adapters, model_config)

    def write(tmp: Path) -> None:
        _peft_config(config, base).save_pretrained(str(tmp))
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})

    write_folder(Path(path), write)


def trainable(params: Sequence[nn.Parameter] | Iterator[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters an optimizer steps (a LoRA model's adapters; every parameter of a plain model)."""
    return [p for p in params if p.requires_grad]
