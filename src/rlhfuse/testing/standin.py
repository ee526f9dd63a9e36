"""A stand-in accelerator for CPU tests: tensors that compute on the CPU but live, as far as every caller can
tell, on another device, and that refuse to be mixed with CPU tensors, as CUDA does.

Code that only works because the test machine is a CPU (a `torch.zeros(n)` without `device=` scattered into by
device results, a CPU index handed to `torch.isin`, a host tensor concatenated to device ones) runs on the
stand-in exactly as far as it would on a GPU: to the first op that mixes devices, which raises `DeviceMixError`
naming the op.

    device = standin_device()          # torch.device("standin", 0); registers the backend once per process
    model = model.to(device)           # parameters become StandinTensor (tied weights stay tied)
    x = torch.zeros(3, device=device)  # factories with device= give stand-in tensors
    model(torch.zeros(3, dtype=torch.long))  # DeviceMixError: aten.embedding.default mixes standin:0 and cpu

How it is built (and why not the alternatives, on a CPU-only torch build):

- The device is PrivateUse1, renamed "standin", with torch's Python backend hooks
  (`torch.utils.backend_registration._setup_privateuseone_for_python_backend`): its device guard is what lets
  autograd, the optimizers' foreach kernels and streams (`torch.Stream`, `torch.Event`, `record_stream`) run.
  A tensor that reports `cuda` cannot: autograd's input metadata, Python indexing (`x[None]`) and `F.embedding`
  look up the CUDA device guard, which a CPU build lacks, and abort the process. So the stand-in is not "cuda":
  `device.type == "cuda"` branches (pinned memory, Triton kernels, bf16 autocast) take their non-CUDA path.
- `StandinTensor` is a `__torch_dispatch__` wrapper subclass holding a CPU tensor (`_data`): every aten op
  reaches `__torch_dispatch__`, which checks the devices of its tensor arguments, runs the op on the CPU data and
  wraps the results. Values are real, so data-dependent control flow (a decode loop's stop test) runs;
  `FakeTensorMode` has no values and the `meta` device neither.
- Factories with `device=standin` reach the backend's `empty` / `empty_strided` kernels registered here (every
  other factory is `empty` + an in-place fill), so `torch.zeros(n, device=device)`, `torch.arange`,
  `torch.tensor(..., device=)` and `tensor.to(device)` give stand-in tensors with no mode to enter (a mode would
  be thread-local, and autograd runs backward on its own device thread).

What it checks: every op's tensor arguments are stand-in tensors, with CUDA's two exceptions — a 0-dim CPU tensor
as an operand (CUDA's "CPU scalar" rule; not as the tensor an in-place op writes) and CPU index tensors in
advanced indexing (`x[cpu_index]`, `x[cpu_index] = v`), which CUDA copies over itself. Copies across devices
(`.to()`, `.cpu()`, `copy_`) are allowed and counted: `recording()` gives the number of device-to-host reads
(`.item()`, `.tolist()`, `bool(t)`, `.cpu()`) and of `record_stream` calls. What it cannot check: stream
ordering (the backend's streams are one synchronous queue, so a missing `wait_event` goes unnoticed), memory,
kernels that exist only on CUDA (Triton, flash-attn), and anything that tests `device.type == "cuda"` on purpose.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.utils._python_dispatch import return_and_correct_aliasing
from torch.utils._pytree import tree_flatten, tree_map_only

STANDIN = "standin"
"""The stand-in device's type name (the renamed PrivateUse1 backend)."""

aten = torch.ops.aten

# Ops that copy across devices by design: the device check does not apply, the result's device is the target's.
_COPIES = {
    aten._to_copy.default,
    aten.copy_.default,
    aten._copy_from.default,
    aten._copy_from_and_resize.default,
}
# Advanced indexing: CUDA moves CPU index tensors to the device itself (TensorAdvancedIndexing's make_info).
_INDEXING = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
    aten._unsafe_index.Tensor,
    aten._unsafe_index_put.default,
}
# Ops that read a device value on the host: a device-to-host sync on a GPU.
_HOST_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}


class DeviceMixError(RuntimeError):
    """An op got stand-in and CPU tensors together (CUDA raises "Expected all tensors to be on the same
    device")."""


@dataclass
class Recording:
    """What the stand-in saw while `recording()` was open."""

    host_reads: int = 0  # device values read on the host (.item(), .tolist(), bool(t), .cpu(), copy to CPU)
    record_streams: int = 0  # tensor.record_stream(stream) calls on stand-in tensors


