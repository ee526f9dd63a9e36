"""migration=auto on a loaded machine: `rlhfuse-train generator.instances=2 migration=auto` (2 processes) runs
beside a busy loop on each core, and every iteration's Rt follows what auto had measured until then. Once
migrating measured no faster than Rt = 0 (`migration/measured_migrating` * (1 + MIN_GAIN) not below
`migration/measured_serial`, the medians of measured over predicted-serial seconds), the next iteration runs
Rt = 0, but for one migrating probe after every CHECK_EVERY iterations off: what `off` would run, up to those
probes. The timings themselves are the machine's (nothing here compares seconds with a bound); the test checks
that the choices follow them, whatever they are under this load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlhfuse.generation.tuning import CHECK_EVERY, MIN_GAIN

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(900)
def test_migration_auto_follows_its_own_measurements_beside_busy_loops(tmp_path: Path, train_cli) -> None:
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        rows = train_cli(
            tmp_path / "run",
            "generator.instances=2",
            "migration=auto",
            "iterations=12",
            "logger=quiet",
            "distributed.timeout_s=120",
            f"model.warmstart.cache_dir={tmp_path / 'cache'}",
            timeout=800,
        )
    finally:
        for loop in busy:
            loop.kill()
            loop.wait()
    assert len(rows) == 12
    rts = [row["migration/threshold"] for row in rows]
    assert rts[0] > 0  # the configured initial Rt, before anything is measured
    measured = [
        row for row in rows if "migration/measured_migrating" in row and "migration/measured_serial" in row
    ]
    assert measured, "auto measured both modes within 12 iterations"
    for i in range(1, len(rows)):
        before = rows[i - 1]
        migrating = before.get("migration/measured_migrating")
        serial = before.get("migration/measured_serial")
        if migrating is None or serial is None or migrating * (1 + MIN_GAIN) < serial or rts[i] == 0:
            continue
        # migrating measured no faster, yet Rt > 0: only as the probe after CHECK_EVERY iterations off
        assert i >= CHECK_EVERY and all(rt == 0 for rt in rts[i - CHECK_EVERY : i]), (i, rts, rows[i - 1])
