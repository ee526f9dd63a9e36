"""Test support that ships with the package (importable from spawned ranks and benchmarks): the stand-in
device (`rlhfuse.testing.standin`) and random valid batches (`rlhfuse.testing.data`)."""
