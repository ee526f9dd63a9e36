"""Metrics sinks (metrics.jsonl, Lightning Fabric's CSV/TensorBoard loggers, W&B) and a rich progress bar."""

from __future__ import annotations

import csv
import json
import logging
import os
import socket
import sys
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rlhfuse._optional import MissingDependencyError
from rlhfuse.core.config_checks import choice_problems, non_negative
from rlhfuse.core.protocols import Callback, Logger

log = logging.getLogger(__name__)

Backend = Literal["jsonl", "csv", "tensorboard", "wandb"]
BACKENDS = get_args(Backend)


@dataclass
class LoggerConfig:
    # Registered logger set name (documentation only; the backends list is what counts).
    name: str = "default"
    # Metric sinks: jsonl (<run_dir>/metrics.jsonl) | csv | tensorboard | wandb.
    backends: list[Backend] = field(default_factory=lambda: ["jsonl", "csv"])
    # W&B project and run name (null = the run directory's name).
    wandb_project: str = "rlhfuse"
    wandb_run_name: str | None = None
    # auto = online only when WANDB_API_KEY is set and api.wandb.ai answers within 2 s, else offline;
    # online | offline | disabled force a mode. The WANDB_MODE environment variable wins over auto.
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    # Show a rich progress bar with the current stage and per-stage timings.
    progress: bool = True
    # Print one summary line per iteration.
    print_every: int = 1
    # Every this many iterations (0 = never), write a table of prompts, responses and scores to
    # <run_dir>/samples.jsonl (and to W&B as the Table `samples` when the wandb backend is on).
    log_samples_every: int = 0
    # Samples per table: the first this many of the iteration (0 = all).
    log_samples_count: int = 16

    def problems(self) -> list[str]:
        problems = choice_problems(self, "logger")
        non_negative(problems, "logger.log_samples_every", self.log_samples_every, "0 = never")
        non_negative(problems, "logger.log_samples_count", self.log_samples_count, "0 = all")
        if "tensorboard" in self.backends:
            try:
                require_tensorboard()
            except MissingDependencyError as err:
                problems.append(str(err))
        return problems


def require_tensorboard() -> None:
    """MissingDependencyError (the install line) unless tensorboard (or tensorboardX) can be imported."""
    import importlib.util

    if not any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX")):
        raise MissingDependencyError(
            "logger.backends contains tensorboard (logger=tensorboard), which needs the tensorboard package: "
            "pip install 'rlhfuse[tensorboard]' (or pip install tensorboard), or choose another logger"
        )


class JsonlLogger:
    """Appends one JSON object per `log_metrics` call to `path` (the run's metrics.jsonl); one row per
    iteration: `truncate_after` (called when a run starts) cuts the file back to the iteration it starts from."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.last_iteration: int | None = None

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        row = {k: _plain(v) for k, v in metrics.items()}
        iteration = row.get("iteration")
        if (
            isinstance(iteration, int)
            and self.last_iteration is not None
            and iteration <= self.last_iteration
        ):
            self.truncate_after(iteration - 1)  # a row for this iteration exists: replace it, never two
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row, allow_nan=True) + "\n")
        if isinstance(iteration, int):
            self.last_iteration = iteration

    def log_hyperparams(self, params: Any) -> None:
        (self.path.parent / "hparams.json").write_text(json.dumps(params, indent=1, default=str))

    def finalize(self, status: str) -> None:
        pass

    def truncate_after(self, iteration: int) -> None:
        """Keep the rows of iterations <= `iteration` (0 = none: a fresh start), the last one for each
        iteration, and replace the file atomically. Rows that do not parse (a row torn by a kill) are dropped
        with a warning naming the file and line."""
        self.last_iteration = iteration
        if not self.path.exists():
            return
        kept: dict[int, str] = {}
        lines = self.path.read_bytes().decode("utf-8", errors="replace").splitlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                row_iteration = int(row["iteration"])
            except (ValueError, KeyError, TypeError) as err:
                where = "last row" if number == len(lines) else "row"
                log.warning("rlhfuse: %s:%d: dropped a malformed %s (%s)", self.path, number, where, err)
                continue
            if row_iteration <= iteration:
                kept[row_iteration] = line
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(kept[i] + "\n" for i in sorted(kept)), encoding="utf-8")
        os.replace(tmp, self.path)


def rewind_loggers(loggers: list[Logger], iteration: int) -> None:
    """Cut the sinks that keep rows in the run folder back to iterations <= `iteration` as a run (re)starts:
    metrics.jsonl, and Fabric's CSVLogger (`keep_csv_rows`). A CSVLogger exists only once Lightning's loggers
    module is imported: a run without one does not import Lightning (seconds) to find none."""
    fabric_loggers = sys.modules.get("lightning.fabric.loggers")
    for logger in loggers:
        if isinstance(logger, JsonlLogger):
            logger.truncate_after(iteration)
        elif fabric_loggers is not None and isinstance(logger, fabric_loggers.CSVLogger):
            keep_csv_rows(logger, iteration)


def keep_csv_rows(logger: Any, iteration: int) -> None:
    """Fabric's CSVLogger deletes an existing metrics.csv when it starts writing: carry over its rows of
    iterations <= `iteration` (those of the run being resumed; none on a fresh start), one per iteration."""
    path = Path(logger.log_dir) / "metrics.csv"
    if iteration <= 0 or not path.is_file():
        return
    kept: dict[int, dict[str, Any]] = {}
    with path.open(newline="", encoding="utf-8", errors="replace") as handle:
        for row in csv.DictReader(handle):
            try:
                step = int(float(row.get("step") or "nan"))
            except ValueError:
                continue  # a torn row
            if step <= iteration:
                kept[step] = {k: v for k, v in row.items() if k != "step" and k is not None and v != ""}
    with warnings.catch_warnings():  # "Previous log files ... will be deleted": not these rows
        warnings.filterwarnings("ignore", message="Experiment logs directory")
        for step in sorted(kept):
            logger.log_metrics(kept[step], step=step)
    logger.save()


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value  # tensors and numpy scalars -> Python numbers


def wandb_mode(requested: str) -> str:
    """Resolve `auto` without ever blocking for long: online needs an API key and a reachable server."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if not os.environ.get("WANDB_API_KEY"):
        return "offline"
    reachable: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection(("api.wandb.ai", 443), timeout=2).close()
            reachable.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout=3)
    return "online" if reachable else "offline"


