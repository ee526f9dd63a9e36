"""Process-group facts and the device rule: which device a rank's collectives use.

`rank_device(backend)`: `cuda:LOCAL_RANK` when the backend is NCCL (or, with no backend named, when CUDA is
available and the process group, if any, is not gloo), the CPU otherwise. `group_device(group)`: the device an
existing group's collectives need (gloo: CPU; NCCL: this rank's current CUDA device).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from typing import Any

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


def new_group(ranks: Sequence[int], timeout_s: float | None = None) -> Any:
    """Collective over the world (every rank calls it, same order): a process group of `ranks`."""
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    return dist.new_group(list(ranks), **kwargs)


def global_rank(group: Any, group_rank: int) -> int:
    """The world rank of rank `group_rank` of `group` (torch's point-to-point calls name peers by world rank,
    whatever group they run on); the rank itself for the world (None)."""
    return group_rank if group is None else int(dist.get_global_rank(group, group_rank))


def rank_in(group: Any, world_rank: int) -> int:
    """`global_rank`'s inverse: the rank in `group` of world rank `world_rank`."""
    return world_rank if group is None else int(dist.get_group_rank(group, world_rank))


_CPU_GROUPS: dict[int, Any] = {}


def control_subgroups(rank_lists: Sequence[Sequence[int]]) -> Any:
    """Collective over the world (every rank calls it, same order): a gloo control group per list of ranks (each
    made on every rank, as torch requires), each its own `cpu_group`; this rank's group (None when it is in
    none). For control messages among some ranks only: `cpu_group` of a group that some ranks are not in would
    be made by its members alone."""
    from rlhfuse.distributed import ordering

    mine = None
    for ranks in rank_lists:
        group = dist.new_group(list(ranks), backend="gloo")
        if rank() in ranks:
            ordering.mark_control(group)
            _CPU_GROUPS[id(group)] = group
            mine = group
    return mine


def cpu_group(group: Any = None) -> Any:
    """A gloo control group over the ranks of `group` (the world if None), for small control messages on the CPU,
    the only kind of group that may use tags or receive from any rank (NCCL matches point-to-point messages by
    order alone). On gloo it is `group` itself, except under the NCCL-ordering emulation
    (`rlhfuse.distributed.ordering`), which needs the control messages apart from the device messages it queues: a
    gloo group made once per group, as on NCCL. Collective: every rank of `group` calls it together."""
    from rlhfuse.distributed import ordering

    if backend(group) == "gloo" and not ordering.enabled():
        return group
    key = 0 if group is None else id(group)
    if key not in _CPU_GROUPS:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        _CPU_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
        ordering.mark_control(_CPU_GROUPS[key])
    return _CPU_GROUPS[key]


def shutdown(device: torch.device | None = None) -> None:
    """Every rank done (a barrier on the collective device), then the process group torn down."""
    if not is_initialized():
        return
    from rlhfuse.distributed.collectives import barrier

    barrier(device if device is not None else group_device())
    dist.destroy_process_group()
