"""Table 3 of the RLHFuse paper: fused Actor+Critic pipeline schedules on the twelve published settings.

For each setting: our makespan vs greedy vs the paper's solver (FlexFusion) vs the lower bound, the speedup over
serial 1F1B, the peak activation relative to serial 1F1B and the search seconds (target: <= 60 s per setting on a
2-core machine). Problems come from `<repo>/../shared/bench/table3.json`, or `$RLHFUSE_TABLE3`.
`RLHFUSE_SCHEDULE_BUDGET` (seconds per setting) and `RLHFUSE_SCHEDULE_WORKERS` override the search effort.
"""

from __future__ import annotations

import os

from rlhfuse.pipeline.cli import bench, default_table_path


def run(quick: bool = False) -> None:
    path = default_table_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"Table-3 problems not found at {path}: set RLHFUSE_TABLE3=/path/to/table3.json"
        )
    budget = float(os.environ.get("RLHFUSE_SCHEDULE_BUDGET", 5.0 if quick else 60.0))
    workers = int(os.environ.get("RLHFUSE_SCHEDULE_WORKERS", 1 if quick else 2))
    print(f"problems: {path}; time budget {budget:g}s per setting, {workers} worker process(es)", flush=True)
    bench(path, time_budget=budget, workers=workers)
