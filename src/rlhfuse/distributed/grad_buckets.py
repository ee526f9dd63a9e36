"""Data-parallel gradient reduction in buckets, overlapped with backward (as DDP's and Megatron's reducers do).

`plan_buckets` (pure): the parameters, in the order their gradients become final (each backward pass's
parameters in reverse module order, the passes in the order they run: the Actor's loss, then the Critic's), cut
into buckets of at most `cap_bytes` of one dtype; a parameter larger than the cap is a bucket of its own.

`GradReducer` runs that plan for one process group. `arm()` before the backward that finishes the gradients
(the last micro-batch's): every parameter's post-accumulate hook counts down its bucket, and a bucket whose
gradients are all final is copied into its own persistent buffer and all-reduced asynchronously, so the sum of
the early buckets runs while the rest of the backward (and, in a fused schedule, the other model's work)
computes. Buckets are launched strictly in bucket order on every rank (a bucket that is ready early waits for
the ones before it), so every rank of the group issues the same collectives in the same order, as NCCL needs.
`finish()` launches whatever is left (a parameter that got no gradient is summed as zeros), `wait()` completes
the reductions and points each `.grad` at its slice of the summed buffer (no copy back). No buffer ever holds
more than one bucket: nothing concatenates a whole model's gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhfuse.core.buckets import split_consecutive
from rlhfuse.distributed.collectives import Work, all_reduce

DEFAULT_BUCKET_MB = 25.0  # DDP's bucket_cap_mb


@dataclass(frozen=True)
class Bucket:
    """Parameter indices (into the reducer's list) reduced together, and their element offsets in its buffer."""

    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: torch.dtype


def plan_buckets(params: Sequence[Tensor], cap_bytes: int) -> list[Bucket]:
    """Buckets of `params` (in the order their gradients become final) in launch order, each of one dtype and
    at most `cap_bytes` (a larger parameter alone)."""
    if cap_bytes <= 0:
        raise ValueError(f"gradient bucket size must be > 0 bytes, got {cap_bytes}")
    sizes = [p.numel() * p.element_size() for p in params]
    buckets: list[Bucket] = []
    for run in split_consecutive(sizes, cap_bytes, kinds=[p.dtype for p in params]):
        offsets = [0]
        for i in run:
            offsets.append(offsets[-1] + params[i].numel())
        buckets.append(Bucket(tuple(run), tuple(offsets[:-1]), offsets[-1], params[run[0]].dtype))
    return buckets


class GradReducer:
    """Sums the gradients of `passes` over `group` bucket by bucket (see the module docstring).

    passes: the parameters of each backward pass, in module order, the passes in the order they run (one model:
    `[model.parameters()]`); `wait_fn(work, what)` completes a launched reduction (the executor's bounded wait;
    default `work.wait()`)."""

    def __init__(
        self,
        passes: Sequence[Iterable[torch.nn.Parameter]],
        group: object,
        *,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        wait_fn: Callable[[Work, str], None] | None = None,
    ) -> None:
        self.params = [p for params in passes for p in reversed([p for p in params if p.requires_grad])]
        self.group = group
        self.buckets = plan_buckets(self.params, max(1, int(bucket_mb * 2**20)))
        self._owner = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.params}
        self._wait = wait_fn or (lambda work, _what: work.wait())
        self._buffers: list[Tensor | None] = [None] * len(self.buckets)
        self._works: list[Work] = []
        self._pending: list[int] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._next = 0  # the next bucket to launch
        self.launched_in_backward = 0  # buckets launched by hooks (the overlapped ones) in the last round

    def arm(self) -> None:
        """Count gradients from the next backward on: each completed bucket is launched (in order) at once."""
        self._disarm()
        self._pending = [len(b.params) for b in self.buckets]
        self._works, self._next, self.launched_in_backward = [], 0, 0
        for i, p in enumerate(self.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(i)))

    def _hook(self, index: int) -> Callable[[Tensor], None]:
        def ready(_param: Tensor) -> None:
            b = self._owner[index]
            self._pending[b] -= 1
            while self._next < len(self.buckets) and self._pending[self._next] == 0:
                self._launch(self._next)
                self.launched_in_backward += 1

        return ready

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        buffer = self._buffers[b]
        if buffer is None:
            device = self.params[bucket.params[0]].device
            buffer = self._buffers[b] = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
        for i, offset in zip(bucket.params, bucket.offsets, strict=True):
            p = self.params[i]
            piece = buffer[offset : offset + p.numel()]
            if p.grad is None:
                piece.zero_()
            elif p.grad.data_ptr() != piece.data_ptr():  # a .grad left pointing at the buffer needs no copy
                piece.copy_(p.grad.reshape(-1))
        self._works.append(all_reduce(buffer, group=self.group, async_op=True))
        self._pending[b] = -1  # launched
        self._next = b + 1

    def finish(self) -> None:
        """Launch every bucket not launched yet, in order (after the backward; `arm()` not called: all)."""
        self._disarm()
        if not self._pending:
            self._pending = [len(b.params) for b in self.buckets]
            self._works, self._next = [], 0
        while self._next < len(self.buckets):
            self._launch(self._next)

    def wait(self, what: str = "gradient reduction") -> None:
        """Complete the launched reductions; each `.grad` is then its slice of the summed bucket buffer."""
        for work in self._works:
            if work is not None:  # None: no process group (nothing to sum)
                self._wait(work, what)
        for bucket, buffer in zip(self.buckets, self._buffers, strict=True):
            assert buffer is not None, "wait() before finish()"
            for i, offset in zip(bucket.params, bucket.offsets, strict=True):
                p = self.params[i]
                p.grad = buffer[offset : offset + p.numel()].view_as(p)
        self._works, self._pending = [], []

    def _disarm(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
