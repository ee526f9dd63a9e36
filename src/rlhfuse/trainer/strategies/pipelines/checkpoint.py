"""Sharded checkpoints of the pipeline strategies: every rank saves the stages it trains, with their optimizer
and LR-scheduler states; rank 0 seals the folder with a manifest recording the layout.

Layout of `<run_dir>/checkpoints/iter_00000010/` (the folder every rank can see: a shared file system):
    rank_00000/stages.safetensors   the rank's stage weights, keys `<model>.r<replica>.s<stage>.<parameter>`
    rank_00000/state.pt             optimizer and scheduler states, the rank's RNG states, the trainer's state
                                    (iteration, data position), the schedule (loaded with weights_only=True)
    rank_00001/...
    meta.json                       written last, by rank 0: kind "pipeline", iteration, the layout (world size,
                                    dp, micro-batches, per model pp and every stage's layer range) and the
                                    SHA-256 of every shard file

Atomic as a whole: the shards are written into one temporary folder; only when every rank reports its shard
written and synced does rank 0 write meta.json and rename the folder into place. A rank that fails (an error,
NaN weights, a full disk) makes every rank raise `CheckpointError` and the folder is removed; a rank killed
mid-save leaves an unsealed temporary folder that is never loaded and is removed by the next save or start. Either way
the previous checkpoint is untouched.

Resume checks the manifest against the current layout before loading anything (`check_layout`, called by
`rlhfuse-train` before any model is built) and names the file and every mismatch.

`ShardedCheckpointer` is the pipeline strategies' `Checkpointer` over this format.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import Tensor

from rlhfuse import distributed
from rlhfuse.core.checkpoint import (
    SealedFolder,
    mismatch_error,
    plain_weights,
    prune_run,
    resume_path,
    seal_fields,
    sha256,
)
from rlhfuse.core.errors import CheckpointError
from rlhfuse.models.stages import balanced_ranges
from rlhfuse.runtime.layout import MODELS, ParallelLayout
from rlhfuse.runtime.partition import RankStages
from rlhfuse.trainer.strategies.pipelines.config import PipelineRun

KIND = "pipeline"
FORMAT = 1
WEIGHTS, STATE = "stages.safetensors", "state.pt"


def layout_record(
    layout: ParallelLayout, layer_ranges: Mapping[str, list[tuple[int, int]]]
) -> dict[str, Any]:
    """What a shard depends on: world size, data parallelism, micro-batches, each trained model's stages and
    layers. An Actor-only layout (a critic-free algorithm) records `trained: ["actor"]` and no critic entry, so a
    run with a Critic cannot resume its checkpoints, nor the reverse."""
    only = {} if tuple(layout.trained) == tuple(MODELS) else {"trained": list(layout.trained)}
    return {
        "world_size": layout.world_size,
        "dp": layout.dp,
        **({"tp": layout.tp} if layout.tp > 1 else {}),
        "microbatches": layout.microbatches,
        **only,
        **{
            m: {
                "pp": layout.stages(m),
                # a merged model's own tp (its stages merged onto the tp-wide groups)
                **({"tp": layout.model_tp(m)} if layout.model_tp(m) != layout.tp else {}),
                "layers": [list(r) for r in layer_ranges[m]],
            }
            for m in layout.trained
            if m in layer_ranges
        },
    }


def expected_record(layout: ParallelLayout, num_layers: Mapping[str, int] | None) -> dict[str, Any]:
    """The record of `layout` with equal-cost stages over `num_layers` per model (None: layers unknown yet)."""
    ranges = {m: balanced_ranges([1.0] * n, layout.stages(m)) for m, n in (num_layers or {}).items()}
    record = layout_record(layout, ranges)
    for m in layout.trained:
        record.setdefault(
            m,
            {
                "pp": layout.stages(m),
                **({"tp": layout.model_tp(m)} if layout.model_tp(m) != layout.tp else {}),
            },
        )
    return record


def _mismatches(saved: Mapping[str, Any], current: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in current.items():
        if key not in saved:
            out.append(f"{prefix}{key}: not recorded (this run: {value})")
        elif isinstance(value, Mapping) and isinstance(saved[key], Mapping):
            out += _mismatches(saved[key], value, f"{prefix}{key}.")
        elif saved[key] != value:
            out.append(f"{prefix}{key}: saved {saved[key]}, this run {value}")
    return out


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The meta.json of a sharded checkpoint folder; a CheckpointError naming the file if it is not one."""
    meta_path = Path(path) / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(
            f"{Path(path)} is not a complete rlhfuse checkpoint (no meta.json): pass a folder written by "
            "checkpoint.every=N, or resume=auto to pick the latest complete one"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as err:
        raise CheckpointError(f"{meta_path} is malformed ({err})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"{meta_path} is malformed (a JSON object expected, got a {type(meta).__name__})"
        )
    if meta.get("kind") != KIND:
        raise CheckpointError(
            f"{meta_path} is a single-process checkpoint (pipeline=plain); a pipeline strategy resumes only its "
            "own sharded checkpoints: resume it with pipeline=plain, or start this run with resume=never"
        )
    return dict(meta)


def check_layout(path: str | Path, current: Mapping[str, Any]) -> dict[str, Any]:
    """Refuse to resume `path` under another layout: CheckpointError naming meta.json and every mismatch."""
    meta = read_manifest(path)
    problems = _mismatches(meta.get("layout", {}), current)
    if problems:
        saved = meta.get("layout", {})
        critic_free = "trained" in saved  # an Actor-only layout: no critic entry
        critic_pp = "" if critic_free else f"pipeline.critic_pp={saved.get('critic', {}).get('pp')} "
        hint = (
            f"resume with distributed.nproc_per_node={saved.get('world_size')} "
            f"pipeline.actor_pp={saved.get('actor', {}).get('pp')} {critic_pp}"
            f"pipeline.microbatches={saved.get('microbatches')} (and the same model and "
            + ("a critic-free algorithm" if critic_free else "an algorithm with a Critic")
            + "), or resume=never"
        )
        raise CheckpointError(
            f"checkpoint {Path(path) / 'meta.json'} was saved with another pipeline layout:\n  - "
            + "\n  - ".join(problems)
            + f"\n{hint}"
        )
    return meta


def check_resume(
    run: PipelineRun,
    resume: str,
    checkpoint_dir: str | Path,
    run_dir: str | Path | None = None,
    layout: ParallelLayout | None = None,
) -> Path | None:
    """Before any model is built: the checkpoint `resume` designates (None: fresh start) after checking its
    manifest against the layout `run` will have (`layout` as already derived, else `run.layout()`; stage layer
    ranges too when the model is built from config; a Hugging Face model's layers are checked when the strategy
    loads the shards)."""
    path = resume_path(run_dir or Path(checkpoint_dir).parent, checkpoint_dir, resume)
    if path is None:
        return None
    layout = layout or run.layout()  # as the strategy
    layers = None if run.num_layers is None else {m: run.num_layers for m in layout.trained}
    check_layout(path, expected_record(layout, layers))
    return path


def open_sealed(root: Path, iteration: int, tag: str) -> SealedFolder:
    """Collective: the checkpoint folder of `iteration`, its temporary folder made by rank 0; a CheckpointError on
    every rank when it cannot be."""
    folder = SealedFolder(root / f"iter_{iteration:08d}", tag)
    error: str | None = None
    if distributed.rank() == 0:
        try:
            folder.open()
        except OSError as err:
            error = f"cannot create {folder.path}: {err}"
    all_ok(error, f"checkpoint of iteration {iteration} not written")
    return folder


def all_ok(error: str | None, what: str) -> None:
    """Collective: raise the same CheckpointError on every rank if any rank reports an error."""
    gathered = distributed.all_gather_json(error, distributed.group_device())
    failed = [(rank, e) for rank, e in enumerate(gathered) if e is not None]
    if failed:
        raise CheckpointError(f"{what}: " + "; ".join(f"rank {rank}: {e}" for rank, e in failed))


def save_sharded(
    directory: str | Path,
    iteration: int,
    *,
    weights: Mapping[str, Tensor],
    state: Mapping[str, Any],
    layout: Mapping[str, Any],
    keep: int = 0,
    run: str | None = None,
) -> Path:
    """Collective: every rank writes its shard (`weights`, weights-only loadable `state`), rank 0 seals the
    checkpoint with the manifest. Returns the final folder on every rank; raises CheckpointError on every rank
    (previous checkpoints untouched) if any rank could not write its shard."""
    rank = distributed.rank()
    root = Path(directory)
    folder = open_sealed(root, iteration, "sharded")
    error: str | None = None
    hashes: dict[str, str] = {}
    try:
        shard = folder.path / f"rank_{rank:05d}"
        shard.mkdir()
        safetensors.torch.save_file(plain_weights(weights, f"rank {rank} stage"), str(shard / WEIGHTS))
        torch.save(dict(state), shard / STATE)
        hashes = folder.hash_files(f"{shard.name}/{name}" for name in (WEIGHTS, STATE))
    except Exception as err:  # reported to every rank below
        error = f"{type(err).__name__}: {err}"
    parts = distributed.all_gather_json([error, hashes], distributed.group_device())
    failed = [(r, e) for r, (e, _) in enumerate(parts) if e is not None]
    if failed:
        if rank == 0:
            folder.discard()
        raise CheckpointError(
            f"checkpoint of iteration {iteration} not written (previous checkpoints untouched): "
            + "; ".join(f"rank {r} could not save its shard: {e}" for r, e in failed)
        )
    all_hashes = {k: v for _, part in parts for k, v in part.items()}
    error = None
    if rank == 0:
        try:
            record = {"kind": KIND, "format": FORMAT, "iteration": iteration, "layout": dict(layout)}
            folder.seal({**record, **seal_fields(run)}, all_hashes)
            prune_run(root, run, keep)
        except OSError as err:
            folder.discard()
            error = f"cannot seal {folder.final}: {err}"
    all_ok(error, f"checkpoint of iteration {iteration} not written")
    return folder.final


def load_sharded(
    path: str | Path, current: Mapping[str, Any]
) -> tuple[dict[str, Tensor], dict[str, Any], int]:
    """Collective: check the manifest against `current` (the layout record), verify and load this rank's shard.
    Returns (weights, state, iteration); every rank raises the same CheckpointError if any rank cannot load."""
    rank = distributed.rank()
    path = Path(path)
    names = distributed.all_gather_json(str(path.resolve()), distributed.group_device())
    if len(set(names)) != 1:
        raise CheckpointError(f"ranks would resume from different checkpoints: {names} (use a shared folder)")
    error: str | None = None
    out: tuple[dict[str, Tensor], dict[str, Any], int] = ({}, {}, 0)
    try:
        meta = check_layout(path, current)
        shard = path / f"rank_{rank:05d}"
        expected = meta.get("sha256", {})
        for name in (WEIGHTS, STATE):
            file = shard / name
            if not file.is_file():
                raise CheckpointError(f"checkpoint file {file} is missing")
            if expected.get(f"{shard.name}/{name}") != sha256(file):
                raise CheckpointError(
                    f"checkpoint file {file} does not match its SHA-256 in meta.json (corrupt or tampered)"
                )
        weights = safetensors.torch.load_file(str(shard / WEIGHTS))
        try:
            state = torch.load(shard / STATE, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
            raise CheckpointError(f"{shard / STATE} is not a plain tensor/number state file: {err}") from None
        out = (weights, state, int(meta["iteration"]))
    except CheckpointError as err:
        error = str(err)
    gathered = distributed.all_gather_json(error, distributed.group_device())
    if error is not None:
        raise CheckpointError(error)
    failed = [(r, e) for r, e in enumerate(gathered) if e is not None]
    if failed:
        raise CheckpointError(f"rank {failed[0][0]} cannot resume: {failed[0][1]}")
    return out


class ShardedCheckpointer:
    """The pipeline strategies' `Checkpointer` (collective: every rank saves and loads its own shard).

    A shard holds this rank's stage weights (`stages.shard()`) and `state()`, the rank's other state
    (optimizer and scheduler states, the planned schedule); `restore` takes that state back after loading.
    """

    def __init__(
        self,
        stages: RankStages,
        state: Callable[[], Mapping[str, Any]],
        restore: Callable[[Mapping[str, Any]], None],
    ) -> None:
        self.stages, self.state, self.restore = stages, state, restore

    def layout_record(self) -> dict[str, Any]:
        """The layout a shard depends on: world size, dp, micro-batches, each model's stages and layer ranges."""
        return layout_record(self.stages.layout, self.stages.layer_ranges())

    def save(
        self,
        directory: str | Path,
        iteration: int,
        extra: Mapping[str, Any],
        *,
        keep: int = 0,
        run: str | None = None,
    ) -> Path:
        return save_sharded(
            directory,
            iteration,
            weights=self.stages.shard(),
            state={**self.state(), **extra},
            layout=self.layout_record(),
            keep=keep,
            run=run,
        )

    def load(self, path: str | Path) -> dict[str, Any]:
        """Check the manifest against this layout, restore this rank's shard (and, with full copies on
        every rank, bring them in sync); returns the shard's state."""
        weights, state, _ = load_sharded(path, self.layout_record())
        try:
            self.stages.load_shard(weights)
            self.restore(state)
        except (RuntimeError, ValueError, KeyError) as err:
            raise mismatch_error(path, err) from None
        if not self.stages.sharded:  # full copies on every rank: bring them in sync
            self.stages.gather()
        return state
