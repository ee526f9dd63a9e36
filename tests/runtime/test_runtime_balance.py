"""Sequence-length load balancing: Karmarkar-Karp partitions and mini-batch splits whose weights sum to one."""

from __future__ import annotations

import random

import pytest
from runtime_helpers import random_batch

from rlhfuse.runtime.batch_split import imbalance, karmarkar_karp, sample_costs, split_minibatch


def test_costs_grow_with_attention() -> None:
    assert sample_costs([10, 100], attention_tokens=100) == [11.0, 200.0]


def test_karmarkar_karp_hand_example() -> None:
    # {8,7,6,5,4}: KK pairs 8-7 and 6-5 first and reaches 16 / 14 (the optimum is 15 / 15: KK is a heuristic)
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2)
    totals = sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts)
    assert totals == [14, 16]
    assert sorted(i for p in parts for i in p) == [0, 1, 2, 3, 4]


def test_karmarkar_karp_beats_contiguous_chunks_on_long_tails() -> None:
    rng = random.Random(0)
    for _ in range(20):
        lengths = [int(rng.lognormvariate(3, 1)) + 1 for _ in range(64)]
        costs = sample_costs(lengths)
        parts = karmarkar_karp(costs, 4)
        assert sorted(i for p in parts for i in p) == list(range(64)) and all(parts)
        chunks = [list(range(k, k + 16)) for k in range(0, 64, 16)]
        assert imbalance(costs, parts) <= imbalance(costs, chunks) + 1e-12
        assert imbalance(costs, parts) < 0.05


def test_karmarkar_karp_never_leaves_a_part_empty() -> None:
    parts = karmarkar_karp([1000.0, 1.0, 1.0, 1.0], 3)
    assert all(parts) and sorted(i for p in parts for i in p) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="cannot split 2 samples into 3"):
        karmarkar_karp([1.0, 2.0], 3)


@pytest.mark.parametrize("balance", [True, False])
@pytest.mark.parametrize("reduction", ["token", "sequence"])
def test_split_covers_every_sample_once_with_weights_summing_to_one(balance: bool, reduction: str) -> None:
    batch = random_batch(13, seed=3)
    micro, weights, skew = split_minibatch(batch, 2, 3, balance=balance, loss_reduction=reduction)
    assert len(micro) == 2 and all(len(m) == 3 for m in micro)
    assert sum(sum(w) for w in weights) == pytest.approx(1.0)
    rows = sorted(tuple(r.tolist()) for g in micro for m in g for r in m.input_ids_BT[:, :5])
    assert rows == sorted(tuple(r.tolist()) for r in batch.input_ids_BT[:, :5])
    assert skew >= 0
    with pytest.raises(ValueError, match=r"dp \* microbatches = 2 \* 7 = 14"):
        split_minibatch(batch, 2, 7)


def test_token_budget_sets_the_micro_batch_count() -> None:
    from rlhfuse.runtime.batch_split import budget_microbatches

    lengths = [10] * 12  # 120 tokens
    assert budget_microbatches(lengths, 1, 40) == 3
    assert budget_microbatches(lengths, 1, 41) == 3  # ceil(120 / 41) = 3
    assert budget_microbatches(lengths, 2, 40) == 2  # 60 tokens per group
    assert budget_microbatches(lengths, 1, 40, multiple=2) == 4  # rounded up to the replicas
    assert budget_microbatches(lengths, 1, 1) == 12  # never more micro-batches than samples
    assert budget_microbatches(lengths, 1, 1, multiple=5) == 10
    assert budget_microbatches(lengths, 1, 10_000) == 1
    with pytest.raises(ValueError, match="cannot fill 4 data-parallel groups x 4 replicas"):
        budget_microbatches(lengths, 4, 40, multiple=4)


def test_microbatch_imbalance_is_largest_over_mean() -> None:
    from rlhfuse.runtime.batch_split import microbatch_imbalance, sample_costs

    batch = random_batch(8, seed=3)
    micro, _, _ = split_minibatch(batch, 2, 2, balance=False)
    costs = [sum(sample_costs(m.attention_mask_BT.sum(dim=1).tolist())) for g in micro for m in g]
    assert microbatch_imbalance(micro) == pytest.approx(max(costs) / (sum(costs) / 4) - 1)
    balanced, _, _ = split_minibatch(batch, 2, 2)
    assert 0 <= microbatch_imbalance(balanced) <= microbatch_imbalance(micro)
