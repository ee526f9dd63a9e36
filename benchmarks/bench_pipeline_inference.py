"""Inference stage of the default tiny job on 2 gloo processes: over the pipeline layout vs whole models.

`python -m benchmarks.run pipeline_inference [--quick]`. One rollout of the default job's shape (128 samples,
prompts <= 16 tokens, long-tailed responses <= 48) goes through Actor, Ref, Critic and Reward forward passes,
three ways in alternation (so machine noise hits all alike), median wall time of the slowest rank:

- single: one process runs the whole models (`ModelInferencer`) while the other rank idles (no contention);
- replicated: both ranks run the whole models at once (what pipeline=fused did before: each rank duplicated it);
- pipeline: `PipelineInferencer`, actor_pp = critic_pp = 2, 4 micro-batches, Actor/Ref on ranks 0 -> 1 and
  Critic/Reward on 1 -> 0, results summed to every rank.

The outputs of the pipeline are checked against the single-process ones before timing.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.two_ranks import SHAPES, init_worker, run_two_ranks
from rlhfuse.core.types import Rollout
from rlhfuse.models import ModelConfig, Transformer


def _rollout(samples: int, seed: int, vocab: int) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    prompt, response = 16, 48
    lengths = torch.exp(torch.randn(samples, generator=g) * 0.8 + 2.4).round().clamp(1, response).long()
    keep = int(lengths.max())
    p_ids = torch.randint(4, vocab, (samples, prompt), generator=g)
    r_ids = torch.randint(4, vocab, (samples, keep), generator=g)
    p_mask = torch.ones_like(p_ids)
    r_mask = torch.zeros_like(r_ids)
    for b in range(samples):
        p = int(torch.randint(6, prompt + 1, (1,), generator=g))
        p_mask[b, : prompt - p] = 0
        r_mask[b, : int(lengths[b])] = 1
    finished = lengths < response
    return Rollout(
        p_ids * p_mask,
        p_mask,
        r_ids * r_mask,
        r_mask,
        torch.arange(samples),
        torch.zeros_like(lengths),
        finished,
    )


def _worker(rank: int, world: int, init: str, shape: str, rounds: int, queue: Any) -> None:
    from rlhfuse.core.inference import InferencerConfig
    from rlhfuse.data.synthetic import build_tokenizer
    from rlhfuse.runtime.layout import ModelParallel, ParallelLayout
    from rlhfuse.trainer.strategies.pipelines.inference import PipelineInferencer
    from rlhfuse.trainer.strategies.plain.inference import ModelInferencer

    init_worker(rank, world, init)
    cfg = ModelConfig.tiny(vocab_size=91, **SHAPES[shape])
    torch.manual_seed(0)
    heads = {"actor": "lm", "ref": "lm", "critic": "value", "reward": "value"}
    models = {name: Transformer(cfg, head=head) for name, head in heads.items()}
    config = InferencerConfig()
    tokenizer = build_tokenizer()
    whole = ModelInferencer(
        config, actor=models["actor"], ref=models["ref"], critic=models["critic"], reward_model=models["reward"],
        rewards=None, tokenizer=tokenizer, temperature=1.0,
    )  # fmt: skip
    layout = ParallelLayout(ModelParallel(2), ModelParallel(2), 1, world, 4)
    pipe = PipelineInferencer(
        config,
        layout,
        models,
        rewards=None,
        tokenizer=tokenizer,
        temperature=1.0,
        timeout_s=120,
        log=lambda m: None,
    )
    rollout = _rollout(128, 0, cfg.vocab_size)
    want, got = whole.infer(rollout), pipe.infer(rollout)
    for name in ("logprobs_BR", "ref_logprobs_BR", "values_BR", "scores_B"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-4, atol=1e-4)

    def timed(kind: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        if kind == "pipeline":
            pipe.infer(rollout)
        elif kind == "replicated" or rank == 0:
            whole.infer(rollout)
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took)

    kinds = ["single", "replicated", "pipeline"]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else list(reversed(kinds)):
            times[kind].append(timed(kind))
    if rank == 0:
        queue.put({k: statistics.median(v) for k, v in times.items()})


def measure(shape: str, rounds: int) -> dict[str, float]:
    result: dict[str, float] = run_two_ranks(_worker, shape, rounds)
    return result


def run(quick: bool = False, shapes: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Figures per shape: single, replicated, pipeline (median seconds of the slowest rank) and their ratios
    single_over_pipeline, replicated_over_pipeline."""
    shapes = shapes or (["default"] if quick else ["default", "wide256"])
    rounds = 4 if quick else 12
    out: dict[str, dict[str, float]] = {}
    print(
        f"{'shape':<9} {'single ms':>10} {'replicated ms':>14} {'pipeline ms':>12} "
        f"{'single/pipeline':>16} {'replicated/pipeline':>20}"
    )
    for shape in shapes:
        r = measure(shape, rounds)
        out[shape] = {
            **r,
            "single_over_pipeline": r["single"] / r["pipeline"],
            "replicated_over_pipeline": r["replicated"] / r["pipeline"],
        }
        print(
            f"{shape:<9} {r['single'] * 1e3:>10.1f} {r['replicated'] * 1e3:>14.1f} {r['pipeline'] * 1e3:>12.1f} "
            f"{r['single'] / r['pipeline']:>16.2f} {r['replicated'] / r['pipeline']:>20.2f}",
            flush=True,
        )
    return out


if __name__ == "__main__":
    run(quick="--quick" in sys.argv, shapes=[a for a in sys.argv[1:] if not a.startswith("--")] or None)
