"""Test support that ships with the package (importable from spawned ranks and benchmarks): the stand-in
device (`rlhfuse.testing.standin`), random valid batches (`rlhfuse.testing.data`), a
chat tokenizer (`rlhfuse.testing.chat`) and the end of a spawned rank (`rlhfuse.testing.processes`)."""
