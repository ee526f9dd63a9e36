"""`benchmarks.two_ranks.run_two_ranks`, the launcher of the two-process benchmarks: a worker that dies ends the
run at once, naming the dead rank and its exit code, instead of leaving the caller waiting on a result that will
never come while the other rank stays blocked."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:  # benchmarks/ is a folder of the repository, not of the installed package
    sys.path.append(REPO)

from benchmarks.two_ranks import WorkerDied, run_two_ranks  # noqa: E402

pytestmark = pytest.mark.distributed


def _one_dies(rank: int, world: int, init: str, shape: str, rounds: int, queue: Any) -> None:
    """Rank 1 fails at once; rank 0 waits, as a rank blocked in a collective with it would."""
    if rank == 1:
        raise ValueError(f"rank 1 gives up ({shape}, {rounds} rounds)")
    time.sleep(600)


def _both_report(rank: int, world: int, init: str, shape: str, rounds: int, queue: Any) -> None:
    if rank == 0:
        queue.put({"shape": shape, "rounds": rounds})


@pytest.mark.timeout(120)
def test_a_worker_that_dies_ends_the_run_naming_its_rank_and_exit_code() -> None:
    start = time.monotonic()
    died = r"rank 1 \(pid \d+\) died: exit code 1, ValueError: rank 1 gives up"
    with pytest.raises(WorkerDied, match=died):
        run_two_ranks(_one_dies, "tiny", 3)
    assert time.monotonic() - start < 60  # start-up and the other rank's stop, not rank 0's 600 s wait


@pytest.mark.timeout(120)
def test_rank_zeros_result_comes_back() -> None:
    assert run_two_ranks(_both_report, "tiny", 3) == {"shape": "tiny", "rounds": 3}
