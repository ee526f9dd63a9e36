"""Atomic, safe checkpoints.

Layout of `<run_dir>/checkpoints/iter_00000010/`:
    actor.safetensors, critic.safetensors   model weights (safetensors: no code can run on load; no critic file
                                            for a critic-free algorithm)
    state.pt     optimizer/scheduler states, RNG states, data position (loaded with torch.load(weights_only=True))
    meta.json    iteration, format and the SHA-256 of every file (checked on load: a tampered or truncated
                 file is an error)
A checkpoint is written into a temporary folder and renamed into place only when complete, so a run killed
during a save leaves the previous checkpoint loadable; incomplete folders are ignored, and `clean_stale` (called
by the trainer at start) removes them with the temporary folders of interrupted saves and prunes.

Checkpoints belong to a run (`RunIdentity`, `<run_dir>/run.json`): meta.json records the id of the run that
wrote it; `resume=auto` continues the run recorded in run.json, and rotation (`prune_run`) removes only that
run's older checkpoints, newest kept by iteration and time.

`PlainCheckpointer` is the `Checkpointer` of strategies whose ranks hold the same state (one process, or data
parallel): rank 0 writes, every rank loads. The pipeline strategies' sharded format is in
`rlhfuse.trainer.strategies.pipelines.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import random
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import safetensors.torch
import torch
from torch import Tensor

from rlhfuse.core.checkpoint_config import CheckpointConfig as CheckpointConfig  # importable from here too
from rlhfuse.core.errors import CheckpointError

FORMAT = 1
MODEL_KEYS = ("actor", "critic")


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


class SealedFolder:
    """A folder that appears whole or not at all. Its files are written into `path`, a temporary folder beside
    `final` (`.tmp-<final name>-<tag>`, which `clean_stale` removes if a kill leaves it); `seal` syncs and
    hashes them, writes the seal file (meta.json) last and renames the folder into place, replacing an older
    `final`.

    One process: `with SealedFolder(final, tag) as folder:` write into `folder.path`, then `folder.seal(...)`;
    an error (or a body that does not seal) removes the temporary folder. Several ranks writing one folder: the
    owning rank `open`s it, every rank writes its files and `hash_files` them, the owner `seal`s with the
    gathered hashes or `discard`s; the collectives between these steps stay the caller's."""

    def __init__(self, final: Path, tag: str, *, seal_file: str = "meta.json") -> None:
        self.final, self.seal_file = final, seal_file
        self.path = final.with_name(f".tmp-{final.name}-{tag}")

    def open(self) -> Path:
        """Create the temporary folder afresh (one left by a process killed during an earlier write goes)."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(parents=True)
        return self.path

    def hash_files(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """Sync the files `names` (relative to `path`; None: every file in it) to disk; their SHA-256 by name."""
        if names is None:
            names = sorted(p.relative_to(self.path).as_posix() for p in self.path.rglob("*") if p.is_file())
        hashes = {}
        for name in names:
            fsync(self.path / name)
            hashes[name] = sha256(self.path / name)
        return hashes

    def seal(self, record: Mapping[str, Any], hashes: Mapping[str, str] | None = None) -> Path:
        """Write `record` with the SHA-256 of the files ("sha256": `hashes`, gathered from the ranks that wrote
        them; None: `hash_files()` here) into the seal file, then move the folder to `final`. Returns `final`."""
        digests = self.hash_files() if hashes is None else hashes
        seal = self.path / self.seal_file
        seal.write_text(json.dumps({**record, "sha256": dict(sorted(digests.items()))}, indent=1))
        fsync(seal)
        if self.final.exists():
            remove_checkpoint(self.final)
        os.rename(self.path, self.final)
        fsync(self.final.parent)
        return self.final

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> SealedFolder:
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.discard()  # after a seal there is nothing left to remove


def save_checkpoint(
    directory: str | Path,
    iteration: int,
    state: Mapping[str, Any],
    *,
    keep: int = 0,
    run: str | None = None,
) -> Path:
    """Write `state` (a strategy state with 'actor' (and, with a Critic, 'critic') weights, plus any
    weights-only-loadable extras); `run` (the writing run's id) goes into meta.json; `keep` > 0 then keeps that
    many checkpoints of `run`."""
    root = Path(directory)
    with SealedFolder(root / f"iter_{iteration:08d}", str(os.getpid())) as folder:
        for key in (k for k in MODEL_KEYS if k in state):  # no critic file for a critic-free algorithm
            weights = plain_weights(state[key], key)
            safetensors.torch.save_file(weights, str(folder.path / f"{key}.safetensors"))
        torch.save({k: v for k, v in state.items() if k not in MODEL_KEYS}, folder.path / "state.pt")
        final = folder.seal({"format": FORMAT, "iteration": iteration, **seal_fields(run)})
    prune_run(root, run, keep)
    return final


def seal_fields(run: str | None) -> dict[str, Any]:
    """What meta.json records about the save itself: the writing run's id and the time."""
    return {"run": run, "saved_at": time.time()}


def checkpoint_meta(path: Path) -> dict[str, Any] | None:
    """meta.json of a complete checkpoint folder (every file it lists present), else None."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or not isinstance(meta.get("sha256", {}), dict):
        return None
    if not all((path / name).is_file() for name in meta.get("sha256", {})):
        return None  # half-removed by an interrupted prune
    return meta


def _order(path: Path, meta: Mapping[str, Any]) -> tuple[int, float]:
    return int(meta.get("iteration", 0)), float(meta.get("saved_at") or path.stat().st_mtime)


def remove_checkpoint(path: Path) -> None:
    """Remove a checkpoint folder: renamed out of the `iter_*` names first, so a kill midway leaves no
    half-removed checkpoint that looks complete."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def prune_run(directory: str | Path, run: str | None, keep: int) -> list[Path]:
    """Keep the `keep` newest (by iteration, then time) complete checkpoints written by `run` (0 = keep all);
    checkpoints of other runs are never touched. Returns the removed folders."""
    if keep <= 0:
        return []
    own = list_checkpoints(directory, run=run)
    removed = own[:-keep]
    for old in removed:
        remove_checkpoint(old)
    return removed


def clean_stale(directory: str | Path) -> list[str]:
    """Remove what interrupted saves and prunes left in a checkpoint folder: `.tmp-*` / `.trash-*` folders
    and `iter_*` folders that are not complete. Returns the names removed."""
    root = Path(directory)
    if not root.is_dir():
        return []
    removed = []
    for path in sorted(root.iterdir()):
        stale = path.name.startswith((".tmp-", ".trash-")) or (
            path.name.startswith("iter_") and checkpoint_meta(path) is None
        )
        if stale and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


_ANY = object()


def list_checkpoints(directory: str | Path, *, run: Any = _ANY) -> list[Path]:
    """Complete checkpoints (meta.json and every file it lists) in `directory`, oldest first (by iteration,
    then time); with `run`, only those that run wrote."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for path in root.glob("iter_*"):
        meta = checkpoint_meta(path) if path.is_dir() else None
        if meta is not None and (run is _ANY or meta.get("run") == run):
            found.append((_order(path, meta), path))
    return [path for _, path in sorted(found)]


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
        if not isinstance(meta, dict):
            raise TypeError(f"a JSON object expected, got a {type(meta).__name__}")
        if meta.get("kind") == "pipeline":  # rlhfuse.trainer.strategies.pipelines.checkpoint
            layout = meta.get("layout", {})
            raise CheckpointError(
                f"{meta_path} is a sharded pipeline checkpoint ({layout.get('world_size')} ranks, actor.pp="
                f"{layout.get('actor', {}).get('pp')}, critic.pp={layout.get('critic', {}).get('pp')}): resume it "
                f"with pipeline=fused (or serial_1f1b) and distributed.nproc_per_node={layout.get('world_size')}"
            )
        expected: dict[str, str] = dict(meta["sha256"])
        iteration = int(meta["iteration"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{meta_path} is malformed ({err}): this checkpoint is damaged; resume from another one "
            "(resume=<checkpoint folder>) or remove it"
        ) from None
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
        self,
        directory: str | Path,
        iteration: int,
        extra: Mapping[str, Any],
        *,
        keep: int = 0,
        run: str | None = None,
    ) -> Path | None:
        """The checkpoint folder on the writer rank, None elsewhere."""
        if not self.writer:
            return None
        return save_checkpoint(directory, iteration, {**self.state(), **extra}, keep=keep, run=run)

    def load(self, path: str | Path) -> dict[str, Any]:
        state = load_checkpoint(path)
        try:
            self.restore(state)
        except (RuntimeError, ValueError, KeyError) as err:
            raise mismatch_error(path, err) from None
        return state


def mismatch_error(path: str | Path, err: BaseException) -> CheckpointError:
    """A checkpoint that does not fit this run's models or optimizers, named with the first key that differs."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    sizes = [line for line in lines if line.startswith("size mismatch for")]
    if sizes:
        first = sizes[0].removeprefix("size mismatch for ").replace("copying a param with shape", "saved")
        what = f"{len(sizes)} tensor(s) differ in shape, first {first}"
    elif isinstance(err, KeyError):
        what = f"entry {err.args[0]!r} is missing"
    else:
        what = lines[-1] if lines else type(err).__name__
    return CheckpointError(
        f"checkpoint {path} does not fit this run's models ({what}): resume with the model.* settings it was "
        "saved with, or start a new run (resume=never in another hydra.run.dir)"
    )


# ---------------------------------------------------------------- the run a checkpoint belongs to
RUN_FILE = "run.json"


@dataclass
class RunIdentity:
    """Who writes the checkpoints of a run folder (`<run_dir>/run.json`). A run starts fresh (resume=never, or
    resume=auto with nothing to continue), continues itself (resume=auto), or branches from an explicit
    checkpoint (a new run whose `resumed_from` records the lineage)."""

    id: str
    # SHA-256 prefix of the configuration (without the top-level keys that may change between attempts:
    # iterations, resume, run_dir, logger, checkpoint, experiment; `rlhfuse.trainer.resume.config_hash`).
    config_hash: str
    # Iteration the run started from (0 = fresh).
    start_iteration: int
    # The checkpoint a branched run started from: {"path", "run", "iteration"}; None otherwise.
    resumed_from: dict[str, Any] | None = None
    started_at: float = 0.0
    # The resolved configuration of the run's latest attempt, keyed as on the command line
    # (`rlhfuse.trainer.resume.config_record`), which a resume is checked against; None in runs recorded
    # before run.json held it (only the hash is compared).
    config: dict[str, Any] | None = None
    # How the latest attempt ended (`end_run`): "completed" or "failed"; None while it runs, or after a kill.
    status: str | None = None
    # Why that attempt failed, on one line; None otherwise.
    reason: str | None = None
    ended_at: float | None = None

    @classmethod
    def new(
        cls,
        config_hash: str,
        start_iteration: int,
        resumed_from: Path | None = None,
        config: dict[str, Any] | None = None,
    ) -> RunIdentity:
        lineage = None
        if resumed_from is not None:
            meta = checkpoint_meta(resumed_from) or {}
            lineage = {
                "path": str(resumed_from.resolve()),
                "run": meta.get("run"),
                "iteration": meta.get("iteration"),
            }
        return cls(uuid.uuid4().hex[:12], config_hash, start_iteration, lineage, time.time(), config)


def read_runs(run_dir: str | Path) -> list[RunIdentity]:
    """The runs recorded in `run_dir/run.json`, the current one first (empty: none recorded)."""
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return [RunIdentity(**entry) for entry in [data["run"], *data.get("earlier", [])]]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{path} is malformed ({err}): delete it to let resume=auto pick the latest checkpoint by iteration"
        ) from None


