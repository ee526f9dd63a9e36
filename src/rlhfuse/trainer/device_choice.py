"""The run's compute device, chosen once at start-up by the device rule of `rlhfuse.distributed.rank_device`.

`device=auto`: this rank's CUDA device when CUDA is available, `cuda:LOCAL_RANK` (torchrun and Fabric's launcher
set LOCAL_RANK; 0 in a single process), else the CPU. `device=cuda`: this rank's CUDA device. `device=cuda:N`:
device N, for a single process (validation refuses it for several, which would all land on device N).
`claim_device` makes it the current CUDA device once, before the process group and any CUDA work: NCCL's
communicators, Triton's kernel launches and `torch.cuda.current_device()` (which
`rlhfuse.distributed.group_device` reads) follow the current device, not the tensors.
"""

from __future__ import annotations

import torch

from rlhfuse import distributed


def resolve_device(name: str) -> torch.device:
    """The compute device of `device=<name>` (auto | cpu | cuda | cuda:N) for this rank."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available here: set device=cpu or device=auto")
    if name in ("auto", "cuda"):
        return distributed.rank_device("nccl")  # cuda:LOCAL_RANK with CUDA, the CPU without
    return torch.device(name)


def claim_device(device: torch.device) -> None:
    """Make `device` this process's current CUDA device (nothing to do off CUDA). Called once, at start-up."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def device_problems(name: str, world: int) -> list[str]:
    """`device=cuda:N` names one device for every process: refused when the run has several."""
    if world > 1 and name.startswith("cuda:"):
        return [
            f"device={name} puts all {world} processes on one GPU: set device=auto (or device=cuda), and each "
            "rank takes cuda:LOCAL_RANK"
        ]
    return []
