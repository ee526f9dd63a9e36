"""Configuration of the generation engine (`generator=engine`).

`GenerationConfig` extends the trainer's `GeneratorConfig` with the engine's own fields; it is the schema of the
Hydra group `generator` for every generator, so the fields below are ignored by `generator=sampling` (and
`validate` refuses them there when set away from their defaults).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfuse.core.config import need, non_negative
from rlhfuse.core.sampling import GeneratorConfig


@dataclass
class GenerationConfig(GeneratorConfig):
    # Generation instances (data-parallel copies of the Actor; > 1 selects the engine). With pipeline=plain the
    # job runs one process per instance (rlhfuse.trainer.data_parallel), training data-parallel over them.
    instances: int = 1
    # true = keep every instance in this one process, stepped in turn (no launch, no speed-up: a correctness
    # mode for tests and scripts that cannot re-launch themselves).
    in_process: bool = False
    # generator=engine only. KV-cache slots per instance: most samples decoded together (continuous batching:
    # waiting samples join as slots free up). 0 = room for every sample of the iteration.
    num_slots: int = 0
    # generator=engine only. Prefill each prompt once and copy its KV cache to the slots of its n samples.
    prefix_sharing: bool = True
    # generator=vllm only. CPU backend: bytes of KV cache per vLLM engine, in GiB.
    vllm_kv_cache_gb: float = 1.0
    # generator=vllm only. GPU backend: fraction of device memory each vLLM engine may take (weights + KV).
    vllm_gpu_memory_utilization: float = 0.5

    def problems(self) -> list[str]:
        problems = GeneratorConfig.problems(self)
        need(problems, self.instances >= 1, f"generator.instances={self.instances} must be >= 1")
        non_negative(problems, "generator.num_slots", self.num_slots, "0 = room for every sample")
        return problems
