"""Step 1 of an iteration, the rollout (generation + inference), in its two forms (`RolloutStage`):

- `SerialRollout`: the generator yields chunks of finished samples and the inferencer runs Ref / Reward / Critic
  on each chunk as it arrives (one process, or every process generating the whole batch);
- `FusedRollout`: inter-stage fusion across processes (RLHFuse §2) — each rank is one generation instance, the
  long tail migrates to a few instances and the freed ones infer finished samples while it completes.

`build_trainer` chooses one of them once (`rollout_stage_for`); the trainer only calls `run`.
"""

from __future__ import annotations

import time

from rlhfuse.core.protocols import FusingGenerator, Generator, Inferencer, StageHook
from rlhfuse.core.sampling import Sampling
from rlhfuse.core.stats import RolloutStats
from rlhfuse.core.types import Experience, PromptBatch


def _ignore(stage: str) -> None:
    del stage


class SerialRollout:
    """Generate, and infer each chunk of finished samples as the generator streams it."""

    def __init__(self, generator: Generator, inferencer: Inferencer, *, pad_token_id: int) -> None:
        self.generator, self.inferencer = generator, inferencer
        self.pad_token_id = pad_token_id

    def run(
        self,
        prompts: PromptBatch,
        iteration: int,
        on_stage: StageHook | None = None,
        sampling: Sampling | None = None,
    ) -> tuple[Experience, RolloutStats]:
        on_stage = on_stage or _ignore
        on_stage("generation")
        gen_time = inf_time = 0.0
        parts: list[Experience] = []
        t0 = start = time.perf_counter()
        for chunk in self.generator.generate(prompts, iteration=iteration, sampling=sampling):
            gen_time += time.perf_counter() - t0
            on_stage("inference")
            t1 = time.perf_counter()
            parts.append(self.inferencer.infer(chunk))
            inf_time += time.perf_counter() - t1
            t0 = time.perf_counter()
        gen_time += time.perf_counter() - t0
        span = time.perf_counter() - start  # first decode step to the last inference output
        generation = self.generator.generation_stats()
        stats = RolloutStats(
            generation_s=gen_time,
            inference_s=inf_time,
            # reported for generators with instances (the serial baseline of inter-stage fusion)
            generation_inference_s=span if generation is not None else None,
            generation=generation,
        )
        return Experience.cat(parts, self.pad_token_id), stats


class FusedRollout:
    """Generation fused with inference by the generator itself, one generation instance per rank."""

    def __init__(self, generator: FusingGenerator, inferencer: Inferencer) -> None:
        self.generator, self.inferencer = generator, inferencer

    def run(
        self,
        prompts: PromptBatch,
        iteration: int,
        on_stage: StageHook | None = None,
        sampling: Sampling | None = None,
    ) -> tuple[Experience, RolloutStats]:
        (on_stage or _ignore)("generation")
        return self.generator.fused_rollout(
            prompts, iteration=iteration, inferencer=self.inferencer, sampling=sampling
        )
