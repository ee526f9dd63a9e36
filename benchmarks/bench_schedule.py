"""Table 3 of the RLHFuse paper: fused Actor+Critic pipeline schedules on the twelve published settings.

For each setting: our makespan vs greedy vs the paper's solver (FlexFusion) vs the lower bound, the speedup over
serial 1F1B, the peak activation relative to serial 1F1B and the search seconds (target: <= 60 s per setting on a
2-core machine). Then a 64-rank dry run (greedy + search in one process) as a scale check.

Problems come from `<repo>/../shared/bench/table3.json`, or `$RLHFUSE_TABLE3`. The effort is deterministic
(`RLHFUSE_SCHEDULE_ITERATIONS` annealing iterations per phase, default 1M, plus a fixed CP-SAT deterministic
time), so the figures do not depend on the machine's load; `RLHFUSE_SCHEDULE_ITERATIONS=0` uses the wall-clock
`RLHFUSE_SCHEDULE_BUDGET` (seconds per setting) instead, and `RLHFUSE_SCHEDULE_WORKERS` sets the processes.
"""

from __future__ import annotations

import os
import time

from rlhfuse.pipeline import greedy, simulate
from rlhfuse.pipeline.cli import bench, default_table_path
from rlhfuse.pipeline.problem import scale_check_problem
from rlhfuse.pipeline.search import SearchConfig, solve


def dry_run_64(budget: float) -> None:
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


def run(quick: bool = False) -> None:
    path = default_table_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"Table-3 problems not found at {path}: set RLHFUSE_TABLE3=/path/to/table3.json"
        )
    budget = float(os.environ.get("RLHFUSE_SCHEDULE_BUDGET", 5.0 if quick else 60.0))
    workers = int(os.environ.get("RLHFUSE_SCHEDULE_WORKERS", 1))
    iterations = int(os.environ.get("RLHFUSE_SCHEDULE_ITERATIONS", 100_000 if quick else 1_000_000)) or None
    effort = f"{iterations} iterations per phase" if iterations else f"time budget {budget:g}s"
    print(f"problems: {path}; {effort} per setting, {workers} worker process(es)", flush=True)
    bench(path, time_budget=budget, workers=workers, max_iterations=iterations)
    dry_run_64(budget)
