"""Splitting a mini-batch over data-parallel groups and micro-batches, balanced by token cost.

The cost model, Karmarkar–Karp and the micro-batch weighting live in `rlhfuse.core.balance` (the one balancer
module); this module applies them to a `TrainBatch` for the pipeline strategies and re-exports them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from rlhfuse.core.balance import (
    batch_costs,
    imbalance,
    karmarkar_karp,
    microbatch_weights,
    sample_costs,
)
from rlhfuse.core.types import TrainBatch

__all__ = [
    "budget_microbatches",
    "imbalance",
    "karmarkar_karp",
    "microbatch_imbalance",
    "microbatch_weights",
    "sample_costs",
    "split_minibatch",
]


def budget_microbatches(lengths: Sequence[int], dp: int, tokens: int, multiple: int = 1) -> int:
    """Micro-batches per data-parallel group for a token budget: ceil(tokens per group / budget), rounded up to
    a multiple of `multiple` (the smaller model's replicas), at most what the mini-batch can fill (every
    micro-batch holds a sample). The budget is met on average: Karmarkar-Karp then balances the micro-batches
    by cost, it does not cap each one."""
    if tokens <= 0:
        raise ValueError(f"token budget {tokens} must be > 0")
    cap = len(lengths) // dp // multiple * multiple
    if cap < multiple:
        raise ValueError(
            f"a mini-batch of {len(lengths)} samples cannot fill {dp} data-parallel groups x {multiple} replicas "
            "with one sample per micro-batch: raise data.mini_batch_size"
        )
    wanted = max(1, math.ceil(sum(lengths) / dp / tokens))
    return min(math.ceil(wanted / multiple) * multiple, cap)


def microbatch_imbalance(micro: Sequence[Sequence[TrainBatch]], attention_tokens: float = 1024.0) -> float:
    """Largest micro-batch cost / mean micro-batch cost - 1, over every group (0 = perfect)."""
    totals = [sum(batch_costs(m, attention_tokens)) for g in micro for m in g]
    mean = sum(totals) / len(totals)
    return max(totals) / mean - 1.0 if mean > 0 else 0.0


def split_minibatch(
    batch: TrainBatch,
    dp: int,
    microbatches: int,
    *,
    balance: bool = True,
    attention_tokens: float = 1024.0,
    loss_reduction: str = "token",
) -> tuple[list[list[TrainBatch]], list[list[float]], float]:
    """Micro-batches per data-parallel group, their loss weights, and the group imbalance.

    Weights are each micro-batch's share of the mini-batch's response tokens (token-mean losses) or samples
    (sequence-mean), so the weighted sum of micro-batch losses is the mini-batch loss whatever the split.
    """
    n = len(batch)
    if n < dp * microbatches:
        raise ValueError(
            f"a mini-batch of {n} samples cannot fill dp * microbatches = {dp} * {microbatches} = "
            f"{dp * microbatches} micro-batches: raise data.mini_batch_size or lower data.micro_batch_size"
        )
    costs = batch_costs(batch, attention_tokens)
    if balance:
        groups = karmarkar_karp(costs, dp)
        micro_index = [
            [
                [groups[g][i] for i in part]
                for part in karmarkar_karp([costs[i] for i in groups[g]], microbatches)
            ]
            for g in range(dp)
        ]
        skew = imbalance(costs, groups)
    else:
        chunks = [c.tolist() for c in torch.arange(n).tensor_split(dp * microbatches)]
        micro_index = [chunks[g * microbatches : (g + 1) * microbatches] for g in range(dp)]
        skew = imbalance(costs, [[i for part in m for i in part] for m in micro_index])
    micro = [[batch.select(torch.tensor(idx)) for idx in micro_index[g]] for g in range(dp)]
    weights = [microbatch_weights(group, batch, loss_reduction) for group in micro]
    return micro, weights, skew
