"""Frozen models kept in host memory between inference stages, swapped onto the compute device for inference.

Ref and Reward are only used by inference (docs/paper.md §2): between iterations their weights live in host memory
(pinned on CUDA, so copies are asynchronous) and the device keeps its memory for generation and training.
`prefetch()` starts the host-to-device copy early — the fused rollout calls it when this rank's long tail
begins, so on a GPU the copy runs on a side stream while the tail decodes; `acquire()` makes the compute stream
wait for the copy's event and points the module at the device copies; `release()` points it back at the host
copies and drops the device ones (the weights are frozen: the host copy stays the master, nothing is copied
back).

Streams: one side stream per `OffloadedModel`, made on its first prefetch and reused for every later one (a new
stream per prefetch would take a fresh one from the pool each iteration). The device copies are allocated on the
side stream but read on the compute stream, so `acquire()` records them on the compute stream
(`Tensor.record_stream`): when `release()` drops them, the caching allocator waits for the compute stream's
kernels that read them before it hands their memory to anything else. The device-generic stream API
(`torch.Stream`, `torch.Event`, `torch.accelerator.current_stream`) serves CUDA and the CPU tests' stand-in device
(`rlhfuse.testing.standin`) alike.

On a CPU device the host copy is the device copy and the swap costs nothing; the same code runs for any target
device (tested with `meta`, where a weight left on the device or a copy made back to the host would show, and
with the stand-in device, where a CPU tensor mixed into the device's computation would raise).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

# devices without streams: the copies there are plain synchronous ones (the CPU copies nothing at all)
_NO_STREAMS = ("cpu", "meta")


class OffloadedModel:
    """`module`'s weights in host memory, swapped onto `device` between `acquire()` and `release()`."""

    def __init__(self, module: nn.Module, device: torch.device | str) -> None:
        self.module = module
        self.device = torch.device(device)
        # pinned host memory: what makes CUDA's host-to-device copies asynchronous
        pin = self.device.type == "cuda"
        # one entry per parameter object (tied weights once); swapping the objects' contents keeps the ties
        self.host: dict[str, Tensor] = {
            name: (t.detach().cpu().pin_memory() if pin else t.detach().cpu())
            for name, t in module.named_parameters()
        }
        self._staged: dict[str, Tensor] | None = None
        self._ready: torch.Event | None = None  # the side stream's copy of `_staged` is done
        self._stream: torch.Stream | None = None  # this model's side stream, made once
        self._assign(self.host)

    @property
    def on_host(self) -> bool:
        """Whether the module's weights are the host copies (no device memory held)."""
        params = dict(self.module.named_parameters())
        return all(
            params[name].device == t.device and params[name].data_ptr() == t.data_ptr()
            for name, t in self.host.items()
        )

    @property
    def side_stream(self) -> torch.Stream | None:
        """The stream this model's copies run on (None before the first prefetch, and on the CPU or `meta`)."""
        return self._stream

    def _swaps(self) -> bool:
        return self.device != torch.device("cpu")

    def _assign(self, tensors: dict[str, Tensor]) -> None:
        for name, param in self.module.named_parameters():
            target = tensors[name]
            # data pointers only on the host: a device tensor's may be opaque (0 on the stand-in device)
            same = param.device == target.device and (
                target.device.type != "cpu" or param.data_ptr() == target.data_ptr()
            )
            if not same:
                torch.utils.swap_tensors(param, nn.Parameter(target, requires_grad=False))

    def prefetch(self) -> None:
        """Start copying the weights to the device (asynchronous, on the side stream); the module stays on the
        host."""
        if self._staged is not None or not self._swaps():
            return
        if self.device.type in _NO_STREAMS:
            self._staged = {n: t.to(self.device) for n, t in self.host.items()}
            return
        if self._stream is None:
            self._stream = torch.Stream(device=self.device)
        with self._stream:
            self._staged = {n: t.to(self.device, non_blocking=True) for n, t in self.host.items()}
        self._ready = self._stream.record_event()

    def acquire(self) -> nn.Module:
        """The module with its weights on the device (prefetching now if `prefetch` was not called); work queued
        on the compute stream after this call sees the finished copies."""
        if not self._swaps():
            return self.module
        if self._staged is None:
            self.prefetch()
        assert self._staged is not None
        if self._ready is not None:
            compute = torch.accelerator.current_stream(self.device)
            compute.wait_event(self._ready)
            # made on the side stream, read on this one: their memory is not reused before these reads finish
            for staged in self._staged.values():
                staged.record_stream(compute)
            self._ready = None
        self._assign(self._staged)
        return self.module

    def release(self) -> None:
        """Back to the host copies; the device copies are freed (once the compute stream is done with them)."""
        if self._swaps():
            self._assign(self.host)
        self._staged, self._ready = None, None
