"""Planner benchmark: the paper's grid predicted by `rlhfuse.planner`, against the paper's reported ranges.

Prints (1) the grid as `rlhfuse-plan paper-grid` plans it (uneven pipeline stages admitted, as the paper's own
Table 3 runs LLaMA-33B, 60 layers, on 8 and 16 stages; the fused schedule searched under `GRID_SEARCH`'s
deterministic budget), (2) the same grid under Megatron-LM's strict pruning (pp divides the layers) with the
greedy schedule, as the grid was planned before, (3) the Rt sweep at max length 1024 (the paper's Figure 9),
(4) the planner's wall times, (5) the CPU calibration error.
"""

from __future__ import annotations

import time

from rlhfuse.planner.grid import PAPER_RANGES, paper_grid
from rlhfuse.planner.plan_command import grid_table


def run(quick: bool = False) -> None:
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

    print("\nRt sweep at max length 1024 (fused Gen+Inf seconds; paper: minimum near 20%):")
    for comp in searched if quick else [c for c in searched if c.rlhfuse.workload.max_len == 1024]:
        sweep = comp.rlhfuse.sweep
        if not sweep:
            continue
        best = min(sweep, key=lambda x: x[1])
        curve = " ".join(f"{s:.2f}" for f, s in sweep if round(f * 100) % 15 == 5)
        print(f"  {comp.rlhfuse.models.name:<8} best Rt {best[0]:.0%} ({best[1]:.2f} s); "
              f"Rt 5%,20%,...,95%: {curve}; Base {comp.base.breakdown.gen_inf:.2f} s")  # fmt: skip

    in_range = {
        k: sum(PAPER_RANGES[k][0] <= round(getattr(c, k), 2) <= PAPER_RANGES[k][1] for c in searched)
        for k in PAPER_RANGES
    }
    print(f"\ncells inside the paper's ranges (the searched grid, of {len(searched)}): {in_range}")

    try:
        from rlhfuse.planner.calibrate import calibrate_cpu
    except ImportError as exc:  # pragma: no cover - torch is a hard dependency of the package
        print(f"CPU calibration skipped: {exc}")
        return
    print("\nCPU calibration (cost model vs measured tiny-model runs on this machine):")
    print(calibrate_cpu(repeats=3 if quick else 7).report())
