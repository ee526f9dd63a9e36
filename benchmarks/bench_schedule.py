"""Table 3 of the RLHFuse paper: fused Actor+Critic pipeline schedules on the twelve published settings.

For each setting: our makespan vs greedy vs the paper's solver (FlexFusion) vs the lower bound, the speedup over
serial 1F1B, the peak activation relative to serial 1F1B and the search seconds (target: <= 60 s per setting on a
2-core machine). Then a 64-rank dry run (greedy + search in one process) as a scale check.

Problems come from the package's own `rlhfuse/pipeline/table3.json`, or `$RLHFUSE_TABLE3`. The effort is deterministic
(`RLHFUSE_SCHEDULE_ITERATIONS` annealing iterations per phase, default 1M, plus a fixed CP-SAT deterministic
time), so the figures do not depend on the machine's load; `RLHFUSE_SCHEDULE_ITERATIONS=0` uses the wall-clock
`RLHFUSE_SCHEDULE_BUDGET` (seconds per setting) instead, and `RLHFUSE_SCHEDULE_WORKERS` sets the processes.
`RLHFUSE_SCHEDULE_SLACK=F` lets every setting trade makespan for memory up to (1 + F) x its proven bound
(`--makespan-slack`; the Pareto column then lists the points found), 0 by default.
"""

from __future__ import annotations

import os
import time
from typing import Any

from rlhfuse.pipeline import greedy, make_problem, simulate
from rlhfuse.pipeline.baselines import serial_peak
from rlhfuse.pipeline.problem import Problem, scale_check_problem
from rlhfuse.pipeline.schedule_command import BENCH_ITERATIONS, bench, default_table_path
from rlhfuse.pipeline.search import SearchConfig, Solution, solve


def dry_run_64(budget: float) -> dict[str, Any]:
    """65B/33B-like fused pipelines on 64 ranks: an Actor of 64 stages, two reversed 32-stage Critic replicas."""
    problem = scale_check_problem(64)
    began = time.perf_counter()
    g = simulate(problem, greedy(problem))
    greedy_seconds = time.perf_counter() - began
    s = solve(problem, SearchConfig(time_budget=budget))
    print(
        f"{problem.name}: greedy {g.makespan:g} ({greedy_seconds:.1f}s), ours {s.makespan:g}, bound "
        f"{s.lower_bound:g}, serial 1F1B {s.serial_makespan:g} (x{s.speedup:.2f}), peak {s.peak:.2f} "
        f"(x{s.memory_ratio:.2f} serial 1F1B), {s.seconds:.1f}s for {s.schedule_size} ops",
        flush=True,
    )
    return {**_figures(s), "greedy_s": greedy_seconds, "ops": s.schedule_size}


def unseen_problems() -> list[Problem]:
    """Problems the search was not tuned on: other stage and micro-batch counts, unequal stage times, latency,
    and memory caps (set relative to serial 1F1B's peak, which is what a user with tight memory asks for)."""

    def capped(p: Problem, factor: float) -> Problem:
        return make_problem(
            [m | {"microbatches": m["microbatches"]} for m in _specs(p)],
            ranks=p.ranks, name=f"{p.name} cap {factor:g}x", memory_cap=round(factor * serial_peak(p), 6),
        )  # fmt: skip

    def spec(name, stages, micro, f, b, act):  # type: ignore[no-untyped-def]
        return {"name": name, "stages": stages, "microbatches": micro, "forward": f, "backward": b,
                "activation": act}  # fmt: skip

    base = [
        make_problem([spec("actor", 16, 16, 2, 4, 1.64), spec("critic", 8, 8, 2, 4, 2.0)], name="16/8 mb16"),
        make_problem(
            [spec("actor", 16, 24, [2, 3] * 8, [4, 6] * 8, 1.64), spec("critic", 16, 24, 1, 2, 1.0)],
            name="16/16 mb24 unequal",
        ),
        make_problem([spec("actor", 12, 20, 3, 6, 1.5), spec("critic", 6, 10, 2, 4, 1.0)], name="12/6 mb20"),
        make_problem([spec("actor", 8, 12, 5, 10, 1.95), spec("critic", 4, 10, 4, 8, 2.0)], name="8/4 mb12"),
        make_problem(
            [
                spec("actor", 6, 9, [2, 3, 2, 2, 3, 2], [4, 6, 4, 4, 6, 4], 1.0),
                spec("critic", 3, 7, 1, 2, 2.0),
            ],
            name="6/3 mb9 unequal latency 1",
            comm_latency=1.0,
        ),
    ]
    return [*base, capped(base[0], 1.0), capped(base[0], 1.2), capped(base[1], 1.1), capped(base[3], 1.0)]


