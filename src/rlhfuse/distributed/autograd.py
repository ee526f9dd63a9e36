"""Differentiable collectives for tensor parallelism (Megatron's conjugate pair), on the tensor's own device.

- `copy_to_group(x)`: identity forward; backward sums the gradient over the group (the input of a
  column-parallel layer: each rank's slice contributes part of the input's gradient).
- `reduce_from_group(x)`: sum over the group forward; identity backward (the output of a row-parallel layer, a
  vocabulary-parallel lookup or a partial sum: every rank then computes the same replicated result).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlhfuse.distributed.collectives import all_reduce


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        out = x.contiguous().clone()
        all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def copy_to_group(x: Tensor, group: Any = None) -> Tensor:
    out: Tensor = _CopyToGroup.apply(x, group)
    return out


def reduce_from_group(x: Tensor, group: Any = None) -> Tensor:
    out: Tensor = _ReduceFromGroup.apply(x, group)
    return out


def max_over_group(x: Tensor, group: Any = None) -> Tensor:
    """Elementwise max over the group, outside autograd (a shift for a stable log-sum-exp)."""
    out = x.detach().contiguous().clone()
    all_reduce(out, op="max", group=group)
    return out
