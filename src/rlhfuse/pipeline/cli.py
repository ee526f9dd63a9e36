"""`rlhfuse-schedule`: solve fused pipeline problems and print the Table-3 comparison.

rlhfuse-schedule solve PROBLEM.json --time-budget SECONDS --out RESULT.json [--plot TIMELINE.png]
rlhfuse-schedule bench [TABLE.json] [--time-budget SECONDS] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from rlhfuse.pipeline.problem import load_problem, load_problems
from rlhfuse.pipeline.search import SearchConfig, Solution, solve

TABLE_ENV = "RLHFUSE_TABLE3"


def default_table_path() -> Path:
    """`$RLHFUSE_TABLE3`, else `<repo>/../shared/bench/table3.json` next to a source checkout."""
    env = os.environ.get(TABLE_ENV)
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[3]
    return repo.parent / "shared" / "bench" / "table3.json"


def format_table(solutions: Sequence[Solution]) -> str:
    """A Table-3-like comparison: makespans, speedups over serial 1F1B, memory relative to serial 1F1B."""
    head = (
        f"{'setting':34s} {'serial':>6s} {'greedy':>6s} {'ours':>6s} {'bound':>6s} {'paper':>6s} "
        f"{'x greedy':>8s} {'x ours':>7s} {'x paper':>7s} {'mem greedy':>10s} {'mem ours':>8s} {'mem paper':>9s} "
        f"{'peak':>7s} {'p.peak':>7s} {'sec':>6s}"
    )
    lines = [head, "-" * len(head)]
    hits = 0
    for s in solutions:
        ref = s.problem.reference
        paper_ms = ref.get("flexfusion_sa_makespan")
        paper_peak = ref.get("flexfusion_sa_peak")
        paper_mem = ref.get("paper_memory_ratio_to_1f1b")
        hits += s.makespan <= s.lower_bound + 1e-9
        lines.append(
            f"{s.problem.name:34s} {s.serial_makespan:6g} {s.greedy_makespan:6g} {s.makespan:6g} "
            f"{s.lower_bound:6g} {paper_ms if paper_ms is not None else '-':>6} "
            f"{s.serial_makespan / s.greedy_makespan:8.2f} {s.speedup:7.2f} "
            f"{s.serial_makespan / paper_ms if paper_ms else float('nan'):7.2f} "
            f"{s.greedy_peak / s.serial_peak:10.2f} {s.memory_ratio:8.2f} "
            f"{paper_mem if paper_mem is not None else '-':>9} {s.peak:7.2f} "
            f"{paper_peak if paper_peak is not None else '-':>7} {s.seconds:6.1f}"
        )
    lines.append(
        f"lower bound reached in {hits} of {len(solutions)}; speedups (x) are over serial 1F1B; memory is the peak "
        "activation relative to serial 1F1B (per rank the larger of the two models' 1F1B peaks, max over ranks)"
    )
    return "\n".join(lines)


def _solve(args: argparse.Namespace) -> int:
    problem = load_problem(args.problem)
    config = SearchConfig(time_budget=args.time_budget, seed=args.seed, workers=args.workers)
    solution = solve(problem, config)
    result = solution.to_result()
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    if args.plot:
        from rlhfuse.pipeline.plot import plot_timeline

        plot_timeline(problem, solution.schedule, args.plot, reference_memory=solution.serial_peak)
    print(
        f"{problem.name}: makespan {solution.makespan:g} (lower bound {solution.lower_bound:g}, greedy "
        f"{solution.greedy_makespan:g}, serial 1F1B {solution.serial_makespan:g}), peak activation "
        f"{solution.peak:.2f} ({solution.memory_ratio:.2f}x serial 1F1B), {solution.seconds:.1f}s",
        file=sys.stderr,
    )
    return 0


def bench(
    path: Path | None = None, time_budget: float = 60.0, workers: int = 1, seed: int = 0
) -> list[Solution]:
    """Solve every problem of a table3.json-style file, printing each row as it is found, then the table."""
    path = path or default_table_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"problem table not found at {path}: pass its path (rlhfuse-schedule bench TABLE.json) or set "
            f"{TABLE_ENV}=/path/to/table3.json"
        )
    solutions = []
    for problem in load_problems(path):
        s = solve(problem, SearchConfig(time_budget=time_budget, seed=seed, workers=workers))
        print(
            f"  {problem.name}: {s.makespan:g} / bound {s.lower_bound:g}, peak {s.peak:.2f}, {s.seconds:.1f}s",
            flush=True,
        )
        solutions.append(s)
    print(format_table(solutions), flush=True)
    return solutions


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhfuse-schedule", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    p_solve = sub.add_parser("solve", help="solve one problem (FORMAT.md JSON) and write the result")
    p_solve.add_argument("problem", type=Path)
    p_solve.add_argument(
        "--time-budget", type=float, default=60.0, help="seconds for the search (default 60)"
    )
    p_solve.add_argument("--out", type=Path, help="result JSON (default: print it)")
    p_solve.add_argument("--plot", type=Path, help="timeline PNG (Figure 10 style)")
    p_solve.add_argument("--workers", type=int, default=1, help="local processes running seeds in parallel")
    p_solve.add_argument("--seed", type=int, default=0)
    p_bench = sub.add_parser(
        "bench", help="solve every problem of a table3.json-style file and print Table 3"
    )
    p_bench.add_argument(
        "table", type=Path, nargs="?", help=f"default: ${TABLE_ENV} or ../shared/bench/table3.json"
    )
    p_bench.add_argument("--time-budget", type=float, default=60.0, help="seconds per problem (default 60)")
    p_bench.add_argument("--workers", type=int, default=1)
    p_bench.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if args.command == "solve":
            return _solve(args)
        bench(args.table, args.time_budget, args.workers, args.seed)
        return 0
    except (ValueError, FileNotFoundError) as err:
        print(f"rlhfuse-schedule: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
