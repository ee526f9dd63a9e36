"""Load balancing as pure functions of sample lengths and costs: one module for every split in rlhfuse.

- `sample_costs`: the cost of a sample, its tokens plus the attention term (tokens² / `attention_tokens`), the
  shape of a transformer's FLOPs (linear layers ∝ tokens, attention ∝ tokens²);
- `karmarkar_karp`: parts of near-equal total cost (multi-way largest differencing): data-parallel shares and
  micro-batches of training (`rlhfuse.runtime.batch_split.split_minibatch`, `PlainStrategy.share`);
- `least_loaded`: each item, in order, to the currently least-loaded part: prompt groups over generation
  instances (`rlhfuse.generation.coordinator.balance`);
- `assign_rows`: inference rows sorted by length and dealt in snake order over groups and replicas, so every
  micro-batch holds rows of similar length (`rlhfuse.trainer.strategies.pipelines.inference`);
- `microbatch_weights`: the one loss weighting of micro-batches (their share of the mini-batch's response
  tokens, or samples), so the weighted sum of micro-batch losses is the mini-batch loss whatever the split.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch
from torch import Tensor

from rlhfuse.core.types import TrainBatch


def sample_costs(lengths: Sequence[int], attention_tokens: float = 1024.0) -> list[float]:
    """Cost per sample: tokens + tokens² / attention_tokens."""
    return [float(n) + float(n) * float(n) / attention_tokens for n in lengths]


def batch_costs(batch: TrainBatch, attention_tokens: float = 1024.0) -> list[float]:
    """`sample_costs` of every row of `batch` (its sequence lengths)."""
    return sample_costs(batch.host_lengths(), attention_tokens)


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


def least_loaded(costs: Sequence[float], parts: int, loads: Sequence[float] | None = None) -> list[list[int]]:
    """Indices of `costs`, in order, each to the part with the least cost so far (ties: lower part index);
    `loads`: what each part holds already (default nothing)."""
    shares: list[list[int]] = [[] for _ in range(parts)]
    loads = [0.0] * parts if loads is None else [float(x) for x in loads]
    for i, c in enumerate(costs):
        target = min(range(parts), key=lambda p: (loads[p], p))
        shares[target].append(i)
        loads[target] += c
    return shares


def imbalance(costs: Sequence[float], parts: Sequence[Sequence[int]]) -> float:
    """max part cost / mean part cost - 1 (0 = perfect)."""
    totals = [sum(costs[i] for i in p) for p in parts]
    mean = sum(totals) / len(totals)
    return max(totals) / mean - 1.0 if mean > 0 else 0.0


def split_rows(n: int, parts: int) -> list[Tensor]:
    """Positions of `parts` contiguous non-empty chunks of n rows. With n < parts, positions run past n
    (position p stands for row p % n); callers keep only positions < n."""
    return list(torch.arange(max(n, parts)).tensor_split(parts))


def assign_rows(
    lengths_B: Tensor, dp: int, microbatches: int, replicas: int
) -> list[list[tuple[Tensor, Tensor]]]:
    """out[g][i] = (row indices, first-copy mask) of micro-batch i of data-parallel group g.

    Rows are sorted by response length and cut into dp * M chunks of near-equal count, dealt in length order to
    the groups and, inside a group, to the K replicas of the smaller model, every other round in reverse (0 1 1 0
    ...), so every group and replica gets short and long rows alike, while each micro-batch holds rows of similar
    length (it is then trimmed to its own longest response: less padding computed).
    """
    n = len(lengths_B)
    order = torch.argsort(lengths_B.cpu(), stable=True)
    per = microbatches // replicas
    out: list[list[tuple[Tensor, Tensor]]] = [[] for _ in range(dp)]
    slots: list[dict[int, tuple[Tensor, Tensor]]] = [{} for _ in range(dp)]

    def snake(c: int, ways: int) -> tuple[int, int]:  # deal in rounds, every other round reversed: 0 1 | 1 0
        rnd, k = divmod(c, ways)
        return (k if rnd % 2 == 0 else ways - 1 - k), rnd

    for c, pos in enumerate(split_rows(n, dp * microbatches)):
        g, c2 = snake(c, dp)
        replica, slot = snake(c2, replicas)
        slots[g][replica * per + slot] = (order[pos % n], pos < n)
    for g in range(dp):
        out[g] = [slots[g][i] for i in range(microbatches)]
    return out


def microbatch_weights(
    micro: Sequence[TrainBatch], batch: TrainBatch, loss_reduction: str = "token"
) -> list[float]:
    """Loss weight of each micro-batch of `batch`: its share of the mini-batch's response tokens (`token`-mean
    losses) or of its samples (`sequence`-mean)."""
    if loss_reduction == "token":  # counted on the host masks (no device read when the batches carry them)
        total_tokens = float(max(batch.host_response_tokens(), 1))
        return [m.host_response_tokens() / total_tokens for m in micro]
    return [len(m) / len(batch) for m in micro]
