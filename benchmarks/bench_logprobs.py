"""Chunked chosen-token log-probabilities (`logprobs_from_logits`) against `log_softmax(...).gather(...)`.

Legend: B batch rows, T time (tokens), V vocabulary.

Time: both sides interleaved in this process, median of the runs. Peak memory: each side runs alone in a fresh
subprocess; the figure is the growth of the process's peak resident set (ru_maxrss) from just after the logits
were allocated to just after the call, i.e. the extra memory the method needed on top of its input. For
forward+backward it includes the gradient of the logits (B·T·V floats), which both sides must produce.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from rlhfuse.algorithms import logprobs_from_logits

_MEMORY_PROBE = """
import json, resource, sys, torch
from rlhfuse.algorithms import logprobs_from_logits
method, backward, B, T, V = sys.argv[1], sys.argv[2] == "1", *map(int, sys.argv[3:6])
torch.manual_seed(0)
logits_BTV = torch.randn(B, T, V, requires_grad=backward)
labels_BT = torch.randint(0, V, (B, T))
before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.set_grad_enabled(backward):
    if method == "reference":
        logprobs_BT = torch.log_softmax(logits_BTV, -1).gather(-1, labels_BT[..., None]).squeeze(-1)
    else:
        logprobs_BT = logprobs_from_logits(logits_BTV, labels_BT)
    if backward:
        logprobs_BT.sum().backward()
after_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"extra_mb": (after_kb - before_kb) / 1024}))
"""


def _reference_BT(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits_BTV, -1).gather(-1, labels_BT[..., None]).squeeze(-1)


def _extra_memory_mb(method: str, backward: bool, shape: tuple[int, int, int]) -> float:
    completed = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, method, "1" if backward else "0", *map(str, shape)],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(json.loads(completed.stdout)["extra_mb"])


def _median_ms(timings_s: list[float]) -> float:
    return 1e3 * statistics.median(timings_s)


def run(quick: bool = False) -> dict[str, Any]:
    """Figures: max_diff; forward_ms / forward_backward_ms (reference, chunked, ratio); forward_extra_mb /
    forward_backward_extra_mb (reference, chunked)."""
    B, T, V = (2, 128, 32000) if quick else (8, 512, 32000)
    repeats = 3
    # Memory first: Linux carries a parent's peak RSS over fork/exec into the child's ru_maxrss, so the probes
    # must start while this process is still small.
    memory_rows = []
    figures: dict[str, Any] = {"shape_BTV": [B, T, V]}
    for label, key, backward in (
        ("forward extra MB", "forward_extra_mb", False),
        ("forward+backward MB", "forward_backward_extra_mb", True),
    ):
        ref_mb = _extra_memory_mb("reference", backward, (B, T, V))
        chunked_mb = _extra_memory_mb("chunked", backward, (B, T, V))
        memory_rows.append(f"{label:>22} {ref_mb:>12.0f} {chunked_mb:>12.0f}")
        figures[key] = {"reference": ref_mb, "chunked": chunked_mb}
    generator = torch.Generator().manual_seed(0)
    logits_BTV = torch.randn(B, T, V, generator=generator)
    labels_BT = torch.randint(0, V, (B, T), generator=generator)
    logits_mb = logits_BTV.numel() * logits_BTV.element_size() / 2**20
    print(f"threads={torch.get_num_threads()}  logits (B, T, V)=({B}, {T}, {V}) fp32 = {logits_mb:.0f} MB")

    max_diff = (
        (logprobs_from_logits(logits_BTV, labels_BT) - _reference_BT(logits_BTV, labels_BT)).abs().max()
    )
    print(f"max |chunked − reference| = {max_diff.item():.2e}")
    figures["max_diff"] = max_diff.item()

    timings: dict[str, list[float]] = {"reference": [], "chunked": []}
    methods = {"reference": _reference_BT, "chunked": logprobs_from_logits}
    with torch.no_grad():
        for _ in range(repeats):
            for name, fn in methods.items():
                start = time.perf_counter()
                fn(logits_BTV, labels_BT)
                timings[name].append(time.perf_counter() - start)
    backward_timings: dict[str, list[float]] = {"reference": [], "chunked": []}
    logits_grad_BTV = logits_BTV.requires_grad_(True)
    for _ in range(repeats):
        for name, fn in methods.items():
            logits_grad_BTV.grad = None
            start = time.perf_counter()
            fn(logits_grad_BTV, labels_BT).sum().backward()
            backward_timings[name].append(time.perf_counter() - start)
    del logits_BTV, logits_grad_BTV

    print(f"{'':>22} {'reference':>12} {'chunked':>12} {'ratio':>7}")
    for label, key, table in (
        ("forward ms", "forward_ms", timings),
        ("forward+backward ms", "forward_backward_ms", backward_timings),
    ):
        ref_ms, chunked_ms = _median_ms(table["reference"]), _median_ms(table["chunked"])
        print(f"{label:>22} {ref_ms:>12.1f} {chunked_ms:>12.1f} {ref_ms / chunked_ms:>6.2f}x", flush=True)
        figures[key] = {"reference": ref_ms, "chunked": chunked_ms, "ratio": ref_ms / chunked_ms}
    print("\n".join(memory_rows), flush=True)
    return figures


if __name__ == "__main__":
    run()
