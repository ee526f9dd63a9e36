"""What a resume may change: the resolved configuration a run records in run.json (`config_record`), the keys
that may differ between attempts (`MUTABLE_ON_RESUME`), and the check of a resume against the record
(`check_resume_config`), made before any model is built.

A resume continues the checkpoint's optimizer, LR schedule, data position and RNG states, so it must train the
same models on the same data with the same algorithm and layout; only the keys of `MUTABLE_ON_RESUME` may
change, and they take effect (a learning rate replaces the checkpoint's: `rlhfuse.core.optim.set_peak_lr`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from rlhfuse.core.checkpoint import RunIdentity, checkpoint_meta, read_runs, resume_path
from rlhfuse.core.config_checks import config_key, is_flat
from rlhfuse.core.errors import CheckpointError

# Dotted key prefixes (as on the command line) that may change when a run resumes; a prefix covers the key
# itself and every key below it (`logger` covers logger.progress, ...). Every other key is refused on resume.
MUTABLE_ON_RESUME: tuple[str, ...] = (
    "iterations",  # train further (above the checkpoint's iteration)
    "resume",  # what to resume from
    "run_dir",
    "experiment",  # the preset's display name
    "logger",  # sinks, progress, sample tables
    "checkpoint",  # how often, how many kept, where, export (checkpoint.dir: where resume=auto looks)
    "model.lora.export_merged",  # whether the export adds the merged model
    "pipeline.actor_lr",  # peak learning rates: they replace the checkpoint's in the optimizer and LR schedule
    "pipeline.critic_lr",
    "eval.every",  # evaluation: how often and how it samples (no effect on training)
    "eval.samples_per_prompt",
    "eval.temperature",
    "eval.max_prompts",
    "eval.before_training",  # a resumed run does not evaluate before its first iteration
)

# What else a pipeline=fsdp run may change on resume: the number of processes and with it the generation instances
# (its checkpoint's shards are read through torch.distributed.checkpoint, which reshards them for any world
# size; the migration policy and the generator only decide how the same samples are made).
RESHARDABLE_ON_RESUME: tuple[str, ...] = (
    "generator.instances",
    "generator.name",
    "generator.in_process",
    "distributed.nproc_per_node",
    "migration",
)

# Keys left out of the changed-configuration warning: `resume` differs from a fresh start's by design.
_UNREPORTED = ("resume",)


def is_mutable(key: str, prefixes: tuple[str, ...] = MUTABLE_ON_RESUME) -> bool:
    """Whether the dotted `key` may change on resume (it is, or lies below, one of `prefixes`)."""
    return any(key == p or key.startswith(f"{p}.") for p in prefixes)


def mutable_keys(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> tuple[str, ...]:
    """The key prefixes a resume from the `recorded` configuration to the `current` one may change: also the
    world size when both run a strategy whose checkpoints load on another world size (pipeline=fsdp)."""
    from rlhfuse.trainer.strategies import STRATEGIES, strategy_class

    names = [str(flat_keys(r).get("pipeline.name", "")) for r in (recorded, current)]
    reshardable = all(n in STRATEGIES and strategy_class(n).reshardable for n in names)
    return MUTABLE_ON_RESUME + (RESHARDABLE_ON_RESUME if reshardable else ())


# ---------------------------------------------------------------- the record
def callable_name(value: Any) -> str:
    """'module:qualname' of a function or class (of its type for any other callable): stable across
    processes, unlike its repr (which holds an address)."""
    target = value if hasattr(value, "__qualname__") else type(value)
    return f"{getattr(target, '__module__', '?')}:{target.__qualname__}"


def config_record(config: Any) -> dict[str, Any]:
    """`config` (a config dataclass) as JSON-ready nested dicts keyed as on the command line: the fields of a
    flat-composed part (`rlhfuse.core.config_checks.flat_field`) at its parent's level, as `dataclasses.asdict` gives
    them otherwise; callables (a reward function given in Python) as 'module:qualname', other non-JSON values
    as their str()."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if is_flat(f):
            out.update(config_record(value))
        else:
            out[config_key(f)] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return config_record(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if callable(value):
        return callable_name(value)
    return str(value)


def flat_keys(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """The record's leaves by dotted key (`pipeline.actor_lr`); lists are leaves."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, Mapping):
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_hash(config: Any) -> str:
    """SHA-256 prefix of `config` without its top-level mutable keys (iterations, resume, run_dir, logger,
    checkpoint, experiment), over `dataclasses.asdict` as before run.json held the configuration: still
    written, so that a run recorded before then is told of a changed configuration as it was."""
    top = {p for p in MUTABLE_ON_RESUME if "." not in p}
    data = {k: v for k, v in dataclasses.asdict(config).items() if k not in top}
    text = json.dumps(data, sort_keys=True, default=lambda v: callable_name(v) if callable(v) else str(v))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------- the check
class Change(NamedTuple):
    key: str
    old: Any
    new: Any

    def describe(self) -> str:
        return f"{self.key}: {_show(self.old)} -> {_show(self.new)}"


_ABSENT = object()


def _show(value: Any) -> str:
    if value is _ABSENT:
        return "(not recorded)"
    return value if isinstance(value, str) else json.dumps(value)


def config_changes(
    recorded: Mapping[str, Any], current: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> list[Change]:
    """Every dotted key whose value differs between the two records, in the current record's order. A key the
    recorded run did not have (added to rlhfuse since) counts only when it differs from its default in
    `defaults`; a key no longer in the configuration is not compared."""
    old, new = flat_keys(recorded), flat_keys(current)
    base = flat_keys(defaults or {})
    changes = []
    for key, value in new.items():
        if key not in old:
            if key in base and base[key] == value:
                continue
            changes.append(Change(key, _ABSENT, value))
        elif old[key] != value:
            changes.append(Change(key, old[key], value))
    return changes


@dataclass(frozen=True)
class ResumeCheck:
    """What `check_resume_config` found: the checkpoint (None: a fresh start), the mutable keys that changed
    since the recorded attempt, and whether that attempt recorded its configuration (runs recorded before
    run.json held it have only a hash)."""

    path: Path | None
    changes: tuple[Change, ...] = ()
    recorded: bool = False

    def warning(self) -> str | None:
        """The changed-configuration warning line (None: nothing to report)."""
        shown = [c for c in self.changes if c.key not in _UNREPORTED]
        if not shown:
            return None
        return (
            f"rlhfuse: resuming {self.path} with a changed configuration: "
            + "; ".join(c.describe() for c in shown)
            + " (applied)"
        )


def check_resume_config(
    config: Any,
    run_dir: str | Path,
    checkpoint_dir: str | Path,
    record: Mapping[str, Any] | None = None,
) -> ResumeCheck:
    """Before anything is built: the checkpoint `config.resume` designates, checked against `config`.

    Raises CheckpointError (one line) when `iterations` is not above the checkpoint's iteration, or when a key
    outside `MUTABLE_ON_RESUME` differs from the configuration recorded for the checkpoint's run; returns the
    mutable keys that changed. `record` is `config_record(config)` unless given (the trainer's, taken before
    anything was derived into the config)."""
    path = resume_path(run_dir, checkpoint_dir, config.resume)
    if path is None:
        return ResumeCheck(None)
    meta = checkpoint_meta(path)
    if meta is None:  # not a complete checkpoint: loading it names what is wrong
        return ResumeCheck(path)
    iteration = int(meta.get("iteration", 0))
    if config.iterations <= iteration:
        raise CheckpointError(
            f"iterations={config.iterations} but the checkpoint {path} is at iteration {iteration}: set "
            f"iterations above {iteration} to train more"
        )
    run = _recorded_run(run_dir, path, meta.get("run"), auto=config.resume == "auto")
    if run is None or run.config is None:
        return ResumeCheck(path)
    current = config_record(config) if record is None else record
    recorded = renamed_keys_upgraded(run.config)
    changes = config_changes(recorded, current, config_record(type(config)()))
    allowed = mutable_keys(recorded, current)
    fixed = [c for c in changes if not is_mutable(c.key, allowed)]
    if fixed:
        raise CheckpointError(
            f"resume={config.resume}: the checkpoint {path} was trained with another configuration: "
            + "; ".join(c.describe() for c in fixed)
            + f". A resume may change only {', '.join(allowed)}: set "
            + ("that key" if len(fixed) == 1 else "those keys")
            + " back, or start a new run (resume=never in another run folder)"
        )
    return ResumeCheck(path, tuple(changes), recorded=True)


def renamed_keys_upgraded(record: Mapping[str, Any]) -> dict[str, Any]:
    """A configuration recorded before keys were renamed (`rlhfuse.core.advantages.RENAMED_KEYS`), under the new
    names and values: such a run resumes as it was configured."""
    from rlhfuse.core.advantages import RENAMED_KEYS

    upgraded = dict(record)
    algorithm = record.get("algorithm")
    if isinstance(algorithm, Mapping) and any(old in algorithm for old in RENAMED_KEYS):
        section = dict(algorithm)
        for old, (new, values) in RENAMED_KEYS.items():
            if old in section and new not in section:
                value = section.pop(old)
                section[new] = values.get(value, value) if isinstance(value, str) else value
        upgraded["algorithm"] = section
    return upgraded


def _recorded_run(run_dir: str | Path, path: Path, run_id: Any, *, auto: bool) -> RunIdentity | None:
    """The recorded attempt a resume compares against: under resume=auto the run this folder records (the
    latest attempt's configuration); for an explicit checkpoint, the run that wrote it, looked up in this run
    folder and in the one holding the checkpoint (`<run folder>/<checkpoint.dir>/iter_N`)."""
    runs = read_runs(run_dir)
    if auto:
        return runs[0] if runs else None
    home = path.resolve().parent.parent
    if home != Path(run_dir).resolve():
        runs += _quiet_runs(home)
    return next((run for run in runs if run.id == run_id), None)


def _quiet_runs(folder: Path) -> list[RunIdentity]:
    """Another folder's runs; a malformed run.json there is not this run's problem (nothing to compare)."""
    try:
        return read_runs(folder)
    except CheckpointError:
        return []
