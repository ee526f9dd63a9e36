"""A rank killed (SIGKILL, by its pid) at start-up or mid-run: the surviving rank ends within seconds with one
line naming the dead rank and its last step, no traceback, exit status 1 (issue 18, class 3)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhfuse.trainer import build_trainer, compose_config

SMOKE = ["experiment=smoke", "generator.instances=2", "iterations=100000", "distributed.timeout_s=60"]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _launch(tmp_path: Path, marker: str) -> tuple[subprocess.Popen[str], int, list[str]]:
    """Start a 2-rank smoke job; return (rank 0's process, rank 1's pid, output so far) once `marker` shows."""
    cache = tmp_path / "cache"
    build_trainer(  # warm start once in this process: the job itself starts in seconds
        compose_config([*SMOKE[:1], f"model.warmstart.cache_dir={cache}", "iterations=1"]),
        run_dir=tmp_path / "warm",
        log=lambda _: None,
    )
    cmd = [sys.executable, "-m", "rlhfuse.trainer.cli", *SMOKE, f"model.warmstart.cache_dir={cache}",
           f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if marker in line:
            break
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert len(children) == 1, "".join(lines)
    return proc, int(children[0]), lines


def _check_one_line(out: str, dead: int, survivor: int) -> None:
    assert "Traceback" not in out and "frame #" not in out, out[-3000:]
    (line,) = [x for x in out.splitlines() if "rlhfuse-train: error:" in x]
    assert f"rank {dead}" in line and f"this is rank {survivor}" in line and "last step:" in line, line
    assert "resume=auto" in line


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_rank_1_killed_mid_run_ends_rank_0_with_one_line(tmp_path: Path) -> None:
    proc, rank1, _ = _launch(tmp_path, "Starting with 2 processes")
    time.sleep(3.0)  # into the iterations
    os.kill(rank1, signal.SIGKILL)
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert time.monotonic() - start < 10
    assert proc.returncode == 1, out[-3000:]
    _check_one_line(out, dead=1, survivor=0)
    assert "last step: iteration" in out


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_rank_0_killed_at_start_up_ends_rank_1_with_one_line(tmp_path: Path) -> None:
    proc, rank1, _ = _launch(tmp_path, "GLOBAL_RANK: 1")  # rank 1 is joining the process group
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    start = time.monotonic()
    while _running(rank1) and time.monotonic() - start < 30:
        time.sleep(0.1)
    elapsed = time.monotonic() - start
    if _running(rank1):
        os.kill(rank1, signal.SIGKILL)
    assert proc.stdout is not None
    out = proc.stdout.read()  # rank 1 held the pipe: its output, to EOF
    assert elapsed < 10, out[-3000:]
    _check_one_line(out, dead=0, survivor=1)
