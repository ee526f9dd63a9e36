"""Generation in the trainer: what batch-independent sampling costs, and what decoding only active rows saves.

Legend: B samples, N max new tokens.

Side by side in one process, on a tiny random LLaMA (hidden 64, 2 layers) whose responses are forced to the
embedded task's long-tailed length law (log-normal, median 6 tokens, cut at N): the shipped `SamplingGenerator`
(per-sample random streams + inverse-CDF sampling, decoding only the still-active rows) against
(a) the same loop drawing with one batched `torch.multinomial` (no per-sample streams, so a sample's tokens then
depend on its batch), and (b) every row decoding until the longest response ends, as a generator without row
compaction does (the long tail keeps the whole batch busy). Runs are interleaved; each time is a median.
"""

from __future__ import annotations

import math
import random
import statistics
import time

import torch
from torch import Tensor

from rlhfuse.core.sampling import SamplingConfig, filter_logits
from rlhfuse.core.types import PromptBatch
from rlhfuse.generation.batched import SamplingGenerator
from rlhfuse.models import ModelConfig, Transformer

EOS = 2


class _ForcedLengths(SamplingGenerator):
    """Emits EOS as row b's token number lengths_B[b] (the sampled tokens are kept otherwise)."""

    def __init__(self, *args: object, lengths_B: Tensor, multinomial: bool, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lengths_B, self.multinomial, self.step = lengths_B, multinomial, 0
        self.shipped_pick, self.pick = self.pick, self._forced_pick

    def _forced_pick(self, logits_BV: Tensor, uniforms_B: Tensor, rows_B: Tensor) -> Tensor:
        if self.multinomial:
            probs_BV = filter_logits(logits_BV.float(), temperature=1.0, top_k=0, top_p=1.0)
            tokens_B = torch.multinomial(probs_BV.float(), 1).squeeze(1)
        else:
            tokens_B = self.shipped_pick(logits_BV, uniforms_B, rows_B)
        done_B = self.lengths_B[rows_B] <= self.step + 1
        self.step += 1
        return torch.where(done_B, torch.full_like(tokens_B, EOS), tokens_B.clamp(min=EOS + 1))


def _time(gen: _ForcedLengths, prompts: PromptBatch) -> float:
    gen.step = 0
    start = time.perf_counter()
    for _ in gen.generate(prompts, iteration=0):
        pass
    return time.perf_counter() - start


def run(quick: bool = False) -> dict[str, dict[str, float]]:
    """Figures per side (`shipped`, `multinomial`, `no_compaction`): ms (median) and over_shipped (ratio)."""
    torch.manual_seed(0)
    config = ModelConfig.tiny(
        vocab_size=96, hidden_size=64, intermediate_size=192, num_heads=2, num_kv_heads=2, head_dim=32
    )
    model = Transformer(config).eval()
    batch, max_new = (64, 32) if quick else (128, 48)
    repeats = 3 if quick else 7
    rng = random.Random(0)
    lengths = [max(1, min(max_new, round(math.exp(rng.gauss(math.log(6), 0.8))))) for _ in range(batch)]
    lengths[0] = max_new  # at least one sample in the tail
    prompts = PromptBatch(
        torch.randint(3, 96, (batch, 6)), torch.ones(batch, 6, dtype=torch.long), torch.arange(batch)
    )

    def make(lengths_B: Tensor, multinomial: bool) -> _ForcedLengths:
        return _ForcedLengths(
            model, SamplingConfig(max_new_tokens=max_new), eos_token_id=EOS, pad_token_id=0,
            samples_per_prompt=1, seed=0, lengths_B=lengths_B, multinomial=multinomial,
        )  # fmt: skip

    long_tail = torch.tensor(lengths)
    sides = {
        "shipped": make(long_tail, multinomial=False),
        "multinomial": make(long_tail, multinomial=True),
        "no compaction": make(torch.full_like(long_tail, max(lengths)), multinomial=False),
    }
    print(
        f"threads={torch.get_num_threads()}  B={batch}  N={max_new}  response lengths p50="
        f"{statistics.median(lengths)} max={max(lengths)}  median of {repeats}"
    )
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, gen in sides.items():
            times[name].append(_time(gen, prompts))
    base = statistics.median(times["shipped"])
    figures: dict[str, dict[str, float]] = {}
    for name, values in times.items():
        t = statistics.median(values)
        print(f"{name:>14}: {t * 1e3:8.1f} ms   this / shipped = {t / base:5.2f}x")
        figures[name.replace(" ", "_")] = {"ms": t * 1e3, "over_shipped": t / base}
    return figures
