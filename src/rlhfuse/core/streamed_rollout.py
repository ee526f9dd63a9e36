"""A rollout whose inference follows its generation chunk by chunk: what the serial rollout stage runs
(`rlhfuse.trainer.rollout.SerialRollout`), and how a generator whose samples finish over time fuses inference
into its own rollout (a multi-turn `AgentGenerator`: episodes inferred as they end, while the environments answer
the next turn)."""

from __future__ import annotations

import time

from rlhfuse.core.protocols import Generator, Inferencer, StageHook
from rlhfuse.core.sampling import Sampling
from rlhfuse.core.stats import RolloutStats
from rlhfuse.core.types import Experience, PromptBatch


def no_stage_hook(stage: str) -> None:
    """A `StageHook` that listens to nothing."""
    del stage


def streamed_rollout(
    generator: Generator,
    inferencer: Inferencer,
    prompts: PromptBatch,
    *,
    iteration: int,
    pad_token_id: int,
    on_stage: StageHook | None = None,
    sampling: Sampling | None = None,
) -> tuple[Experience, RolloutStats]:
    """Generate, and infer each chunk of finished samples as the generator streams it. `on_stage` hears
    "generation" and "inference" as they alternate."""
    on_stage = on_stage or no_stage_hook
    on_stage("generation")
    gen_time = inf_time = 0.0
    parts: list[Experience] = []
    t0 = start = time.perf_counter()
    for chunk in generator.generate(prompts, iteration=iteration, sampling=sampling):
        gen_time += time.perf_counter() - t0
        on_stage("inference")
        t1 = time.perf_counter()
        parts.append(inferencer.infer(chunk))
        inf_time += time.perf_counter() - t1
        t0 = time.perf_counter()
    gen_time += time.perf_counter() - t0
    span = time.perf_counter() - start  # first decode step to the last inference output
    generation = generator.generation_stats()
    stats = RolloutStats(
        generation_s=gen_time,
        inference_s=inf_time,
        # reported for generators with instances (the serial baseline of inter-stage fusion)
        generation_inference_s=span if generation is not None else None,
        generation=generation,
    )
    return Experience.cat(parts, pad_token_id), stats
