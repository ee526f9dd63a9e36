"""rlhfuse benchmarks: each `bench_<name>.py` module defines `run(quick: bool) -> None` that prints its table."""
