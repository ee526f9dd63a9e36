"""Device-to-host synchronisations: `SyncCounter` counts them (`rlhfuse.models.upload` moves host bookkeeping
to the device without one). This module imports nothing of rlhfuse, so it can count the syncs of any revision.

A CUDA host thread only waits for the device when it needs a value the device computes (a scalar for Python, a
tensor's size that depends on its data, a copy to host memory) or when it copies pageable host memory to the
device (torch synchronises the stream after a blocking host-to-device copy). A decode step that does this
several times leaves the GPU idle between its kernels; `docs/generation.md` gives the budget (one per step).

What `SyncCounter` counts (kinds, as keys of `by_kind`):

- ``item``: `aten._local_scalar_dense`, behind `.item()`, `bool(t)`, `int(t)`, `float(t)`, `t.__index__`
  (a tensor used as a Python index or slice bound), `if t:` and f-strings of 0-d tensors;
- ``nonzero``, ``bool_index``, ``masked_select``, ``unique``, ``repeat_interleave``: ops whose output size
  depends on the data (`nonzero`, `torch.where(mask)`, `argwhere`, `t[mask]` with a boolean mask,
  `masked_select`, `unique*`, `repeat_interleave` with tensor repeats and no `output_size`);
- ``tolist``, ``numpy``, ``cpu``: those Tensor methods (patched while the counter is active, since on a CPU
  tensor they read memory without dispatching an op);
- ``to_host``: a copy from the device to the CPU by any other way (`.to("cpu")`, `copy_` into a CPU tensor);
  seen on CUDA only (on the CPU it is no copy at all);
- ``to_device_blocking``: a host-to-device copy that is not `non_blocking` from pinned memory; seen on CUDA only.

Which tensors count: those on `device` (default: CUDA when it is available, else the CPU). On a CPU-only machine
the CPU stands in for the GPU: every read of any tensor counts, also of tensors that would stay on the host on a
GPU, so a CPU count bounds the GPU's reads from above; host-to-device copies, on the other hand, are invisible
on the CPU (there is no copy), which is why decode code sends host values through `rlhfuse.models.upload`.

What it does not see: `torch.tensor([t0, t1])` of a list holding 0-d tensors on the CPU (read without an op; on
CUDA `torch.tensor` reads each with `item`, counted), `torch.cuda.synchronize`, events,
NCCL collectives (their waits are the collective's, not a read), and syncs inside compiled or C++ extension code
that bypasses the dispatcher. The CUDA-only kinds follow torch's copy rules (a copy that is not non_blocking
from pinned memory synchronises the stream) and have not been run on a GPU yet: there,
`torch.cuda.set_sync_debug_mode("warn")` around the same code is the cross-check.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_DATA_DEPENDENT: dict[Any, str] = {
    aten._local_scalar_dense.default: "item",
    aten.nonzero.default: "nonzero",
    aten.nonzero.out: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.masked_select.out: "masked_select",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.unique_dim_consecutive.default: "unique",
}

_PATCHED_METHODS = ("tolist", "numpy", "cpu")

_active = threading.local()


def _tensors(args: Any) -> list[Tensor]:
    out: list[Tensor] = []
    for a in args:
        if isinstance(a, Tensor):
            out.append(a)
        elif isinstance(a, list | tuple):
            out.extend(x for x in a if isinstance(x, Tensor))
    return out


class SyncCounter(TorchDispatchMode):
    """Counts the device-to-host synchronisations the code it wraps makes (see the module docstring):
    `with SyncCounter() as c: ...`, then `c.count` and `c.by_kind` ({"item": 2, "tolist": 1, ...}).

    `device`: the tensors that live on the device (default: CUDA when available, else the CPU, which then stands
    in for it). Counters nest: an inner counter counts alone while it is active."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()
        # only the device *type* matters here (every CUDA device's reads count)
        self.device_type = (
            torch.device(device).type
            if device is not None
            else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.by_kind: Counter[str] = Counter()
        self._originals: dict[str, Callable[..., Any]] = {}
        self._owned: dict[str, bool] = {}
        self._quiet = 0  # > 0 inside a patched method: its own dispatched ops are that method's one sync

    @property
    def count(self) -> int:
        return sum(self.by_kind.values())

    def _on_device(self, t: Tensor) -> bool:
        return t.device.type == self.device_type

    def _record(self, kind: str) -> None:
        if self._quiet == 0 and getattr(_active, "counter", None) is self:
            self.by_kind[kind] += 1

    # ------------------------------------------------------------------ dispatched ops
    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        kind = self._kind(func, args, kwargs)
        if kind is not None:
            self._record(kind)
        return func(*args, **kwargs)

    def _kind(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
        inputs = [t for t in _tensors(args) if self._on_device(t)]
        if func in _DATA_DEPENDENT:
            return _DATA_DEPENDENT[func] if inputs else None
        packet = func.overloadpacket
        if packet is aten.index and inputs:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, Tensor) and i.dtype == torch.bool for i in indices):
                return "bool_index"
            return None
        if packet is aten.repeat_interleave and inputs:
            repeats = args[0] if func is aten.repeat_interleave.Tensor else args[1] if len(args) > 1 else None
            if isinstance(repeats, Tensor) and kwargs.get("output_size") is None:
                return "repeat_interleave"
            return None
        if packet in (aten._to_copy, aten.copy_):
            return self._copy_kind(func, args, kwargs)
        return None

    def _copy_kind(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
        if self.device_type == "cpu":
            return None  # CPU to CPU: no copy between memories to see
        if func.overloadpacket is aten.copy_:
            dst, src = args[0], args[1]
            dst_type = dst.device.type
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        else:
            src = args[0]
            target = kwargs.get("device")
            dst_type = src.device.type if target is None else torch.device(target).type
            non_blocking = bool(kwargs.get("non_blocking", False))
        if not isinstance(src, Tensor):
            return None
        if src.device.type == self.device_type and dst_type == "cpu":
            return "to_host"
        if src.device.type == "cpu" and dst_type == self.device_type:
            return None if non_blocking and src.is_pinned() else "to_device_blocking"
        return None

    # ------------------------------------------------------------------ patched methods
    def _patch(self) -> None:
        for name in _PATCHED_METHODS:
            original = getattr(Tensor, name)
            self._originals[name] = original
            self._owned[name] = name in Tensor.__dict__  # else inherited from the C base class
            setattr(Tensor, name, self._counting(name, original))

    def _counting(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def method(t: Tensor, *args: Any, **kwargs: Any) -> Any:
            if getattr(_active, "counter", None) is not counter:
                return original(t, *args, **kwargs)
            if counter._on_device(t):
                counter._record(name)
            counter._quiet += 1
            try:
                return original(t, *args, **kwargs)
            finally:
                counter._quiet -= 1

        method.__name__ = name
        method.__doc__ = original.__doc__
        return method

    def _unpatch(self) -> None:
        for name, original in self._originals.items():
            if self._owned[name]:
                setattr(Tensor, name, original)
            else:
                delattr(Tensor, name)  # back to the inherited method, as before
        self._originals.clear()

    def __enter__(self) -> SyncCounter:
        self._outer = getattr(_active, "counter", None)
        _active.counter = self
        self._patch()
        super().__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        super().__exit__(exc_type, exc, tb)
        self._unpatch()
        _active.counter = self._outer
