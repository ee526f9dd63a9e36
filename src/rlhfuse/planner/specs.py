"""Hardware and model specifications the planner's cost model reads.

Units: FLOP/s, bytes, bytes/s, seconds. Every preset names its source; where a figure is an assumption rather
than a datasheet value, the docstring says so. Peaks are vendor *peaks*: achieved rates are peak times an
`Efficiency` factor (model-FLOPs utilisation for compute, bandwidth utilisation for memory and links).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU socket used as a device)."""

    name: str
    peak_flops: float
    """Dense peak of the compute dtype (bf16 on GPUs, fp32 on the CPU), FLOP/s, no sparsity."""
    hbm_bw: float
    """Device memory bandwidth, bytes/s."""
    memory: float
    """Device memory, bytes."""
    intra_bw: float
    """Per-device one-direction bandwidth to devices of the same node (NVLink), bytes/s."""
    inter_bw: float
    """Per-device one-direction bandwidth to other nodes (its share of the node's NICs), bytes/s."""
    host_bw: float
    """Host-to-device copy bandwidth (PCIe), bytes/s; used for Ref/RW swap-in from CPU memory."""
    intra_latency: float = 10e-6
    """Latency of one small collective inside a node, s (assumed: NCCL small-message all-reduce on NVLink)."""
    inter_latency: float = 20e-6
    """Latency of one small message between nodes, s (assumed: InfiniBand + NCCL protocol overhead)."""
    dtype_bytes: int = 2
    """Bytes per weight / activation element of the compute dtype (2 = bf16, 4 = fp32)."""


GB = 1e9
TB = 1e12

# NVIDIA H100 SXM5 80GB datasheet: 989 TFLOP/s dense BF16 (1979 with sparsity), 3.35 TB/s HBM3, 80 GB,
# NVLink 4 900 GB/s bidirectional (450 GB/s per direction). DGX H100 networking: 8 x ConnectX-7 400 Gb/s
# InfiniBand NDR, one per GPU = 50 GB/s per direction. PCIe Gen5 x16: 64 GB/s per direction.
H100 = DeviceSpec("H100-SXM-80GB", 989e12, 3.35 * TB, 80 * GB, 450 * GB, 50 * GB, 64 * GB)
# NVIDIA H200 SXM datasheet: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s; same NICs as H100.
H200 = DeviceSpec("H200-SXM-141GB", 989e12, 4.8 * TB, 141 * GB, 450 * GB, 50 * GB, 64 * GB)
# NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s dense BF16, 2.039 TB/s HBM2e, 80 GB, NVLink 3 600 GB/s
# bidirectional. DGX A100: 8 x 200 Gb/s HDR InfiniBand = 25 GB/s per GPU. PCIe Gen4 x16: 32 GB/s per direction.
A100 = DeviceSpec("A100-SXM-80GB", 312e12, 2.039 * TB, 80 * GB, 300 * GB, 25 * GB, 32 * GB)
# This machine (nominal, before calibration): Intel Xeon (Sapphire Rapids, lscpu model 207) at 2.3 GHz, 2 cores,
# 2 AVX-512 FMA units per core: 2 cores x 2.3e9 x 2 units x 16 fp32 lanes x 2 FLOP = 294 GFLOP/s fp32.
# Memory bandwidth of the VM is not published: 20 GB/s is an assumption that `calibrate_cpu` replaces with a
# measured copy bandwidth. "Links" are shared memory between processes of one host.
CPU = DeviceSpec(
    "this-CPU (nominal)", 294e9, 20 * GB, 16 * GB, 10 * GB, 10 * GB, 20 * GB, 50e-6, 50e-6, dtype_bytes=4
)

DEVICES: dict[str, DeviceSpec] = {"h100": H100, "h200": H200, "a100": A100, "cpu": CPU}

# GPU preset rule: the first preset whose name appears in the device's name (torch.cuda.get_device_name():
# H200, H100, A100); otherwise the preset whose memory is nearest the device's.
GPU_NAMES = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"))


def gpu_preset(device_name: str, memory_bytes: float | None = None) -> tuple[str, str]:
    """(device preset, why) for a GPU of this name and memory (None: unknown memory, h100 when no name matches)."""
    upper = device_name.upper()
    for token, preset in GPU_NAMES:
        if token in upper:
            return preset, f"{device_name!r} matches {token}"
    if memory_bytes is None:
        return "h100", f"{device_name!r} is not a preset and its memory is not known: H100 assumed"
    gpus = [k for k in DEVICES if k != "cpu"]
    preset = min(gpus, key=lambda k: (abs(DEVICES[k].memory - memory_bytes), k))
    return preset, (
        f"{device_name!r} is not a preset: nearest memory ({memory_bytes / 1e9:.0f} GB) is {DEVICES[preset].name}"
    )


