"""Multi-process launch through Lightning Fabric (no home-made launcher or transport).

`rlhfuse-train ... distributed.nproc_per_node=2`: Fabric's subprocess launcher re-runs the same command for
ranks 1..N-1 (Hydra-aware: same run directory) and initialises torch.distributed (gloo on CPU, NCCL on GPU).
Under `torchrun`, Fabric reads the torchelastic environment and each process is one rank.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
from lightning.fabric import Fabric


def distributed_fabric(
    *, nproc_per_node: int, backend: str, timeout_s: float, device_type: str, precision: str
) -> Fabric:
    """A launched Fabric with its process group initialised; returns on every rank."""
    from lightning.fabric.strategies import DDPStrategy

    world = int(os.environ.get("WORLD_SIZE", nproc_per_node))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", nproc_per_node))
    if world % local:
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}")
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    strategy = DDPStrategy(process_group_backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    accelerator = "cuda" if device_type == "cuda" else "cpu"
    fabric = Fabric(
        accelerator=accelerator,
        devices=local,
        num_nodes=world // local,
        strategy=strategy,
        precision=precision,  # type: ignore[arg-type]
    )
    fabric.launch()
    if device_type != "cuda":
        # N processes share the cores: without this each would start one thread per core
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return fabric


def is_global_zero(fabric: Any) -> bool:
    return bool(getattr(fabric, "global_rank", 0) == 0)
