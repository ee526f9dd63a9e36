"""Calibrate the "this CPU" spec against measured runs of small `rlhfuse.models.Transformer`s (needs torch).

1. Micro-benchmarks set the device: best fp32 matmul rate -> `peak_flops`, large tensor copy -> `hbm_bw`.
2. One model ("fit") sets the two software factors the datasheet cannot give: the prefill MFU ceiling and the
   fixed per-layer cost of a decode step (Python and kernel dispatch, large on CPU).
3. The cost model with these values predicts prefill and decode-step times of the other models (held out),
   and the report gives the relative error on each. Timings are CPU time of this process (one torch thread),
   fastest of `repeats` runs, round-robin over the models: on a shared machine, wall time measures the
   neighbours too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from rlhfuse.planner.cost import CostModel
from rlhfuse.planner.specs import CPU, ClusterSpec, DeviceSpec, Efficiency, ModelSpec, with_measured

PREFILL_BATCH, PREFILL_LEN = 4, 128
DECODE_BATCH, DECODE_CONTEXT, DECODE_STEPS = 4, 128, 8


def _models() -> list[tuple[str, dict[str, int]]]:
    """(name, ModelConfig overrides): the first is fitted, the others are held out."""
    return [
        ("fit-256x4", {"hidden_size": 256, "intermediate_size": 688, "num_layers": 4, "num_heads": 4,
                       "num_kv_heads": 4, "vocab_size": 2048}),
        ("tiny-64x2", {}),
        ("small-512x4", {"hidden_size": 512, "intermediate_size": 1376, "num_layers": 4, "num_heads": 8,
                         "num_kv_heads": 4, "vocab_size": 4096}),
        ("deep-256x8", {"hidden_size": 256, "intermediate_size": 688, "num_layers": 8, "num_heads": 4,
                        "num_kv_heads": 2, "vocab_size": 2048}),
    ]  # fmt: skip


def _best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Fastest of `repeats` runs after a warm-up: on a shared machine, slower runs measure the neighbours."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


@dataclass(frozen=True)
class CalibrationRow:
    model: str
    phase: str
    measured: float
    predicted: float
    held_out: bool

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


@dataclass(frozen=True)
class Calibration:
    device: DeviceSpec
    eff: Efficiency
    rows: tuple[CalibrationRow, ...]
    threads: int

    @property
    def held_out_mean_abs_error(self) -> float:
        errs = [abs(r.error) for r in self.rows if r.held_out]
        return sum(errs) / len(errs) if errs else float("nan")

    def report(self) -> str:
        lines = [
            f"this CPU ({self.threads} torch threads): matmul {self.device.peak_flops / 1e9:.1f} GFLOP/s fp32, "
            f"copy bandwidth {self.device.hbm_bw / 1e9:.1f} GB/s "
            f"(nominal spec: {CPU.peak_flops / 1e9:.0f} GFLOP/s, {CPU.hbm_bw / 1e9:.0f} GB/s)",
            f"fitted on the first model: prefill MFU ceiling {self.eff.prefill_mfu:.2f}, "
            f"decode fixed cost {self.eff.layer_overhead * 1e6:.0f} us/layer",
            f"{'model':<12} {'phase':<28} {'measured ms':>11} {'predicted ms':>12} {'error':>7}",
        ]
        for r in self.rows:
            lines.append(
                f"{r.model:<12} {r.phase:<28} {r.measured * 1e3:>11.2f} {r.predicted * 1e3:>12.2f} "
                f"{r.error:>+7.0%}{'' if r.held_out else '  (fitted)'}"
            )
        lines.append(f"held-out mean |error|: {self.held_out_mean_abs_error:.0%}")
        return "\n".join(lines)


def calibrate_cpu(repeats: int = 5) -> Calibration:
    """Measure, fit on the first model, predict the rest (see the module docstring). Takes a few seconds."""
    import torch

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _calibrate(torch, repeats)
    finally:
        torch.set_num_threads(threads)


def _calibrate(torch: Any, repeats: int) -> Calibration:
    from rlhfuse.models import KVCache, ModelConfig, Transformer

    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    peak = 2 * n**3 / _best_seconds(lambda: a @ b, 4 * repeats)
    big = torch.randn(16 * 2**20)
    dst = torch.empty_like(big)
    bw = 2 * big.numel() * 4 / _best_seconds(lambda: dst.copy_(big), 4 * repeats)
    device = with_measured(CPU, peak_flops=peak, hbm_bw=bw, name="this-CPU (calibrated)")
    cluster = ClusterSpec(device, 1, 1)
    # CPU kernels: the peak is a measured achievable rate, so ceilings start at 1; no fixed step overhead
    eff = Efficiency(train_mfu=1.0, prefill_mfu=1.0, decode_mfu=1.0, decode_mbu=1.0, decode_step_overhead=0.0,
                     layer_overhead=0.0, memory_reserve=0.0)  # fmt: skip

    nets = []
    for name, overrides in _models():
        config = ModelConfig.tiny(**overrides)
        ids = torch.randint(0, config.vocab_size, (PREFILL_BATCH, PREFILL_LEN))
        nets.append((name, config, Transformer(config).eval(), ids))
    best: dict[str, list[float]] = {name: [float("inf"), float("inf")] for name, *_ in nets}
    with torch.no_grad():
        # round-robin over the models, keeping each one's fastest run: a busy spell hits every model alike
        for _ in range(repeats + 1):
            for name, config, net, ids in nets:
                start = time.process_time()
                net(ids)
                best[name][0] = min(best[name][0], time.process_time() - start)
                cache = KVCache.allocate(config, DECODE_BATCH, DECODE_CONTEXT + DECODE_STEPS + 1)
                net(ids[:DECODE_BATCH, :DECODE_CONTEXT], cache=cache)
                step_ids = ids[:DECODE_BATCH, :1]
                start = time.process_time()
                for _ in range(DECODE_STEPS):
                    net(step_ids, cache=cache)
                best[name][1] = min(best[name][1], (time.process_time() - start) / DECODE_STEPS)
    measured = [
        (name, ModelSpec.from_config(config, name), best[name][0], best[name][1])
        for name, config, _, _ in nets
    ]

    # fit on the first model: decode (memory-bound) gives the per-layer fixed cost, then prefill the MFU ceiling
    _, spec0, prefill0, decode0 = measured[0]
    cost = CostModel(cluster, eff)
    eff = replace(eff, layer_overhead=max(0.0, (decode0 - _decode(cost, spec0)) / spec0.layers))
    cost = CostModel(cluster, eff)
    compute0 = cost.prefill_time(spec0, [PREFILL_LEN] * PREFILL_BATCH, 1) - spec0.layers * eff.layer_overhead
    eff = replace(
        eff, prefill_mfu=min(1.0, compute0 / max(prefill0 - spec0.layers * eff.layer_overhead, 1e-9))
    )
    cost = CostModel(cluster, eff)

    rows = []
    for i, (name, spec, t_prefill, t_decode) in enumerate(measured):
        predicted_prefill = cost.prefill_time(spec, [PREFILL_LEN] * PREFILL_BATCH, 1)
        rows.append(
            CalibrationRow(
                name, f"prefill {PREFILL_BATCH}x{PREFILL_LEN}", t_prefill, predicted_prefill, i > 0
            )
        )
        rows.append(
            CalibrationRow(
                name,
                f"decode step b{DECODE_BATCH} ctx{DECODE_CONTEXT}",
                t_decode,
                float(_decode(cost, spec)),
                i > 0,
            )
        )
    return Calibration(device, eff, tuple(rows), torch.get_num_threads())


def _decode(cost: CostModel, spec: ModelSpec) -> float:
    ctx = DECODE_BATCH * (DECODE_CONTEXT + 1)
    return float(cost.decode_step_time(spec, 1, DECODE_BATCH, ctx))
