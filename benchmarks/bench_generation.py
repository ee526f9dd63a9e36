"""Generation throughput: `rlhfuse.generation.GenerationEngine` vs `transformers`' `generate`, same weights.

The workload is RLHF's: n samples per prompt, sampled at temperature 1, response lengths long-tailed (the EOS
token's logit is pinned so that every step stops a sample with probability about 1/vocab: geometric lengths,
p99 / median about 6.6, capped at max_new_tokens). `generate` decodes every row of its batch until the longest
finishes; the engine drops finished samples from the batch (continuous batching) and prefills each prompt once
for its n samples (prefix sharing). Tokens/s counts generated tokens up to and including EOS. Rounds alternate
between the two so machine noise hits both; fp32, no grad, one thread.

Then generation's memory and host syncs, before (`BASELINE`: main before the block KV cache and the host-side
decode bookkeeping) and after:

- **peak KV bytes** of one iteration's generation of the default job and of `experiment=longtail` (their
  warm-started Actors, their prompts, both generators: `generator=sampling`'s plain engine and the engine):
  before, the dense cache allocated every slot at max_len (prompt width + max_new_tokens); after, the block cache
  holds `peak_nbytes_in_use` at most (the pool it allocated, grown on demand, is printed too);
- **syncs per decode step** (`rlhfuse.core.syncs.SyncCounter`, the CPU standing in for the device: an upper
  bound of the GPU's) of the engine and of `SamplingGenerator` on this benchmark's workload, measured on this tree and
  on BASELINE's (exported with `git archive` when this is a git checkout).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhfuse.core.types import PromptBatch
from rlhfuse.generation import GenerationEngine, SamplingParams, requests_for
from rlhfuse.models import ModelConfig, Transformer, save_pretrained

EOS, PAD = 1, 0
BASELINE = "5c2ba0a"
"""main before the block KV cache and the host-side decode bookkeeping."""


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


def run(quick: bool = False) -> dict[str, Any]:
    """Figures: `throughput` (round_ratios, median_ratio, best_round_ratio: engine / generate tokens/s);
    `kv_memory.{default,longtail}.{sampling,engine}` (dense_mib, block_mib, pool_mib, ratio) with the workload's
    lengths; `syncs.{after,before}.{engine,sampling,training_step}` (mean, max per step) and `syncs.baseline`."""
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
    throughput = {
        "round_ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "best_round_ratio": max(ours_rate) / max(theirs_rate),
        "engine_tok_s": ours_rate,
        "transformers_tok_s": theirs_rate,
    }
    return {"throughput": throughput, **memory_and_syncs(quick)}


# ---------------------------------------------------------------------------------------------- memory, syncs
@contextmanager
def _recorded_caches() -> Iterator[list]:
    """Every KVCache allocated inside (the real caches, read after generation for their memory)."""
    from rlhfuse.models import KVCache

    made: list[KVCache] = []
    allocate = KVCache.allocate.__func__  # type: ignore[attr-defined]

    def recording(cls, *args, **kwargs):
        made.append(allocate(cls, *args, **kwargs))
        return made[-1]

    KVCache.allocate = classmethod(recording)  # type: ignore[method-assign]
    try:
        yield made
    finally:
        KVCache.allocate = classmethod(allocate)  # type: ignore[method-assign]


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:8.2f} MiB"


def kv_memory(experiment: str) -> dict[str, Any]:
    """Peak KV bytes of one iteration's generation of `experiment` (its warm-started Actor and prompts)."""
    from rlhfuse.data.collate import collate_prompts
    from rlhfuse.trainer import build_trainer, compose_config

    config = compose_config([f"experiment={experiment}"])
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build_trainer(config, run_dir=run_dir, log=lambda _: None)
    prompts = collate_prompts(trainer.prompts.next_batch(), trainer.pad_token_id)
    generator = trainer.generator
    model = generator.actor_copies()[0]
    sampling = config.generator.sampling
    n = config.data.samples_per_prompt
    with torch.no_grad(), _recorded_caches() as caches:
        lengths = [
            int(x) for r in generator.generate(prompts, iteration=1) for x in r.response_mask_BR.sum(1)
        ]
    dense = max(c.nbytes_per_slot() * c.num_slots for c in caches)
    block = max(c.peak_nbytes_in_use for c in caches)
    pool = max(c.nbytes() for c in caches)
    s = sorted(lengths)
    print(
        f"{experiment}: {len(prompts)} prompts x {n} samples, prompt width {prompts.input_ids_BP.shape[1]}, "
        f"max_new_tokens {sampling.max_new_tokens}; response lengths p50 {s[len(s) // 2]}, "
        f"p90 {s[int(0.9 * len(s))]}, max {s[-1]}"
    )
    print(f"  {'generator':<24} {'dense (before)':>16} {'blocks (after)':>16} {'pool allocated':>16}  ratio")
    print(f"  {'sampling (plain engine)':<24} {_mib(dense):>16} {_mib(block):>16} {_mib(pool):>16}  "
          f"{dense / block:.1f}x")  # fmt: skip
    figures: dict[str, Any] = {
        "lengths": {"p50": s[len(s) // 2], "p90": s[int(0.9 * len(s))], "max": s[-1]},
        "max_new_tokens": sampling.max_new_tokens,
        "sampling": _kv_figures(dense, block, pool),
    }
    params = generator.params  # type: ignore[attr-defined]  # the tokenizer's EOS and the job's stop tokens
    requests = requests_for(prompts, samples_per_prompt=n, seed=config.seed, iteration=1)
    width = max(len(r.prompt_P) for r in requests)
    engine = GenerationEngine(model, params, num_slots=len(requests), max_len=width + params.max_new_tokens)
    engine.add(requests)
    with torch.no_grad():
        while engine.has_work():
            engine.step()
    cache = engine.cache
    dense = cache.nbytes_per_slot() * cache.num_slots
    block = cache.peak_nbytes_in_use
    print(f"  {'engine (1 instance)':<24} {_mib(dense):>16} {_mib(block):>16} {_mib(cache.nbytes()):>16}  "
          f"{dense / block:.1f}x")  # fmt: skip
    figures["engine"] = _kv_figures(dense, block, cache.nbytes())
    return figures


def _kv_figures(dense: float, block: float, pool: float) -> dict[str, float]:
    return {
        "dense_mib": dense / 2**20,
        "block_mib": block / 2**20,
        "pool_mib": pool / 2**20,
        "ratio": dense / block,
    }


def syncs_per_step(max_new: int = 24) -> dict[str, list[int]]:
    """Syncs of each decode step of the engine (all samples admitted by its first step) and of
    `SamplingGenerator` (between consecutive model calls), sampled, on the quick workload. Uses only what
    BASELINE has too (whose SamplingGenerator had its own decode loop)."""
    from rlhfuse.core.syncs import SyncCounter
    from rlhfuse.trainer import SamplingGenerator

    try:
        from rlhfuse.core.sampling import SamplingConfig
    except ImportError:  # BASELINE's name for it
        from rlhfuse.core.sampling import GeneratorConfig as SamplingConfig  # type: ignore[attr-defined,no-redef]

    out: dict[str, list[int]] = {"engine": [], "sampling": []}
    with workload(True) as w, torch.no_grad():
        params = SamplingParams(max_new_tokens=max_new, temperature=1.0, stop_token_ids=(EOS,))
        width = w.prompts.input_ids_BP.shape[1]
        engine = GenerationEngine(w.model, params, num_slots=len(w.prompts) * w.n, max_len=width + max_new)
        engine.add(requests_for(w.prompts, samples_per_prompt=w.n, seed=0, iteration=0))
        engine.step()
        while engine.has_work():
            with SyncCounter(device="cpu") as counter:
                engine.step()
            out["engine"].append(counter.count)
        generator = SamplingGenerator(
            w.model, SamplingConfig(max_new_tokens=max_new), eos_token_id=EOS, pad_token_id=PAD,
            samples_per_prompt=w.n, seed=0,
        )  # fmt: skip
        marks: list[int] = []
        with SyncCounter(device="cpu") as counter:
            hook = generator.model.register_forward_pre_hook(lambda *_: marks.append(counter.count))
            try:
                list(generator.generate(w.prompts, iteration=0))
            finally:
                hook.remove()
        out["sampling"] = [b - a for a, b in itertools.pairwise(marks[1:])]
    out["training step"] = training_step_syncs()
    return out


def training_step_syncs(microbatches: int = 4) -> list[int]:
    """Syncs of one pipeline training step (`PipelineExecutor.run`, Actor + Critic, pp=1 in one process: the
    point-to-point adds none; packed micro-batches), counted after a warm-up step. The micro-batches' mask layouts,
    where this revision has them, are worked out from the host masks before the count, as `PlanExecutor` does
    before it moves them to the device."""
    from rlhfuse.core.advantages import AlgorithmConfig
    from rlhfuse.core.syncs import SyncCounter
    from rlhfuse.models import ModelConfig
    from rlhfuse.pipeline import greedy
    from rlhfuse.runtime.executor import PipelineExecutor, StepWork, ppo_losses

    try:
        from rlhfuse.runtime.batch_split import split_minibatch
    except ImportError:  # BASELINE's name for the module
        from rlhfuse.runtime.balance import split_minibatch  # type: ignore[no-redef]
    from rlhfuse.runtime.layout import ModelParallel, ParallelLayout
    from rlhfuse.runtime.lower import lower_checked
    from rlhfuse.runtime.partition import stages_for_rank
    from rlhfuse.testing.data import random_batch

    torch.manual_seed(0)
    cfg = ModelConfig.tiny(num_layers=2)
    models = {"actor": Transformer(cfg, head="lm"), "critic": Transformer(cfg, head="value")}
    for model in models.values():
        model.packing = True
    layout = ParallelLayout(ModelParallel(1), ModelParallel(1), 1, 1, microbatches)
    problem = layout.problem()
    executor = PipelineExecutor(
        0, lower_checked(problem, greedy(problem)), problem, stages_for_rank(layout, 0, models),
        losses=ppo_losses(AlgorithmConfig(entropy_coef=0.01)),
    )  # fmt: skip
    micro, weights, _ = split_minibatch(
        random_batch(2 * microbatches, seed=1, dtype=torch.float32), 1, microbatches
    )
    work = StepWork(micro, weights)
    with_layouts = getattr(work, "with_layouts", None)  # absent at BASELINE: its forwards read the masks
    if with_layouts is not None:
        work = with_layouts(packed=True)
    executor.run(work)
    with SyncCounter(device="cpu") as counter:
        executor.run(work)
    return [counter.count]


def baseline_syncs_per_step() -> dict[str, list[int]] | None:
    """`syncs_per_step` on BASELINE's source (with this tree's SyncCounter, which imports nothing of rlhfuse), in
    a subprocess; None when this is not a git checkout holding BASELINE."""
    root = Path(__file__).resolve().parents[1]
    git = shutil.which("git")
    if git is None or not (root / ".git").exists():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            [git, "-C", str(root), "archive", BASELINE, "src", "benchmarks"], capture_output=True, check=False
        )
        if archive.returncode != 0:
            return None
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        shutil.copy(root / "src" / "rlhfuse" / "core" / "syncs.py", Path(tmp) / "src" / "rlhfuse" / "core")
        (Path(tmp) / "src" / "rlhfuse" / "testing").mkdir(
            exist_ok=True
        )  # the random batch (imports only types)
        for name in ("__init__.py", "data.py"):
            shutil.copy(
                root / "src" / "rlhfuse" / "testing" / name, Path(tmp) / "src" / "rlhfuse" / "testing"
            )
        shutil.copy(Path(__file__), Path(tmp) / "benchmarks" / "bench_generation.py")
        code = "import json, benchmarks.bench_generation as b; print(json.dumps(b.syncs_per_step()))"
        env = dict(os.environ, PYTHONPATH=f"{tmp}/src:{tmp}")
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"syncs_per_step on BASELINE ({BASELINE}) failed:\n{done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def _describe(counts: list[int]) -> str:
    return f"mean {statistics.mean(counts):5.1f}, max {max(counts):3d} over {len(counts)} steps"


def memory_and_syncs(quick: bool) -> dict[str, Any]:
    print("\npeak KV bytes of one iteration's generation (fp32 caches)")
    kv = {experiment: kv_memory(experiment) for experiment in ("default", "longtail")}
    print("\nsyncs per decode step and per training step (SyncCounter on the CPU, sampled; quick workload)")
    after = syncs_per_step()
    before = baseline_syncs_per_step()
    print("  (the training step: one PipelineExecutor step of Actor + Critic over 4 packed micro-batches)")
    for name in ("engine", "sampling", "training step"):
        was = f"before ({BASELINE}) {_describe(before[name])}" if before else "before: BASELINE not available"
        print(f"  {name:<9} {was} | after {_describe(after[name])}")

    def summary(counts: dict[str, list[int]]) -> dict[str, dict[str, float]]:
        return {
            name.replace(" ", "_"): {"mean": statistics.mean(c), "max": max(c), "steps": len(c)}
            for name, c in counts.items()
        }

    syncs = {"baseline": BASELINE, "after": summary(after), "before": summary(before) if before else None}
    return {"kv_memory": kv, "syncs": syncs}
