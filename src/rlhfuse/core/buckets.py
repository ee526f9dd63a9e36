"""Consecutive groups of bounded size: how the gradient reduction (`rlhfuse.distributed.buckets`) and the weight
sync (`Strategy.actor_weight_buckets`) cut a model's tensors. Pure: sizes in, index ranges out."""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def split_consecutive(sizes: Sequence[int], cap: int, kinds: Sequence[Hashable] | None = None) -> list[range]:
    """`range(len(sizes))` cut, in order, into runs whose sizes sum to at most `cap` (an item larger than `cap`
    is a run of its own); with `kinds`, a run also ends where the kind changes (a gradient bucket holds one
    dtype). Every rank cutting the same sizes gets the same runs."""
    if cap <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {cap}")
    if kinds is not None and len(kinds) != len(sizes):
        raise ValueError(f"{len(kinds)} kinds for {len(sizes)} sizes")
    runs: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        other_kind = kinds is not None and i > start and kinds[i] != kinds[start]
        if i > start and (other_kind or total + size > cap):
            runs.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        runs.append(range(start, len(sizes)))
    return runs
