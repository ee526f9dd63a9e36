"""Data configuration (Hydra group `data`): where prompts come from and the batch sizes, named by unit."""

from __future__ import annotations

from dataclasses import dataclass

TRUNCATE_MODES = ("error", "left", "right")


@dataclass
class DataConfig:
    # Prompt source: "synthetic" (the embedded topic task, generated from `run.seed`) or "file" (`path`).
    source: str = "synthetic"
    # A local .jsonl (one JSON object per line) or .parquet file of prompts; used when source=file.
    path: str | None = None
    # The field of each row that holds the prompt text.
    prompt_key: str = "prompt"
    # Synthetic task only: number of distinct prompts, and the SFT response-length law (log-normal, in words).
    num_prompts: int = 512
    length_median: float = 6.0
    length_sigma: float = 0.8
    # Longest prompt, in tokens (BOS included). Longer prompts are an error unless `truncate` is left|right.
    max_prompt_length: int = 16
    # What to do with a prompt longer than max_prompt_length: error | left (keep the end) | right (keep the start).
    truncate: str = "error"
    # Batch sizes, by unit. One iteration generates prompts_per_iteration * samples_per_prompt samples.
    prompts_per_iteration: int = 32
    # Responses sampled per prompt (the generator's n).
    samples_per_prompt: int = 4
    # Samples per optimizer step (one PPO mini-batch); must divide the samples of an iteration.
    mini_batch_size: int = 64
    # Samples per forward/backward (gradient accumulation = mini_batch_size / micro_batch_size).
    micro_batch_size: int = 32
    # Optional token budget per micro-batch instead (0 = off): micro-batches are packed greedily up to it.
    micro_batch_tokens: int = 0
