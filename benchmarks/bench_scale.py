"""Per-rank weight memory under sharded construction, and weight-sync traffic, for pp = 1, 2, 4; per-rank weight
memory with the tensor-parallel shard (pp x tp = 1/2 x 1/2) and its step time at width 512.

Each rank of each layout loads the four models exactly as `rlhfuse-train` does under pipeline=fused
(`rlhfuse.models.from_pretrained(stages=...)`: meta init, only its stages read from the safetensors files) plus
the full generation copy, in this one process one rank after the other (no process group is needed to build a
rank's shard). Printed per layout: the most parameter bytes a rank holds (`memory/param_bytes`) as a ratio of a
single process's four whole models + generation copy, the same without the generation copy (the trained and
frozen models only), and the most bytes a rank receives for one weight sync (`weight_sync/bytes_per_rank`:
the Actor stages it does not own) vs the former sync (every stage of both models broadcast to every rank).

Tensor parallelism (`rlhfuse.runtime.tensor_parallel.shard_transformer`): the most bytes a rank of a pp x tp
grid holds of the four models (pp stages, then each stage's tp shard), as a ratio of one process, next to the
planner's prediction for the same layout (`rlhfuse.planner.memory`, which the trainer's plan=auto uses); the
forward + backward time of a log-prob loss on 2 gloo ranks with tp=2 vs tp=1 (the whole model in each process);
and the runtime's training step at width 512: one PPO optimizer step of the Actor and the Critic through
`PipelineStrategy` on the same 2 gloo ranks with pipeline.actor_tp = critic_tp = 2 (pp=1) vs tp=1 with
pp=2 and with dp=2, the three strategies stepping in alternation on the same mini-batches, median wall time of
a step (barrier to barrier). No gain is expected on a 2-core CPU: the ratios show the cost of the collectives.
"""

from __future__ import annotations

import pathlib
import statistics
import tempfile
import time
from typing import Any

import torch

from rlhfuse.models import ModelConfig, Transformer, from_pretrained, resident_bytes, save_pretrained
from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
from rlhfuse.trainer.strategies.pipelines.training import pipeline_layout


def _rank_bytes(root: pathlib.Path, pp: int, rank: int) -> tuple[int, int, int, int]:
    """(trained + frozen bytes, generation copy bytes, bytes received by a sync, bytes the former sync received:
    every Actor and Critic stage this rank does not own) of one rank."""
    layout = pipeline_layout(PipelineConfig(actor_pp=pp, critic_pp=pp, microbatches=pp), pp, 8, 4)
    held = layout.held_stages(rank)
    actor = from_pretrained(root / "sft", stages=(pp, held["actor"]))
    models = [
        actor,
        from_pretrained(root / "sft", stages=(pp, held["actor"])),
        from_pretrained(root / "rm", head="value", stages=(pp, held["critic"])),
        from_pretrained(root / "rm", head="value", stages=(pp, held["critic"])),
    ]
    generation = from_pretrained(root / "sft")

    def elsewhere(model: Transformer) -> int:
        return sum(p.numel() * p.element_size() for p in model.parameters() if p.is_meta)

    received = elsewhere(actor)
    return resident_bytes(*models), resident_bytes(generation), received, received + elsewhere(models[2])


