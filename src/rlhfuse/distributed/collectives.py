"""Typed collectives and point-to-point operations; the only `torch.distributed` calls of rlhfuse.

Tensors are reduced / broadcast / gathered in place on their own device, which must be the group's collective
device (`check_device`). Byte strings, JSON values and `rlhfuse.core.wire` messages travel as uint8 / int64
tensors allocated on the `device` the caller names: no hidden CPU tensors, nothing pickled.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from rlhfuse.core.wire import Packed, pack_tensors, unpack_tensors
from rlhfuse.distributed import ordering
from rlhfuse.distributed.device import backend, is_initialized, world_size

ReduceOp = Literal["sum", "max", "min"]
Work = Any  # torch.distributed's work handle (`.wait()`), None for a completed synchronous call

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def check_device(tensor: Tensor, what: str, group: Any = None, *, backend_name: str | None = None) -> None:
    """Refuse a CPU tensor for an NCCL group (NCCL only moves CUDA memory), naming the operation."""
    name = backend_name if backend_name is not None else backend(group)
    if "nccl" in name and tensor.device.type != "cuda":
        raise ValueError(
            f"{what}: a {tensor.device.type} tensor {tuple(tensor.shape)} {tensor.dtype} handed to an NCCL "
            "group; allocate it on the rank's device (rlhfuse.distributed.rank_device / group_device)"
        )


def wait_all(works: Sequence[Work]) -> None:
    for work in works:
        if work is not None:
            work.wait()


# ------------------------------------------------------------------ tensors, in place
def all_reduce(tensor: Tensor, *, op: ReduceOp = "sum", group: Any = None, async_op: bool = False) -> Work:
    """`tensor` reduced over `group` in place (a no-op without a process group)."""
    if not is_initialized():
        return None
    check_device(tensor, "all_reduce", group)
    return dist.all_reduce(tensor, op=_OPS[op], group=group, async_op=async_op)


def broadcast(tensor: Tensor, src: int, *, group: Any = None, async_op: bool = False) -> Work:
    """`tensor` of global rank `src` copied into every rank's `tensor` of the same shape."""
    if not is_initialized():
        return None
    check_device(tensor, "broadcast", group)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(tensor: Tensor, *, group: Any = None) -> list[Tensor]:
    """Every rank's `tensor` (same shape everywhere), in rank order, on `tensor`'s device."""
    if not is_initialized():
        return [tensor]
    check_device(tensor, "all_gather", group)
    out = [torch.empty_like(tensor) for _ in range(world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def barrier(device: torch.device, group: Any = None) -> None:
    """Every rank of `group` reached this point: an all-reduce of one element on `device` (explicit, so NCCL
    never guesses a device)."""
    if is_initialized():
        all_reduce(torch.zeros(1, device=device), group=group)


# ------------------------------------------------------------------ point to point
def _check_p2p(what: str, tensor: Tensor, peer: int | None, group: Any, tag: int) -> None:
    """NCCL matches point-to-point ops by order alone: no tags, no receive from any rank. Those stay on control
    groups (`cpu_group`, gloo wherever the job runs); on a device group they are refused on every backend, so
    code tested on gloo cannot rely on them."""
    check_device(tensor, what, group)
    device_group = "nccl" in backend(group) or ordering.emulates(group)
    if (tag != 0 or peer is None) and device_group and not ordering.is_control(group):
        raise ValueError(
            f"{what}: tag={tag} / src={peer} on a device group: NCCL matches point-to-point messages by order "
            "alone; send control messages on rlhfuse.distributed.cpu_group(...)"
        )


def isend(tensor: Tensor, dst: int, *, group: Any = None, tag: int = 0) -> Work:
    """Non-blocking send; under the NCCL-ordering emulation (`rlhfuse.distributed.ordering`) queued on this
    rank's (group, dst) stream."""
    _check_p2p("isend", tensor, dst, group, tag)
    if ordering.emulates(group):
        return ordering.submit("send", tensor, dst, group)
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: Tensor, src: int | None, *, group: Any = None, tag: int = 0) -> Work:
    """Non-blocking receive (`src=None`: from any rank, which NCCL cannot do: control groups only)."""
    _check_p2p("irecv", tensor, src, group, tag)
    if src is not None and ordering.emulates(group):
        return ordering.submit("recv", tensor, src, group)
    return dist.irecv(tensor, src, group=group, tag=tag)


def recv(tensor: Tensor, src: int | None = None, *, group: Any = None) -> int:
    """Blocking receive into `tensor`; returns the sender's rank (`src=None`: from any rank, control groups)."""
    _check_p2p("recv", tensor, src, group, 0)
    if src is not None and ordering.emulates(group):
        ordering.submit("recv", tensor, src, group).wait()
        return src
    return int(dist.recv(tensor, src, group=group))


# ------------------------------------------------------------------ messages of the tensor codec
def broadcast_packed(packed: Packed | None, src: int, device: torch.device, *, group: Any = None) -> Packed:
    """Rank `src`'s message (`packed`, ignored elsewhere) on every rank: frame, then header and payload."""
    from rlhfuse.distributed.device import rank

    mine = rank() == src
    frame = torch.tensor(
        packed.frame if mine and packed is not None else (0, 0), dtype=torch.int64, device=device
    )
    broadcast(frame, src, group=group)
    out = packed.to(device) if mine and packed is not None else Packed.empty(frame.tolist(), device)
    for part in (out.header_H, out.payload_N):
        if part.numel():  # an empty tensor is nothing to move (and some backends refuse it)
            broadcast(part, src, group=group)
    return out


def all_gather_packed(packed: Packed, device: torch.device, *, group: Any = None) -> list[Packed]:
    """Every rank's message, in rank order (messages padded to the longest for the collective)."""
    packed = packed.to(device)
    frames = all_gather(torch.tensor(packed.frame, dtype=torch.int64, device=device), group=group)
    sizes = [tuple(int(v) for v in f.tolist()) for f in frames]
    longest = [max(1, *(s[k] for s in sizes)) for k in (0, 1)]  # never an empty collective
    gathered = []
    for k, part in enumerate((packed.header_H, packed.payload_N)):
        gathered.append(all_gather(F.pad(part, (0, longest[k] - part.numel())), group=group))
    return [Packed(h[: s[0]], p[: s[1]]) for h, p, s in zip(*gathered, sizes, strict=True)]


def broadcast_tensors(
    tensors: Sequence[Tensor] | None, src: int, device: torch.device, *, group: Any = None
) -> list[Tensor]:
    """Rank `src`'s tensors (any dtypes and shapes; ignored elsewhere) on every rank, on `device`, as one
    message of the tensor codec (views of its payload are cloned so each result owns its memory)."""
    from rlhfuse.distributed.device import rank

    packed = pack_tensors([], list(tensors), device=device) if rank() == src and tensors is not None else None
    _, out = unpack_tensors(broadcast_packed(packed, src, device, group=group))
    return [t.clone() for t in out]


# ------------------------------------------------------------------ bytes and JSON values
def _bytes_message(data: bytes, device: torch.device) -> Packed:
    """`data` as a message: header [length], payload the bytes (on `device`)."""
    payload = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        if data
        else torch.empty(0, dtype=torch.uint8, device=device)
    )
    return Packed(torch.tensor([len(data)], dtype=torch.int64, device=device), payload)


