"""Masked GAE on CPU: the implementations of `rlhfuse.algorithms.gae` against the reference loop.

Legend: B batch rows, T time (tokens).

Compared, side by side in one process: `compute_gae_loop` (reference, one batched step per token),
`compute_gae` (dispatch: the numba-compiled recursion on CPU), `compute_gae_scan` (reverse compaction + fp64
cumulative sum, pure PyTorch) and `compute_gae_matrix` (one triangular product per chunk, chunk 128 and 512).
Runs are interleaved (loop, then each method, repeated) so that machine noise hits all sides alike; each side's
time is the median of its runs. Masks keep ~90% of the tokens at random, with interior holes, so compaction and
skipping are exercised. Accuracy: a second line per T gives each side's max |difference| (advantages and
returns) to the loop run in fp64 on the same inputs, the fp32 loop included.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from rlhfuse.algorithms.gae import (
    compute_gae,
    compute_gae_loop,
    compute_gae_matrix,
    compute_gae_scan,
)

GAMMA, LAM = 0.99, 0.95


def _time_once(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def run(quick: bool = False) -> dict[str, Any]:
    """Figures: `loop_ms.T{T}`, `ms.{method}.T{T}`, `speedup.{method}.T{T}` (loop / method), `max_err.{method}.T{T}`."""
    B = 64
    lengths = (256, 1024) if quick else (2048, 8192)
    repeats = 5 if quick else 11
    methods: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
        "compute_gae": compute_gae,
        "scan": compute_gae_scan,
        "matrix 128": functools.partial(compute_gae_matrix, chunk_size=128),
        "matrix 512": functools.partial(compute_gae_matrix, chunk_size=512),
    }
    print(
        f"threads={torch.get_num_threads()}  B={B}  gamma={GAMMA} lam={LAM}  ~90% mask  median of {repeats}"
    )
    header = "".join(f" {name + ' ms':>15} {'speedup':>8}" for name in methods)
    print(f"{'T':>6} {'loop ms':>10}{header}")
    generator = torch.Generator().manual_seed(0)
    figures: dict[str, Any] = {"loop_ms": {}, "ms": {}, "speedup": {}, "max_err": {}}
    for T in lengths:
        rewards_BT = torch.randn(B, T, generator=generator)
        values_BT = torch.randn(B, T, generator=generator)
        mask_BT = torch.rand(B, T, generator=generator) < 0.9
        args = (rewards_BT, values_BT, mask_BT, GAMMA, LAM)
        for fn in methods.values():
            fn(*args)  # warm-up: first-call allocations, numba compilation
        loop_s: list[float] = []
        method_s: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(repeats):
            loop_s.append(_time_once(compute_gae_loop, *args))
            for name, fn in methods.items():
                method_s[name].append(_time_once(fn, *args))
        expected = compute_gae_loop(rewards_BT.double(), values_BT.double(), mask_BT, GAMMA, LAM)

        def max_diff(outputs: tuple[torch.Tensor, torch.Tensor], expected=expected) -> float:
            return max((got - want).abs().max().item() for got, want in zip(outputs, expected, strict=True))

        loop_ms = 1e3 * statistics.median(loop_s)
        figures["loop_ms"][f"T{T}"] = loop_ms
        row = f"{T:>6} {loop_ms:>10.1f}"
        diffs = f"{'|err|':>6} {max_diff(compute_gae_loop(*args)):>10.1e}"
        for name, fn in methods.items():
            method_ms = 1e3 * statistics.median(method_s[name])
            err = max_diff(fn(*args))
            row += f" {method_ms:>15.3f} {loop_ms / method_ms:>7.1f}x"
            diffs += f" {err:>15.1e} {'':>8}"
            for table, value in (("ms", method_ms), ("speedup", loop_ms / method_ms), ("max_err", err)):
                figures[table].setdefault(name.replace(" ", "_"), {})[f"T{T}"] = value
        print(row, flush=True)
        print(diffs, flush=True)
    print("|err|: max |difference| to the loop in fp64, advantages and returns (inputs fp32)")
    print(
        "note: compute_gae_loop is already vectorised over the batch (one step per token, ~8 tensor ops each); "
        "the paper's >100x is against one GPU kernel launch per token."
    )
    return figures


if __name__ == "__main__":
    run()
