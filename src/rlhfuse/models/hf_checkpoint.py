"""Hugging Face checkpoint directories <-> `Transformer`, through safetensors only (never pickle).

Read: config.json + model.safetensors, or shards listed in model.safetensors.index.json, written by
<Family>ForCausalLM (head "lm" or "value") or <Family>ForSequenceClassification with num_labels=1 (head
"value"), for the families of `rlhfuse.models.model_config.ARCHITECTURES` (Llama, Qwen2, Qwen3, Mistral). Written: config.json + model.safetensors that `transformers` loads with the matching class.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from rlhfuse._resources import read_json
from rlhfuse.models.attention import AttentionBackend
from rlhfuse.models.model_config import ARCHITECTURES, SUPPORTED_HEADS, ModelConfig
from rlhfuse.models.stages import stage_of
from rlhfuse.models.transformer import Transformer

log = logging.getLogger(__name__)

_CAUSAL_LM_CLASS = {name: a.lm_class for name, a in ARCHITECTURES.items()}
SUPPORTED_HF_CLASSES = {
    **{cls: (name, "lm") for name, cls in _CAUSAL_LM_CLASS.items()},
    **{a.value_head_class: (name, "value") for name, a in ARCHITECTURES.items()},
}
_HF_HEAD_KEYS = {"lm": "lm_head.weight", "value": "score.weight"}
# buffers some old checkpoints saved; they are recomputed from the config
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint directory cannot be loaded; the message names the file, the tensor and the fix."""


def _hf_key(name: str) -> str:
    """Our parameter name -> the HF checkpoint key."""
    if name == "lm_head.weight":
        return name
    if name == "value_head.weight":
        return _HF_HEAD_KEYS["value"]
    return f"model.{name}"


# Phi-3's fused projections: the checkpoint's module -> ours, stacked along the output rows in this order
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


# Mixtral's names for a mixture-of-experts MLP and its experts' projections
_MIXTRAL = (
    (".mlp.gate.", ".block_sparse_moe.gate."),
    (".mlp.experts.", ".block_sparse_moe.experts."),
    (".gate_proj.", ".w1."),
    (".up_proj.", ".w3."),
    (".down_proj.", ".w2."),
)


def _family_name(config: ModelConfig, name: str) -> str:
    """Our parameter name as the family's checkpoints spell it (before the `model.` prefix)."""
    if config.family.moe == "mixtral" and (".mlp.experts." in name or ".mlp.gate." in name):
        for ours, theirs in _MIXTRAL:
            name = name.replace(ours, theirs)
    return name


def hf_layout(config: ModelConfig, names: Iterable[str]) -> dict[str, list[str]]:
    """HF checkpoint key -> the parameter names it holds: one, or for a family that fuses projections
    (`Architecture.fused`) the parts of a fused one, in their order along its rows."""
    out: dict[str, list[str]] = {}
    rank: dict[str, int] = {}
    for name in names:
        key = _hf_key(_family_name(config, name))
        if config.family.fused:
            for fused, parts in _FUSED.items():
                for i, part in enumerate(parts):
                    if f".{part}." in f".{name}":  # layers.3.self_attn.q_proj.weight -> ...qkv_proj.weight
                        key, rank[name] = _hf_key(name.replace(part, fused)), i
        out.setdefault(key, []).append(name)
    return {key: sorted(group, key=lambda n: rank.get(n, 0)) for key, group in out.items()}


def hf_named_tensors(named_tensors: Mapping[str, Tensor], config: ModelConfig) -> list[tuple[str, Tensor]]:
    """(HF checkpoint key, tensor) for a `Transformer` state dict, e.g. for an inference engine's weight reload:
    fused projections joined (Phi-3), a tied LM head left out (the checkpoint stores the embedding table once)."""
    return [
        (key, named_tensors[names[0]] if len(names) == 1 else torch.cat([named_tensors[n] for n in names]))
        for key, names in hf_layout(config, named_tensors).items()
        if not (config.tie_word_embeddings and names == ["lm_head.weight"])
    ]