def build_loggers(config: LoggerConfig, run_dir: Path) -> list[Logger]:
    loggers: list[Logger] = []
    for backend in config.backends:
        if backend == "jsonl":
            loggers.append(JsonlLogger(run_dir / "metrics.jsonl"))
        elif backend == "csv":
            from lightning.fabric.loggers import CSVLogger

            loggers.append(CSVLogger(str(run_dir), name="csv", version=0))
        elif backend == "tensorboard":
            from lightning.fabric.loggers import TensorBoardLogger

            require_tensorboard()
            loggers.append(TensorBoardLogger(str(run_dir), name="tensorboard", version=0))
        elif backend == "wandb":
            mode = wandb_mode(config.wandb_mode)
            if mode == "disabled":
                continue
            from lightning.pytorch.loggers import WandbLogger

            loggers.append(
                WandbLogger(
                    project=config.wandb_project,
                    name=config.wandb_run_name or run_dir.name,
                    save_dir=str(run_dir),
                    offline=mode == "offline",
                    mode=mode,
                )
            )
        else:
            raise ValueError(
                f"unknown logger backend logger.backends={backend!r}: known are {list(BACKENDS)}"
            )
    return loggers


def table_sinks(config: LoggerConfig, loggers: list[Logger]) -> list[Any]:
    """The loggers that also take tables (W&B): the samples table goes to them too."""
    if "wandb" not in config.backends:
        return []  # no need to import lightning.pytorch (seconds) to find none
    from lightning.pytorch.loggers import WandbLogger

    return [logger for logger in loggers if isinstance(logger, WandbLogger)]


STAGES = ("generation", "inference", "training")


class RichProgress(Callback):
    """Progress bar over iterations showing the current stage and the last iteration's stage timings."""

    def __init__(
        self, total: int, *, enabled: bool = True, print_every: int = 1, console: Console | None = None
    ):
        self.total = total
        self.print_every = print_every
        self.console = console or line_console()
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[timings]}"),
            console=self.console,
            disable=not enabled,
            transient=False,
        )
        self.task = self.progress.add_task("starting", total=total, timings="")

    def on_fit_start(self, trainer: Any) -> None:
        self.progress.update(self.task, completed=trainer.iteration)
        self.progress.start()

    def on_stage_start(self, trainer: Any, stage: str) -> None:
        self.progress.update(self.task, description=f"iter {trainer.iteration + 1}: {stage}")

    def on_iteration_end(self, trainer: Any, iteration: int, metrics: Mapping[str, float]) -> None:
        timings = " ".join(f"{s[:3]} {metrics.get(f'time/{s}', 0.0):.2f}s" for s in STAGES)
        self.progress.update(self.task, completed=iteration, timings=timings)
        if self.print_every and iteration % self.print_every == 0:
            self.progress.console.print(format_metrics(iteration, self.total, metrics), highlight=False)

    def on_fit_end(self, trainer: Any) -> None:
        self.progress.stop()

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        self.progress.stop()


def line_console() -> Console:
    """The console every line of the CLI goes to: stderr, never wrapped (piped output keeps paths whole)."""
    return Console(stderr=True, soft_wrap=True)


def format_metrics(iteration: int, total: int, m: Mapping[str, float]) -> str:
    task = f" task {m['task/score']:.3f}" if "task/score" in m else ""
    if "eval/reward/mean" in m:  # an evaluation iteration
        task += f" eval {m['eval/reward/mean']:+.3f}"
        task += f" acc {m['eval/accuracy']:.3f}" if "eval/accuracy" in m else ""
    return (
        f"iter {iteration:>3}/{total} reward {m['reward/mean']:+.3f}{task} kl {m['kl/mean']:.4f} "
        f"len p50 {m['response_length/p50']:.0f} p99 {m['response_length/p99']:.0f} "
        f"max {m['response_length/max']:.0f} | gen {m['time/generation']:.2f}s "
        f"inf {m['time/inference']:.2f}s train {m['time/training']:.2f}s"
    )
