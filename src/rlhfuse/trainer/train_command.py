"""`rlhfuse-train`: the Hydra entry point. Composes `conf/`, converts to `RLHFConfig` once, builds and fits.

rlhfuse-train                                  # the embedded default RLHF job
rlhfuse-train algorithm.kl_coef=0.05 generator.max_new_tokens=64
rlhfuse-train experiment=smoke
rlhfuse-train hydra.run.dir=runs/a checkpoint.every=10 resume=auto

A bad input (configuration key or value, data file, checkpoint, model folder, a missing optional package) ends
in one line naming the file or key and the fix, exit status 2; a multi-process job whose rank died or lost
contact ends in one line naming the rank and the last step, exit status 1. Ctrl-C ends in one line naming the
last finished iteration and what `resume=auto` continues from, exit status 130. `RLHFUSE_DEBUG=1` shows
tracebacks.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape

from rlhfuse._optional import MissingDependencyError
from rlhfuse._resources import conf_dir
from rlhfuse.core.checkpoint import auto_resume_path
from rlhfuse.core.errors import CheckpointError, NonFiniteError
from rlhfuse.data.prompts import DatasetError
from rlhfuse.models import CheckpointError as ModelCheckpointError
from rlhfuse.runtime.launch import Watchdog
from rlhfuse.trainer.build import build_trainer
from rlhfuse.trainer.hydra import check_keys, override_keys, register_schema, to_config
from rlhfuse.trainer.logging import line_console

USER_ERRORS = (
    ValueError,
    KeyError,
    FileNotFoundError,
    DatasetError,
    CheckpointError,
    ModelCheckpointError,
    NonFiniteError,
    MissingDependencyError,
)


def debug() -> bool:
    return os.environ.get("RLHFUSE_DEBUG", "") not in ("", "0")


def run(cfg: DictConfig) -> None:
    console = line_console()
    trainer = None
    several = False  # a multi-process run
    try:
        config = to_config(cfg)
        if config.run_dir is None:
            config.run_dir = HydraConfig.get().runtime.output_dir
        trainer = build_trainer(config, log=lambda msg: console.print(msg, highlight=False))
        history = trainer.fit()
        trainer.generator.close()  # engines with process-wide state (vLLM) shut down before the process group
        several = _shutdown_process_group()
    except KeyboardInterrupt:
        _disarm()
        if debug():
            raise
        print_error(console, interrupted_message(trainer))
        sys.exit(130)
    except USER_ERRORS as err:
        _disarm()
        if debug():
            raise
        message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        print_error(console, message)
        _remove_if_unused(Path(HydraConfig.get().runtime.output_dir))
        sys.exit(2)
    except Exception as err:
        watchdog = Watchdog.current
        if watchdog is None or debug():  # one process: a bug, shown with its traceback
            raise
        # a multi-process job: a rank that died or stopped breaks the collectives of the others. The watchdog
        # stays armed: whichever of its thread and this one names the dead rank first prints the line
        dead = watchdog.await_dead()
        if dead:
            watchdog.stop(watchdog.describe(dead))
        cause = (str(err).strip().splitlines() or [""])[0][:200]
        watchdog.stop(
            f"rank {watchdog.rank} stopped at {watchdog.step}: {type(err).__name__}: {cause}; another rank "
            "probably failed (see its output); RLHFUSE_DEBUG=1 shows the traceback, resume=auto continues "
            "from the last checkpoint"
        )
    elapsed = seconds_since_start()  # start-up (imports, Hydra, building) included
    if history:
        first, last = history[0], history[-1]
        task = (
            f", task score {first['task/score']:.3f} -> {last['task/score']:.3f}"
            if "task/score" in last
            else ""
        )
        console.print(
            f"rlhfuse-train: done in {elapsed:.0f}s, {len(history)} iterations this run; reward "
            f"{first['reward/mean']:+.3f} -> {last['reward/mean']:+.3f}{task}; metrics in "
            f"{config.run_dir}/metrics.jsonl",
            highlight=False,
        )
    if several:
        _exit_finished()


# What Hydra writes into a run folder before the job starts; a folder holding nothing else was never used.
HYDRA_FILES = frozenset({"rlhfuse-train.log", ".hydra"})


def _remove_if_unused(run_dir: Path) -> None:
    """A run that failed before writing anything leaves no `outputs/<date>/<time>/` folder behind (a folder with
    checkpoints, metrics or any other file is kept)."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= HYDRA_FILES:
        shutil.rmtree(run_dir, ignore_errors=True)


_IMPORTED = time.perf_counter()


def seconds_since_start() -> float:
    """Wall seconds since this process started (Linux: its start time in /proc; elsewhere: since this module
    was imported, which leaves out only the interpreter's own start)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in clock ticks
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


def interrupted_message(trainer: Any) -> str:
    """Ctrl-C's one line: where the run stood and what `resume=auto` would continue from."""
    if trainer is None:
        return "interrupted while starting up (nothing trained yet)"
    path = auto_resume_path(trainer.run_dir, trainer.checkpoint_dir)
    where = (
        f"resume=auto continues from {path}"
        if path is not None
        else "no checkpoint was saved yet (checkpoint.every=N saves one every N iterations), resume=auto starts "
        "afresh"
    )
    return f"interrupted at iteration {trainer.iteration}; {where}"


def print_error(console: Console, message: str) -> None:
    """The one error line; the message is escaped (a gloo path such as `[/__w/.../pair.cc:553]` is not markup)."""
    console.print(f"[bold red]rlhfuse-train: error:[/] {escape(message)}", highlight=False)


def _shutdown_process_group() -> bool:
    """Multi-process runs: every rank done, then an orderly teardown (left to interpreter exit, gloo's
    background threads can abort a finished process). Whether there was a process group."""
    from rlhfuse import distributed

    if not distributed.is_initialized():
        return False
    _disarm()  # peers now exit on their own; the barrier below is bounded by distributed.timeout_s
    distributed.shutdown()
    return True


def _exit_finished() -> NoReturn:
    """A finished multi-process rank exits with status 0 once the Python-level exit work is done (the `atexit`
    handlers: W&B finishing its run, logging's flush) and its output is flushed, skipping interpreter
    finalisation. The run's files are written (metrics, checkpoints, export, loggers finalised in `fit`) and the
    process group is torn down, so what finalisation has left is destroying the C++ worker threads of gloo and
    vLLM, which can abort a finished process ('terminate called without an active exception', seen about once in
    15 two-process vLLM runs: the teardown race of c10d's threads with interpreter finalisation,
    pytorch/pytorch#179291)."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _disarm() -> None:
    if Watchdog.current is not None:
        Watchdog.current.disarm()


def main() -> None:
    try:  # every unknown key at once (Hydra stops at the first)
        check_keys(override_keys([a for a in sys.argv[1:] if not a.startswith("-")]))
    except ValueError as err:
        print_error(line_console(), str(err))
        sys.exit(2)
    register_schema()
    hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(run)()


if __name__ == "__main__":
    main()
