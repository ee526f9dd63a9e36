"""`rlhfuse-schedule`: solve fused pipeline problems and print the Table-3 comparison.

rlhfuse-schedule solve PROBLEM.json --time-budget SECONDS --out RESULT.json [--plot TIMELINE.png]
rlhfuse-schedule solve PROBLEM.json --max-iterations N      # deterministic effort: same result on any machine
rlhfuse-schedule solve PROBLEM.json --makespan-slack 0.012  # up to 1.2% above the proven bound for less memory
rlhfuse-schedule bound PROBLEM.json --time-budget SECONDS --out BOUND.json [--makespan-limit M]
rlhfuse-schedule bench [TABLE.json] [--max-iterations N | --time-budget SECONDS] [--workers N] [--makespan-slack F]
rlhfuse-schedule bench --zero-bubble [TABLE.json] [--max-iterations N] [--out RESULTS.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlhfuse.pipeline.bounds import lower_bounds, peak_lower_bound
from rlhfuse.pipeline.compiled import compile_problem
from rlhfuse.pipeline.exact import DEFAULT_MAX_OPS, exact_search
from rlhfuse.pipeline.problem import Problem, load_problem, load_problems
from rlhfuse.pipeline.search import SearchConfig, Solution, solve
from rlhfuse.pipeline.zero_bubble import BASELINES, back_to_back, per_model_bound

BENCH_ITERATIONS = 1_000_000
ZERO_BUBBLE_ITERATIONS = BENCH_ITERATIONS
"""`bench --zero-bubble`'s default effort, for both searches (F/B and F/I/W): the F/B figures are then those of
`bench` (docs/schedules.md, Results). Less is not faster: at 200 000 the exact step closes the gaps that the
shorter annealing leaves, and took longer (F/I/W 11: 159 s of CP-SAT against 57 s in all at 1M; F/B 03: 239 s
against 56 s)."""
ZERO_BUBBLE_RESULTS = Path("benchmarks/results/zero_bubble.json")

TABLE_ENV = "RLHFUSE_TABLE3"


def default_table_path() -> Path:
    """`$RLHFUSE_TABLE3`, else the twelve Table-3 settings shipped with the package (`rlhfuse/pipeline/
    table3.json`; the format: docs/schedule-format.md)."""
    env = os.environ.get(TABLE_ENV)
    if env:
        return Path(env)
    return Path(__file__).with_name("table3.json")


def format_table(solutions: Sequence[Solution]) -> str:
    """A Table-3-like comparison: makespans, speedups over serial 1F1B, memory relative to serial 1F1B."""
    head = (
        f"{'setting':34s} {'serial':>6s} {'greedy':>6s} {'ours':>6s} {'bound':>6s} {'gap':>6s} {'paper':>6s} "
        f"{'x greedy':>8s} {'x ours':>7s} {'x paper':>7s} {'mem greedy':>10s} {'mem ours':>8s} {'mem paper':>9s} "
        f"{'peak':>7s} {'peak lb':>7s} {'p.peak':>7s} {'sec':>6s}  pareto (makespan/peak)"
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
            f"{s.lower_bound:6g} {100 * s.gap:5.2f}% {paper_ms if paper_ms is not None else '-':>6} "
            f"{s.serial_makespan / s.greedy_makespan:8.2f} {s.speedup:7.2f} "
            f"{s.serial_makespan / paper_ms if paper_ms else float('nan'):7.2f} "
            f"{s.greedy_peak / s.serial_peak:10.2f} {s.memory_ratio:8.2f} "
            f"{paper_mem if paper_mem is not None else '-':>9} {s.peak:7.2f} {s.peak_bound:7.2f} "
            f"{paper_peak if paper_peak is not None else '-':>7} {s.seconds:6.1f}  "
            + " ".join(f"{ms:g}/{pk:.2f}" for ms, pk in s.pareto)
        )
    lines.append(
        f"proven optimal (makespan = proven lower bound) in {hits} of {len(solutions)}; speedups (x) are over serial 1F1B; memory is the peak "
        "activation relative to serial 1F1B (per rank the larger of the two models' 1F1B peaks, max over ranks)"
    )
    return "\n".join(lines)


def _config(args: argparse.Namespace) -> SearchConfig:
    iterations = args.max_iterations if args.max_iterations else None
    return SearchConfig(
        time_budget=args.time_budget, seed=args.seed, workers=args.workers, max_iterations=iterations,
        makespan_slack=_slack(args.makespan_slack),
    )  # fmt: skip


def _slack(value: float) -> float:
    if not 0.0 <= value < 1.0:
        raise ValueError(
            f"--makespan-slack={value:g} must be a fraction in [0, 1), e.g. 0.01 for up to 1% above the proven "
            "lower bound"
        )
    return float(value)


def _solve(args: argparse.Namespace) -> int:
    problem = load_problem(args.problem)
    config = _config(args)
    solution = solve(problem, config)
    result = solution.to_result()
    if args.split_backward:
        # Reported next to the plain F/B result, which stays the schedule the result's `ranks` hold.
        split = solve(problem, dataclasses.replace(config, split_backward=True))
        result["split_backward"] = {
            "makespan": split.to_result()["makespan"],
            "lower_bound": split.to_result()["lower_bound"],
            "gap": round(split.gap, 6),
            "peak_activation": round(split.peak, 6),
            "search_seconds": round(split.seconds, 3),
            "ranks": split.schedule.labels(),
            "note": "F/I/W schedule (I: input gradient, W: weight gradient, each half of B); the runtime lowers and "
            "executes F/I/W schedules too (pipeline.split_backward; docs/runtime.md, split backward)",
        }
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
        f"{problem.name}: makespan {solution.makespan:g} (proven lower bound {solution.lower_bound:g}, gap "
        f"{100 * solution.gap:.2f}%, greedy "
        f"{solution.greedy_makespan:g}, serial 1F1B {solution.serial_makespan:g}), peak activation "
        f"{solution.peak:.2f} ({solution.memory_ratio:.2f}x serial 1F1B), {solution.seconds:.1f}s",
        file=sys.stderr,
    )
    return 0


def bound(
    problem_path: Path,
    time_budget: float = 60.0,
    seed: int = 0,
    max_ops: int = DEFAULT_MAX_OPS,
    makespan_limit: float | None = None,
) -> dict:
    """The proven lower bound of one problem and, if the exact model finds one, an optimal schedule.

    A short deterministic annealing run gives the warm start; the exact model then decides "makespan <=
    bound?" upwards from the analytic bound and, if a decision stays open, minimises from the warm start.
    Also a lower bound on the peak activation of any schedule with makespan <= `makespan_limit` (default:
    the best schedule's makespan), `bounds.peak_lower_bound`.
    """
    problem = load_problem(problem_path)
    began = time.perf_counter()
    c = compile_problem(problem)
    analytic = lower_bounds(problem, c).makespan
    warm = solve(problem, SearchConfig(seed=seed, max_iterations=100_000, max_starts=200, exact=False))
    order = c.from_schedule(warm.schedule)
    r = exact_search(
        problem, compiled=c, upper_order=order, analytic_bound=analytic, time_budget=time_budget, seed=seed,
        max_ops=max_ops,
    )  # fmt: skip
    best = r.order if r.order is not None else order
    ms = float(c.evaluate(best)[0])
    lower = max(analytic, r.lower_bound)
    out: dict[str, Any] = {
        "problem": problem.name,
        "lower_bound": int(lower) if float(lower).is_integer() else round(lower, 6),
        "lower_bound_analytic": int(analytic) if float(analytic).is_integer() else round(analytic, 6),
        "makespan": int(ms) if ms.is_integer() else round(ms, 6),
        "gap": round(max(0.0, ms - lower) / lower, 6) if lower else 0.0,
        "optimal": ms <= lower + 1e-9,
        "status": "TOO_LARGE" if c.n > max_ops else r.status,
        "note": r.note,
        "ops": c.n,
        "seconds": round(time.perf_counter() - began, 3),
        "peak_activation": round(c.peak(best), 6),
    }
    limit = ms if makespan_limit is None else float(makespan_limit)
    if limit < lower - 1e-9:
        raise ValueError(
            f"--makespan-limit={limit:g} is below the proven lower bound {lower:g}: no schedule ends by then"
        )
    pb = peak_lower_bound(problem, limit, c)
    out.update(
        peak_lower_bound=round(pb.peak, 6),
        peak_lower_bound_makespan=int(limit) if float(limit).is_integer() else round(limit, 6),
        peak_lower_bound_per_rank=[round(x, 6) for x in pb.per_rank],
        ranks=c.to_schedule(best).labels(),
    )
    return out


def _bound(args: argparse.Namespace) -> int:
    out = bound(args.problem, args.time_budget, args.seed, args.max_ops, args.makespan_limit)
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(
        f"{out['problem']}: proven lower bound {out['lower_bound']:g} (analytic {out['lower_bound_analytic']:g}), "
        f"best schedule {out['makespan']:g}, gap {100 * out['gap']:.2f}%"
        + (" (optimal)" if out["optimal"] else "")
        + f"; {out['status']}: {out['note']}; peak activation of any schedule ending by "
        f"{out['peak_lower_bound_makespan']:g} >= {out['peak_lower_bound']:g} (best schedule's peak "
        f"{out['peak_activation']:g}); {out['seconds']:.1f}s"
    )
    return 0


def bench(
    path: Path | None = None,
    time_budget: float = 60.0,
    workers: int = 1,
    seed: int = 0,
    max_iterations: int | None = BENCH_ITERATIONS,
    makespan_slack: float = 0.0,
) -> list[Solution]:
    """Solve every problem of a table3.json-style file, printing each row as it is found, then the table.

    By default the effort is `max_iterations` annealing iterations per phase (and a fixed CP-SAT
    deterministic time), so the figures do not depend on the machine's load; `max_iterations=None` uses the
    wall-clock `time_budget` instead. With `makespan_slack`, each row's schedule is the lowest peak within
    (1 + slack) x the proven bound, and the Pareto column lists the (makespan, peak) points from the best
    makespan up.
    """
    path = path or default_table_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"problem table not found at {path}: pass its path (rlhfuse-schedule bench TABLE.json) or set "
            f"{TABLE_ENV}=/path/to/table3.json"
        )
    solutions = []
    for problem in load_problems(path):
        config = SearchConfig(
            time_budget=time_budget, seed=seed, workers=workers, max_iterations=max_iterations,
            makespan_slack=_slack(makespan_slack),
        )  # fmt: skip
        s = solve(problem, config)
        print(
            f"  {problem.name}: {s.makespan:g} / proven bound {s.lower_bound:g} (gap {100 * s.gap:.2f}%), "
            f"peak {s.peak:.2f} (lower bound {s.peak_bound:.2f}), pareto "
            + " ".join(f"{ms:g}/{pk:.2f}" for ms, pk in s.pareto)
            + f", {s.seconds:.1f}s"
            + (
                f"; {s.stats['wall_capped']} CP-SAT solve(s) stopped by the wall-clock safety cap: this result may "
                "depend on the machine's load"
                if s.stats.get("wall_capped")
                else ""
            ),
            flush=True,
        )
        solutions.append(s)
    print(format_table(solutions), flush=True)
    return solutions


ZERO_BUBBLE_ROWS: tuple[tuple[str, str], ...] = (
    ("serial_1f1b", "serial 1F1B"),
    ("fused_fb", "fused F/B (ours)"),
    *((b.key, f"{b.title} back to back") for b in BASELINES),
    ("fused_fiw", "fused F/I/W (ours)"),
)
"""The rows of `bench --zero-bubble`, in print order: (results key, title)."""
PER_MODEL = tuple(b.key for b in BASELINES)


def zero_bubble_setting(problem: Problem, max_iterations: int, seed: int = 0) -> dict[str, Any]:
    """One setting of `bench --zero-bubble`: serial 1F1B, the fused F/B and F/I/W searches, and each
    per-model zero-bubble baseline back to back (`rlhfuse.pipeline.zero_bubble`), with the winner.

    Per row: `makespan`, `lower_bound` (fused rows: the proven bound, analytic or exact; per-model rows: the
    analytic bound of any per-model F/I/W schedule back to back, `zero_bubble.per_model_bound`; serial 1F1B:
    null), `peak` and `memory_ratio` (to serial 1F1B's peak); fused rows also `gap`, `optimal`,
    `exact_status`, `seconds`; per-model rows `closed_form` (the published makespan formula, ZB-H1 only) and
    `models` (each model's makespan and peak alone), or `makespan: null` and `reason` where the definition
    does not apply. Then `winner` (lowest makespan, then lowest peak), `runner_up`, `winner_margin`
    (runner-up makespan / winner's - 1), `best_per_model` and the speedups of the fused schedules over it
    (`fiw_over_best_per_model`, `fb_over_best_per_model`: its makespan / theirs).
    """
    fb = solve(problem, SearchConfig(seed=seed, max_iterations=max_iterations))
    fiw = solve(problem, SearchConfig(seed=seed, max_iterations=max_iterations, split_backward=True))
    reference = fb.serial_peak

    def memory(peak: float) -> dict[str, float]:
        return {"peak": round(peak, 6), "memory_ratio": round(peak / reference, 4)}

    def fused(s: Solution) -> dict[str, Any]:
        return {
            "makespan": _plain(s.makespan), "lower_bound": _plain(s.lower_bound), "gap": round(s.gap, 6),
            "optimal": s.optimal, "exact_status": s.stats.get("exact_status", "not run"), **memory(s.peak),
            "seconds": round(s.seconds, 2),
        }  # fmt: skip

    bound = per_model_bound(problem)
    row: dict[str, Any] = {
        "name": problem.name,
        "serial_1f1b": {"makespan": _plain(fb.serial_makespan), "lower_bound": None, **memory(reference)},
        "fused_fb": fused(fb),
    }
    for baseline in BASELINES:
        run = back_to_back(problem, baseline)
        if run.makespan is None or run.peak is None:
            row[baseline.key] = {"makespan": None, "reason": run.reason}
            continue
        row[baseline.key] = {
            "makespan": _plain(run.makespan), "lower_bound": _plain(bound),
            "closed_form": None if run.closed_form is None else _plain(run.closed_form), **memory(run.peak),
            "models": {r.model: {"makespan": _plain(r.makespan), "peak": round(max(r.peak_per_rank), 6)}
                       for r in run.runs},
        }  # fmt: skip
    row["fused_fiw"] = fused(fiw)
    row["per_model_bound"] = _plain(bound)
    ranked = sorted(
        (key for key, _ in ZERO_BUBBLE_ROWS if row[key]["makespan"] is not None),
        key=lambda key: (row[key]["makespan"], row[key]["peak"]),
    )
    winner, runner_up = ranked[0], ranked[1]
    best = min((k for k in PER_MODEL if row[k]["makespan"] is not None), key=lambda k: row[k]["makespan"])
    row.update(
        winner=winner,
        runner_up=runner_up,
        winner_margin=round(row[runner_up]["makespan"] / row[winner]["makespan"] - 1, 6),
        best_per_model=best,
        fiw_over_best_per_model=round(row[best]["makespan"] / row["fused_fiw"]["makespan"], 4),
        fb_over_best_per_model=round(row[best]["makespan"] / row["fused_fb"]["makespan"], 4),
    )
    return row


def _plain(x: float) -> int | float:
    return int(x) if float(x).is_integer() else round(float(x), 6)


def format_zero_bubble(row: dict[str, Any]) -> str:
    """One setting's block of `bench --zero-bubble`: a line per schedule, then the winner."""
    titles = dict(ZERO_BUBBLE_ROWS)

    def cell(value: Any) -> str:
        return "-" if value is None else f"{value:g}"

    lines = [
        f"{row['name']}  (per-model bound: no per-model F/I/W schedule back to back ends before "
        f"{row['per_model_bound']:g})",
        f"  {'schedule':26s} {'makespan':>8s} {'bound':>7s} {'formula':>7s} {'peak (x serial 1F1B)':>21s}",
    ]
    for key, title in ZERO_BUBBLE_ROWS:
        r = row[key]
        if r["makespan"] is None:
            lines.append(f"  {title:26s} {'-':>8s} {'-':>7s} {'-':>7s} {'-':>21s}  {r['reason']}")
            continue
        lines.append(
            f"  {title:26s} {cell(r['makespan']):>8s} {cell(r['lower_bound']):>7s} "
            f"{cell(r.get('closed_form')):>7s} {r['peak']:12.2f} ({r['memory_ratio']:.2f})"
        )
    lines.append(
        f"  winner: {titles[row['winner']]}, {100 * row['winner_margin']:.2f}% ahead of "
        f"{titles[row['runner_up']]}; fused F/I/W vs the best per-model ({titles[row['best_per_model']]}): "
        f"{row['fiw_over_best_per_model']:.3f}x, fused F/B vs it: {row['fb_over_best_per_model']:.3f}x"
    )
    return "\n".join(lines)


def zero_bubble_bench(
    path: Path | None = None,
    max_iterations: int = ZERO_BUBBLE_ITERATIONS,
    seed: int = 0,
    out: Path | None = ZERO_BUBBLE_RESULTS,
) -> dict[str, Any]:
    """`rlhfuse-schedule bench --zero-bubble`: does fusing still pay when each model could run a zero-bubble
    schedule on its own? Every setting of a table3.json-style file (`zero_bubble_setting`), printed as it is
    found, then a summary; the figures go to `out` (None: not written) in the layout of benchmarks/run.py's
    results files (`figures`, `output`, `command`, `date`, `seconds`, `machine`; `commit` null: the package
    does not run git).

    Figures: `table3.<setting>` (`zero_bubble_setting`'s row), `effort` (max_iterations, seed, workers),
    `fiw_within_1pct` and `fiw_optimal` (settings whose fused F/I/W is within 1% of / at its proven bound),
    `wins` (settings won per schedule), and as `{count, settings}`: `per_model_beats_fiw` (the settings where a
    per-model schedule ends before fused F/I/W), `per_model_beats_fb` (the same against fused F/B),
    `fiw_below_per_model_bound` (where fused F/I/W ends before any per-model F/I/W schedule back to back
    can); `total_s`.
    """
    if max_iterations <= 0:
        raise ValueError(
            f"--max-iterations={max_iterations} with --zero-bubble: the comparison runs with a deterministic "
            f"effort; give a positive count (default {ZERO_BUBBLE_ITERATIONS})"
        )
    path = path or default_table_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"problem table not found at {path}: pass its path (rlhfuse-schedule bench --zero-bubble "
            f"TABLE.json) or set {TABLE_ENV}=/path/to/table3.json"
        )
    load_before, date, began = _load(), datetime.datetime.now(datetime.UTC), time.perf_counter()
    output: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        output.extend(text.splitlines())

    say(f"problems: {path}; {max_iterations} iterations per phase, 1 worker, seed {seed}")
    table: dict[str, Any] = {}
    for problem in load_problems(path):
        row = zero_bubble_setting(problem, max_iterations, seed)
        table[problem.name.split()[0]] = row
        say(format_zero_bubble(row))
    titles = dict(ZERO_BUBBLE_ROWS)
    say(f"{'setting':10s} {'winner':26s} {'margin':>7s} {'fused F/I/W':>11s} {'best per-model':>26s} "
        f"{'F/I/W x':>7s} {'F/B x':>6s}")  # fmt: skip
    for name, row in table.items():
        best = row["best_per_model"]
        say(
            f"{name:10s} {titles[row['winner']]:26s} {100 * row['winner_margin']:6.2f}% "
            f"{row['fused_fiw']['makespan']:11g} {titles[best] + ' ' + format(row[best]['makespan'], 'g'):>26s} "
            f"{row['fiw_over_best_per_model']:7.3f} {row['fb_over_best_per_model']:6.3f}"
        )
    figures: dict[str, Any] = {
        "effort": {"max_iterations": max_iterations, "seed": seed, "workers": 1},
        "table3": table,
        "fiw_within_1pct": sum(r["fused_fiw"]["gap"] <= 0.01 for r in table.values()),
        "fiw_optimal": sum(r["fused_fiw"]["optimal"] for r in table.values()),
        "wins": {key: sum(r["winner"] == key for r in table.values()) for key, _ in ZERO_BUBBLE_ROWS},
        "per_model_beats_fiw": _settings(table, lambda r: r["fiw_over_best_per_model"] < 1),
        "per_model_beats_fb": _settings(table, lambda r: r["fb_over_best_per_model"] < 1),
        "fiw_below_per_model_bound": _settings(
            table, lambda r: r["fused_fiw"]["makespan"] < r["per_model_bound"]
        ),
        "total_s": round(time.perf_counter() - began, 1),
    }
    say(
        f"fused F/I/W within 1% of its proven bound on {figures['fiw_within_1pct']} of {len(table)} (at it on "
        f"{figures['fiw_optimal']}); a per-model zero-bubble schedule ends first against fused F/I/W on "
        f"{figures['per_model_beats_fiw']['count']}, against fused F/B on {figures['per_model_beats_fb']['count']}; "
        f"fused F/I/W below the per-model bound on {figures['fiw_below_per_model_bound']['count']}; "
        f"{figures['total_s']:.1f}s"
    )
    if out is not None:
        record = {
            "benchmark": "zero_bubble",
            "command": f"rlhfuse-schedule bench --zero-bubble --max-iterations {max_iterations} --seed {seed}",
            "quick": False,
            "commit": None,
            "date": date.isoformat(timespec="seconds"),
            "seconds": figures["total_s"],
            "machine": {
                "cpus": os.cpu_count(),
                "load_before": load_before,
                "load_after": _load(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            },
            "figures": figures,
            "output": output,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"results: {out}", flush=True)
    return figures


def _settings(table: dict[str, Any], keep: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """`{count, settings}` of the rows of `table` that `keep` holds for."""
    names = [name for name, row in table.items() if keep(row)]
    return {"count": len(names), "settings": names}


def _load() -> list[float]:
    """The 1-, 5- and 15-minute load averages (the machine's state next to the seconds)."""
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhfuse-schedule", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    p_solve = sub.add_parser(
        "solve", help="solve one problem (docs/schedule-format.md JSON) and write the result"
    )
    p_solve.add_argument("problem", type=Path)
    p_solve.add_argument(
        "--time-budget", type=float, default=60.0, help="seconds for the search (default 60)"
    )
    p_solve.add_argument("--out", type=Path, help="result JSON (default: print it)")
    p_solve.add_argument("--plot", type=Path, help="timeline PNG (Figure 10 style)")
    p_solve.add_argument("--workers", type=int, default=1, help="local processes running seeds in parallel")
    p_solve.add_argument("--seed", type=int, default=0)
    p_solve.add_argument(
        "--max-iterations", type=int, default=0,
        help="deterministic effort: annealing iterations per phase (the clock is then ignored); 0: time budget",
    )  # fmt: skip
    p_solve.add_argument(
        "--split-backward", action="store_true",
        help="also search split-backward (F/I/W) schedules and report them next to the F/B result",
    )  # fmt: skip
    slack_help = (
        "trade makespan for memory: allow up to (1 + FRACTION) x the proven lower bound and return the lowest "
        "peak found within it (the JSON's pareto lists the (makespan, peak) points); default 0"
    )
    p_solve.add_argument("--makespan-slack", type=float, default=0.0, metavar="FRACTION", help=slack_help)
    p_bound = sub.add_parser("bound", help="prove a lower bound (and, if found, an optimal schedule)")
    p_bound.add_argument("problem", type=Path)
    p_bound.add_argument("--time-budget", type=float, default=60.0, help="seconds for the exact model")
    p_bound.add_argument("--out", type=Path, help="bound JSON (default: only print the summary)")
    p_bound.add_argument("--seed", type=int, default=0)
    p_bound.add_argument(
        "--max-ops", type=int, default=DEFAULT_MAX_OPS, help="larger problems keep the analytic bound"
    )
    p_bound.add_argument(
        "--makespan-limit", type=float, default=None,
        help="bound the peak activation of schedules ending by this makespan (default: the best schedule's)",
    )  # fmt: skip
    p_bench = sub.add_parser(
        "bench", help="solve every problem of a table3.json-style file and print Table 3"
    )
    p_bench.add_argument(
        "table", type=Path, nargs="?", help=f"default: ${TABLE_ENV} or the package's own Table-3 settings"
    )
    p_bench.add_argument(
        "--time-budget", type=float, default=60.0, help="seconds per problem, with --max-iterations 0"
    )
    p_bench.add_argument(
        "--max-iterations", type=int, default=None,
        help=f"deterministic effort per problem (default {BENCH_ITERATIONS}, with --zero-bubble "
        f"{ZERO_BUBBLE_ITERATIONS}); 0: use --time-budget",
    )  # fmt: skip
    p_bench.add_argument(
        "--zero-bubble", action="store_true",
        help="compare serial 1F1B, fused F/B, per-model ZB-H1 / ZB-V / DualPipeV back to back and fused F/I/W",
    )  # fmt: skip
    p_bench.add_argument(
        "--out", type=Path, default=ZERO_BUBBLE_RESULTS,
        help=f"with --zero-bubble: the results file (default {ZERO_BUBBLE_RESULTS})",
    )  # fmt: skip
    p_bench.add_argument("--workers", type=int, default=1)
    p_bench.add_argument("--makespan-slack", type=float, default=0.0, metavar="FRACTION", help=slack_help)
    p_bench.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if args.command == "solve":
            return _solve(args)
        if args.command == "bound":
            return _bound(args)
        if args.zero_bubble:
            iterations = ZERO_BUBBLE_ITERATIONS if args.max_iterations is None else args.max_iterations
            zero_bubble_bench(args.table, iterations, args.seed, args.out)
            return 0
        iterations = BENCH_ITERATIONS if args.max_iterations is None else args.max_iterations
        bench(
            args.table, args.time_budget, args.workers, args.seed, iterations or None, args.makespan_slack
        )  # fmt: skip
        return 0
    except (ValueError, FileNotFoundError) as err:
        print(f"rlhfuse-schedule: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