def _read_config(path: Path) -> tuple[dict, str]:
    config_file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory: pass a Hugging Face checkpoint directory")
    if not config_file.is_file():
        raise CheckpointError(
            f"{config_file} is missing: a checkpoint directory needs config.json next to its *.safetensors "
            "(save it with transformers' save_pretrained or rlhfuse.models.save_pretrained)"
        )
    hf = read_json(config_file, CheckpointError)
    if not isinstance(hf, dict):
        raise CheckpointError(
            f"{config_file} holds a {type(hf).__name__}, not a JSON object: fix or replace it"
        )
    classes = hf.get("architectures") or []
    if not classes and hf.get("model_type") in _CAUSAL_LM_CLASS:
        # some exported checkpoints omit `architectures`; model_type alone means the plain causal LM
        classes = [_CAUSAL_LM_CLASS[hf["model_type"]]]
    known = [c for c in classes if c in SUPPORTED_HF_CLASSES]
    if not known:
        raise CheckpointError(
            f"{config_file}: architectures={classes} (model_type={hf.get('model_type')!r}) is not supported; "
            f"rlhfuse.models loads {sorted(SUPPORTED_HF_CLASSES)}"
        )
    return hf, known[0]


def _tensor_files(path: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file holding it."""
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        index = read_json(index_file, CheckpointError)
        weight_map = index.get("weight_map", {}) if isinstance(index, dict) else {}
        missing_files = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing_files:
            raise CheckpointError(
                f"{index_file} lists shard(s) {missing_files} that are not in {path}: copy the whole checkpoint"
            )
        return {key: path / file for key, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in path.iterdir())
        raise CheckpointError(
            f"no *.safetensors files in {path} (found {found}); rlhfuse reads safetensors only, never pickled "
            ".bin files: re-save with save_pretrained(..., safe_serialization=True)"
        )
    mapping: dict[str, Path] = {}
    for file in files:
        with _open_safetensors(file) as f:
            for key in f.keys():
                mapping[key] = file
    return mapping


def _open_safetensors(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(
            f"{file} is not a readable safetensors file ({err}): it is truncated or corrupt; copy it again"
        ) from None


def from_pretrained(
    path: str | os.PathLike,
    head: str = "lm",
    dtype: torch.dtype = torch.float32,
    *,
    stages: tuple[int, Collection[int]] | None = None,
    attention_backend: AttentionBackend = "sdpa",
) -> Transformer:
    """Load a Hugging Face checkpoint directory as a `Transformer` with the given head, in `dtype`, attending
    with `attention_backend` (not a property of the checkpoint: config.json does not carry it).

    `stages=(num_stages, held)`: sharded construction for a pipeline rank: the model is built on the meta device
    and only the tensors of the `held` stages (of `num_stages` equal-cost stages, `rlhfuse.models.stage_of`)
    are read from the safetensors files (`safe_open`, one tensor at a time) and materialised on the CPU; every
    other parameter stays a meta tensor (shape and dtype only, no memory)."""
    if head not in SUPPORTED_HEADS:
        raise ValueError(f"head={head!r} is unknown: use one of {SUPPORTED_HEADS}")
    path = Path(path)
    hf, hf_class = _read_config(path)
    _, file_head = SUPPORTED_HF_CLASSES[hf_class]
    if head == "lm" and file_head == "value":
        raise CheckpointError(
            f"{path / 'config.json'}: {hf_class} has a score layer, not an LM head; load it with head='value'"
        )
    if file_head == "value" and hf.get("num_labels", len(hf.get("id2label") or {0: 0})) != 1:
        raise CheckpointError(
            f"{path / 'config.json'}: {hf_class} has num_labels={hf.get('num_labels', len(hf['id2label']))}; "
            "a value head needs num_labels=1 (one scalar per token)"
        )
    try:
        config = dataclasses.replace(
            ModelConfig.from_hf_dict(hf), attention_backend=attention_backend
        ).validate()
    except ValueError as err:
        raise CheckpointError(f"{path / 'config.json'}: {err}") from err

    with torch.device("meta"):
        model = Transformer(config, head=head)
    files = _tensor_files(path)
    expected = hf_layout(config, (name for name, _ in model.named_parameters()))
    fresh_value_head = head == "value" and file_head == "lm"
    if fresh_value_head:
        del expected[_HF_HEAD_KEYS["value"]]
    ignorable = {"lm_head.weight"} if head == "value" or config.tie_word_embeddings else set()
    missing = sorted(set(expected) - set(files))
    unexpected = sorted(
        k for k in set(files) - set(expected) if k not in ignorable and not k.endswith(_IGNORED_SUFFIXES)
    )
    if missing or unexpected:
        where = sorted({files[k].name for k in unexpected}) or sorted({p.name for p in files.values()})
        raise CheckpointError(
            f"checkpoint {path} ({', '.join(where)}) does not match {hf_class} from its config.json: "
            f"missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}; "
            "check that config.json belongs to these weights (num_hidden_layers, attention_bias, "
            "tie_word_embeddings) and that the checkpoint is complete"
        )

    held_names: set[str] | None = None
    if stages is not None:
        num_stages, held = stages
        if num_stages > 1 and config.tie_word_embeddings and head == "lm":
            raise ValueError(
                f"{path} ties its embedding and LM head, which a {num_stages}-stage pipeline places on different "
                "ranks: untie them (tie_word_embeddings=false) or use pp=1 for this model"
            )
        held_names = {
            name
            for name, _ in model.named_parameters()
            if stage_of(name, config.num_layers, num_stages) in held
        }
        expected = {key: names for key, names in expected.items() if set(names) <= held_names}
    shapes = {name: p.shape for name, p in model.named_parameters()}
    state: dict[str, Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for key in expected:
        by_file.setdefault(files[key], []).append(key)
    for file, keys in by_file.items():
        with _open_safetensors(file) as f:
            for key in keys:
                try:
                    tensor = f.get_tensor(key)
                except SafetensorError as err:
                    raise CheckpointError(
                        f"{file}: tensor {key!r} cannot be read ({err}): the file is truncated or corrupt; "
                        "copy it again"
                    ) from None
                names = expected[key]
                rows = [shapes[n][0] for n in names]
                implied = (sum(rows), *shapes[names[0]][1:])
                if tuple(tensor.shape) != implied:
                    raise CheckpointError(
                        f"{file}: tensor {key!r} has shape {tuple(tensor.shape)} but config.json implies "
                        f"{implied}; the config and the weights disagree (wrong config.json?)"
                    )
                for name, part in zip(names, tensor.split(rows), strict=True):
                    state[name] = part.to(dtype)
    if held_names is None:
        model = model.to_empty(device="cpu").to(dtype)
    else:
        model = model.to(dtype)  # meta -> meta of `dtype`: shapes and dtypes for the stages held elsewhere
    if fresh_value_head and (held_names is None or "value_head.weight" in held_names):
        weight = torch.empty(model.value_head.weight.shape, dtype=dtype)
        torch.nn.init.normal_(weight, std=config.initializer_range)
        state["value_head.weight"] = weight
        log.warning(
            "%s is a %s checkpoint without a value head: value_head initialised fresh (normal, std %s)",
            path,
            hf_class,
            config.initializer_range,
        )
    model.load_state_dict(state, strict=False, assign=True)
    if head == "lm" and config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    unset = [
        n
        for n, p in model.named_parameters()
        if n not in state and not model._is_tied(n) and (held_names is None or n in held_names)
    ]
    assert not unset, f"parameters left uninitialised: {unset}"
    return model


def save_pretrained(model: Transformer, path: str | os.PathLike) -> None:
    """Write config.json + model.safetensors for `transformers`; atomically (temp dir, then rename)."""
    path = Path(path)
    hf = model.config.to_hf_dict(model.head)
    # transformers 5 reads "dtype", 4.x "torch_dtype"
    hf["dtype"] = hf["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    named = {n: p for n, p in model.named_parameters() if not model._is_tied(n)}
    tensors = {key: t.detach().contiguous().cpu() for key, t in hf_named_tensors(named, model.config)}

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    write_folder(path, write)


def write_folder(path: Path, write: Callable[[Path], None]) -> None:
    """Fill a folder with `write(tmp)` in a temporary sibling, then rename it to `path` (replacing an old one
    whole): a reader never sees a half-written folder, and a failure leaves the old one as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        write(tmp)
        if path.exists():
            # rename cannot replace a non-empty directory: move the old one aside first, delete it last
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old / path.name)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_weights(model: torch.nn.Module, named_tensors: Mapping[str, Tensor]) -> None:
    """A weight sync into a generation copy: copy each of `named_tensors` into `model`'s tensor of that name
    (casting to its dtype). The whole state, or the part that changed (a LoRA Actor's merged projections,
    `rlhfuse.models.lora.merged_weights`); a name `model` lacks is an error."""
    with torch.no_grad():
        unexpected = model.load_state_dict(dict(named_tensors), strict=False).unexpected_keys
    if unexpected:
        raise KeyError(f"weight sync: the generation copy has no tensors {sorted(unexpected)[:8]}")
