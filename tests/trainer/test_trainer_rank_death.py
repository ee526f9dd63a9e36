"""A rank killed (SIGKILL, by its pid) at start-up or mid-run: the surviving rank ends within seconds with one
line naming the dead rank and its last step, no traceback, exit status 1 (issue 18, class 3). Each kill waits for
an event of the run (a line of output, a metrics row), never for a fixed time (issue 25 item 7)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rlhfuse.core.checkpoint import read_runs
from rlhfuse.trainer import build_trainer, compose_config

SMOKE = ["experiment=smoke", "generator.instances=2", "iterations=100000", "distributed.timeout_s=60"]
# the split placement: rank 0 trains, rank 1 generates (async.generation_ranks)
SPLIT = ["experiment=smoke", "async.generation_ranks=1", "async.max_staleness=1", "distributed.nproc_per_node=2",
         "iterations=100000", "distributed.timeout_s=60"]  # fmt: skip


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class _Output:
    """The job's output (both ranks share the pipe), read to EOF by a thread so the job never blocks on a full
    pipe; `wait_for` returns once a line holds the marker."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self.reader.start()

    def _read(self, stdout: Any) -> None:
        for line in stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.lines.append("")  # EOF
            self.changed.notify_all()

    def wait_for(self, marker: str, timeout: float = 120) -> None:
        def seen() -> bool:
            return any(marker in x for x in self.lines)

        with self.changed:
            self.changed.wait_for(lambda: seen() or "" in self.lines, timeout)
        assert seen(), f"no {marker!r} within {timeout:g} s in:\n" + "".join(self.lines)[-3000:]

    def text(self) -> str:
        self.reader.join(timeout=30)
        return "".join(self.lines)


def _launch(
    tmp_path: Path, marker: str, overrides: list[str] = SMOKE
) -> tuple[subprocess.Popen[str], int, _Output]:
    """Start a 2-rank smoke job; return (rank 0's process, rank 1's pid, its output) once `marker` shows."""
    cache = tmp_path / "cache"
    build_trainer(  # warm start once in this process: the job itself starts in seconds
        compose_config([*SMOKE[:1], f"model.warmstart.cache_dir={cache}", "iterations=1"]),
        run_dir=tmp_path / "warm",
        log=lambda _: None,
    )
    cmd = [sys.executable, "-m", "rlhfuse.trainer.train_command", *overrides, f"model.warmstart.cache_dir={cache}",
           f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output = _Output(proc)
    output.wait_for(marker)
    # rank 1 is rank 0's one child (Fabric's launcher started it before any marker is printed)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert len(children) == 1, "".join(output.lines)
    return proc, int(children[0]), output


def _check_one_line(out: str, dead: int, survivor: int) -> None:
    assert "Traceback" not in out and "frame #" not in out, out[-3000:]
    (line,) = [x for x in out.splitlines() if "rlhfuse-train: error:" in x]
    assert f"rank {dead}" in line and f"this is rank {survivor}" in line and "last step:" in line, line
    assert "resume=auto" in line


def _signal_rank_1_after_iteration_1(
    tmp_path: Path, overrides: list[str], sig: signal.Signals, wait_s: float
) -> tuple[float, str, subprocess.Popen[str]]:
    """Launch the job, send rank 1 `sig` once iteration 1 has ended, wait up to `wait_s` for the job to end:
    (seconds from the signal to the end, the job's output, rank 0's process). Whatever still runs is killed."""
    proc, rank1, output = _launch(tmp_path, "Starting with 2 processes", overrides)
    # rank 0 writes iteration 1's metrics row once both ranks finished it: both are in the loop
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert time.monotonic() < deadline and proc.poll() is None, output.text()[-3000:]
        time.sleep(0.02)  # polling for the event
    os.kill(rank1, sig)
    start = time.monotonic()
    try:
        proc.wait(timeout=wait_s)
    finally:
        proc.kill()
        if _running(rank1):
            os.kill(rank1, signal.SIGKILL)
    return time.monotonic() - start, output.text(), proc


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("overrides", [SMOKE, SPLIT], ids=["instances", "split_generation_rank"])
def test_rank_1_killed_mid_run_ends_rank_0_with_one_line(tmp_path: Path, overrides: list[str]) -> None:
    # the kill comes right after an iteration ends, where Fabric's child observer used to SIGKILL rank 0 first
    # (exit -9)
    elapsed, out, proc = _signal_rank_1_after_iteration_1(tmp_path, overrides, signal.SIGKILL, 30)
    assert elapsed < 10, out[-3000:]
    assert proc.returncode == 1, out[-3000:]
    _check_one_line(out, dead=1, survivor=0)
    assert "killed by SIGKILL" in out and "last step: iteration" in out, out[-3000:]
    # the run folder keeps the reason: the same line in its log, and run.json says the attempt failed
    (line,) = [x for x in out.splitlines() if "rlhfuse-train: error:" in x]
    assert line.strip() in (tmp_path / "run" / "rlhfuse-train.log").read_text()
    (attempt,) = read_runs(tmp_path / "run")
    assert attempt.status == "failed" and "rank 1" in (attempt.reason or ""), attempt


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_stalled_generation_rank_ends_the_split_run_within_the_timeout_with_one_line(
    tmp_path: Path,
) -> None:
    """Item 7 of issue 42: rank 1 (the split placement's generation rank) stopped (SIGSTOP: alive, silent) right
    after iteration 1: rank 0's wait for its next batch breaks at distributed.timeout_s, and its line names rank 1
    as died or stalled and the timeout to raise."""
    timeout_s = 30
    overrides = [
        *[x for x in SPLIT if not x.startswith("distributed.timeout_s")],
        f"distributed.timeout_s={timeout_s}",
    ]
    elapsed, out, proc = _signal_rank_1_after_iteration_1(tmp_path, overrides, signal.SIGSTOP, timeout_s + 60)
    assert elapsed < timeout_s + 30, out[-3000:]
    assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    (line,) = [x for x in out.splitlines() if "rlhfuse-train: error:" in x]
    assert "this is rank 0" in line or "rank 0 stopped" in line, line
    assert (
        f"the generation rank (rank 1) died or stalled, nothing within distributed.timeout_s={timeout_s} s"
        in line
    )


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_rank_0_killed_at_start_up_ends_rank_1_with_one_line(tmp_path: Path) -> None:
    proc, rank1, output = _launch(tmp_path, "GLOBAL_RANK: 1")  # rank 1 is joining the process group
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    start = time.monotonic()
    while _running(rank1) and time.monotonic() - start < 30:
        time.sleep(0.1)
    elapsed = time.monotonic() - start
    if _running(rank1):
        os.kill(rank1, signal.SIGKILL)
    out = output.text()  # rank 1 held the pipe: its output, to EOF
    assert elapsed < 10, out[-3000:]
    _check_one_line(out, dead=0, survivor=1)
