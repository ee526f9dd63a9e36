"""Run the benchmarks: `python -m benchmarks.run [NAME ...] [--quick]` (`make bench`, `make bench BENCH=gae`).

Every benchmark prints ratios measured side by side in the same process, so that machine noise cancels, and
returns the figures of its table. This runner writes them beside the table: `benchmarks/results/NAME.json`
(`NAME.quick.json` under --quick) holds the figures, the printed lines, the commit, the command and the machine's
load before and after. Before it replaces a file it prints the figures that moved against the run the file
held (that run's commit and date): the comparison with a previous commit that bench_generation's BASELINE makes
for host syncs, for every figure.

The README and docs quote figures from these files by name and key, e.g. `(benchmarks/results/gae.quick.json:
speedup.compute_gae.T1024)`; tests/test_docs_figures.py checks each quoted figure against its file.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import io
import json
import math
import os
import pkgutil
import platform
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator, Mapping
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MOVED = 0.05
"""A figure that moved by more than this fraction since the file's previous run is printed."""
SETTINGS = ("RLHFUSE_SCHEDULE_", "REAL_MODEL_ITERATIONS")
"""Environment variables that change what a benchmark measures: recorded in the results file's command."""


def available() -> list[str]:
    return sorted(
        m.name.removeprefix("bench_")
        for m in pkgutil.iter_modules([str(HERE)])
        if m.name.startswith("bench_")
    )


def result_path(name: str, quick: bool, folder: Path = RESULTS) -> Path:
    return folder / f"{name}{'.quick' if quick else ''}.json"


def figure(figures: Mapping[str, Any], key: str) -> Any:
    """The figure at a dotted key (`speedup.compute_gae.T1024`); list items by index (`rows.0`). A name that
    holds dots itself (`unseen.16/8 mb16 cap 1.2x.peak`) is matched whole: the longest name that exists wins."""
    value: Any = figures
    parts = key.split(".")
    while parts:
        if isinstance(value, list) and parts[0].isdigit() and int(parts[0]) < len(value):
            value, parts = value[int(parts[0])], parts[1:]
            continue
        names = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
        found = next((n for n in names if isinstance(value, Mapping) and n in value), None)
        if found is None:
            raise KeyError(f"no figure {key!r} (stopped at {parts[0]!r})")
        value, parts = value[found], parts[len(found.split(".")) :]
    return value


def leaves(figures: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(dotted key, number) for every number in the figures."""
    if isinstance(figures, Mapping):
        for k, v in figures.items():
            yield from leaves(v, f"{prefix}{k}.")
    elif isinstance(figures, list):
        for i, v in enumerate(figures):
            yield from leaves(v, f"{prefix}{i}.")
    elif isinstance(figures, int | float) and not isinstance(figures, bool):
        yield prefix.rstrip("."), float(figures)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):  # tensors and numpy values
        return value.tolist()
    raise TypeError(f"a benchmark figure must be a number, string, list or dict, got {type(value).__name__}")


def _git(*args: str) -> str | None:
    git = shutil.which("git")
    if git is None or not (HERE.parent / ".git").exists():
        return None
    done = subprocess.run([git, "-C", str(HERE.parent), *args], capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def commit() -> str | None:
    """The checkout's commit, `+modified` when src/ or benchmarks/ (results aside) differ from it."""
    head = _git("rev-parse", "--short", "HEAD")
    if head is None:
        return None
    paths = ("src", "benchmarks", ":(exclude)benchmarks/results")
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", *paths)
    return f"{head}+modified" if changed else head


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy."""

    def __init__(self, terminal: Any) -> None:
        self.terminal, self.copy = terminal, io.StringIO()

    def write(self, text: str) -> int:
        self.terminal.write(text)
        return self.copy.write(text)

    def flush(self) -> None:
        self.terminal.flush()


def report_moved(previous: Mapping[str, Any], figures: Any) -> None:
    """Print the figures that moved by more than MOVED since the run `previous` (a results file) records."""
    before = dict(leaves(previous.get("figures", {})))
    moved = [
        (key, before[key], now)
        for key, now in leaves(figures)
        if key in before and not math.isclose(before[key], now, rel_tol=MOVED, abs_tol=1e-12)
    ]
    print(f"--- against the previous results ({previous.get('commit')}, {previous.get('date')}): "
          f"{len(moved)} of {len(before)} figures moved by more than {MOVED:.0%}")  # fmt: skip
    for key, was, now in moved:
        print(f"    {key}: {was:.4g} -> {now:.4g}")


def run_one(name: str, quick: bool, folder: Path | None) -> None:
    """Run benchmark `name`, print its table and, unless `folder` is None, write its results file there."""
    print(f"\n=== benchmark: {name} ===", flush=True)
    load_before, started = _load(), datetime.datetime.now(datetime.UTC)
    start = time.perf_counter()
    tee = _Tee(sys.stdout)
    with redirect_stdout(tee):
        figures = importlib.import_module(f"benchmarks.bench_{name}").run(quick=quick)
    seconds = time.perf_counter() - start
    print(f"--- {name} took {seconds:.1f}s", flush=True)
    if folder is None:
        return
    if figures is None:
        print(f"--- {name} measured nothing: its results file is left as it was", flush=True)
        return
    import torch

    settings = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(SETTINGS))
    record = {
        "benchmark": name,
        "command": f"{settings + ' ' if settings else ''}python -m benchmarks.run {name}{' --quick' if quick else ''}",
        "quick": quick,
        "commit": commit(),
        "date": started.isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "load_before": load_before,  # 1-, 5- and 15-minute load averages
            "load_after": _load(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        },
        "figures": figures,
        "output": tee.copy.getvalue().splitlines(),
    }
    path = result_path(name, quick, folder)
    if path.is_file():
        report_moved(json.loads(path.read_text()), record["figures"])
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=_jsonable) + "\n")
    print(f"--- results: {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {available()})")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke check")
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help=f"folder of the results files ({RESULTS})"
    )
    parser.add_argument("--no-results", action="store_true", help="print the tables only, write no file")
    args = parser.parse_args(argv)
    names = args.names or available()
    unknown = sorted(set(names) - set(available()))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; known: {available()}")
    failed = []
    for name in names:
        try:
            run_one(name, args.quick, None if args.no_results else args.results)
        except Exception:  # one broken benchmark does not stop the others; its results file is left as it was
            traceback.print_exc()
            failed.append(name)
    if failed:
        print(f"failed (no results written): {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
