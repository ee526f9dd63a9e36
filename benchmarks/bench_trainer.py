"""Generation in the trainer: what batch-independent sampling costs in the engine's decode loop.

Legend: B samples, N max new tokens.

Side by side in one process, on a tiny random LLaMA (hidden 64, 2 layers) with several stop tokens (responses
end at spread lengths, a long tail up to N): rlhfuse's `GenerationEngine` choosing tokens the shipped way
(`WholeVocabulary`: each sample's own stream of uniforms and inverse-CDF sampling, so a sample's tokens do not
depend on its batch, its slot or a migration; its log-prob recorded for `rollout/logprob_abs_diff`) against the
same engine drawing with one batched `torch.multinomial` (no per-sample streams: a sample's tokens then depend on
its batch). Both decode only the still-running rows (continuous batching). Runs are interleaved; each time is a
median. The multinomial side's samples end at other lengths than the shipped side's, so its time is also given
per generated token.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import Tensor

from rlhfuse.core.sampling import filter_logits
from rlhfuse.core.types import PromptBatch
from rlhfuse.generation.engine import GenerationEngine, SamplingParams, WholeVocabulary, requests_for
from rlhfuse.models import ModelConfig, Transformer

EOS = 2
STOPS = (EOS, 7, 11, 13)


class _Multinomial(WholeVocabulary):
    """One batched `torch.multinomial` draw per step from the filtered probabilities (the uniforms unused)."""

    def sample(self, logits_NV: Tensor, uniforms_N: Tensor, params: SamplingParams) -> Tensor:
        probs_NV = filter_logits(
            logits_NV.float(), temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
            dtype=self.dtype,
        )  # fmt: skip
        return torch.multinomial(probs_NV, 1).squeeze(1)


def _time(engine: GenerationEngine, prompts: PromptBatch) -> tuple[float, int]:
    requests = requests_for(prompts, samples_per_prompt=1, seed=0, iteration=0)
    start = time.perf_counter()
    engine.run(requests)
    return time.perf_counter() - start, sum(len(r.tokens) for r in requests)


def run(quick: bool = False) -> dict[str, dict[str, float]]:
    """Figures per side (`shipped`, `multinomial`): ms (median), us_per_token, and over_shipped (ratio of ms)."""
    torch.manual_seed(0)
    config = ModelConfig.tiny(
        vocab_size=96, hidden_size=64, intermediate_size=192, num_heads=2, num_kv_heads=2, head_dim=32
    )
    model = Transformer(config).eval()
    batch, max_new = (64, 32) if quick else (128, 48)
    repeats = 3 if quick else 7
    prompts = PromptBatch(
        torch.randint(3, 96, (batch, 6)), torch.ones(batch, 6, dtype=torch.long), torch.arange(batch)
    )
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, stop_token_ids=STOPS)
    sides = {
        name: GenerationEngine(model, params, num_slots=batch, max_len=6 + max_new, choice=choice)
        for name, choice in (("shipped", None), ("multinomial", _Multinomial()))
    }
    print(
        f"threads={torch.get_num_threads()}  B={batch}  N={max_new}  stop tokens {STOPS}  median of {repeats}"
    )
    times: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        for name, engine in sides.items():
            seconds, tokens[name] = _time(engine, prompts)
            times[name].append(seconds)
    base = statistics.median(times["shipped"])
    figures: dict[str, dict[str, float]] = {}
    for name, values in times.items():
        t = statistics.median(values)
        per_token = t / max(tokens[name], 1) * 1e6
        print(f"{name:>12}: {t * 1e3:8.1f} ms  {per_token:6.1f} us/token  this / shipped = {t / base:5.2f}x")
        figures[name] = {"ms": t * 1e3, "us_per_token": per_token, "over_shipped": t / base}
    return figures
