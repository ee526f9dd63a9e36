"""Packed vs padded micro-batches (`data.packing`): tokens/s and peak memory of a training step and of an
inference pass, side by side in one process (`make bench BENCH=packing`).

Two settings:
- default: the default job's model (the embedded tiny Actor/Critic, conf/model/tiny.yaml) and its batches: the
  synthetic task's prompts (load_prompts of the default data config) with responses of the task's SFT length law
  (log-normal, median 6 words, sigma 0.8, + EOS, capped at generator.max_new_tokens=48); one mini-batch of 64
  samples in micro-batches of 32, as data.mini_batch_size / micro_batch_size. Goal: >= 1.5x training tokens/s.
- width512: a width-512 model (4 layers, 8 heads) with long-tailed lengths (median 29 words, sigma 1.1, cap 512:
  experiment=longtail's law).

tokens/s counts real tokens only (the work both paths must do). Peak memory: on CUDA torch's peak allocated
bytes; on CPU the peak of the bytes held by tensors that ops allocate during the step (a dispatch-mode tracker,
parameters and inputs excluded), run once outside the timed rounds.
"""

from __future__ import annotations

import copy
import math
import random
import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric import Fabric
from torch.utils._python_dispatch import TorchDispatchMode

from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.core.inference import InferencerConfig
from rlhfuse.core.optim import OptimConfig
from rlhfuse.core.types import Rollout, TrainBatch
from rlhfuse.data.data_config import DataConfig
from rlhfuse.data.prompts import load_prompts
from rlhfuse.data.synthetic import build_tokenizer
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.trainer.strategies.plain.inference import ModelInferencer
from rlhfuse.trainer.strategies.plain.training import PlainStrategy


class _PeakBytes(TorchDispatchMode):
    """The peak of the bytes of live storages that ops allocate (each counted once, freed when the last tensor
    viewing it dies)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}

    def _release(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            self.live -= self.sizes.pop(ptr)
            del self.refs[ptr]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr == 0:
                    continue
                if ptr not in self.refs:
                    self.refs[ptr], self.sizes[ptr] = 0, storage.nbytes()
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                self.refs[ptr] += 1
                weakref.finalize(t, self._release, ptr)
        return out


def _peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)
    tracker = _PeakBytes()
    with tracker:
        fn()
    return tracker.peak


def _lengths(rng: random.Random, n: int, median: float, sigma: float, cap: int) -> list[int]:
    """Response tokens: the synthetic task's log-normal word count + EOS, capped at max_new_tokens."""
    return [min(cap, max(1, round(math.exp(rng.gauss(math.log(median), sigma)))) + 1) for _ in range(n)]


