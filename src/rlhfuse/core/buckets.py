"""Consecutive groups of bounded size: how the gradient reduction (`rlhfuse.distributed.grad_buckets`) and the weight
sync (`Strategy.actor_weight_buckets`) cut a model's tensors (`split_consecutive`: sizes in, index ranges out),
and a LoRA Actor's merged projections cut that way for every strategy's sync (`merged_weight_buckets`)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence

from torch import Tensor, nn

from rlhfuse.models.lora import adapted_layers, merged_weights


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


def merged_weight_buckets(
    model: nn.Module, cap_bytes: int, groups: Iterable[Sequence[str]] | None = None
) -> Iterator[dict[str, Tensor]]:
    """An adapted `model`'s merged projections (`merged_weights`) in buckets: each group of adapted layer names
    (default: all of them, in order; a pipeline passes one group per stage) cut into runs of at most `cap_bytes`
    by whole shapes (the same on every rank, whether it holds a projection's weight, a DTensor shard of it or a
    meta tensor), each run merged when it is asked for."""
    layers = adapted_layers(model)
    for names in [list(layers)] if groups is None else groups:
        weights = [layers[n].get_base_layer().weight for n in names]
        for run in split_consecutive([w.numel() * w.element_size() for w in weights], cap_bytes):
            yield merged_weights(model, [names[i] for i in run])
