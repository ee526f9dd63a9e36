"""Data configuration (Hydra group `data`): where prompts come from and the batch sizes, named by unit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhfuse.core.config_checks import choice_problems, need, positive

TruncateMode = Literal["error", "left", "right"]


@dataclass
class DataConfig:
    # Prompt source: "synthetic" (the embedded topic task, generated from `seed`), "arithmetic" (the embedded
    # verifiable task: generated `a + b =` problems whose rows carry the `answer`), "calculator" (the same
    # problems, the tiny model warm-started to call a calculator tool: agent.env=calculator), "guess" (games of
    # guessing a number from 1 to 100, rows carrying the `secret`: agent.env=guess; no warm start, for a chat
    # model) or "file" (`path`).
    source: Literal["synthetic", "arithmetic", "calculator", "guess", "file"] = "synthetic"
    # A local .jsonl (one JSON object per line) or .parquet file of prompts, or a folder saved with datasets'
    # `Dataset.save_to_disk`; used when source=file. (The Python API: build_trainer(train_dataset=...).)
    path: str | None = None
    # The field of each row that holds the prompt text (the row's other fields, e.g. `answer`, reach the reward).
    prompt_key: str = "prompt"
    # Embedded tasks: the number of distinct prompts; synthetic task only: the SFT response-length law
    # (log-normal, in words).
    num_prompts: int = 512
    length_median: float = 6.0
    length_sigma: float = 0.8
    # Arithmetic and calculator tasks only: operands are drawn from 0..max_operand (answers from -max_operand to
    # 2*max_operand).
    max_operand: int = 9
    # Synthetic task only: 0 = response words drawn one by one; n > 0 = responses are made of n-word phrases
    # from a fixed per-topic phrase book (repetitive text, as reasoning rollouts are: what n-gram drafts of
    # speculative decoding exploit).
    phrase_length: int = 0
    # Longest prompt, in tokens (BOS included). Longer prompts are an error unless `truncate` is left|right.
    max_prompt_length: int = 16
    # What to do with a prompt longer than max_prompt_length: error | left (keep the end) | right (keep the start).
    truncate: TruncateMode = "error"
    # auto = when the tokenizer has a chat template (tokenizer_config.json or chat_template.jinja), render each
    # prompt with it (a text prompt as one user turn, a file row's `messages` list as is); none = plain text.
    chat_template: Literal["auto", "none"] = "auto"
    # A Python format string each text prompt is rewritten with before tokenising (and before the chat template):
    # `{prompt}` is the prompt text, `{name}` any field of its row (data=arithmetic: `a`, `op`, `b`, `answer`).
    # null = the text as is. E.g. "What is {a} {op} {b}? Answer with just the number."
    prompt_template: str | None = None
    # Batch sizes, by unit. One iteration generates prompts_per_iteration * samples_per_prompt samples.
    prompts_per_iteration: int = 32
    # Responses sampled per prompt (the generator's n).
    samples_per_prompt: int = 4
    # Dynamic sampling (DAPO): 0 = off, every prompt's group is trained. A factor f >= 1 = the rollout trains
    # exactly prompts_per_iteration groups whose samples did not all score alike (zero reward variance: no
    # gradient under a group baseline). It generates ceil(f * prompts_per_iteration) prompts' groups, drops the
    # uniform ones, and generates ceil(f * missing) further prompts (drawn from the data as the iteration's own
    # are) for the groups still missing, round after round until none is. f = 1 generates only what is missing (a
    # dropped group costs its own tokens, more rounds); f > 1 over-provisions (fewer rounds; groups beyond the
    # batch are generated but not trained). Logged: rollout/groups_sampled, groups_dropped, extra_tokens.
    oversample: float = 0.0
    # Samples per optimizer step (one PPO mini-batch); must divide the samples of an iteration.
    mini_batch_size: int = 64
    # Samples per forward/backward (gradient accumulation = mini_batch_size / micro_batch_size).
    micro_batch_size: int = 32
    # Optional token budget per micro-batch instead (0 = off): micro-batches are packed greedily up to it.
    micro_batch_tokens: int = 0
    # Run training and inference micro-batches as packed sequences (real tokens end to end, no padding computed;
    # docs/packing.md); false = padded [B, T] micro-batches. Exact: the same losses and gradients up to rounding.
    packing: bool = True

    def problems(self) -> list[str]:
        problems = choice_problems(self, "data")
        need(
            problems,
            self.phrase_length >= 0,
            f"data.phrase_length={self.phrase_length} must be >= 0 (0 = off)",
        )
        for key in ("prompts_per_iteration", "samples_per_prompt", "mini_batch_size", "micro_batch_size"):
            positive(problems, f"data.{key}", getattr(self, key))
        samples = self.prompts_per_iteration * self.samples_per_prompt
        if self.mini_batch_size > 0 and samples > 0:
            need(
                problems,
                samples % self.mini_batch_size == 0,
                f"data.mini_batch_size={self.mini_batch_size} must divide data.prompts_per_iteration*"
                f"data.samples_per_prompt={self.prompts_per_iteration}*{self.samples_per_prompt}={samples}: set "
                f"data.mini_batch_size to a divisor of {samples} (e.g. {divisor_near(samples, self.mini_batch_size)})",
            )
        if self.micro_batch_tokens == 0 and self.micro_batch_size > 0 and self.mini_batch_size > 0:
            need(
                problems,
                self.mini_batch_size % self.micro_batch_size == 0,
                f"data.micro_batch_size={self.micro_batch_size} must divide data.mini_batch_size="
                f"{self.mini_batch_size}: set data.micro_batch_size="
                f"{divisor_near(self.mini_batch_size, self.micro_batch_size)} or a token budget with "
                "data.micro_batch_tokens",
            )
        need(
            problems,
            self.oversample == 0 or self.oversample >= 1,
            f"data.oversample={self.oversample} must be 0 (off) or a factor >= 1 of data.prompts_per_iteration",
        )
        need(
            problems,
            self.oversample == 0 or self.samples_per_prompt >= 2,
            f"data.oversample={self.oversample} drops the groups whose samples all scored alike, and a group of "
            f"data.samples_per_prompt={self.samples_per_prompt} always does: set data.samples_per_prompt >= 2 or "
            "data.oversample=0",
        )
        need(
            problems,
            self.micro_batch_tokens >= 0,
            f"data.micro_batch_tokens={self.micro_batch_tokens} must be >= 0 (0 = off)",
        )
        need(
            problems,
            self.source != "file" or bool(self.path),
            "data.source=file needs data.path=<a local .jsonl or .parquet file, or a save_to_disk folder>",
        )
        positive(problems, "data.max_prompt_length", self.max_prompt_length)
        positive(problems, "data.num_prompts", self.num_prompts)
        positive(problems, "data.max_operand", self.max_operand)
        return problems


def divisor_near(n: int, target: int) -> int:
    """The divisor of `n` closest to `target` (the larger on a tie): the value an error message suggests."""
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    return min(divisors, key=lambda k: (abs(k - target), -k))