def broadcast_bytes(data: bytes | None, src: int, device: torch.device, *, group: Any = None) -> bytes:
    """Rank `src`'s bytes on every rank."""
    from rlhfuse.distributed.device import rank

    mine = rank() == src and data is not None
    packed = _bytes_message(data or b"", device)
    out = broadcast_packed(packed if mine else None, src, device, group=group)
    return bytes(out.payload_N.cpu().numpy().tobytes())


def all_gather_bytes(data: bytes, device: torch.device, *, group: Any = None) -> list[bytes]:
    """Every rank's bytes, in rank order."""
    packed = _bytes_message(data, device)
    return [
        bytes(p.payload_N.cpu().numpy().tobytes()) for p in all_gather_packed(packed, device, group=group)
    ]


def broadcast_json(value: Any, src: int, device: torch.device, *, group: Any = None) -> Any:
    """Rank `src`'s JSON value (ignored elsewhere) on every rank."""
    from rlhfuse.distributed.device import rank

    data = json.dumps(value).encode() if rank() == src else None
    return json.loads(broadcast_bytes(data, src, device, group=group).decode())


def all_gather_json(value: Any, device: torch.device, *, group: Any = None) -> list[Any]:
    """Every rank's JSON value, in rank order (a single process: `[value]`)."""
    if not is_initialized():
        return [value]
    return [json.loads(b.decode()) for b in all_gather_bytes(json.dumps(value).encode(), device, group=group)]


def broadcast_dataclass(obj: Any, cls: type, src: int, device: torch.device, *, group: Any = None) -> Any:
    """Rank `src`'s `cls` instance (a dataclass whose fields are tensors or None; `obj` ignored elsewhere) on
    every rank, its tensors on `device`: one message of the tensor codec (the ints say which fields are set)."""
    from rlhfuse.distributed.device import rank

    names = [f.name for f in dataclasses.fields(cls)]
    packed = None
    if rank() == src:
        values = [getattr(obj, n) for n in names]
        present = [int(v is not None) for v in values]
        packed = pack_tensors(present, [v for v in values if v is not None], device=device)
    present, tensors = unpack_tensors(broadcast_packed(packed, src, device, group=group))
    it = iter(tensors)
    return cls(**{n: (next(it).clone() if p else None) for n, p in zip(names, present, strict=True)})
