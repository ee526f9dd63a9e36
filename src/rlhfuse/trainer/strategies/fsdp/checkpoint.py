"""`pipeline=fsdp`'s checkpoints (`FSDPCheckpointer`): the sharded model and optimizer states through
torch.distributed.checkpoint (every rank writes its shards; the files load on any world size), the schedulers and the
trainer's state written by rank 0, sealed by rank 0's meta.json (kind "fsdp") once every rank's part is written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlhfuse import distributed
from rlhfuse.core.checkpoint import mismatch_error, prune_run, seal_fields, sha256
from rlhfuse.core.errors import CheckpointError
from rlhfuse.distributed.fsdp import (
    load_state,
    save_state,
)
from rlhfuse.trainer.strategies.pipelines.checkpoint import all_ok, open_sealed

if TYPE_CHECKING:
    from rlhfuse.trainer.strategies.fsdp.training import ShardedStrategy

KIND, FORMAT = "fsdp", 1
DCP_DIR, STATE = "dcp", "state.pt"


class FSDPCheckpointer:
    """`pipeline=fsdp`'s `Checkpointer` (collective: every rank saves and loads its shards).

    Layout of `<run_dir>/checkpoints/iter_00000010/`:
        dcp/        torch.distributed.checkpoint's files: the trained models' and optimizers' sharded states
        state.pt    the LR schedulers' states and the trainer's (iteration, data position, RNG), by rank 0
        meta.json   written last, by rank 0: kind "fsdp", iteration, world size, the trained models and the
                    SHA-256 of every file
    Atomic as a whole: written into a temporary folder that rank 0 renames into place once every rank's shards
    are written; a failure on any rank leaves the previous checkpoints untouched.
    """

    def __init__(self, strategy: ShardedStrategy) -> None:
        self.strategy = strategy

    def save(
        self,
        directory: str | Path,
        iteration: int,
        extra: Mapping[str, Any],
        *,
        keep: int = 0,
        run: str | None = None,
    ) -> Path:
        s = self.strategy
        rank = distributed.rank()
        root = Path(directory)
        folder = open_sealed(root, iteration, "fsdp")
        error: str | None = None
        # collective; DCP raises the same error on every rank when one cannot write
        save_state(folder.path / DCP_DIR, s.sharded_state())
        if rank == 0:
            try:
                torch.save({**s.scheduler_state(), **extra}, folder.path / STATE)
                record = {
                    "kind": KIND,
                    "format": FORMAT,
                    "iteration": iteration,
                    "world_size": distributed.world_size(),
                    "models": list(s.trained),
                }
                folder.seal({**record, **seal_fields(run)})  # hashes every file: the DCP shards and STATE
                prune_run(root, run, keep)
            except OSError as err:
                folder.discard()
                error = f"cannot seal {folder.final}: {err}"
        all_ok(error, f"checkpoint of iteration {iteration} not written (previous checkpoints untouched)")
        return folder.final

    def load(self, path: str | Path) -> dict[str, Any]:
        """Check meta.json and every file, then restore the shards (written on any world size) and the
        schedulers; the configured learning rates replace the checkpoint's. Returns the saved state."""
        s = self.strategy
        path = Path(path)
        names = distributed.all_gather_json(str(path.resolve()), distributed.group_device())
        if len(set(names)) != 1:
            raise CheckpointError(
                f"ranks would resume from different checkpoints: {names} (use a shared folder)"
            )
        error: str | None = None
        try:
            check_fsdp_checkpoint(path, list(s.trained), s.algorithm.name)
        except CheckpointError as err:
            error = str(err)
        all_ok(error, "cannot resume")
        shards = s.sharded_state()
        load_state(path / DCP_DIR, shards)
        state: dict[str, Any] = torch.load(path / STATE, map_location="cpu", weights_only=True)
        try:
            s.load_state_dict({**shards, **state})
        except (RuntimeError, ValueError, KeyError) as err:
            raise mismatch_error(path, err) from None
        return state


def check_fsdp_checkpoint(path: Path, models: list[str], algorithm: str) -> dict[str, Any]:
    """meta.json of an fsdp checkpoint folder, every file present and matching its SHA-256, written for the
    same trained models; a CheckpointError naming the file and the fix otherwise."""
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"{meta_path} cannot be read ({err}): not a complete checkpoint; resume from another one "
            "(resume=<checkpoint folder>) or remove it"
        ) from None
    if not isinstance(meta, dict) or meta.get("kind") != KIND:
        kind = meta.get("kind", "single-process") if isinstance(meta, dict) else "unknown"
        raise CheckpointError(
            f"{meta_path} is a {kind} checkpoint, not one of pipeline=fsdp: resume it with the pipeline that "
            "wrote it"
        )
    if meta.get("models") != models:
        raise CheckpointError(
            f"{meta_path} holds the models {meta.get('models')} but algorithm.name={algorithm} trains {models}: "
            "resume it with the algorithm that wrote it"
        )
    for name, digest in dict(meta.get("sha256", {})).items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        if sha256(file) != digest:
            raise CheckpointError(
                f"checkpoint file {file} does not match its SHA-256 in meta.json (corrupt or tampered)"
            )
    return meta
