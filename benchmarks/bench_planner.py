"""Planner benchmark: the paper's grid predicted by `rlhfuse.planner`, against the paper's reported ranges.

Prints (1) the grid as `rlhfuse-plan paper-grid` plans it (uneven pipeline stages admitted, as the paper's own
Table 3 runs LLaMA-33B, 60 layers, on 8 and 16 stages; the fused schedule searched under `GRID_SEARCH`'s
deterministic budget), (2) the same grid under Megatron-LM's strict pruning (pp divides the layers) with the
greedy schedule, as the grid was planned before, (3) the Rt sweep at max length 1024 (the paper's Figure 9),
(4) the planner's wall times, (5) the CPU calibration error.
"""

from __future__ import annotations

import time
from typing import Any

from rlhfuse.planner.grid import PAPER_RANGES, Comparison, paper_grid
from rlhfuse.planner.plan_command import grid_table

RATIOS = (
    "throughput_ratio",
    "gen_inf_ratio",
    "train_ratio",
    "train_ratio_bound",
    "spec_gain",
    "spec_gen_inf_ratio",
)


def _grid_figures(comps: list[Comparison], seconds: float) -> dict[str, Any]:
    """Each cell's ratios (`cells.{actor/critic}@{max len}.{ratio}`), each ratio's range over the cells
    (`range.{ratio}`: [min, max]) and the planner's wall seconds."""
    cells = {
        f"{c.rlhfuse.models.name}@{c.rlhfuse.workload.max_len}": {k: getattr(c, k) for k in RATIOS}
        for c in comps
    }
    ranges = {k: [min(getattr(c, k) for c in comps), max(getattr(c, k) for c in comps)] for k in RATIOS}
    return {"cells": cells, "range": ranges, "wall_s": seconds}


def run(quick: bool = False) -> dict[str, Any]:
    """Figures: `searched` and `strict` grids (see `_grid_figures`), `paper_range.{ratio}`, `in_paper_range.{ratio}`
    (cells of the searched grid), `rt_sweep.{actor/critic}` (best_rt, best_s, base_s) and `calibration`
    (held_out_mean_abs_error, rows)."""
    max_lens = (1024,) if quick else (512, 1024, 2048)
    start = time.perf_counter()
    searched = paper_grid(max_lens=max_lens)
    searched_s = time.perf_counter() - start
    print(
        "RLHFuse / RLHFuse-Base on 32 x 8 H100, batch 512, mini-batch 64 (predicted; train@LB: fused schedule"
    )
    print("at its lower bound). Uneven stages admitted, fused schedule searched (deterministic budget):")
    print(grid_table(searched))
    print(f"planner wall time: {searched_s:.1f} s for {len(searched)} settings x 2 systems (goal: < 60 s)")

    start = time.perf_counter()
    strict = paper_grid(max_lens=max_lens, even_pp=True, search=None)
    strict_s = time.perf_counter() - start
    print("\nStrict Megatron-LM pruning (pp divides the layers), greedy schedule:")
    print(grid_table(strict))
    print(f"planner wall time: {strict_s:.1f} s")
    figures: dict[str, Any] = {
        "searched": _grid_figures(searched, searched_s),
        "strict": _grid_figures(strict, strict_s),
        "paper_range": {k: list(v) for k, v in PAPER_RANGES.items()},
        "rt_sweep": {},
    }

    print("\nRt sweep at max length 1024 (fused Gen+Inf seconds; paper: minimum near 20%):")
    for comp in searched if quick else [c for c in searched if c.rlhfuse.workload.max_len == 1024]:
        sweep = comp.rlhfuse.sweep
        if not sweep:
            continue
        best = min(sweep, key=lambda x: x[1])
        curve = " ".join(f"{s:.2f}" for f, s in sweep if round(f * 100) % 15 == 5)
        print(f"  {comp.rlhfuse.models.name:<8} best Rt {best[0]:.0%} ({best[1]:.2f} s); "
              f"Rt 5%,20%,...,95%: {curve}; Base {comp.base.breakdown.gen_inf:.2f} s")  # fmt: skip
        figures["rt_sweep"][comp.rlhfuse.models.name] = {
            "best_rt": best[0], "best_s": best[1], "base_s": comp.base.breakdown.gen_inf, "sweep": sweep,
        }  # fmt: skip

    in_range = {
        k: sum(PAPER_RANGES[k][0] <= round(getattr(c, k), 2) <= PAPER_RANGES[k][1] for c in searched)
        for k in PAPER_RANGES
    }
    print(f"\ncells inside the paper's ranges (the searched grid, of {len(searched)}): {in_range}")
    figures["in_paper_range"] = in_range

    try:
        from rlhfuse.planner.calibrate import calibrate_cpu
    except ImportError as exc:  # pragma: no cover - torch is a hard dependency of the package
        print(f"CPU calibration skipped: {exc}")
        return figures
    print("\nCPU calibration (cost model vs measured tiny-model runs on this machine):")
    calibration = calibrate_cpu(repeats=3 if quick else 7)
    print(calibration.report())
    rows = [
        {"model": r.model, "phase": r.phase, "measured_ms": r.measured * 1e3, "predicted_ms": r.predicted * 1e3,
         "error": r.error, "held_out": r.held_out}
        for r in calibration.rows
    ]  # fmt: skip
    figures["calibration"] = {"held_out_mean_abs_error": calibration.held_out_mean_abs_error, "rows": rows}
    return figures
