"""Atomic, safe checkpoints.

Layout of `<run_dir>/checkpoints/iter_00000010/`:
    actor.safetensors, critic.safetensors   model weights (safetensors: no code can run on load; no critic file
                                            for a critic-free algorithm)
    state.pt     optimizer/scheduler states, RNG states, data position (loaded with torch.load(weights_only=True))
    meta.json    iteration, format and the SHA-256 of every file (checked on load: a tampered or truncated
                 file is an error)
A checkpoint is written into a temporary folder and renamed into place only when complete, so a run killed
during a save leaves the previous checkpoint loadable; incomplete folders are ignored and cleaned up.

`PlainCheckpointer` is the `Checkpointer` of strategies whose ranks hold the same state (one process, or data
parallel): rank 0 writes, every rank loads. The pipeline strategies' sharded format is in
`rlhfuse.runtime.checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from torch import Tensor

from rlhfuse.core.config import non_negative
from rlhfuse.core.errors import CheckpointError

FORMAT = 1
MODEL_KEYS = ("actor", "critic")


@dataclass
class CheckpointConfig:
    # Save every N iterations (0 = never); the last iteration is always saved when N > 0.
    every: int = 0
    # Most recent checkpoints kept on disk (0 = keep all).
    keep: int = 2
    # Folder, relative to the run directory.
    dir: str = "checkpoints"
    # At the end, export the trained Actor as a Hugging Face checkpoint in <run_dir>/actor_hf.
    export_hf: bool = True

    def problems(self) -> list[str]:
        problems: list[str] = []
        non_negative(problems, "checkpoint.every", self.every, "0 = never")
        non_negative(problems, "checkpoint.keep", self.keep, "0 = keep all")
        return problems


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],  # type: ignore[index,union-attr]
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_weights(state: Mapping[str, Tensor], name: str) -> dict[str, Tensor]:
    weights = {}
    for key, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"refusing to save {name} weights with NaN/inf values (tensor {key!r})")
        # clone: tied weights share storage, which safetensors refuses to serialise.
        weights[key] = tensor.detach().to("cpu").clone().contiguous()
    return weights


def save_checkpoint(
    directory: str | Path, iteration: int, state: Mapping[str, Any], *, keep: int = 0
) -> Path:
    """Write `state` (a strategy state with 'actor' (and, with a Critic, 'critic') weights, plus any
    weights-only-loadable extras)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"iter_{iteration:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for key in (k for k in MODEL_KEYS if k in state):  # no critic file for a critic-free algorithm
            safetensors.torch.save_file(plain_weights(state[key], key), str(tmp / f"{key}.safetensors"))
        torch.save({k: v for k, v in state.items() if k not in MODEL_KEYS}, tmp / "state.pt")
        files = sorted(p.name for p in tmp.iterdir())
        meta = {"format": FORMAT, "iteration": iteration, "sha256": {f: sha256(tmp / f) for f in files}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for path in tmp.iterdir():
            fsync(path)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep > 0:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints (with meta.json) in `directory`, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("iter_*") if p.is_dir() and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(directory: str | Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint folder, verifying every file against meta.json; never unpickles arbitrary objects."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(
            f"{path} is not a complete rlhfuse checkpoint (no meta.json): pass a folder written by "
            "checkpoint.every=N, or resume=auto to pick the latest complete one"
        )
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("kind") == "pipeline":  # rlhfuse.runtime.checkpoint
            layout = meta.get("layout", {})
            raise CheckpointError(
                f"{meta_path} is a sharded pipeline checkpoint ({layout.get('world_size')} ranks, actor.pp="
                f"{layout.get('actor', {}).get('pp')}, critic.pp={layout.get('critic', {}).get('pp')}): resume it "
                f"with pipeline=fused (or serial_1f1b) and distributed.nproc_per_node={layout.get('world_size')}"
            )
        expected: dict[str, str] = dict(meta["sha256"])
        iteration = int(meta["iteration"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{meta_path} is malformed ({err})") from None
    models = [k for k in MODEL_KEYS if k == "actor" or f"{k}.safetensors" in expected]
    for name in (*(f"{k}.safetensors" for k in models), "state.pt"):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        if expected.get(name) != sha256(file):
            raise CheckpointError(
                f"checkpoint file {file} does not match its SHA-256 in meta.json (corrupt or tampered)"
            )
    state: dict[str, Any] = {}
    for key in models:
        state[key] = safetensors.torch.load_file(str(path / f"{key}.safetensors"))
    try:
        extra = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        raise CheckpointError(f"{path / 'state.pt'} is not a plain tensor/number state file: {err}") from None
    state.update(extra)
    state["iteration"] = iteration
    return state


class PlainCheckpointer:
    """The `Checkpointer` of this format for a strategy whose ranks hold the same state: `state()` (the
    strategy's `state_dict`, with 'actor'/'critic' weights) is written by the writer rank only (rank 0);
    `load` reads the folder on every rank and hands it to `restore` (the strategy's `load_state_dict`)."""

    def __init__(
        self,
        state: Callable[[], Mapping[str, Any]],
        restore: Callable[[Mapping[str, Any]], None],
        *,
        writer: bool = True,
    ) -> None:
        self.state, self.restore, self.writer = state, restore, writer

    def save(
        self, directory: str | Path, iteration: int, extra: Mapping[str, Any], *, keep: int = 0
    ) -> Path | None:
        """The checkpoint folder on the writer rank, None elsewhere."""
        if not self.writer:
            return None
        return save_checkpoint(directory, iteration, {**self.state(), **extra}, keep=keep)

    def load(self, path: str | Path) -> dict[str, Any]:
        state = load_checkpoint(path)
        self.restore(state)
        return state
