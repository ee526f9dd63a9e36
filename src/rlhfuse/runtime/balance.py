"""Splitting a mini-batch over data-parallel groups and micro-batches, balanced by token cost.

Cost of a sample: its tokens plus the attention term (tokens² / `attention_tokens`), the shape of a
transformer's FLOPs (linear layers ∝ tokens, attention ∝ tokens²). Karmarkar–Karp (largest differencing)
partitions the samples into groups of near-equal total cost; pure functions of lengths.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch

from rlhfuse.core.types import TrainBatch


def sample_costs(lengths: Sequence[int], attention_tokens: float = 1024.0) -> list[float]:
    """Cost per sample: tokens + tokens² / attention_tokens."""
    return [float(n) + float(n) * float(n) / attention_tokens for n in lengths]


def karmarkar_karp(costs: Sequence[float], parts: int) -> list[list[int]]:
    """Partition indices into `parts` non-empty sets of near-equal cost (multi-way largest differencing).

    Needs len(costs) >= parts. Each set is returned sorted; sets are ordered by decreasing cost.
    """
    if parts < 1 or len(costs) < parts:
        raise ValueError(f"cannot split {len(costs)} samples into {parts} non-empty parts")
    # each heap entry: (-spread, tie, [(cost, indices)] * parts sorted by cost descending)
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for i, c in enumerate(costs):
        part = [(float(c), [i])] + [(0.0, []) for _ in range(parts - 1)]
        heapq.heappush(heap, (-float(c), i, part))
    tie = len(costs)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # combine the largest of one with the smallest of the other
        merged = [(a[j][0] + b[parts - 1 - j][0], a[j][1] + b[parts - 1 - j][1]) for j in range(parts)]
        merged.sort(key=lambda x: -x[0])
        tie += 1
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
    result = [sorted(idx) for _, idx in heap[0][2]]
    if any(not r for r in result):
        # KK may leave a part empty when a few samples dominate: move one sample from the fullest part
        for r in result:
            if not r:
                donor = max(result, key=len)
                r.append(donor.pop())
        result = [sorted(r) for r in result]
    return result


def imbalance(costs: Sequence[float], parts: Sequence[Sequence[int]]) -> float:
    """max part cost / mean part cost - 1 (0 = perfect)."""
    totals = [sum(costs[i] for i in p) for p in parts]
    mean = sum(totals) / len(totals)
    return max(totals) / mean - 1.0 if mean > 0 else 0.0


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
    totals = [
        sum(sample_costs(m.attention_mask_BT.sum(dim=1).tolist(), attention_tokens)) for g in micro for m in g
    ]
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
    lengths = batch.attention_mask_BT.sum(dim=1).tolist()
    costs = sample_costs(lengths, attention_tokens)
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
    total_tokens = float(batch.response_mask_BR.sum().clamp(min=1))
    micro: list[list[TrainBatch]] = []
    weights: list[list[float]] = []
    for g in range(dp):
        micro.append([batch.select(torch.tensor(idx)) for idx in micro_index[g]])
        if loss_reduction == "token":
            weights.append([float(m.response_mask_BR.sum()) / total_tokens for m in micro[g]])
        else:
            weights.append([len(m) / n for m in micro[g]])
    return micro, weights, skew