_LOCK = threading.Lock()
_RECORDINGS: list[Recording] = []


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Counts host reads and `record_stream` calls on stand-in tensors (every thread: autograd's included)."""
    rec = Recording()
    with _LOCK:
        _RECORDINGS.append(rec)
    try:
        yield rec
    finally:
        with _LOCK:
            _RECORDINGS.remove(rec)


def _note(field: str) -> None:
    with _LOCK:
        for rec in _RECORDINGS:
            setattr(rec, field, getattr(rec, field) + 1)


_REGISTERED: list[Any] = []  # the backend's kernel library, kept alive for the process


def standin_device(index: int = 0) -> torch.device:
    """The stand-in device, `standin:<index>` (only index 0 exists); registers the backend on first use.

    Raises RuntimeError when this process already named its PrivateUse1 backend otherwise (it can be named once).
    """
    if index != 0:
        raise ValueError(f"the stand-in device has one index, 0 (got {index})")
    name = torch._C._get_privateuse1_backend_name()
    if not _REGISTERED:
        if not hasattr(torch._C, "_acc"):
            raise RuntimeError(
                f"the stand-in device needs torch's Python backend hooks (torch._C._acc), which torch "
                f"{torch.__version__} lacks: install the torch the Makefile pins (make setup)"
            )
        if name not in ("privateuseone", STANDIN):
            raise RuntimeError(
                f"this process's PrivateUse1 backend is already named {name!r}: the stand-in device needs it "
                f"as {STANDIN!r}; run stand-in tests in a process without that backend"
            )
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        if name != STANDIN:
            _setup_privateuseone_for_python_backend(STANDIN, backend_module=_StandinModule())
        lib = torch.library.Library("aten", "IMPL")  # kernels for the existing aten ops, on this backend only
        lib.impl("empty.memory_format", _empty, "PrivateUse1")
        lib.impl("empty_strided", _empty_strided, "PrivateUse1")
        # torch.tensor(data, device=) copies below the Python dispatch key: the backend's own copy kernel
        lib.impl("_copy_from", _copy_from, "PrivateUse1")
        for factory in _RESIZING_FACTORIES:
            lib.impl(factory, _cpu_factory(factory), "PrivateUse1")
        _REGISTERED.append(lib)
    return torch.device(STANDIN, index)


class _StandinModule:
    """`torch.standin`: what torch asks of a backend's module — seeding, RNG states (activation checkpointing
    saves and restores them around its recompute), autocast's dtypes. The stand-in draws its random numbers from
    the CPU generator, so its RNG state is the CPU's."""

    class device:  # torch looks it up by this name (as torch.cuda.device)
        def __init__(self, index: Any) -> None:
            del index

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    def is_available(self) -> bool:
        # False: the stand-in is a device a test names, never one a library detects. `torch.accelerator.
        # is_available()` asks this; were it true, code that picks its device that way (peft's `infer_device`
        # since 0.22, loading an adapter) would put its tensors on the stand-in in any later test of the process.
        return False

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed(self, seed: int) -> None:
        del seed  # torch.manual_seed seeds the CPU generator, the stand-in's

    def manual_seed_all(self, seed: int) -> None:
        del seed

    def get_rng_state(self, device: Any = None) -> Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    def synchronize(self, device: Any = None) -> None:
        return None  # every op has run when it returns


def _empty(
    size: list[int],
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
    device: torch.device | None = None,
    pin_memory: bool | None = None,
    memory_format: torch.memory_format | None = None,
) -> Tensor:
    del layout, device, pin_memory
    data = torch.empty(size, dtype=dtype, memory_format=memory_format or torch.contiguous_format)
    return StandinTensor(data)


def _empty_strided(
    size: list[int],
    stride: list[int],
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
    device: torch.device | None = None,
    pin_memory: bool | None = None,
) -> Tensor:
    del layout, device, pin_memory
    return StandinTensor(torch.empty_strided(size, stride, dtype=dtype))


# Factories whose composite kernel resizes an empty out= tensor (the wrapper's shape could not follow): run on the
# CPU and wrapped whole instead.
_RESIZING_FACTORIES = (
    "arange",
    "arange.start",
    "arange.start_step",
    "eye",
    "eye.m",
    "tril_indices",
    "triu_indices",
)


def _cpu_factory(name: str) -> Any:
    packet, _, overload = name.partition(".")
    op = getattr(getattr(aten, packet), overload or "default")

    def kernel(*args: Any, **kwargs: Any) -> Tensor:
        return StandinTensor(op(*args, **{**kwargs, "device": torch.device("cpu")}))

    return kernel


def _copy_from(src: Tensor, dst: Tensor, non_blocking: bool = False) -> Tensor:
    cpu_src = src._data if isinstance(src, StandinTensor) else src
    if isinstance(dst, StandinTensor):
        dst._data.copy_(cpu_src)
        return dst
    _note("host_reads")
    return dst.copy_(cpu_src)


def _is_standin_device(device: Any) -> bool:
    return device is not None and torch.device(device).type == STANDIN


class StandinTensor(Tensor):
    """A tensor on the stand-in device: its values are `_data`, a CPU tensor of the same shape and strides."""

    _data: Tensor
    DEVICE: ClassVar[str] = f"{STANDIN}:0"
    # no torch-function layer: results are wrapped (or not) by __torch_dispatch__ alone, so `.cpu()` is plain
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, data: Tensor, requires_grad: bool = False) -> StandinTensor:
        if isinstance(data, StandinTensor):  # nn.Parameter.__deepcopy__ re-wraps a clone
            data = data._data
        assert data.device.type == "cpu", data.device
        out = Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            layout=data.layout,
            device=torch.device(STANDIN, 0),
            requires_grad=requires_grad,
        )
        out._data = data
        return out  # type: ignore[no-any-return]

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"StandinTensor({self._data!r})"

    def tolist(self) -> Any:
        """A host read, as on a GPU (torch refuses `tolist` on subclasses, so it is spelled out here)."""
        _note("host_reads")
        return self._data.tolist()

    def untyped_storage(self) -> torch.UntypedStorage:
        """The CPU data's storage: what storage identity (tied weights counted once) and sizes are read from."""
        return self._data.untyped_storage()

    def __reduce_ex__(self, protocol: Any) -> Any:  # type: ignore[override]
        # pickled (torch.save) as its CPU data: a checkpoint loads as `map_location="cpu"` loads a CUDA one
        return self._data.__reduce_ex__(protocol)

    # the traceable-wrapper-subclass protocol: nn.Module._apply swaps parameters in place (ties kept)
    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, Tensor], meta: None, outer_size: Any, outer_stride: Any
    ) -> StandinTensor:
        return StandinTensor(inner["_data"])

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _COPIES:
            return _copy(func, args, kwargs)
        if func is aten.record_stream.default:
            _note("record_streams")
            return None
        _check_devices(func, args, kwargs)
        if func in _HOST_READS:
            _note("host_reads")
        target = kwargs.get("device")
        to_cpu = target is not None and not _is_standin_device(target)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        cpu_args, cpu_kwargs = tree_map_only(StandinTensor, _unwrap, (args, kwargs))
        out = func(*cpu_args, **cpu_kwargs)
        if to_cpu:
            return out
        wrapped = tree_map_only(Tensor, StandinTensor, out)
        result = return_and_correct_aliasing(func, args, kwargs, wrapped)  # in-place views fix their metadata
        for argument, value in _arguments(func._schema, args, kwargs):
            written = argument.alias_info is not None and argument.alias_info.is_write
            if written and isinstance(value, StandinTensor) and value.shape != value._data.shape:
                raise RuntimeError(
                    f"stand-in device: {func} resized its {argument.name!r} tensor from {tuple(value.shape)} to "
                    f"{tuple(value._data.shape)}, which a wrapper tensor cannot follow; pass an out= tensor of "
                    "the result's shape (or add the factory to standin._RESIZING_FACTORIES)"
                )
        return result