def write_runs(run_dir: str | Path, runs: list[RunIdentity]) -> None:
    """Record `runs` (the current one first) atomically in `run_dir/run.json`."""
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    entries = [dataclasses.asdict(r) for r in runs]
    tmp = root / f".{RUN_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"run": entries[0], "earlier": entries[1:]}, indent=1), encoding="utf-8")
    os.replace(tmp, root / RUN_FILE)


def auto_resume_path(run_dir: str | Path, checkpoint_dir: str | Path) -> Path | None:
    """What `resume=auto` continues: the newest checkpoint of the run recorded in run.json, else the checkpoint
    that run branched from, else nothing (the run had saved nothing). Without run.json (a folder written before
    runs were recorded), the latest complete checkpoint by iteration."""
    runs = read_runs(run_dir)
    if not runs:
        return latest_checkpoint(checkpoint_dir)
    own = list_checkpoints(checkpoint_dir, run=runs[0].id)
    if own:
        return own[-1]
    lineage = runs[0].resumed_from
    if lineage and checkpoint_meta(Path(lineage["path"])) is not None:
        return Path(lineage["path"])
    return None


def resume_path(run_dir: str | Path, checkpoint_dir: str | Path, resume: str) -> Path | None:
    """The folder `resume` (never | auto | a path) designates, or None."""
    if resume == "never":
        return None
    if resume == "auto":
        return auto_resume_path(run_dir, checkpoint_dir)
    return Path(resume)


