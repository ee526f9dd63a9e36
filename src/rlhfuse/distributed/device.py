"""Process-group facts and the device rule: which device a rank's collectives use.

`rank_device(backend)`: `cuda:LOCAL_RANK` when the backend is NCCL (or, with no backend named, when CUDA is
available and the process group, if any, is not gloo), the CPU otherwise. `group_device(group)`: the device an
existing group's collectives need (gloo: CPU; NCCL: this rank's current CUDA device).
"""

from __future__ import annotations

import os
from typing import Any, NoReturn

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return bool(dist.is_available() and dist.is_initialized())


def rank(group: Any = None) -> int:
    """This process's rank in `group` (0 without a process group)."""
    return int(dist.get_rank(group)) if is_initialized() else 0


def world_size(group: Any = None) -> int:
    """Ranks of `group` (1 without a process group)."""
    return int(dist.get_world_size(group)) if is_initialized() else 1


def local_rank() -> int:
    """This process's index on its node (LOCAL_RANK as torchrun and Fabric's launcher set it; 0 otherwise)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def launched_world() -> int | None:
    """The job's processes as torchrun gives them (WORLD_SIZE), before any process group exists; None when not
    launched by torchrun (the run's own launch then decides). The one reader of WORLD_SIZE."""
    env = os.environ.get("WORLD_SIZE", "").strip()
    return int(env) if env.isdigit() else None


def launched_local_world() -> int | None:
    """torchrun's processes per node (LOCAL_WORLD_SIZE) beside its WORLD_SIZE; None otherwise (vLLM sets a
    LOCAL_WORLD_SIZE of its own in any process that built an engine, without WORLD_SIZE)."""
    env = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(env) if launched_world() is not None and env.isdigit() and int(env) > 0 else None


def backend(group: Any = None) -> str:
    """The group's backend name ("gloo", "nccl"); "none" without a process group."""
    return str(dist.get_backend(group)) if is_initialized() else "none"


def rank_device(backend_name: str | None = None) -> torch.device:
    """The device this rank's collective tensors live on: `cuda:LOCAL_RANK` under NCCL, else the CPU.

    With `backend_name=None`, the initialised process group's backend decides; without one, CUDA's availability.
    """
    name = backend_name if backend_name is not None else backend()
    if name == "none":
        name = "nccl" if torch.cuda.is_available() else "gloo"
    if "nccl" in name and torch.cuda.is_available():
        return torch.device("cuda", local_rank() % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def group_device(group: Any = None, data: torch.device | None = None) -> torch.device:
    """Where tensors for `group`'s collectives live: the CPU for gloo; for NCCL the data's CUDA device, else this
    rank's current CUDA device."""
    if not is_initialized() or backend(group) == "gloo":
        return torch.device("cpu")
    if data is not None and data.type == "cuda":
        return data
    return torch.device("cuda", torch.cuda.current_device())


def global_rank(group: Any, group_rank: int) -> int:
    """The world rank of rank `group_rank` of `group` (torch's point-to-point calls name peers by world rank,
    whatever group they run on); the rank itself for the world (None)."""
    return group_rank if group is None else int(dist.get_global_rank(group, group_rank))


def rank_in(group: Any, world_rank: int) -> int:
    """`global_rank`'s inverse: the rank in `group` of world rank `world_rank`."""
    return world_rank if group is None else int(dist.get_group_rank(group, world_rank))


def shutdown(device: torch.device | None = None) -> None:
    """Every rank done (a barrier on the collective device), then the process group torn down."""
    if not is_initialized():
        return
    from rlhfuse.distributed.collectives import barrier

    barrier(device if device is not None else group_device())
    dist.destroy_process_group()


def exit_finished() -> NoReturn:
    """End a finished rank with status 0: the Python-level exit work (the `atexit` handlers: W&B finishing its
    run, logging's flush) and the output flushed, then out without interpreter finalisation. What finalisation
    has left once a rank's work is done is destroying c10d's worker threads, and that races it: a gloo worker
    thread releasing a just-finished collective's tensors needs the GIL, finds the interpreter finalising, and
    the unwinding thread aborts the process ('terminate called without an active exception', SIGABRT; seen in
    two-process generation and vLLM runs on a loaded machine; pytorch/pytorch#179291)."""
    import atexit
    import logging
    import sys

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