def _unwrap(t: StandinTensor) -> Tensor:
    return t._data


def _copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`.to()`, `.cpu()`, `copy_`: across devices by design; a copy onto the host is a host read."""
    if func is aten._to_copy.default:
        (src,) = args
        target = kwargs.get("device")
        cpu_kwargs = {**kwargs, "device": torch.device("cpu")} if "device" in kwargs else kwargs
        data = func(src._data, **cpu_kwargs)
        if target is not None and not _is_standin_device(target):
            _note("host_reads")
            return data
        return StandinTensor(data)
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
    else:  # _copy_from(src, dst): the backend-to-backend copy of some kernels
        src, dst = args[0], args[1]
    cpu_src = _unwrap(src) if isinstance(src, StandinTensor) else src
    if isinstance(dst, StandinTensor):
        dst._data.copy_(cpu_src)
        return dst
    _note("host_reads")
    return dst.copy_(cpu_src)


def _check_devices(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise DeviceMixError when `func` gets a CPU tensor besides stand-in ones (CUDA's exceptions allowed)."""
    schema = func._schema
    for argument, value in _arguments(schema, args, kwargs):
        name = argument.name
        indices = func in _INDEXING and name == "indices"
        written = argument.alias_info is not None and argument.alias_info.is_write
        for tensor in tree_flatten(value)[0]:
            if not isinstance(tensor, Tensor) or isinstance(tensor, StandinTensor):
                continue
            if indices and tensor.device.type == "cpu":
                continue
            if tensor.dim() == 0 and tensor.device.type == "cpu" and not written:
                continue
            raise DeviceMixError(
                f"{func} mixes {StandinTensor.DEVICE} and {tensor.device} tensors (argument {name!r}, a "
                f"{tensor.device} tensor of shape {tuple(tensor.shape)}); CUDA raises 'Expected all tensors to "
                "be on the same device' here: create that tensor with device= the model's device or move it "
                "with .to(device)"
            )


def _arguments(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """(schema argument, value) of every argument given, positional or keyword."""
    by_name = {argument.name: argument for argument in schema.arguments}
    for argument, value in zip(schema.arguments, args, strict=False):
        yield argument, value
    for name, value in kwargs.items():
        yield by_name[name], value
