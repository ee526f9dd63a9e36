"""`rlhfuse-plan sensitivity`: each assumed input moved alone, the grid planned again, the ratio bands."""

from __future__ import annotations

import dataclasses

import pytest

from rlhfuse.planner.sensitivity import VARIATIONS, GridInputs, Variation, sensitivity, sensitivity_table


def test_each_variation_changes_only_its_input():
    base = GridInputs()
    for v in VARIATIONS:
        x = v.change(base)
        assert x != base, v
        changed = {f.name for f in dataclasses.fields(x) if getattr(x, f.name) != getattr(base, f.name)}
        assert len(changed) == 1, (v, changed)


def test_bands_move_with_the_input_and_infeasible_cells_are_named():
    slow_decode = next(
        v for v in VARIATIONS if v.name == "decode memory-bandwidth efficiency" and v.value == "0.5"
    )
    huge = Variation(
        "batch per generation instance", "x4", lambda x: dataclasses.replace(x, global_batch=2048)
    )
    bands = sensitivity(
        (slow_decode, huge),
        pairs=(("13B", "33B"), ("65B", "33B")),
        max_lens=(512,),
        search=None,
        even_pp=True,
    )  # strict stages: 65B/33B's KV cache at batch 2048 does not fit
    base, slow, too_big = bands
    assert base.name == "baseline" and set(base.low) == {"throughput_ratio", "gen_inf_ratio", "train_ratio"}
    assert all(base.low[k] <= base.high[k] for k in base.low)
    # slower decoding makes generation a larger share of the iteration: the Gen+Inf gain shrinks
    assert slow.value == "0.5" and slow.high["gen_inf_ratio"] < base.high["gen_inf_ratio"]
    assert too_big.infeasible and "65B/33B len 512" in too_big.infeasible[-1]
    table = sensitivity_table(bands)
    assert "decode memory-bandwidth efficiency" in table and "over every variation (paper 1.2-1.4)" in table
    assert "no plan under batch per generation instance x4: 65B/33B len 512" in table


def test_a_variation_with_no_plan_anywhere_is_an_error_naming_it():
    none = Variation(
        "batch per generation instance", "x64", lambda x: dataclasses.replace(x, global_batch=32768)
    )
    with pytest.raises(ValueError, match="batch per generation instance x64: no cell of the grid has a plan"):
        sensitivity((none,), pairs=(("65B", "33B"),), max_lens=(512,), search=None)