@dataclass(frozen=True)
class ClusterSpec:
    """`nodes` x `gpus_per_node` identical devices."""

    device: DeviceSpec
    nodes: int
    gpus_per_node: int
    max_tp: int | None = None
    """Largest tensor-parallel degree a runtime can run (None = any that fits a node); the trainer's plan=auto
    passes its devices per node (rlhfuse.runtime runs tp up to the node for every task)."""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def validate(self) -> ClusterSpec:
        problems = []
        if self.nodes < 1:
            problems.append(f"nodes={self.nodes} must be >= 1")
        if self.gpus_per_node < 1:
            problems.append(f"gpus_per_node={self.gpus_per_node} must be >= 1")
        if self.max_tp is not None and self.max_tp < 1:
            problems.append(f"max_tp={self.max_tp} must be >= 1 (or None)")
        if problems:
            raise ValueError("invalid ClusterSpec: " + "; ".join(problems))
        return self


def cluster(
    device: str | DeviceSpec, nodes: int, gpus_per_node: int = 8, max_tp: int | None = None
) -> ClusterSpec:
    """A cluster of a named preset (`h100`, `h200`, `a100`, `cpu`) or of a given DeviceSpec."""
    if isinstance(device, str):
        if device.lower() not in DEVICES:
            raise ValueError(
                f"device={device!r} is unknown: use one of {sorted(DEVICES)} or pass a DeviceSpec"
            )
        device = DEVICES[device.lower()]
    return ClusterSpec(device, nodes, gpus_per_node, max_tp).validate()


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of the peaks, plus fixed software overheads. Values are assumptions, with sources.

    Megatron-LM reaches 41-48% MFU training LLaMA-class 30-70B models on H100 in bf16 (Megatron-Core
    performance tables); prefill-style forward passes run larger GEMMs with no backward and reach more.
    Decoding is bound by HBM bandwidth: vLLM / TensorRT-LLM decoding kernels achieve roughly 60-80% of peak
    HBM bandwidth (MBU); 0.7 is used. Collective bandwidth reaches about 70-80% of the link rate in NCCL tests.
    """

    train_mfu: float = 0.45
    """MFU of a large training GEMM workload (forward + backward)."""
    prefill_mfu: float = 0.55
    """MFU of forward-only passes over whole sequences (prefill, Ref/RW/Critic inference)."""
    decode_mfu: float = 0.5
    """MFU ceiling of decoding GEMMs once the batch is large enough to be compute-bound (sets BSmax)."""
    decode_mbu: float = 0.7
    """Fraction of HBM bandwidth achieved while decoding (weights + KV cache reads)."""
    half_tokens: float = 64.0
    """Tokens per GEMM at which MFU reaches half its ceiling: small micro-batches run below the ceiling."""
    link_eff: float = 0.75
    """Fraction of NVLink / InfiniBand / PCIe bandwidth achieved by collectives and copies."""
    decode_step_overhead: float = 0.5e-3
    """Fixed time per decode step (sampling, scheduling, launch), s. CUDA-graph engines: 0.2-1 ms."""
    layer_overhead: float = 4e-6
    """Fixed time per layer of any forward pass (kernel launches / dispatch that CUDA graphs do not hide), s."""
    memory_reserve: float = 0.1
    """Fraction of device memory not usable (CUDA context, allocator fragmentation)."""
    grad_overlap: float = 1.0
    """Fraction of a stage's last backward that its bucketed data-parallel gradient all-reduce overlaps (1: the
    runtime's buckets, `rlhfuse.distributed.grad_buckets`; 0: reduced after the backward, nothing hidden)."""

    def mfu(self, ceiling: float, tokens: Any) -> Any:
        """MFU of a GEMM over `tokens` rows (a number or an array): `ceiling * tokens / (tokens + half_tokens)`."""
        return ceiling * tokens / (tokens + self.half_tokens)