def run(quick: bool = False) -> dict[str, Any]:
    """Figures: one_process_mib; per `pp1`/`pp2`/`pp4` param_mib, param_ratio, models_only_mib / _ratio,
    sync_mib_per_rank, sync_vs_full_gather; `tp.pp{P}_tp{T}` (mib_per_rank, of_one_process, planner_mib,
    planner_equal) and `tp.logprob_step`; `runtime_step.{tp2,tp1_pp2,tp1_dp2}` (ms, tp2_over_this)."""
    layers = 4 if quick else 8
    cfg = ModelConfig.tiny(
        vocab_size=512, hidden_size=128 if quick else 512, intermediate_size=256 if quick else 1536,
        num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=32 if quick else 128,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        torch.manual_seed(0)
        save_pretrained(Transformer(cfg, head="lm"), root / "sft")
        save_pretrained(Transformer(cfg, head="value"), root / "rm")
        single_models, single_gen, _, _ = _rank_bytes(root, 1, 0)
        print(
            f"width {cfg.hidden_size}, {layers} layers, vocab {cfg.vocab_size}: one process holds "
            f"{single_models / 2**20:.1f} MiB of trained + frozen weights + {single_gen / 2**20:.1f} MiB "
            "generation copy"
        )
        print(f"{'pp':>3} {'param_bytes':>12} {'ratio':>6} {'models only':>12} {'ratio':>6} {'sync/rank':>10} "
              f"{'vs full gather':>14}")  # fmt: skip
        figures: dict[str, Any] = {"one_process_mib": (single_models + single_gen) / 2**20}
        for pp in (1, 2, 4):
            per_rank = [_rank_bytes(root, pp, r) for r in range(pp)]
            most = max(m + g for m, g, _, _ in per_rank)
            models_only = max(m for m, _, _, _ in per_rank)
            sync = max(s for _, _, s, _ in per_rank)
            former = max(f for _, _, _, f in per_rank)
            print(
                f"{pp:>3} {most / 2**20:>10.1f}Mi {most / (single_models + single_gen):>6.3f} "
                f"{models_only / 2**20:>10.1f}Mi {models_only / single_models:>6.3f} {sync / 2**20:>8.2f}Mi "
                f"{sync / former if former else 0.0:>14.3f}"
            )
            figures[f"pp{pp}"] = {
                "param_mib": most / 2**20, "param_ratio": most / (single_models + single_gen),
                "models_only_mib": models_only / 2**20, "models_only_ratio": models_only / single_models,
                "sync_mib_per_rank": sync / 2**20, "sync_vs_full_gather": sync / former if former else 0.0,
            }  # fmt: skip
        figures["tp"] = run_tp(root, quick, cfg)
    figures["runtime_step"] = run_runtime_step(quick)
    return figures


def _predicted_bytes(cfg: ModelConfig, pp: int, tp: int) -> float:
    """The planner's most bytes of the four models on one rank of a pp x tp grid (no generation copy)."""
    from rlhfuse.planner.memory import rank_memories
    from rlhfuse.planner.specs import ModelSpec

    spec = ModelSpec.from_config(cfg)
    ranks = rank_memories(spec, spec, actor_pp=pp, critic_pp=pp, actor_tp=tp, reward=spec)
    return max(m.param_bytes - m.generation_weights for m in ranks)


def _tp_bytes(root: pathlib.Path, pp: int, tp: int) -> int:
    """The most bytes of the four models one rank of a pp x tp grid holds."""
    from rlhfuse.runtime.tensor_parallel import shard_transformer

    layout = pipeline_layout(PipelineConfig(actor_pp=pp, critic_pp=pp, microbatches=pp), pp, 8, 4)
    most = 0
    for rank in range(pp):
        held = layout.held_stages(rank)
        parts = [
            from_pretrained(root / "sft", stages=(pp, held["actor"])),
            from_pretrained(root / "sft", stages=(pp, held["actor"])),
            from_pretrained(root / "rm", head="value", stages=(pp, held["critic"])),
            from_pretrained(root / "rm", head="value", stages=(pp, held["critic"])),
        ]
        for t in range(tp):
            shards = [shard_transformer(m, t, tp) if tp > 1 else m for m in parts]
            most = max(most, resident_bytes(*shards))
    return most


def _tp_worker(rank: int, world: int, init: str, shape: str, rounds: int, queue: Any) -> None:
    import torch.nn.functional as F

    from benchmarks.two_ranks import SHAPES, init_worker
    from rlhfuse.runtime.tensor_parallel import shard_transformer, vocab_parallel_logprobs

    init_worker(rank, world, init)
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(vocab_size=4096, **SHAPES[shape])
    full = Transformer(cfg)
    tp = shard_transformer(full, rank, world)
    ids = torch.randint(0, cfg.vocab_size, (4, 128))

    def step_full() -> None:
        F.log_softmax(full(ids), -1).gather(-1, ids[..., None]).sum().backward()

    def step_tp() -> None:
        vocab_parallel_logprobs(tp(ids), ids, tp.vocab_shard).sum().backward()

    times: dict[str, list[float]] = {"tp1": [], "tp2": []}
    for _ in range(rounds):
        for name, fn in (("tp1", step_full), ("tp2", step_tp)):
            torch.distributed.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        queue.put({k: statistics.median(v) for k, v in times.items()})


def run_tp(root: pathlib.Path, quick: bool, cfg: ModelConfig) -> dict[str, Any]:
    from benchmarks.two_ranks import run_two_ranks

    single = _tp_bytes(root, 1, 1)
    print(f"{'pp':>3} {'tp':>3} {'param_bytes/rank':>17} {'vs one process':>15} {'planner predicts':>17}")
    figures: dict[str, Any] = {}
    for pp in (1, 2):
        for tp in (1, 2):
            most = _tp_bytes(root, pp, tp)
            predicted = _predicted_bytes(cfg, pp, tp)
            print(
                f"{pp:>3} {tp:>3} {most / 2**20:>15.1f}Mi {most / single:>15.3f} {predicted / 2**20:>15.1f}Mi"
                f"{'' if predicted == most else '  (differs)'}"
            )
            figures[f"pp{pp}_tp{tp}"] = {
                "mib_per_rank": most / 2**20, "of_one_process": most / single, "planner_mib": predicted / 2**20,
                "planner_equal": predicted == most,
            }  # fmt: skip
    shape = "wide256" if quick else "wide512"
    t = run_two_ranks(_tp_worker, shape, 3 if quick else 7)
    print(
        f"forward + backward of a log-prob loss, {shape}, 4 x 128 tokens, vocab 4096, 2 gloo ranks: "
        f"tp=1 {t['tp1'] * 1e3:.0f} ms, tp=2 {t['tp2'] * 1e3:.0f} ms (tp2 / tp1 = {t['tp2'] / t['tp1']:.2f})"
    )
    figures["logprob_step"] = {
        "tp1_ms": t["tp1"] * 1e3,
        "tp2_ms": t["tp2"] * 1e3,
        "tp2_over_tp1": t["tp2"] / t["tp1"],
    }
    return figures


RUNTIME_LAYOUTS = {
    # name: (actor_pp = critic_pp, tp, micro-batches per group)
    "tp=2 (pp=1)": (1, 2, 4),
    "tp=1 pp=2": (2, 1, 4),
    "tp=1 dp=2": (1, 1, 2),
}


def _step_worker(rank: int, world: int, init: str, shape: str, rounds: int, queue: Any) -> None:
    """One PPO optimizer step per layout in alternation on the same mini-batches (16 samples, micro-batches of
    4); rank 0 reports each layout's step wall times (barrier to barrier: the slowest rank's step)."""
    import torch.distributed as dist

    from benchmarks.bench_fused_training import _batch
    from benchmarks.two_ranks import SHAPES, init_worker
    from rlhfuse.core.advantages import AlgorithmConfig
    from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
    from rlhfuse.trainer.strategies.pipelines.training import PipelineStrategy

    init_worker(rank, world, init)
    cfg = ModelConfig.tiny(vocab_size=4096, **SHAPES[shape])
    strategies = {}
    for name, (pp, tp, micro) in RUNTIME_LAYOUTS.items():
        torch.manual_seed(0)
        actor, critic = Transformer(cfg, head="lm"), Transformer(cfg, head="value")
        pcfg = PipelineConfig(
            name="fused", actor_pp=pp, critic_pp=pp, actor_tp=tp, critic_tp=tp, microbatches=micro,
            search_budget_s=0.5,
        )  # fmt: skip
        strategies[name] = PipelineStrategy(
            actor, critic, pcfg, AlgorithmConfig(), total_steps=10_000, mini_batch_size=16, micro_batch_size=4,
            schedule="fused", timeout_s=300, log=lambda msg: None,
        )  # fmt: skip
    times: dict[str, list[float]] = {n: [] for n in strategies}
    for step in range(rounds + 1):
        batch = _batch(16, step, cfg.vocab_size)
        order = list(strategies) if step % 2 == 0 else list(reversed(strategies))
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            strategies[name].train_step(batch)
            dist.barrier()
            if step > 0:  # step 0 is each strategy's profiling step
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        queue.put({n: statistics.median(v) for n, v in times.items()})


def run_runtime_step(quick: bool) -> dict[str, dict[str, float]]:
    from benchmarks.two_ranks import run_two_ranks

    shape = "wide256" if quick else "wide512"
    t = run_two_ranks(_step_worker, shape, 2 if quick else 4)
    tp2 = t["tp=2 (pp=1)"]
    print(
        f"runtime training step (PipelineStrategy, Actor + Critic, one PPO optimizer step of 16 samples of "
        f"<= 64 tokens, micro-batches of 4), {shape}, vocab 4096, 2 gloo ranks, median wall time:"
    )
    figures = {}
    for name, seconds in t.items():
        print(f"  {name:<12} {seconds * 1e3:8.0f} ms   tp=2 / this = {tp2 / seconds:.2f}")
        key = name.split(" (")[0].replace("=", "").replace(" ", "_")  # tp2, tp1_pp2, tp1_dp2
        figures[key] = {"ms": seconds * 1e3, "tp2_over_this": tp2 / seconds}
    return figures
