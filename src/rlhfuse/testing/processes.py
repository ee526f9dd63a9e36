"""Spawning test ranks (`spawn_ranks`, `gloo_rank`) and ending them: a rank whose checks all passed leaves
through `rlhfuse.distributed.exit_finished` (past interpreter finalisation, whose race with gloo's worker threads
has aborted passing ranks on a loaded machine); a failing one tears its process group down and raises."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

import torch.distributed as dist

from rlhfuse import distributed


@contextmanager
def finishing_rank() -> Iterator[None]:
    """Around a spawned rank's work, inside its process group: an error tears the group down and propagates (the
    process exits non-zero); success waits for every rank (a barrier) and exits with status 0 (the block never
    returns)."""
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_after_success()


def leave_after_success() -> NoReturn:
    """End a spawned rank whose checks all passed: every rank done (a barrier), then exit with status 0."""
    distributed.barrier(distributed.group_device())
    distributed.exit_finished()


def free_port() -> int:
    """A free loopback TCP port (for a rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_env() -> dict[str, str]:
    """This process's environment for a job a test launches (torchrun, rlhfuse-train): without the rank variables
    of a launch it may run under, one thread per process."""
    import os

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    }
    env["OMP_NUM_THREADS"] = "1"
    return env


def spawn_ranks(
    target: Callable[..., object], *args: object, world: int = 2, timeout_s: float
) -> list[int | None]:
    """`target(rank, port, *args)` in `world` spawned processes (`port`: a free loopback TCP port for their
    rendezvous); each joined for up to `timeout_s` seconds, then killed if still running. Their exit codes."""
    import multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, port, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def init_gloo(rank: int, init: int | str, *, world: int = 2, timeout_s: float = 60.0) -> None:
    """One thread, and rank `rank` of a gloo group of `world` ranks; `init`: a loopback TCP port, or an init_method
    URL (`file://...`)."""
    import datetime

    import torch

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{init}" if isinstance(init, int) else init,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


@contextmanager
def gloo_rank(rank: int, init: int | str, *, world: int = 2, timeout_s: float = 60.0) -> Iterator[None]:
    """A spawned rank's body (`spawn_ranks` passes the port): `init_gloo`, then `finishing_rank`."""
    init_gloo(rank, init, world=world, timeout_s=timeout_s)
    with finishing_rank():
        yield
