"""`pipeline=fsdp`'s inference (`ShardedInference`): every rank infers its share of the rollout with the sharded
models in lockstep, row by row through a `RowInferencer` (the whole-model `ModelInferencer` is one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from rlhfuse import distributed
from rlhfuse.core.balance import karmarkar_karp, sample_costs
from rlhfuse.core.types import Experience, Rollout
from rlhfuse.models import Transformer


@runtime_checkable
class RowInferencer(Protocol):
    """What `ShardedInference` runs each rank's share of the rows with (`ModelInferencer` is one)."""

    actor: Transformer

    def groups(self, rollout: Rollout, rows: Sequence[int] | None = None) -> list[list[int]]: ...

    def infer_rows(
        self, rollout: Rollout, index_G: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]: ...

    def prefetch(self) -> None: ...

    def release(self) -> None: ...


class ShardedInference:
    """`pipeline=fsdp`'s inference stage: every rank holds the whole rollout (the generation instances gather
    it), infers its share (Karmarkar-Karp by sequence cost, as training splits a mini-batch) with the sharded
    models, and the shares are summed back into the rollout's rows on every rank (each row computed by exactly
    one rank, zeros elsewhere: the sum is exact).

    The sharded models' forwards gather each layer from every rank, so every rank runs as many forward passes:
    one with fewer groups of rows runs its last group again (its results dropped). The models are never whole on
    a rank, so the rollout's memory is the generation copy, its KV cache and one gathered layer at a time."""

    def __init__(self, inferencer: RowInferencer, group: Any) -> None:
        self.inferencer, self.group = inferencer, group

    def prefetch(self) -> None:
        self.inferencer.prefetch()

    def release(self) -> None:
        self.inferencer.release()

    @torch.no_grad()
    def infer(self, rollout: Rollout) -> Experience:
        world, rank = distributed.world_size(self.group), distributed.rank(self.group)
        lengths = rollout.attention_mask_BT.sum(dim=1).tolist()  # the generator's host copy: no device sync
        mine = karmarkar_karp(sample_costs(lengths), world)[rank] if len(rollout) >= world else []
        if len(rollout) < world and rank < len(rollout):
            mine = [rank]
        groups = self.inferencer.groups(rollout, mine)
        device = next(self.inferencer.actor.parameters()).device
        count = torch.tensor([float(len(groups))], dtype=torch.float64, device=device)
        distributed.all_reduce(count, op="max", group=self.group)
        rollout = rollout.to(device)
        out: list[Tensor] = []
        for i in range(int(count.item())):
            real = i < len(groups)
            rows = groups[i] if real else (groups[-1] if groups else [0])  # a repeat: dropped
            index_G = torch.tensor(rows, device=device)
            part = self.inferencer.infer_rows(rollout, index_G)
            if not out:
                out = [torch.zeros((len(rollout), *p.shape[1:]), dtype=p.dtype, device=device) for p in part]
            if real:
                for whole, piece in zip(out, part, strict=True):
                    whole[index_G] = piece
        return Experience(rollout, *sum_over_ranks(out, self.group))


def sum_over_ranks(tensors: Sequence[Tensor], group: Any) -> list[Tensor]:
    """`tensors` summed over the ranks of `group` in one all-reduce (flattened into one float64 buffer on
    their device, so that every dtype's values survive the sum exactly when one rank holds each)."""
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    distributed.all_reduce(flat, group=group)
    out, start = [], 0
    for t in tensors:
        out.append(flat[start : start + t.numel()].view(t.shape).to(t.dtype))
        start += t.numel()
    return out
