"""Calibrate the planner's device figures against measurements.

`calibrate_from(gpu_check.json)` (`rlhfuse-plan calibrate --from`, no torch needed) fits a GPU's achieved-rate
factors to what `make gpu-check` measured on it and returns a `DeviceProfile` the grid (`--device FILE`) and
`plan=auto` (`plan_device=FILE`) price plans with. Each factor is fitted to the measurement that isolates it, with
the preset's datasheet peaks kept (the factors carry what the device achieves):

- decode step time per batch size -> `decode_mbu` (the slope: weight and KV reads) and `decode_step_overhead`
  (the intercept: sampling, scheduling, launches), least squares on relative error;
- prefill throughput -> `prefill_mfu` (the forward's GEMM ceiling);
- the pp=2 training step (Actor and Critic, forward and backward) -> `train_mfu`: an effective figure that
  includes that step's pipeline bubble and, on a one-GPU machine, two ranks sharing the GPU;
- the all-reduce bus bandwidth is reported; it replaces `link_eff` only when it was measured over a device
  link (gpu-check's two ranks talk through loopback sockets, which say nothing about NVLink).

The report gives each fitted figure next to the preset's and the fit's error on every measurement.

`calibrate_cpu()` (`rlhfuse-plan calibrate`, needs torch) calibrates the "this CPU" spec against measured runs of
small `rlhfuse.models.Transformer`s:

1. Micro-benchmarks set the device: best fp32 matmul rate -> `peak_flops`, large tensor copy -> `hbm_bw`.
2. One model ("fit") sets the two software factors the datasheet cannot give: the prefill MFU ceiling and the
   fixed per-layer cost of a decode step (Python and kernel dispatch, large on CPU).
3. The cost model with these values predicts prefill and decode-step times of the other models (held out),
   and the report gives the relative error on each. Timings are CPU time of this process (one torch thread),
   fastest of `repeats` runs, round-robin over the models: on a shared machine, wall time measures the
   neighbours too.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from rlhfuse.planner.cost import CostModel
from rlhfuse.planner.specs import (
    CPU,
    DEFAULT_EFFICIENCY,
    DEVICES,
    ClusterSpec,
    DeviceProfile,
    DeviceSpec,
    Efficiency,
    ModelSpec,
    gpu_preset,
    with_measured,
)

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


# ---- a GPU, from make gpu-check's figures -----------------------------------------------------------------------
RERUN = "rerun `make gpu-check` (its JSON file has the figure once the row passes)"


SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
)
"""A model's shape in gpu_check.json (`rlhfuse.models.ModelConfig` names; head_dim resolved)."""


def _shape(values: Any, where: str) -> ModelSpec:
    if not isinstance(values, Mapping) or any(not isinstance(values.get(k), int) for k in SHAPE_KEYS):
        raise ValueError(f"{where} must give the model's {', '.join(SHAPE_KEYS)}: {RERUN}")
    return ModelSpec(
        where, layers=values["num_layers"], hidden=values["hidden_size"], heads=values["num_heads"],
        ffn=values["intermediate_size"], vocab=values["vocab_size"], kv_heads=values["num_kv_heads"],
        head_size=values["head_dim"],
    )  # fmt: skip


def _number(figures: Mapping[str, Any], key: str, where: str) -> float:
    value = figures.get(key)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{where}: figures.{key}={value!r} must be a positive number: {RERUN}")
    return float(value)