def _specs(p: Problem) -> list[dict]:
    return [
        {"name": m.name, "stages": m.stages, "microbatches": m.microbatches, "forward": list(m.forward),
         "backward": list(m.backward), "activation": list(m.activation), "placement": [list(r) for r in m.placement]}
        for m in p.models
    ]  # fmt: skip


def unseen(iterations: int | None = BENCH_ITERATIONS) -> dict[str, Any]:
    """Acceptance on unseen problems: makespan within 5% of the proven bound, never over the cap."""
    figures = {}
    for p in unseen_problems():
        s = solve(p, SearchConfig(max_iterations=iterations))
        sim = simulate(p, s.schedule)
        cap = p.memory_cap
        print(
            f"  {p.name}: {s.makespan:g} / proven bound {s.lower_bound:g} (gap {100 * s.gap:.2f}%), peak "
            f"{sim.peak:.2f}{f' <= cap {cap:g}' if cap is not None and sim.peak <= cap + 1e-9 else ''}"
            f"{' OVER THE CAP' if cap is not None and sim.peak > cap + 1e-9 else ''}, {s.seconds:.1f}s",
            flush=True,
        )
        figures[p.name] = {**_figures(s), "cap": cap, "simulated_peak": sim.peak}
    return figures


def run(quick: bool = False) -> dict[str, Any]:
    """Figures: `table3.table3-NN` (each setting's row: makespan, lower_bound, gap, peak, peak_bound, speedup,
    memory_ratio, seconds, pareto, the paper's figures), table3_total_s, table3_over_60s, table3_optimal;
    `unseen.{name}` (the same row, cap, simulated_peak); `dry_run_64`; `effort`."""
    path = default_table_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"Table-3 problems not found at {path}: set RLHFUSE_TABLE3=/path/to/table3.json"
        )
    budget = float(os.environ.get("RLHFUSE_SCHEDULE_BUDGET", 5.0 if quick else 60.0))
    workers = int(os.environ.get("RLHFUSE_SCHEDULE_WORKERS", 1))
    iterations = int(os.environ.get("RLHFUSE_SCHEDULE_ITERATIONS", 100_000 if quick else 1_000_000)) or None
    slack = float(os.environ.get("RLHFUSE_SCHEDULE_SLACK", 0.0))
    effort = f"{iterations} iterations per phase" if iterations else f"time budget {budget:g}s"
    print(
        f"problems: {path}; {effort} per setting, {workers} worker process(es), makespan slack {slack:g}",
        flush=True,
    )
    solutions = bench(
        path, time_budget=budget, workers=workers, max_iterations=iterations, makespan_slack=slack
    )
    table3 = {s.problem.name.split()[0]: _figures(s) for s in solutions}
    print("unseen problems (other shapes, unequal stage times, latency, memory caps):", flush=True)
    return {
        "effort": {"iterations": iterations, "budget_s": budget, "workers": workers, "slack": slack},
        "table3": table3,
        "table3_total_s": sum(s.seconds for s in solutions),
        "table3_over_60s": [name for name, f in table3.items() if f["seconds"] > 60],
        "table3_optimal": sum(f["optimal"] for f in table3.values()),
        "unseen": unseen(iterations),
        "dry_run_64": dry_run_64(budget),
    }


def _figures(s: Solution) -> dict[str, Any]:
    """One solved problem's row of the table, with the paper's figures (`paper_*`) where the problem has them."""
    ref = s.problem.reference
    return {
        "makespan": s.makespan, "lower_bound": s.lower_bound, "gap": s.gap, "optimal": s.optimal,
        "serial_makespan": s.serial_makespan, "greedy_makespan": s.greedy_makespan, "speedup": s.speedup,
        "peak": s.peak, "peak_bound": s.peak_bound, "memory_ratio": s.memory_ratio, "seconds": s.seconds,
        "pareto": s.pareto, "paper_makespan": ref.get("flexfusion_sa_makespan"),
        "paper_peak": ref.get("flexfusion_sa_peak"), "paper_lower_bound": ref.get("lower_bound"),
    }  # fmt: skip
