"""Run the benchmarks: `python -m benchmarks.run [NAME ...] [--quick]` (`make bench`, `make bench BENCH=gae`).

Every benchmark prints ratios measured side by side in the same process, so that machine noise cancels.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time
from pathlib import Path


def available() -> list[str]:
    here = Path(__file__).resolve().parent
    return sorted(
        m.name.removeprefix("bench_")
        for m in pkgutil.iter_modules([str(here)])
        if m.name.startswith("bench_")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {available()})")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke check")
    args = parser.parse_args(argv)
    names = args.names or available()
    unknown = sorted(set(names) - set(available()))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; known: {available()}")
    for name in names:
        print(f"\n=== benchmark: {name} ===", flush=True)
        start = time.perf_counter()
        importlib.import_module(f"benchmarks.bench_{name}").run(quick=args.quick)
        print(f"--- {name} took {time.perf_counter() - start:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