DEFAULT_EFFICIENCY = Efficiency()


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a LLaMA-style decoder (SwiGLU MLP, RoPE, untied embeddings) for cost estimates."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int = 32000
    kv_heads: int | None = None
    """None means multi-head attention (kv_heads = heads)."""
    head_size: int | None = None
    """Channels per head; None means hidden // heads (ModelConfig.head_dim)."""
    qkv_bias: bool = False
    """Biases on q / k / v (Qwen2, or LLaMA with attention_bias)."""
    o_bias: bool = False
    """A bias on the output projection (LLaMA with attention_bias)."""
    tied: bool = False
    """The LM head shares the embedding's weight (tie_word_embeddings)."""
    qk_norm: bool = False
    """q and k normalised per head (Qwen3, Gemma 3): two head_dim weights per layer."""
    experts: int = 0
    """Experts of each mixture-of-experts MLP (0: every MLP dense)."""
    expert_ffn: int = 0
    """Each expert's intermediate size."""
    experts_per_token: int = 0
    """Experts each token runs (top-k): what a token's FLOPs count."""
    moe_layers: tuple[bool, ...] = ()
    """Which layers' MLPs are mixtures of experts (empty: none)."""

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.hidden // self.heads

    @property
    def attention_params(self) -> int:
        """Matmul weights of one block's attention: q, o (h x heads x head_dim), k, v (h x kv)."""
        q = self.heads * self.head_dim
        kv = self.n_kv_heads * self.head_dim
        return 2 * self.hidden * q + 2 * self.hidden * kv

    @functools.cached_property
    def moe_layer_count(self) -> int:
        return sum(self.moe_layers)

    def block_params(self, *, active: bool = False) -> int:
        """Matmul weights of every decoder block (`active`: those a token runs, the FLOP count); norms and biases
        left out (`rlhfuse.planner.memory.shard_count` counts every tensor). The planner's hot path: no loop."""
        moe = self.moe_layer_count
        dense_mlp = (self.layers - moe) * 3 * self.hidden * self.ffn
        experts = self.experts_per_token if active else self.experts
        moe_mlp = moe * (self.hidden * self.experts + 3 * self.hidden * self.expert_ffn * experts)
        return self.layers * self.attention_params + dense_mlp + moe_mlp

    def params(self, head: str = "lm") -> int:
        """Total weights: embeddings + blocks + head (`lm`: vocab x hidden; `value`: hidden x 1)."""
        head_params = self.vocab * self.hidden if head == "lm" else self.hidden
        return self.vocab * self.hidden + self.block_params() + head_params

    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> ModelSpec:
        """From an `rlhfuse.models.ModelConfig` (read by attribute, so no torch import is needed here; the fields
        past the shape, head_dim, biases and ties, are optional)."""
        bias = bool(getattr(config, "attention_bias", False))
        return cls(
            name=name or f"{config.num_layers}L-{config.hidden_size}",
            layers=config.num_layers,
            hidden=config.hidden_size,
            heads=config.num_heads,
            ffn=config.intermediate_size,
            vocab=config.vocab_size,
            kv_heads=config.num_kv_heads,
            head_size=getattr(config, "resolved_head_dim", None),
            qkv_bias=bool(getattr(config, "qkv_bias", bias)),
            o_bias=bool(getattr(config, "o_bias", bias)),
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            qk_norm=bool(getattr(config, "qk_norm", False)),
            experts=int(getattr(config, "num_experts", 0) or 0),
            expert_ffn=int(getattr(config, "expert_intermediate_size", 0) or 0),
            experts_per_token=int(getattr(config, "num_experts_per_tok", 0) or 0),
            moe_layers=tuple(config.is_moe_layer(i) for i in range(config.num_layers))
            if getattr(config, "num_experts", 0)
            else (),
        )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str | None = None) -> ModelSpec:
        """From a Hugging Face config.json dict (LLaMA / Qwen2 keys)."""
        missing = [
            k
            for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size")
            if k not in d
        ]
        if missing:
            raise ValueError(f"config.json lacks {missing}: rlhfuse-plan reads LLaMA-style configs")
        qwen2 = d.get("model_type") == "qwen2"
        bias = bool(d.get("attention_bias", False))
        return cls(
            name=name or str(d.get("_name_or_path") or d.get("model_type") or "hf"),
            layers=int(d["num_hidden_layers"]),
            hidden=int(d["hidden_size"]),
            heads=int(d["num_attention_heads"]),
            ffn=int(d["intermediate_size"]),
            vocab=int(d.get("vocab_size", 32000)),
            kv_heads=d.get("num_key_value_heads"),
            head_size=d.get("head_dim"),
            qkv_bias=qwen2 or bias,
            o_bias=bias and not qwen2,
            tied=bool(d.get("tie_word_embeddings", False)),
        )


# LLaMA-1 (Touvron et al. 2023, Table 2; RLHFuse Table 2): 13B/33B/65B.
LLAMA_13B = ModelSpec("13B", layers=40, hidden=5120, heads=40, ffn=13824)
LLAMA_33B = ModelSpec("33B", layers=60, hidden=6656, heads=52, ffn=17920)
LLAMA_65B = ModelSpec("65B", layers=80, hidden=8192, heads=64, ffn=22016)
LLAMA_7B = ModelSpec("7B", layers=32, hidden=4096, heads=32, ffn=11008)
MODELS: dict[str, ModelSpec] = {m.name.lower(): m for m in (LLAMA_7B, LLAMA_13B, LLAMA_33B, LLAMA_65B)}


