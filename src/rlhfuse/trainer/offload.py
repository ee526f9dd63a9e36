"""Frozen models kept in host memory between inference stages, swapped onto the compute device for inference.

Ref and Reward are only used by inference (DESIGN §2): between iterations their weights live in host memory
(pinned on CUDA, so copies are asynchronous) and the device keeps its memory for generation and training.
`prefetch()` starts the host-to-device copy early — the fused rollout calls it when this rank's long tail
begins, so on a GPU the copy runs on a side stream while the tail decodes; `acquire()` waits for it and points
the module at the device copies; `release()` points it back at the host copies and drops the device ones (the
weights are frozen: the host copy stays the master, nothing is copied back).

On a CPU device the host copy is the device copy and the swap costs nothing; the same code runs for any target
device (tested with `meta`, where a weight left on the device or a copy made back to the host would show).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class OffloadedModel:
    """`module`'s weights in host memory, swapped onto `device` between `acquire()` and `release()`."""

    def __init__(self, module: nn.Module, device: torch.device | str) -> None:
        self.module = module
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        # one entry per parameter object (tied weights once); swapping the objects' contents keeps the ties
        self.host: dict[str, Tensor] = {
            name: (t.detach().cpu().pin_memory() if pin else t.detach().cpu())
            for name, t in module.named_parameters()
        }
        self._staged: dict[str, Tensor] | None = None
        self._ready: torch.cuda.Event | None = None
        self._assign(self.host)

    @property
    def on_host(self) -> bool:
        """Whether the module's weights are the host copies (no device memory held)."""
        params = dict(self.module.named_parameters())
        return all(params[name].data_ptr() == t.data_ptr() for name, t in self.host.items())

    def _swaps(self) -> bool:
        return self.device != torch.device("cpu")

    def _assign(self, tensors: dict[str, Tensor]) -> None:
        for name, param in self.module.named_parameters():
            if param.data_ptr() != tensors[name].data_ptr() or param.device != tensors[name].device:
                torch.utils.swap_tensors(param, nn.Parameter(tensors[name], requires_grad=False))

    def prefetch(self) -> None:
        """Start copying the weights to the device (asynchronous on CUDA); the module stays on the host."""
        if self._staged is not None or not self._swaps():
            return
        if self.device.type == "cuda":
            stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(stream):
                self._staged = {n: t.to(self.device, non_blocking=True) for n, t in self.host.items()}
            self._ready = stream.record_event()
        else:
            self._staged = {n: t.to(self.device) for n, t in self.host.items()}

    def acquire(self) -> nn.Module:
        """The module with its weights on the device (prefetching now if `prefetch` was not called)."""
        if not self._swaps():
            return self.module
        if self._staged is None:
            self.prefetch()
        assert self._staged is not None
        if self._ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ready)
            self._ready = None
        self._assign(self._staged)
        return self.module

    def release(self) -> None:
        """Back to the host copies; the device copies are freed."""
        if self._swaps():
            self._assign(self.host)
        self._staged, self._ready = None, None
