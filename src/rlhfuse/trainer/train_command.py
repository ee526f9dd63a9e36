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

The console's lines (start-up, progress, summary, error) are also written to the run folder's
`rlhfuse-train.log` (Hydra's job log); in a multi-process run only rank 0 prints the start-up lines and the summary
and only rank 0 keeps a log file.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import SearchPathException
from hydra.types import RunMode
from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape

from rlhfuse._optional import MissingDependencyError
from rlhfuse._resources import conf_dir
from rlhfuse.core.errors import CheckpointError, NonFiniteError
from rlhfuse.core.protocols import Callback
from rlhfuse.runtime.launch import RUN_LOG_NAME, Watchdog, launched_rank_zero
from rlhfuse.trainer.hydra import (
    COMPOSITION_ERRORS,
    check_keys,
    composition_problem,
    override_keys,
    register_schema,
    to_config,
)
from rlhfuse.trainer.logging import format_metrics, line_console

# The errors that are the user's to fix: one line, exit status 2. Among the ValueErrors are a prompt file's
# (rlhfuse.data.DatasetError) and a model folder's (rlhfuse.models.CheckpointError), not imported here: their
# modules load torch, which `rlhfuse-train --help` does without.
USER_ERRORS = (
    ValueError,
    KeyError,
    FileNotFoundError,
    CheckpointError,
    NonFiniteError,
    MissingDependencyError,
)


def debug() -> bool:
    return os.environ.get("RLHFUSE_DEBUG", "") not in ("", "0")


# The console's lines, mirrored into the run folder's log: its handlers are Hydra's job-log file handlers only
# (`_mirror_to_run_log`), as the console already shows these lines. The NullHandler keeps logging's last-resort
# handler from printing them a second time when there is no file.
RUN_LOG = logging.getLogger(RUN_LOG_NAME)
RUN_LOG.propagate = False
RUN_LOG.setLevel(logging.INFO)
RUN_LOG.addHandler(logging.NullHandler())


def _mirror_to_run_log() -> None:
    """Point RUN_LOG at this job's log files (Hydra configures logging anew for each job of a multirun)."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    RUN_LOG.handlers = [logging.NullHandler(), *files]


class RunLogLines(Callback):
    """The per-iteration lines the progress display prints, also in the run log (`logger.print_every`)."""

    def __init__(self, total: int, print_every: int) -> None:
        self.total = total
        self.print_every = print_every

    def on_iteration_end(self, trainer: Any, iteration: int, metrics: Mapping[str, float]) -> None:
        if self.print_every and iteration % self.print_every == 0:
            RUN_LOG.info(format_metrics(iteration, self.total, metrics))


class InterruptGuard(Callback):
    """Ctrl-C ends the run, at the latest at its next stage boundary. SIGINT raises KeyboardInterrupt wherever the
    main thread is, and code that swallows it there (a finalizer, a `__del__`, a library's broad `except`) would
    leave the run going: the handler also sets a flag that every stage start and iteration end reads."""

    def __init__(self) -> None:
        self.interrupted = False

    def handler(self, signum: int, frame: Any) -> None:
        self.interrupted = True
        raise KeyboardInterrupt

    def on_stage_start(self, trainer: Any, stage: str) -> None:
        self.check()

    def on_iteration_end(self, trainer: Any, iteration: int, metrics: Mapping[str, float]) -> None:
        self.check()

    def check(self) -> None:
        if self.interrupted:
            raise KeyboardInterrupt


_jobs_started = 0  # the jobs this process ran: a Hydra multirun (-m) runs them one after another


def run(cfg: DictConfig) -> None:
    global _jobs_started
    from rlhfuse.trainer.build import build_trainer  # torch and the rest of the library: only when a job runs

    _jobs_started += 1
    job_started = time.perf_counter()
    _restore_hydra_full_error()  # composing is done: a bug in the job gets Hydra's own report
    _mirror_to_run_log()
    console = line_console()
    rank0 = launched_rank_zero()

    def say(msg: str) -> None:  # the start-up lines and the summary: rank 0 only
        if rank0:
            console.print(msg, highlight=False)
            RUN_LOG.info(msg)

    trainer = None
    several = False  # a multi-process run
    guard = InterruptGuard()
    signal.signal(signal.SIGINT, guard.handler)
    try:
        config = to_config(cfg)
        if config.run_dir is None:
            config.run_dir = HydraConfig.get().runtime.output_dir
        lines = [RunLogLines(config.iterations, config.logger.print_every)] if rank0 else []
        trainer = build_trainer(config, log=say, callbacks=[guard, *lines])
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
            RUN_LOG.error("rlhfuse-train: error: %s: %s", type(err).__name__, err, exc_info=True)
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
    # the first job counts the process's start-up (imports, Hydra, building); a later job of a multirun its own
    elapsed = seconds_since_start() if _jobs_started == 1 else time.perf_counter() - job_started
    # the iterations' rows (eval.before_training adds one of its own before them)
    trained = [row for row in history if "reward/mean" in row]
    if trained:
        first, last = trained[0], trained[-1]
        task = (
            f", task score {first['task/score']:.3f} -> {last['task/score']:.3f}"
            if "task/score" in last
            else ""
        )
        evaluated = [row["eval/reward/mean"] for row in history if "eval/reward/mean" in row]
        held = f", held-out reward {evaluated[0]:+.3f} -> {evaluated[-1]:+.3f}" if len(evaluated) > 1 else ""
        say(
            f"rlhfuse-train: done in {elapsed:.0f}s, {len(trained)} iterations this run; reward "
            f"{first['reward/mean']:+.3f} -> {last['reward/mean']:+.3f}{task}{held}; metrics in "
            f"{config.run_dir}/metrics.jsonl"
        )
    if several or HydraConfig.get().mode == RunMode.RUN:
        # the process's work is done: out without interpreter finalisation, which races c10d's threads in a
        # multi-process run and takes seconds of freeing in any (a multirun's next job needs the process)
        from rlhfuse import distributed

        distributed.exit_finished()


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
    from rlhfuse.core.checkpoint import auto_resume_path

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
    """The one error line (also in the run log); the message is escaped (a gloo path such as
    `[/__w/.../pair.cc:553]` is not markup)."""
    console.print(f"[bold red]rlhfuse-train: error:[/] {escape(message)}", highlight=False)
    RUN_LOG.error("rlhfuse-train: error: %s", message)


def _shutdown_process_group() -> bool:
    """Multi-process runs: every rank done, then an orderly teardown (left to interpreter exit, gloo's
    background threads can abort a finished process). Whether there was a process group."""
    from rlhfuse import distributed

    if not distributed.is_initialized():
        return False
    _disarm()  # peers now exit on their own; the barrier below is bounded by distributed.timeout_s
    distributed.shutdown()
    return True


def _disarm() -> None:
    if Watchdog.current is not None:
        Watchdog.current.disarm()


# HYDRA_FULL_ERROR as the user set it: main sets it to 1 while Hydra composes, so that a composition error is
# raised to main (one line here) instead of printed by Hydra over several lines with exit status 1.
_user_hydra_full_error: str | None = None


def _restore_hydra_full_error() -> None:
    if _user_hydra_full_error is None:
        os.environ.pop("HYDRA_FULL_ERROR", None)
    else:
        os.environ["HYDRA_FULL_ERROR"] = _user_hydra_full_error


def _user_config_dirs(args: list[str]) -> list[str]:
    """The user's config folders named on the command line (`--config-dir`/`-cd`, `hydra.searchpath=[file://..]`),
    to name the file in an error."""
    dirs = []
    for i, arg in enumerate(args):
        if arg in ("--config-dir", "-cd") and i + 1 < len(args):
            dirs.append(args[i + 1])
        elif arg.startswith("--config-dir="):
            dirs.append(arg.split("=", 1)[1])
        elif arg.startswith("hydra.searchpath="):
            dirs += [d for d in re.findall(r"file://([^,\]'\"]+)", arg)]
    return dirs


def _rank_job_logging(args: list[str]) -> list[str]:
    """Ranks other than 0 log to the console only (`hydra/job_logging=stdout`): no empty per-rank log file in the
    run folder (Fabric's launcher names theirs train_ddp_process_<rank>.log, torchrun's share rank 0's name)."""
    if launched_rank_zero() or any(a.lstrip("+~").startswith("hydra/job_logging") for a in args):
        return []
    return ["hydra/job_logging=stdout"]


def main() -> None:
    global _user_hydra_full_error
    args = sys.argv[1:]
    try:  # every unknown key at once (Hydra stops at the first)
        check_keys(override_keys([a for a in args if not a.startswith("-")]))
    except ValueError as err:
        print_error(line_console(), str(err))
        sys.exit(2)
    register_schema()
    sys.argv += _rank_job_logging(args)
    _user_hydra_full_error = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(run)()
    except (*COMPOSITION_ERRORS, SearchPathException) as err:  # before any job ran
        if debug() or _user_hydra_full_error == "1":
            raise
        print_error(line_console(), composition_problem(err, _user_config_dirs(args)))
        sys.exit(2)
    finally:
        _restore_hydra_full_error()


if __name__ == "__main__":
    main()