def check_fresh_start(checkpoint_dir: str | Path, resume: str, overwrite: bool) -> None:
    """Refuse a fresh run (resume=never) over another run's checkpoints unless checkpoint.overwrite=true."""
    if resume != "never" or overwrite:
        return
    found = list_checkpoints(checkpoint_dir)
    if found:
        names = found[0].name if len(found) == 1 else f"{found[0].name} .. {found[-1].name}"
        raise CheckpointError(
            f"{Path(checkpoint_dir)} holds {len(found)} checkpoint(s) of another run ({names}) and resume=never "
            "starts a fresh one: set resume=auto to continue it, resume=<checkpoint folder> to branch from one, "
            "checkpoint.overwrite=true to start a new run here (the old checkpoints stay, rotation never "
            "removes them), or another hydra.run.dir"
        )


def begin_run(
    run_dir: str | Path,
    config_hash: str,
    resumed: Path | None,
    iteration: int,
    *,
    auto: bool,
    config: dict[str, Any] | None = None,
) -> RunIdentity:
    """The identity this attempt writes its checkpoints under: `resume=auto` continuing the recorded run keeps
    its id (and records this attempt's configuration and hash); a fresh start or a branch from an explicit
    checkpoint is a new run (the earlier ones stay listed). run.json is rewritten atomically either way."""
    runs = read_runs(run_dir)
    if auto and runs:
        current = runs[0]
        branch = current.resumed_from
        own = resumed is None or (checkpoint_meta(resumed) or {}).get("run") == current.id
        # continued from the checkpoint it branched from: it had saved nothing yet
        if own or (branch is not None and resumed is not None and Path(branch["path"]) == resumed.resolve()):
            current.config_hash, current.config = config_hash, config
            current.status = current.reason = current.ended_at = None  # running again
            write_runs(run_dir, runs)
            return current
    run = RunIdentity.new(config_hash, iteration, resumed, config)
    write_runs(run_dir, [run, *runs])
    return run


def end_run(
    root: Path, run_id: str, status: Literal["completed", "failed"], reason: str | None = None
) -> None:
    """Record in `root/run.json` how the attempt of run `run_id` ended: `status`, the time and, for a failure,
    `reason` (folded onto one line). run.json is rewritten atomically, as `begin_run` does."""
    if status not in ("completed", "failed"):
        raise ValueError(f"end_run: status must be 'completed' or 'failed' (got {status!r})")
    runs = read_runs(root)
    entry = next((r for r in runs if r.id == run_id), None)
    if entry is None:
        raise CheckpointError(
            f"{Path(root) / RUN_FILE} records no run {run_id!r} (recorded: {[r.id for r in runs]}): end a run "
            "in the run folder whose begin_run recorded it"
        )
    entry.status, entry.ended_at = status, time.time()
    entry.reason = " ".join(reason.split()) if reason else None
    write_runs(root, runs)
