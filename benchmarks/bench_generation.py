"""Generation throughput: `rlhfuse.generation.GenerationEngine` vs `transformers`' `generate`, same weights.

The workload is RLHF's: n samples per prompt, sampled at temperature 1, response lengths long-tailed (the EOS
token's logit is pinned so that every step stops a sample with probability about 1/vocab: geometric lengths,
p99 / median about 6.6, capped at max_new_tokens). `generate` decodes every row of its batch until the longest
finishes; the engine drops finished samples from the batch (continuous batching) and prefills each prompt once
for its n samples (prefix sharing). Tokens/s counts generated tokens up to and including EOS. Rounds alternate
between the two so machine noise hits both; fp32, no grad, one thread.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhfuse.core.types import PromptBatch
from rlhfuse.generation import GenerationEngine, SamplingParams, requests_for
from rlhfuse.models import ModelConfig, Transformer, save_pretrained

EOS, PAD = 1, 0


def _prompts(count: int, vocab: int, gen: torch.Generator) -> PromptBatch:
    lengths = torch.randint(8, 33, (count,), generator=gen)
    width = int(lengths.max())
    ids = torch.full((count, width), PAD)
    mask = torch.zeros((count, width), dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):
        ids[b, width - n :] = torch.randint(2, vocab, (n,), generator=gen)
        mask[b, width - n :] = 1
    return PromptBatch(ids, mask, torch.arange(count))


def _ours(model: Transformer, prompts: PromptBatch, n: int, max_new: int) -> tuple[float, int, list[int]]:
    start = time.perf_counter()
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, stop_token_ids=(EOS,))
    engine = GenerationEngine(
        model, params, num_slots=len(prompts) * n, max_len=prompts.input_ids_BP.shape[1] + max_new
    )
    engine.add(requests_for(prompts, samples_per_prompt=n, seed=0, iteration=0))
    lengths = []
    while engine.has_work():
        lengths += [len(r.tokens) for r in engine.step()]
    return time.perf_counter() - start, sum(lengths), lengths


def _theirs(model, prompts: PromptBatch, n: int, max_new: int) -> tuple[float, int]:
    start = time.perf_counter()
    out = model.generate(
        input_ids=prompts.input_ids_BP,
        attention_mask=prompts.attention_mask_BP,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new,
        num_return_sequences=n,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    seconds = time.perf_counter() - start
    response = out[:, prompts.input_ids_BP.shape[1] :]
    is_eos = response == EOS
    # tokens up to and including the first EOS (all of them when there is none)
    first = torch.where(
        is_eos.any(1),
        is_eos.float().argmax(1) + 1,
        torch.full_like(is_eos[:, 0], response.shape[1], dtype=torch.long),
    )
    return seconds, int(first.sum())


@dataclass
class Workload:
    """The benchmark's model (ours, and the same weights as an HF checkpoint in `checkpoint`) and batch."""

    config: ModelConfig
    model: Transformer
    checkpoint: Path
    prompts: PromptBatch
    n: int
    max_new: int
    rounds: int


@contextmanager
def workload(quick: bool) -> Iterator[Workload]:
    torch.manual_seed(0)
    vocab = 48
    prompts_count, n, max_new = (4, 4, 96) if quick else (16, 4, 192)
    config = ModelConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        max_position_embeddings=1024,
        eos_token_id=EOS,
        pad_token_id=PAD,
    ).validate()
    ours = Transformer(config).eval().requires_grad_(False)
    with torch.no_grad():
        ours.lm_head.weight[EOS] = 0.0  # EOS logit 0, others ~N(0, small): P(EOS) ~ 1/vocab per step
    prompts = _prompts(prompts_count, vocab, torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ours, Path(tmp) / "ckpt")
        yield Workload(config, ours, Path(tmp) / "ckpt", prompts, n, max_new, 2 if quick else 4)


def hf_model(checkpoint: Path):
    import transformers  # dev dependency; benchmarks are not part of the installed library

    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa").eval()


def run(quick: bool = False) -> None:
    with workload(quick) as w:
        theirs = hf_model(w.checkpoint)
    config, ours, prompts, n, max_new, rounds = w.config, w.model, w.prompts, w.n, w.max_new, w.rounds
    prompts_count, vocab = len(prompts), config.vocab_size
    print(
        f"model: hidden {config.hidden_size}, {config.num_layers} layers, GQA {config.num_heads}/"
        f"{config.num_kv_heads}, vocab {vocab}; {prompts_count} prompts x {n} samples, max_new_tokens {max_new}, "
        f"fp32, torch threads {torch.get_num_threads()}"
    )
    ours_rate, theirs_rate, ratios = [], [], []
    with torch.no_grad():
        for r in range(rounds):
            torch.manual_seed(r)
            o_s, o_tok, lengths = _ours(ours, prompts, n, max_new)
            t_s, t_tok = _theirs(theirs, prompts, n, max_new)
            ours_rate.append(o_tok / o_s)
            theirs_rate.append(t_tok / t_s)
            ratios.append(ours_rate[-1] / theirs_rate[-1])
            if r == 0:
                s = sorted(lengths)
                print(
                    f"response lengths (engine): p50 {s[len(s) // 2]}, p90 {s[int(0.9 * len(s))]}, max {s[-1]}"
                )
            print(f"round {r}: engine {ours_rate[-1]:7.0f} tok/s ({o_tok} tokens) | transformers generate "
                  f"{theirs_rate[-1]:7.0f} tok/s ({t_tok} tokens) | ratio {ratios[-1]:.2f}x")  # fmt: skip
    print(f"engine vs transformers generate: median ratio {statistics.median(ratios):.2f}x, best-round ratio "
          f"{max(ours_rate) / max(theirs_rate):.2f}x (goal >= 2x)")  # fmt: skip
