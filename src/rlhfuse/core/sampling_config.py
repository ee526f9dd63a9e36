"""The sampling settings every generator reads (`rlhfuse.core.sampling` samples with them). No torch, so that the
command line composes the configuration without it."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhfuse.core.config_checks import need, non_negative, positive


@dataclass
class SamplingConfig:
    """The sampling settings every generator reads (keys `generator.*`, composed into `GenerationConfig`)."""

    # Longest response, in tokens (EOS included).
    max_new_tokens: int = 48
    # Softmax temperature; 0 = greedy.
    temperature: float = 1.0
    # Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1.0 = off).
    top_p: float = 1.0
    # Keep only the top_k most likely tokens (0 = off).
    top_k: int = 0
    # Tokens that end a response besides the tokenizer's EOS.
    stop_token_ids: list[int] = field(default_factory=list)
    # Most samples decoded together (0 = all samples of the iteration at once); each chunk is yielded when done.
    max_batch_size: int = 0

    def problems(self) -> list[str]:
        problems: list[str] = []
        positive(problems, "generator.max_new_tokens", self.max_new_tokens)
        need(
            problems,
            self.temperature >= 0,
            f"generator.temperature={self.temperature} must be >= 0 (0 = greedy)",
        )
        need(problems, 0 < self.top_p <= 1, f"generator.top_p={self.top_p} must be in (0, 1] (1 = off)")
        non_negative(problems, "generator.top_k", self.top_k, "0 = off")
        non_negative(problems, "generator.max_batch_size", self.max_batch_size, "0 = all")
        return problems