def model(name: str) -> ModelSpec:
    """A preset by name (`7b`, `13b`, `33b`, `65b`)."""
    key = name.lower()
    if key not in MODELS:
        raise ValueError(f"model={name!r} is unknown: use one of {sorted(MODELS)}")
    return MODELS[key]


def with_measured(
    device: DeviceSpec, *, peak_flops: float, hbm_bw: float, name: str | None = None
) -> DeviceSpec:
    """A copy of `device` with measured peak / bandwidth (what CPU calibration produces)."""
    if not (math.isfinite(peak_flops) and peak_flops > 0 and math.isfinite(hbm_bw) and hbm_bw > 0):
        raise ValueError(f"measured peak_flops={peak_flops} and hbm_bw={hbm_bw} must be finite and > 0")
    return replace(device, peak_flops=peak_flops, hbm_bw=hbm_bw, name=name or device.name + " (calibrated)")


# ---- device profiles: a device with its achieved-rate factors, as a file ------------------------------------
DEVICE_FILE_FORMAT = "rlhfuse-device/1"
_RATIOS = (
    "train_mfu",
    "prefill_mfu",
    "decode_mfu",
    "decode_mbu",
    "link_eff",
    "memory_reserve",
    "grad_overlap",
)
_MAY_BE_ZERO = ("memory_reserve", "grad_overlap")


@dataclass(frozen=True)
class DeviceProfile:
    """A device and the `Efficiency` the planner prices it with: a preset (datasheet peaks, assumed factors) or
    a file written by `rlhfuse-plan calibrate --from gpu_check.json` (the factors fitted to measurements).
    Read by `rlhfuse-plan ... --device FILE` and the trainer's `plan_device=FILE` (plan=auto)."""

    device: DeviceSpec
    eff: Efficiency = DEFAULT_EFFICIENCY
    source: str = "preset"
    """Where the factors come from: `preset`, or the measurement file they were fitted to."""

    def to_dict(self) -> dict[str, Any]:
        return {"format": DEVICE_FILE_FORMAT, "source": self.source, "device": asdict(self.device),
                "efficiency": asdict(self.eff)}  # fmt: skip

    def save(self, path: Path) -> Path:
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: Any, where: str) -> DeviceProfile:
        """Checked: every field present, numbers finite and in range; a problem names `where` and the key."""
        if not isinstance(data, dict) or data.get("format") != DEVICE_FILE_FORMAT:
            raise ValueError(
                f"{where} is not a device file (format {DEVICE_FILE_FORMAT!r}): write one with "
                f"`rlhfuse-plan calibrate --from gpu_check.json --out {where}`"
            )
        device = _checked_fields(DeviceSpec, data.get("device"), f"{where}: device")
        eff = _checked_fields(Efficiency, data.get("efficiency"), f"{where}: efficiency")
        problems = [
            f"{where}: device.{k}={v} must be > 0"
            for k, v in device.items()
            if k != "name" and not (isinstance(v, int | float) and math.isfinite(v) and v > 0)
        ]
        for k, v in eff.items():
            number = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            if k in _MAY_BE_ZERO:
                ok, interval = number and 0 <= v <= 1, "[0, 1]"
            elif k in _RATIOS:
                ok, interval = number and 0 < v <= 1, "(0, 1]"
            else:
                ok, interval = number and v >= 0, "[0, inf)"
            if not ok:
                problems.append(f"{where}: efficiency.{k}={v} must be in {interval}")
        if problems:
            raise ValueError("; ".join(problems))
        device["dtype_bytes"] = int(device["dtype_bytes"])
        return cls(DeviceSpec(**device), Efficiency(**eff), str(data.get("source", where)))

    @classmethod
    def load(cls, path: str | Path) -> DeviceProfile:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(
                f"device file {path} does not exist: write one with `rlhfuse-plan calibrate --from gpu_check.json`"
            ) from None
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"device file {path} cannot be read as JSON: {err}") from None
        return cls.from_dict(data, str(path))


def _checked_fields(kind: type, values: Any, where: str) -> dict[str, Any]:
    names = {f.name for f in fields(kind)}
    if not isinstance(values, dict):
        raise ValueError(f"{where} must be an object with the keys {sorted(names)}")
    missing, unknown = sorted(names - values.keys()), sorted(values.keys() - names)
    if missing or unknown:
        raise ValueError(f"{where}: missing keys {missing}, unknown keys {unknown}")
    return dict(values)


def device_profile(text: str) -> DeviceProfile:
    """A preset name (`h100`, `h200`, `a100`, `cpu`) with the assumed factors, or the path of a device file."""
    if text.lower() in DEVICES:
        return DeviceProfile(DEVICES[text.lower()])
    if text.endswith(".json") or Path(text).exists():
        return DeviceProfile.load(text)
    raise ValueError(f"device={text!r} is unknown: use one of {sorted(DEVICES)} or a device file (.json)")
