"""Configuration of the Hydra group `generator`, for every generator.

`GenerationConfig` composes the sampling settings every generator reads (`SamplingConfig`), the generation
instances, and each backend's own options (`EngineOptions` for generator=engine, `VLLMOptions` for
generator=vllm). The composed parts are flat in YAML: `generator.num_slots` is `GenerationConfig.engine.num_slots`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhfuse.core.config_checks import flat_field, need, non_negative
from rlhfuse.core.sampling_config import SamplingConfig


@dataclass
class EngineOptions:
    """generator=engine (rlhfuse.generation.engine) only."""

    # KV-cache slots per instance: most samples decoded together (continuous batching: waiting samples join as
    # slots free up). 0 = room for every sample of the iteration.
    num_slots: int = 0
    # Prefill each prompt once and copy its KV cache to the slots of its n samples.
    prefix_sharing: bool = True
    # Lossless speculative decoding (rlhfuse.generation.speculative): off | ngram (verify drafts from the prompt
    # group's n-gram index whenever a running sample has one) | auto (only when the measured step costs say a
    # verify step of k+1 positions makes more tokens per second than a plain decode step: the small tail batch).
    # The tokens are the same in every mode.
    speculative: Literal["off", "ngram", "auto"] = "off"
    # k: draft tokens verified per step (>= 1, < generator.max_new_tokens); each verify step computes k+1
    # positions per running sample.
    speculative_tokens: int = 4
    # Finished samples' KV caches kept for a later prompt that continues one (rlhfuse.generation.prefix_store):
    # a multi-turn episode's next turn (agent.env) prefills only its new tokens. At most this many kept (the
    # oldest dropped); 0 = off (every prompt prefilled whole).
    prefix_cache: int = 0

    def problems(self) -> list[str]:
        problems: list[str] = []
        non_negative(problems, "generator.num_slots", self.num_slots, "0 = room for every sample")
        non_negative(problems, "generator.prefix_cache", self.prefix_cache, "0 = off")
        return problems


@dataclass
class VLLMOptions:
    """generator=vllm (rlhfuse.generation.vllm_engine) only."""

    # CPU backend: bytes of KV cache per vLLM engine, in GiB.
    vllm_kv_cache_gb: float = 1.0
    # GPU backend: fraction of device memory each vLLM engine may take (weights + KV).
    vllm_gpu_memory_utilization: float = 0.5
    # GPU backend: capture CUDA graphs for decode, vLLM's default (false = enforce_eager: no capture, no graph
    # memory, slower decode). The CPU backend always runs eagerly.
    vllm_cuda_graphs: bool = True
    # GPU backend: vLLM's sleep level through each training step, after the rollout (2: weights discarded and
    # KV cache freed, the weight sync reloads them; 1: weights offloaded to host memory; 0: stay awake). The CPU
    # backend has no sleep mode.
    vllm_sleep_level: int = 2


@dataclass
class GenerationConfig:
    # Registered generator name: sampling (single process, batched, KV cache) | engine (continuous batching,
    # instances, migration) | vllm.
    name: str = "sampling"
    sampling: SamplingConfig = flat_field(SamplingConfig)
    # Generation instances (data-parallel copies of the Actor; > 1 selects the engine). With pipeline=plain the
    # job runs one process per instance (rlhfuse.trainer.strategies.plain.launch), training data-parallel over them.
    instances: int = 1
    # Tensor-parallel degree of one generation instance: each instance spans generator.tp consecutive ranks and
    # generates its own share of the batch. generator=sampling under pipeline=fused|serial_1f1b: instances = world
    # size / generator.tp (any divisor, whatever pipeline.actor_tp), each rank receiving exactly its tp shard of
    # the trained Actor after every update (rlhfuse.runtime.reshard). generator=vllm: generator.instances engines
    # with vLLM's own tensor parallelism over instances x tp processes, fed whole tensors (vLLM keeps each rank's
    # slice), the tail migrating between them and inference fused into it (rlhfuse.generation.lockstep). 1 = a
    # whole copy per rank.
    tp: int = 1
    # true = keep every instance in this one process, stepped in turn (no launch, no speed-up: a correctness
    # mode for tests and scripts that cannot re-launch themselves).
    in_process: bool = False
    engine: EngineOptions = flat_field(EngineOptions)
    vllm: VLLMOptions = flat_field(VLLMOptions)

    def problems(self) -> list[str]:
        from rlhfuse.generation.speculative import speculation_problems  # with the attention backends (torch)

        problems = self.sampling.problems() + self.engine.problems()
        e = self.engine
        # which generators speculate is their registry entries' rule (`rlhfuse.trainer.rules`)
        problems += speculation_problems(e.speculative, e.speculative_tokens, self.sampling.max_new_tokens)
        need(problems, self.instances >= 1, f"generator.instances={self.instances} must be >= 1")
        utilization = self.vllm.vllm_gpu_memory_utilization
        need(
            problems,
            0 < utilization <= 1,
            f"generator.vllm_gpu_memory_utilization={utilization} must be a fraction of the device's memory in "
            "(0, 1]: set e.g. 0.5",
        )
        need(
            problems,
            self.vllm.vllm_kv_cache_gb > 0,
            f"generator.vllm_kv_cache_gb={self.vllm.vllm_kv_cache_gb} must be > 0 (GiB of KV cache per vLLM engine "
            "on the CPU backend)",
        )
        level = self.vllm.vllm_sleep_level
        need(
            problems,
            level in (0, 1, 2),
            f"generator.vllm_sleep_level={level} is not one of vLLM's sleep levels: set 0 (stay awake), 1 (weights "
            "to host memory) or 2 (weights discarded and reloaded by the weight sync)",
        )
        return problems
