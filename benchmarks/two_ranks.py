"""What the two-process benchmarks (`bench_fused_training`, `bench_pipeline_inference`) share: the model
shapes, the gloo process group of a worker, and the launch of two spawned workers whose rank 0 reports one
result through a queue."""

from __future__ import annotations

import datetime
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )


def run_two_ranks(worker: Callable[..., None], shape: str, rounds: int) -> Any:
    """Spawn `worker(rank, 2, init_file, shape, rounds, queue)` on 2 processes; what rank 0 puts in the queue."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = mp.start_processes(
            worker,
            args=(2, os.path.join(tmp, "init"), shape, rounds, queue),
            nprocs=2,
            join=False,
            start_method="spawn",
        )
        result = queue.get(timeout=900)
        procs.join()
    return result
