"""What the two-process benchmarks (`bench_fused_training`, `bench_pipeline_inference`) share: the model
shapes, the gloo process group of a worker, and the launch of two spawned workers whose rank 0 reports one
result through a queue (a worker that dies ends the launch at once, naming its rank and exit code)."""

from __future__ import annotations

import os
import queue
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from rlhfuse.testing.processes import init_gloo, leave_after_success

SHAPES = {
    "default": dict(
        hidden_size=64, intermediate_size=192, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32
    ),
    "wide256": dict(
        hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=64
    ),
    "wide512": dict(
        hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8, num_kv_heads=8, head_dim=64
    ),
}


def init_worker(rank: int, world: int, init: str) -> None:
    """One thread per process, and the gloo group of the run (file rendezvous)."""
    init_gloo(rank, f"file://{init}", world=world, timeout_s=120)


def _ending(rank: int, worker: Callable[..., None], *args: Any) -> None:
    """`worker(rank, *args)`, then out past interpreter finalisation (`rlhfuse.testing.processes`): its race
    with gloo's worker threads has aborted finished ranks on a loaded machine."""
    worker(rank, *args)
    leave_after_success()


class WorkerDied(RuntimeError):
    """A worker of `run_two_ranks` exited with an error or a signal (the other was stopped)."""


def run_two_ranks(worker: Callable[..., None], shape: str, rounds: int, timeout_s: float = 900.0) -> Any:
    """Spawn `worker(rank, 2, init_file, shape, rounds, queue)` on 2 processes; what rank 0 puts in the queue.

    A worker that dies (an exception, a non-zero exit, a signal) ends the run at once: the other, likely blocked
    in a collective with it, is stopped and `WorkerDied` names the dead rank, its exit code and its error. Both
    still running after `timeout_s` are stopped with a TimeoutError."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = mp.start_processes(
            _ending,
            args=(worker, 2, os.path.join(tmp, "init"), shape, rounds, results),
            nprocs=2,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        # rank 0's result, then both exits; `_joined` raises (and stops the other) when a worker fails
        exited = False
        while True:
            try:
                result = results.get(timeout=0.2 if not exited else 5.0)
                break
            except queue.Empty:
                if exited:  # both ended cleanly, their queue flushed: rank 0 never put its result
                    raise WorkerDied("both workers exited cleanly without rank 0's result") from None
            exited = _joined(procs)
            _check_deadline(procs, deadline, timeout_s)
        while not _joined(procs):
            _check_deadline(procs, deadline, timeout_s)
    return result


def _check_deadline(procs: Any, deadline: float, timeout_s: float) -> None:
    if time.monotonic() > deadline:
        for p in procs.processes:
            p.kill()
        raise TimeoutError(f"the two workers did not finish within {timeout_s:.0f} s (a hang?)")


def _joined(procs: Any) -> bool:
    """Whether both workers exited cleanly (a short wait); WorkerDied, the other stopped, when one failed."""
    try:
        return bool(procs.join(timeout=0.2, grace_period=2.0))
    except mp.ProcessExitedException as died:
        raise WorkerDied(
            f"rank {died.error_index} (pid {died.error_pid}) died: exit code {died.exit_code}"
            + (f" ({died.signal_name})" if died.signal_name else "")
        ) from died
    except mp.ProcessRaisedException as raised:
        code = procs.processes[raised.error_index].exitcode
        last = [line for line in raised.msg.splitlines() if line.strip()][-1:] or ["?"]
        raise WorkerDied(
            f"rank {raised.error_index} (pid {raised.error_pid}) died: exit code {code}, {last[0]}\n{raised.msg}"
        ) from raised