@dataclass(frozen=True)
class GpuFigures:
    """What `calibrate_from` reads from gpu_check.json, checked (a problem names the file and the key)."""

    device_name: str
    decode_model: ModelSpec
    decode_context: float
    """Mean KV entries per sample over the timed decode steps."""
    decode_step_s: dict[int, float]
    prefill_batch: tuple[int, int]
    prefill_tokens_per_s: float
    train_model: ModelSpec
    train_samples: int
    train_tokens: float
    train_step_s: float
    train_devices: int
    allreduce_GBps: float | None
    """The largest message's bus bandwidth, when the all-reduce row passed."""
    allreduce_transport: str | None

    @classmethod
    def load(cls, path: Path) -> GpuFigures:
        where = str(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{where} does not exist: write it with `make gpu-check` on the GPU") from None
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{where} cannot be read as JSON ({err}): {RERUN}") from None
        figures = data.get("figures") if isinstance(data, dict) else None
        if not isinstance(figures, dict):
            raise ValueError(f"{where} has no 'figures' object: it is not a gpu_check.json; {RERUN}")
        model = figures.get("decode_model")
        steps = figures.get("decode_step_ms")
        if not isinstance(steps, dict) or not steps:
            raise ValueError(
                f"{where}: figures.decode_step_ms (ms per decode batch size) is missing: {RERUN}"
            )
        try:
            step_s = {int(bs): float(ms) / 1e3 for bs, ms in steps.items()}
        except (TypeError, ValueError):
            raise ValueError(f"{where}: figures.decode_step_ms must map batch sizes to ms: {RERUN}") from None
        if any(not (math.isfinite(t) and t > 0) or bs < 1 for bs, t in step_s.items()):
            raise ValueError(
                f"{where}: figures.decode_step_ms={steps} must be positive times of batches >= 1"
            )
        decode = _shape(model, f"{where}: figures.decode_model")
        assert isinstance(model, Mapping)
        try:
            context = float(model["prompt"]) + float(model["warm_steps"]) + (float(model["steps"]) - 1) / 2
            batch = figures["prefill_batch"]
            prefill_batch = (int(batch[0]), int(batch[1]))
        except (KeyError, TypeError, ValueError, IndexError):
            raise ValueError(
                f"{where}: figures.decode_model needs prompt, warm_steps and steps and figures.prefill_batch "
                f"[batch, length]: {RERUN}"
            ) from None
        busbw = figures.get("allreduce_busbw_GBps")
        largest = None
        if isinstance(busbw, dict) and busbw:
            largest = float(busbw[max(busbw, key=float)])
        return cls(
            device_name=str(data.get("device", "unknown")),
            decode_model=decode,
            decode_context=context,
            decode_step_s=dict(sorted(step_s.items())),
            prefill_batch=prefill_batch,
            prefill_tokens_per_s=_number(figures, "prefill_tokens_per_s", where),
            train_model=_shape(figures.get("train_model"), f"{where}: figures.train_model"),
            train_samples=int(_number(figures, "train_samples", where)),
            train_tokens=_number(figures, "train_tokens_per_step", where),
            train_step_s=_number(figures, "train_step_s", where),
            train_devices=int(_number(figures, "train_devices", where)),
            allreduce_GBps=largest,
            allreduce_transport=str(figures["allreduce_transport"])
            if "allreduce_transport" in figures
            else None,
        )


@dataclass(frozen=True)
class GpuCalibration:
    """The fitted profile, the preset it started from, and the fit's error on every measurement."""

    profile: DeviceProfile
    preset: str
    preset_reason: str
    rows: tuple[CalibrationRow, ...]
    notes: tuple[str, ...]

    def report(self) -> str:
        base, eff = DEVICES[self.preset], self.profile.eff
        pre = DEFAULT_EFFICIENCY
        lines = [
            f"{self.profile.source}: {self.preset_reason}; peaks of {base.name} kept",
            f"{'figure':<22} {'preset':>9} {'fitted':>9}",
        ]
        for key, scale, unit in (("decode_mbu", 1, ""), ("decode_step_overhead", 1e3, " ms"),
                                 ("prefill_mfu", 1, ""), ("train_mfu", 1, ""), ("link_eff", 1, "")):  # fmt: skip
            lines.append(
                f"{key:<22} {getattr(pre, key) * scale:>9.3f} {getattr(eff, key) * scale:>9.3f}{unit}"
            )
        lines.append(f"{'measurement':<34} {'measured ms':>11} {'fitted ms':>10} {'error':>7}")
        for r in self.rows:
            lines.append(
                f"{r.phase:<34} {r.measured * 1e3:>11.3f} {r.predicted * 1e3:>10.3f} {r.error:>+7.0%}"
            )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def calibrate_from(path: str | Path, preset: str | None = None) -> GpuCalibration:
    """Fit the achieved-rate factors of the GPU that wrote `path` (make gpu-check's JSON file); `preset` (h100,
    h200, a100) names the datasheet peaks to keep, else they follow the device's name. See the module docstring."""
    path = Path(path)
    figures = GpuFigures.load(path)
    if preset is None:
        preset, reason = gpu_preset(figures.device_name)
    elif preset not in DEVICES:
        raise ValueError(f"--preset {preset!r} is unknown: use one of {sorted(DEVICES)}")
    else:
        reason = f"preset {preset} given"
    device = DEVICES[preset]
    cluster = ClusterSpec(device, 1, 1)
    eff, rows = _fit_decode(cluster, figures, DEFAULT_EFFICIENCY)
    eff, prefill_row = _fit_prefill(cluster, figures, eff)
    eff, train_row = _fit_train(cluster, figures, eff)
    notes = []
    if figures.allreduce_GBps is None:
        notes.append("no all-reduce figure (the nccl 2 ranks row did not pass): link_eff is the preset's")
    elif figures.allreduce_transport in (None, "loopback"):
        notes.append(
            f"all-reduce {figures.allreduce_GBps:.2f} GB/s was measured between two ranks over loopback sockets, "
            f"not over NVLink/InfiniBand: link_eff is the preset's ({eff.link_eff})"
        )
    else:
        link = figures.allreduce_GBps * 1e9 / device.intra_bw
        eff = replace(eff, link_eff=min(1.0, link))
        notes.append(
            f"all-reduce {figures.allreduce_GBps:.1f} GB/s over {figures.allreduce_transport}: link_eff"
        )
    notes.append(
        "train_mfu is the pp=2 step's effective rate: its pipeline bubble is in it"
        + (", and both ranks shared one GPU" if figures.train_devices == 1 else "")
    )
    profile = DeviceProfile(replace(device, name=f"{device.name} (calibrated)"), eff, str(path))
    return GpuCalibration(profile, preset, reason, (*rows, prefill_row, train_row), tuple(notes))


def _decode_terms(cost: CostModel, fig: GpuFigures) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per measured batch size: the weight+KV read time at mbu 1, the GEMM time at decode_mfu, the measured time."""
    spec, dev = fig.decode_model, cost.device
    bs = np.array(list(fig.decode_step_s), dtype=np.float64)
    ctx = bs * fig.decode_context
    mem = (cost.weight_bytes(spec) + ctx * cost.kv_bytes_per_token(spec)) / dev.hbm_bw
    flops = bs * cost.matmul_flops_per_token(spec) + 4.0 * spec.layers * spec.hidden * ctx
    comp = flops / (dev.peak_flops * cost.eff.decode_mfu)
    return mem, comp, np.array(list(fig.decode_step_s.values()))


def _fit_decode(
    cluster: ClusterSpec, fig: GpuFigures, eff: Efficiency
) -> tuple[Efficiency, list[CalibrationRow]]:
    """decode_mbu and decode_step_overhead minimising the squared relative error over the batch sizes: for each
    mbu on a fine grid the best overhead is closed-form (weighted by 1/measured^2), floored at 0."""
    cost = CostModel(cluster, eff)
    mem, comp, measured = _decode_terms(cost, fig)
    fixed_layers = fig.decode_model.layers * eff.layer_overhead
    w = 1.0 / measured**2
    best: tuple[float, float, float] | None = None
    for mbu in np.geomspace(0.02, 1.0, 400):
        body = np.maximum(mem / mbu, comp) + fixed_layers
        overhead = max(0.0, float(np.sum(w * (measured - body)) / np.sum(w)))
        err = float(np.sum(((body + overhead) - measured) ** 2 * w))
        if best is None or err < best[0]:
            best = (err, float(mbu), overhead)
    assert best is not None
    eff = replace(eff, decode_mbu=best[1], decode_step_overhead=best[2])
    cost = CostModel(cluster, eff)
    rows = [
        CalibrationRow("decode", f"decode step bs {b}", float(t),
                       float(cost.decode_step_time(fig.decode_model, 1, b, b * fig.decode_context)), False)
        for b, t in fig.decode_step_s.items()
    ]  # fmt: skip
    return eff, rows


def _ceiling(eff: Efficiency, achieved: float, tokens: float) -> float:
    """The MFU ceiling whose `Efficiency.mfu` at `tokens` per GEMM is `achieved`, within (0, 1]."""
    return float(min(1.0, max(1e-4, achieved * (tokens + eff.half_tokens) / tokens)))


def _fit_prefill(cluster: ClusterSpec, fig: GpuFigures, eff: Efficiency) -> tuple[Efficiency, CalibrationRow]:
    cost = CostModel(cluster, eff)
    batch, length = fig.prefill_batch
    lens = [length] * batch
    measured = batch * length / fig.prefill_tokens_per_s
    compute = max(measured - fig.decode_model.layers * eff.layer_overhead, 1e-9)
    achieved = cost.forward_flops(fig.decode_model, lens) / (cluster.device.peak_flops * compute)
    eff = replace(eff, prefill_mfu=_ceiling(eff, achieved, batch * length))
    predicted = CostModel(cluster, eff).prefill_time(fig.decode_model, lens, 1)
    return eff, CalibrationRow("prefill", f"prefill {batch}x{length}", measured, predicted, False)


def _fit_train(cluster: ClusterSpec, fig: GpuFigures, eff: Efficiency) -> tuple[Efficiency, CalibrationRow]:
    """Forward and backward (3 x the forward's FLOPs) of the Actor (lm head) and the Critic (value head) over the
    step's tokens, on `train_devices` devices."""
    cost = CostModel(cluster, eff)
    spec = fig.train_model
    lens = [fig.train_tokens / fig.train_samples] * fig.train_samples
    flops = 3.0 * (cost.forward_flops(spec, lens, "lm") + cost.forward_flops(spec, lens, "value"))
    achieved = flops / (fig.train_devices * cluster.device.peak_flops * fig.train_step_s)
    eff = replace(eff, train_mfu=_ceiling(eff, achieved, fig.train_tokens))
    predicted = CostModel(cluster, eff).compute_time(
        flops, fig.train_devices, eff.train_mfu, fig.train_tokens
    )
    return eff, CalibrationRow("train", "pp=2 train step (actor+critic)", fig.train_step_s, predicted, False)
