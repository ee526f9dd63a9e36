"""Forward throughput (tokens/s) of rlhfuse.models.Transformer vs `transformers`, same weights, side by side.

Both run fp32, no grad, SDPA attention, on an unpadded batch (the rollout-scoring case: Ref / Reward / Critic
forward passes), on a left-padded one, and for cached single-token decode steps (generation). Repeats alternate between the two models so machine noise hits both.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rlhfuse.models import KVCache, ModelConfig, Transformer, save_pretrained


def _time_forward(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _report(name: str, tokens: int, ours_s: list[float], theirs_s: list[float]) -> dict[str, float]:
    # other processes share these cores: the best round is the least disturbed one, and the median of
    # per-round ratios pairs runs made seconds apart
    paired = statistics.median(t / o for o, t in zip(ours_s, theirs_s))
    figures = {
        "rlhfuse_tok_s": tokens / min(ours_s),
        "transformers_tok_s": tokens / min(theirs_s),
        "ratio_best": min(theirs_s) / min(ours_s),
        "ratio_paired_median": paired,
    }
    print(
        f"{name:>12}: rlhfuse {figures['rlhfuse_tok_s']:8.0f} tok/s | transformers "
        f"{figures['transformers_tok_s']:8.0f} tok/s (best of {len(ours_s)}) | ratio best "
        f"{figures['ratio_best']:.2f}x, paired median {paired:.2f}x (goal >= 1.0x)"
    )
    return figures


def _ours_decode(model: Transformer, prompt_ids_BT: torch.Tensor, steps: int) -> float:
    """Seconds for `steps` greedy single-token steps after a (untimed) prefill into an rlhfuse KVCache."""
    batch, prompt_len = prompt_ids_BT.shape
    cache = KVCache.allocate(model.config, batch, prompt_len + steps)
    next_ids_B1 = model(prompt_ids_BT, cache=cache)[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(steps):
        next_ids_B1 = model(next_ids_B1, cache=cache)[:, -1:].argmax(-1)
    return time.perf_counter() - start


def _hf_decode(model, prompt_ids_BT: torch.Tensor, steps: int) -> float:
    out = model(prompt_ids_BT, use_cache=True)
    next_ids_B1 = out.logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(steps):
        # transformers 5 names the KV cache `cache`; 4.x names it `past_key_values`
        kv = {"cache": out.cache} if hasattr(out, "cache") else {"past_key_values": out.past_key_values}
        out = model(next_ids_B1, use_cache=True, **kv)
        next_ids_B1 = out.logits[:, -1:].argmax(-1)
    return time.perf_counter() - start


def run(quick: bool = False) -> dict[str, Any]:
    """Figures: max_logits_diff; per case (`unpadded`, `left_padded`, `decode`) rlhfuse_tok_s, transformers_tok_s,
    ratio_best, ratio_paired_median (transformers time / rlhfuse time)."""
    import transformers  # dev dependency; benchmarks are not part of the installed library

    torch.manual_seed(0)
    batch, seq = (2, 64) if quick else (8, 256)
    rounds = 3 if quick else 12
    config = ModelConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        max_position_embeddings=1024,
    ).validate()
    ours = Transformer(config).eval()
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ours, Path(tmp) / "ckpt")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            Path(tmp) / "ckpt", attn_implementation="sdpa"
        )
    theirs.eval()

    input_ids_BT = torch.randint(0, config.vocab_size, (batch, seq))
    mask_BT = torch.ones(batch, seq, dtype=torch.long)
    mask_BT[: batch // 2, : seq // 4] = 0  # half the rows left-padded by a quarter
    cases = {
        "unpadded": (lambda: ours(input_ids_BT), lambda: theirs(input_ids_BT).logits),
        "left-padded": (
            lambda: ours(input_ids_BT, attention_mask_BT=mask_BT),
            lambda: theirs(input_ids_BT, attention_mask=mask_BT).logits,
        ),
    }
    print(f"config: hidden {config.hidden_size}, {config.num_layers} layers, GQA {config.num_heads}/"
          f"{config.num_kv_heads}, vocab {config.vocab_size}; batch {batch} x {seq} tokens, fp32, no grad, "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip
    with torch.no_grad():
        diff = (ours(input_ids_BT) - theirs(input_ids_BT).logits).abs().max().item()
        print(f"max |logits difference| = {diff:.2e}")
        figures: dict[str, Any] = {"batch": batch, "seq": seq, "max_logits_diff": diff}
        for name, (ours_fn, theirs_fn) in cases.items():
            ours_fn(), theirs_fn()  # warm-up
            ours_s, theirs_s = [], []
            for _ in range(rounds):
                ours_s.append(_time_forward(ours_fn))
                theirs_s.append(_time_forward(theirs_fn))
            figures[name.replace("-", "_")] = _report(name, batch * seq, ours_s, theirs_s)

        # generation: single-token steps over a prompt of seq // 2 tokens (KV cache vs HF DynamicCache)
        steps = 8 if quick else 32
        prompt_ids_BT = input_ids_BT[:, : seq // 2]
        ours_s, theirs_s = [], []
        for _ in range(max(rounds // 2, 2)):
            ours_s.append(_ours_decode(ours, prompt_ids_BT, steps))
            theirs_s.append(_hf_decode(theirs, prompt_ids_BT, steps))
        figures["decode"] = _report("decode", batch * steps, ours_s, theirs_s)
    return figures
