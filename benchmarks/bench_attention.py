"""Grouped-query SDPA layouts side by side (`make bench BENCH=attention`): native (enable_gqa), K / V repeated to
H heads, query heads folded onto the kv heads (`rlhfuse.models.attention.sdpa_call`), for a decode step, a
speculative verify step and a padded prefill of a LLaMA-like attention layer (32 query heads, 8 kv heads, head
dim 128), each with a padding mask.

Prints the median time per call of each layout, the largest difference from the native layout, the bytes each
layout materialises besides the inputs (repeat: K and V at H heads; fold: the mask's rows G times), and which
layout the CUDA call picks. On CUDA (bf16) the native layout of a masked grouped-query call is the math kernel,
which also materialises the [B, H, T, S] scores; on CPU (fp32) every layout runs the CPU flash kernel.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch.nn.attention import SDPBackend

from rlhfuse.models.attention import KvLayout, SdpaCall, sdpa_as_called, sdpa_call

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def _time_ms(fn, rounds: int, device: torch.device) -> float:
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _extra_bytes(layout: KvLayout, batch: int, t: int, s: int, element: int) -> int:
    group = HEADS // KV_HEADS
    if layout == "repeat":
        return 2 * batch * HEADS * s * HEAD_DIM * element
    if layout == "fold" and t > 1:
        return batch * group * t * s  # the repeated bool mask
    return 0


def run(quick: bool = False) -> dict[str, Any]:
    """Figures per shape (`decode`, `verify_k=4`, `prefill`): T, S, cuda_choice and per layout ms, extra_mib,
    max_diff."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch = 2 if quick else 8
    rounds = 3 if quick else 9
    shapes = [("decode", 1, 1024), ("verify k=4", 5, 1024), ("prefill", 256, 256)]
    if quick:
        shapes = [(name, min(t, s // 4), s // 4) for name, t, s in shapes]
    gen = torch.Generator(device=device).manual_seed(0)
    figures: dict[str, Any] = {"device": str(device), "dtype": str(dtype), "batch": batch}
    print(f"device {device}, {dtype}, batch {batch}, {HEADS} query heads / {KV_HEADS} kv heads x {HEAD_DIM}")
    for name, t, s in shapes:
        q = torch.randn(batch, t, HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype).transpose(1, 2)
        k, v = (
            torch.randn(batch, KV_HEADS, s, HEAD_DIM, generator=gen, device=device, dtype=dtype)
            for _ in range(2)
        )
        allowed = torch.ones(batch, 1, t, s, dtype=torch.bool, device=device).tril(s - t)
        allowed[0, :, :, :3] = False  # row 0's first keys are padding
        chosen = sdpa_call(
            "cuda",
            dtype,
            masked=True,
            num_heads=HEADS,
            num_kv_heads=KV_HEADS,
            num_queries=t,
            head_dim=HEAD_DIM,
        ).kv
        native = sdpa_as_called(q, k, v, allowed, SdpaCall("native", ()))
        cells = []
        row: dict[str, Any] = {"T": t, "S": s, "cuda_choice": chosen}
        for layout in ("native", "repeat", "fold"):
            call = SdpaCall(layout, (SDPBackend.FLASH_ATTENTION,))
            out = sdpa_as_called(q, k, v, allowed, call)
            ms = _time_ms(lambda args=(q, k, v, allowed, call): sdpa_as_called(*args), rounds, device)
            diff = float((out.float() - native.float()).abs().max())
            extra = _extra_bytes(layout, batch, t, s, q.element_size()) / 2**20
            cells.append(f"{layout} {ms:.2f} ms (+{extra:.1f} MiB, max diff {diff:.1e})")
            row[layout] = {"ms": ms, "extra_mib": extra, "max_diff": diff}
        print(f"{name:10s} T={t:<4d} S={s:<5d} " + " | ".join(cells) + f"  -> CUDA choice: {chosen}")
        figures[name.replace(" ", "_")] = row
    return figures


if __name__ == "__main__":
    run()
