"""The one tensor wire codec: a message as one flat byte tensor plus a small int64 header, no pickling.

A message type (e.g. `rlhfuse.generation.messages.SampleBatch`) is a dataclass with `pack() -> Packed` and
`unpack(Packed)`; it hands `pack_tensors` its integers and tensors. What goes over a link is then always the
same three tensors, so a receiver can allocate every buffer before it receives:

    frame_2    int64 [2]  (header length H, payload length N)
    header_H   int64 [H]  [n_ints, *ints, n_tensors, (dtype code, ndim, *shape) per tensor]
    payload_N  uint8 [N]  each tensor's bytes (C order), padded to a multiple of 8 bytes

Every tensor keeps its dtype (bf16 KV caches travel as bytes, so gloo never sees bf16) and shape; the header and
the payload are created on the device the message is packed for (the KV cache's device for NCCL).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

DTYPES: tuple[torch.dtype, ...] = (
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
)
"""Dtype codes of the header: the index in this tuple."""

_ALIGN = 8  # bytes: every tensor starts at a multiple of the largest element size, so unpacking is a view


@dataclass(frozen=True)
class Packed:
    """One message: header_H int64 [H] and payload_N uint8 [N] (layout in the module docstring)."""

    header_H: Tensor
    payload_N: Tensor

    @property
    def frame(self) -> tuple[int, int]:
        """(H, N): what a receiver needs to allocate the two buffers."""
        return int(self.header_H.numel()), int(self.payload_N.numel())

    @property
    def device(self) -> torch.device:
        return self.payload_N.device

    def to(self, device: torch.device | str) -> Packed:
        return Packed(self.header_H.to(device), self.payload_N.to(device))

    @staticmethod
    def empty(frame: Sequence[int], device: torch.device | str) -> Packed:
        """Buffers for receiving a message of `frame` = (H, N)."""
        return Packed(
            torch.empty(int(frame[0]), dtype=torch.int64, device=device),
            torch.empty(int(frame[1]), dtype=torch.uint8, device=device),
        )


def _code(dtype: torch.dtype) -> int:
    if dtype not in DTYPES:
        raise TypeError(f"the wire codec has no code for {dtype}: add it to rlhfuse.core.wire.DTYPES")
    return DTYPES.index(dtype)


def pack_tensors(
    ints: Sequence[int], tensors: Sequence[Tensor], *, device: torch.device | str | None = None
) -> Packed:
    """`ints` and `tensors` as one message on `device` (default: the first tensor's device, else CPU)."""
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    header = [len(ints), *(int(i) for i in ints), len(tensors)]
    chunks: list[Tensor] = []
    for t in tensors:
        header += [_code(t.dtype), t.dim(), *t.shape]
        raw = t.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
        chunks.append(raw)
        if pad := -raw.numel() % _ALIGN:
            chunks.append(torch.zeros(pad, dtype=torch.uint8, device=device))
    payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=device)
    return Packed(torch.tensor(header, dtype=torch.int64, device=device), payload)


def unpack_tensors(packed: Packed) -> tuple[list[int], list[Tensor]]:
    """The `ints` and `tensors` of `pack_tensors`; the tensors are views of the payload (on its device)."""
    header = packed.header_H.tolist()
    n_ints = header[0]
    ints = header[1 : 1 + n_ints]
    pos = 1 + n_ints
    count = header[pos]
    pos += 1
    tensors: list[Tensor] = []
    offset = 0
    for _ in range(count):
        dtype, ndim = DTYPES[header[pos]], header[pos + 1]
        shape = header[pos + 2 : pos + 2 + ndim]
        pos += 2 + ndim
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > packed.payload_N.numel():
            break
        tensors.append(packed.payload_N[offset : offset + nbytes].view(dtype).reshape(shape))
        offset += nbytes + (-nbytes % _ALIGN)
    if len(tensors) != count or pos != len(header) or offset != packed.payload_N.numel():
        raise ValueError(
            f"malformed message: header of {len(header)} ints describes {pos}, payload of "
            f"{packed.payload_N.numel()} bytes holds {offset} (sender and receiver disagree on the codec)"
        )
    return ints, tensors
