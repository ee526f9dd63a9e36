"""The migration decision: hand-derived cases and invariants."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlhfuse.planner import (
    choose_mechanism,
    decide_migration,
    destination_count,
    should_migrate,
    threshold_from_fraction,
)


def test_speed_rule_picks_ceil_rt_over_bs_max():
    d = decide_migration([5, 0, 3, 1], bs_max=4, kv_bytes_per_sample=1.0, free_kv_bytes=100.0)
    assert (d.m, d.m_speed, d.m_memory) == (3, 3, 1)
    assert d.destinations == (0, 2, 3)  # most unfinished first
    assert d.moves == ()  # instance 1 has nothing to move
    assert d.loads == (5, 3, 1)


def test_consolidate_to_one_instance_when_the_tail_is_small():
    d = decide_migration([10, 2, 2, 2], bs_max=100, kv_bytes_per_sample=1.0, free_kv_bytes=100.0)
    assert d.m == 1 and d.destinations == (0,)
    assert d.moves == ((1, 0, 2), (2, 0, 2), (3, 0, 2))
    assert d.loads == (16,) and d.moved == 6


def test_memory_rule_can_dominate():
    # 16 samples x 10 bytes at max length into 50 bytes per instance: ceil(160 / 50) = 4
    assert destination_count(16, bs_max=100, kv_bytes_per_sample=10.0, free_kv_bytes=50.0) == (4, 1, 4)


def test_m_is_capped_by_the_instance_count_and_zero_when_nothing_remains():
    d = decide_migration([3, 3], bs_max=1, kv_bytes_per_sample=1.0, free_kv_bytes=1.0)
    assert d.m == 2 and d.moves == ()
    assert destination_count(0, 4, 1.0, 1.0) == (0, 0, 0)


@given(st.lists(st.integers(0, 40), min_size=1, max_size=24), st.integers(1, 64), st.floats(0.1, 10.0))
def test_every_unfinished_sample_lands_on_a_destination(counts, bs_max, kv):
    d = decide_migration(counts, bs_max=bs_max, kv_bytes_per_sample=kv, free_kv_bytes=20.0)
    total = sum(counts)
    assert sum(d.loads) == total
    if total:
        # m is the fewest instances meeting both rules (speed: batch <= BSmax; memory: KV fits), capped at n
        def meets(m):
            return m * bs_max >= total and m * 20.0 >= total * kv * (1 - 1e-12)

        assert d.m == len(counts) or meets(d.m)
        assert d.m == 1 or not meets(d.m - 1)
        # destinations hold the most unfinished samples: nobody left out has more than a destination
        outside = [c for i, c in enumerate(counts) if i not in d.destinations]
        assert not outside or max(outside) <= min(counts[i] for i in d.destinations)
        # each source is emptied, and only sources send
        sent = {}
        for src, dst, c in d.moves:
            assert src not in d.destinations and dst in d.destinations
            sent[src] = sent.get(src, 0) + c
        assert all(sent.get(i, 0) == c for i, c in enumerate(counts) if i not in d.destinations)


def test_trigger_and_mechanism_and_threshold():
    assert should_migrate(100, 102) and should_migrate(102, 102)
    assert not should_migrate(103, 102) and not should_migrate(0, 102)
    assert choose_mechanism(0.1, 0.2) == "kv"
    assert choose_mechanism(0.3, 0.2) == "reprefill"
    assert threshold_from_fraction(0.2, 512) == 102
    with pytest.raises(ValueError, match="fraction"):
        threshold_from_fraction(1.0, 512)
    with pytest.raises(ValueError, match="bs_max"):
        destination_count(5, 0, 1.0, 1.0)


def test_kv_read_rule_spreads_a_heavy_tail():
    counts = [6, 2, 2, 2]
    paper = decide_migration(counts, bs_max=100, kv_bytes_per_sample=1.0, free_kv_bytes=100.0)
    assert paper.m == 1 and paper.m_read == 0
    # 12 samples holding 300 bytes of KV now; a destination may read 100 per step: ceil(300 / 100) = 3
    ours = decide_migration(
        counts,
        bs_max=100,
        kv_bytes_per_sample=1.0,
        free_kv_bytes=100.0,
        kv_read_bytes=300.0,
        kv_read_budget=100.0,
    )
    assert (ours.m, ours.m_read) == (3, 3)
    assert sum(ours.loads) == 12
    with pytest.raises(ValueError, match="kv_read_budget"):
        decide_migration(counts, 100, 1.0, 100.0, kv_read_bytes=1.0, kv_read_budget=0.0)