def _rollout(prompts: list[list[int]], responses: list[int], vocab: int, seed: int) -> Rollout:
    """Left-padded prompts, right-padded responses of the given lengths (random token ids)."""
    gen = torch.Generator().manual_seed(seed)
    n, p_width, r_width = len(prompts), max(map(len, prompts)), max(responses)
    prompt_ids, prompt_mask = (
        torch.zeros(n, p_width, dtype=torch.long),
        torch.zeros(n, p_width, dtype=torch.long),
    )
    response_ids = torch.zeros(n, r_width, dtype=torch.long)
    response_mask = torch.zeros(n, r_width, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[b, p_width - len(p) :] = torch.tensor(p)
        prompt_mask[b, p_width - len(p) :] = 1
        response_ids[b, :r] = torch.randint(3, vocab, (r,), generator=gen)
        response_mask[b, :r] = 1
    return Rollout(
        prompt_ids, prompt_mask, response_ids, response_mask, torch.arange(n), torch.zeros(n, dtype=torch.long),
        torch.ones(n, dtype=torch.bool),
    )  # fmt: skip


def _train_batch(rollout: Rollout, seed: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    mask_BR = rollout.response_mask_BR.float()

    def field(scale: float, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(mask_BR.shape, generator=gen) * scale + shift) * mask_BR

    return TrainBatch(
        rollout.input_ids_BT, rollout.attention_mask_BT, mask_BR, field(0.1, -3.0), field(1.0), field(1.0),
        field(1.0),
    )  # fmt: skip


def _models(config: ModelConfig, device: torch.device) -> tuple[Transformer, Transformer]:
    torch.manual_seed(0)
    return Transformer(config, "lm").to(device), Transformer(config, "value").to(device)


def _compare(
    name: str,
    config: ModelConfig,
    rollout: Rollout,
    micro_batch_size: int,
    rounds: int,
    device: torch.device,
    goal: float | None,
) -> dict[str, float]:
    batch = _train_batch(rollout, seed=1)
    tokens = int(rollout.attention_mask_BT.sum())
    padded_tokens = rollout.attention_mask_BT.numel()
    fabric = Fabric(accelerator="cuda" if device.type == "cuda" else "cpu", devices=1, precision="32-true")
    setups: dict[bool, tuple[PlainStrategy, ModelInferencer]] = {}
    for packing in (False, True):
        actor, critic = _models(config, device)
        ref, reward = _models(config, device)
        strategy = PlainStrategy(
            actor, critic, OptimConfig(warmup_steps=0), AlgorithmConfig(), fabric=fabric, total_steps=10**6,
            micro_batch_size=micro_batch_size, packing=packing,
        )  # fmt: skip
        inferencer = ModelInferencer(
            InferencerConfig(micro_batch_size=micro_batch_size, truncated_score=None), actor=actor, ref=ref,
            critic=critic, reward_model=reward, rewards=None, tokenizer=build_tokenizer(), temperature=1.0,
            packing=packing,
        )  # fmt: skip
        setups[packing] = (strategy, inferencer)

    def train(packing: bool) -> None:
        setups[packing][0].train_step(copy.deepcopy(batch))

    def infer(packing: bool) -> None:
        setups[packing][1].infer(rollout)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    results: dict[str, float] = {}
    for stage, fn in (("train", train), ("infer", infer)):
        for packing in (False, True):  # warm-up (allocator, kernels)
            fn(packing)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):  # alternate, so that machine noise hits both
            for packing in (False, True):
                sync()
                start = time.perf_counter()
                fn(packing)
                sync()
                times[packing].append(time.perf_counter() - start)
        memory = {packing: _peak_bytes(lambda p=packing, f=fn: f(p), device) for packing in (False, True)}
        speedup = min(times[False]) / min(times[True])
        paired = statistics.median(a / b for a, b in zip(times[False], times[True], strict=True))
        mem_ratio = memory[False] / max(memory[True], 1)
        results[f"{stage}_speedup"], results[f"{stage}_memory_ratio"] = speedup, mem_ratio
        results[f"{stage}_speedup_paired"] = paired
        results[f"{stage}_padded_tok_s"] = tokens / min(times[False])
        results[f"{stage}_packed_tok_s"] = tokens / min(times[True])
        results[f"{stage}_padded_mib"] = memory[False] / 2**20
        results[f"{stage}_packed_mib"] = memory[True] / 2**20
        target = f" (goal >= {goal:.1f}x)" if goal is not None and stage == "train" else ""
        print(
            f"{name:>9} {stage:>5}: padded {tokens / min(times[False]):9.0f} tok/s, packed "
            f"{tokens / min(times[True]):9.0f} tok/s -> {speedup:.2f}x best, {paired:.2f}x paired median{target}; "
            f"peak memory padded {memory[False] / 2**20:7.1f} MiB, packed {memory[True] / 2**20:7.1f} MiB "
            f"-> {mem_ratio:.2f}x less",
            flush=True,
        )
    print(
        f"{name:>9}: {len(rollout)} samples, {tokens} real tokens of {padded_tokens} padded "
        f"({padded_tokens / tokens:.2f}x padding), micro-batches of {micro_batch_size}",
        flush=True,
    )
    results["padding"] = padded_tokens / tokens
    return results


def run(quick: bool = False) -> dict[str, dict[str, float]]:
    """Figures per setting (`default`, `width512`), per stage (train, infer): speedup (best round),
    speedup_paired, memory_ratio, padded_tok_s / packed_tok_s, padded_mib / packed_mib; padding (padded / real
    tokens)."""
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rounds = 2 if quick else 5
    rng = random.Random(0)
    tokenizer = build_tokenizer()
    data = DataConfig()
    prompts = [p.token_ids for p in load_prompts(data, tokenizer, seed=0)]

    # the default job: tiny model, one mini-batch of 64 samples (16 prompts x 4 samples), micro-batches of 32
    tiny = ModelConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=192, num_layers=2, num_heads=2, num_kv_heads=2,
        head_dim=32, max_position_embeddings=2048,
    ).validate()  # fmt: skip
    picked = [
        prompts[rng.randrange(len(prompts))] for _ in range(data.mini_batch_size // data.samples_per_prompt)
    ]
    batch_prompts = [p for p in picked for _ in range(data.samples_per_prompt)]
    responses = _lengths(rng, len(batch_prompts), data.length_median, data.length_sigma, cap=47)
    rollout = _rollout(batch_prompts, responses, tokenizer.vocab_size, seed=0)
    totals = sorted((rollout.attention_mask_BT.sum(1)).tolist())
    print(f"  default: sequence lengths p50 {totals[len(totals) // 2]}, max {totals[-1]} (tokens)")
    figures = {"default": _compare("default", tiny, rollout, data.micro_batch_size, rounds, device, goal=1.5)}

    # width 512, long-tailed lengths (experiment=longtail's law), 16 samples in micro-batches of 8
    wide = ModelConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8, num_kv_heads=8,
        max_position_embeddings=2048,
    ).validate()  # fmt: skip
    n = 8 if quick else 16
    wide_prompts = [prompts[rng.randrange(len(prompts))] for _ in range(n)]
    wide_responses = _lengths(rng, n, 29.0, 1.1, cap=511)
    wide_rollout = _rollout(wide_prompts, wide_responses, tokenizer.vocab_size, seed=1)
    totals = sorted((wide_rollout.attention_mask_BT.sum(1)).tolist())
    print(f" width512: sequence lengths p50 {totals[len(totals) // 2]}, max {totals[-1]} (tokens)")
    figures["width512"] = _compare("width512", wide, wide_rollout, 8, max(1, rounds - 2), device, goal=None)
    return figures
