"""`split_consecutive`: the one cut behind the gradient buckets and the streamed weight sync."""

import pytest

from rlhfuse.core.buckets import split_consecutive


def test_runs_stay_under_the_cap_in_order_and_a_larger_item_stands_alone() -> None:
    sizes = [3, 4, 2, 9, 1, 1, 5]
    runs = split_consecutive(sizes, 7)
    assert [list(r) for r in runs] == [[0, 1], [2], [3], [4, 5, 6]]
    assert [i for r in runs for i in r] == list(range(len(sizes)))  # every item once, in order
    assert all(sum(sizes[i] for i in r) <= 7 or len(r) == 1 for r in runs)
    assert split_consecutive([], 5) == []
    assert split_consecutive([1, 1, 1], 10**9) == [range(3)]


def test_a_change_of_kind_ends_a_run() -> None:
    runs = split_consecutive([1, 1, 1, 1], 10, kinds=["f32", "f32", "bf16", "bf16"])
    assert runs == [range(0, 2), range(2, 4)]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="bucket size must be > 0"):
        split_consecutive([1], 0)
    with pytest.raises(ValueError, match="2 kinds for 3 sizes"):
        split_consecutive([1, 1, 1], 4, kinds=["a", "b"])
