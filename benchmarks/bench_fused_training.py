"""Training stage of the default tiny job on 2 gloo processes: fused schedule vs serial 1F1B on the same ranks.

`python -m benchmarks.run fused_training [--quick]`. Both strategies (`rlhfuse.runtime.PipelineStrategy`,
schedule "fused" and "serial_1f1b") train their own copy of the same models on the same mini-batches, one step
each in alternation, so machine noise hits both alike. Printed side by side:

- predicted: serial / fused makespan simulated with the stage times measured on the profiling step;
- measured: median over rounds of serial / fused wall time of one optimizer step (slowest rank);
- measured / predicted speedup (goal >= 0.9);
- replay x: serial / fused makespan simulated with each step's own op times (same contention as measured);
- comm+book: measured makespan / that replayed makespan - 1 per schedule: communication, bookkeeping and waiting
  not explained by compute;
- bubble ratio measured on the ranks.

Then the split backward (zero-bubble F/I/W, `pipeline.split_backward`): a third strategy, the fused schedule
planned with F/I/W (`split_backward=true`, its profiling step measuring I and W), stepped in the same rotation:
F/B vs F/I/W makespans predicted and measured side by side, measured / predicted for F/I/W, and which one
`split_backward=auto` would keep (the shorter prediction).

Then the data-parallel gradient reduction (dp = 2, the Actor of each shape, 2 micro-batches per step), measured
side by side in alternation: `whole` (the reduction before buckets: after the last backward, every gradient
concatenated into one transient buffer, one all-reduce, copied back) vs `bucketed`
(`rlhfuse.distributed.grad_buckets.GradReducer` at `pipeline.grad_bucket_mb`, launched bucket by bucket during the
last backward). Printed: the median wall time of last backward + reduction, the part exposed after the
backward, and the bytes each holds for it (whole: a transient copy of all gradients; bucketed: its persistent
bucket buffers, the largest bucket).

Shapes: the default job (conf/model/tiny.yaml: width 64, 2 layers; mini-batches of 64 samples, prompts <= 16
tokens, long-tailed responses up to 48) with actor_pp = critic_pp = 2 and 4 micro-batches; `--wide` variants
(width 256 / 512) show how the ratios move as compute grows against communication.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.two_ranks import SHAPES, init_worker, run_two_ranks
from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.core.types import TrainBatch
from rlhfuse.models import ModelConfig, Transformer


def _batch(samples: int, seed: int, vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    prompt, response = 16, 48
    lengths = torch.exp(torch.randn(samples, generator=g) * 0.8 + 2.4).round().clamp(1, response).long()
    ids = torch.randint(4, vocab, (samples, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    resp = torch.zeros(samples, response)
    for b in range(samples):
        p = int(torch.randint(6, prompt + 1, (1,), generator=g))
        mask[b, : prompt - p] = 0
        mask[b, prompt + int(lengths[b]) :] = 0
        resp[b, : int(lengths[b])] = 1
    keep = int(lengths.max())
    ids, mask, resp = ids[:, : prompt + keep], mask[:, : prompt + keep], resp[:, :keep]
    ids = ids * mask

    def rand() -> torch.Tensor:
        return torch.randn(samples, keep, generator=g)

    return TrainBatch(ids, mask, resp, -2.0 + 0.1 * rand(), 0.3 * rand(), rand(), rand())


def _worker(rank: int, world: int, init: str, shape: str, rounds: int, queue: Any) -> None:
    from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
    from rlhfuse.trainer.strategies.pipelines.training import PipelineStrategy

    init_worker(rank, world, init)
    cfg = ModelConfig.tiny(vocab_size=91, **SHAPES[shape])
    strategies = {}
    for key, name, split in (("serial_1f1b", "serial_1f1b", False), ("fused", "fused", False),
                             ("fused_fiw", "fused", True)):  # fmt: skip
        torch.manual_seed(0)
        actor, critic = Transformer(cfg, head="lm"), Transformer(cfg, head="value")
        pcfg = PipelineConfig(
            name=name, actor_pp=2, critic_pp=2, microbatches=4, search_budget_s=3.0, split_backward=split
        )
        strategies[key] = PipelineStrategy(
            actor,
            critic,
            pcfg,
            AlgorithmConfig(),
            total_steps=10_000,
            mini_batch_size=64,
            micro_batch_size=16,
            schedule=name,
            timeout_s=120,
            log=lambda msg: None,
        )
    rows: dict[str, list[dict[str, float]]] = {n: [] for n in strategies}
    for step in range(rounds + 1):
        batch = _batch(64, step, cfg.vocab_size)
        order = list(strategies)[step % 3 :] + list(strategies)[: step % 3]  # each goes first in turn
        for name in order:
            stats = strategies[name].train_step(batch).metrics()
            if step > 0:  # step 0 is each strategy's profiling step (serial 1F1B)
                stats["replay_s"] = strategies[name].replay_makespan()
                rows[name].append(stats)
    if rank == 0:
        fused, fiw = strategies["fused"], strategies["fused_fiw"]
        queue.put(
            {
                "rows": rows,
                "predicted_fused": fused.plan.predicted_s,
                "predicted_serial": fused.plan.predicted_serial_s,
                "predicted_fiw": fiw.plan.predicted_s,
                "schedule": str(fused.schedule),
            }
        )


def _reduce_worker(rank: int, world: int, init: str, shape: str, rounds: int, queue: Any) -> None:
    import time

    from rlhfuse.core import step_losses as losses
    from rlhfuse.distributed.grad_buckets import DEFAULT_BUCKET_MB, GradReducer

    init_worker(rank, world, init)
    cfg = ModelConfig.tiny(vocab_size=91, **SHAPES[shape])
    torch.manual_seed(0)
    model = Transformer(cfg, head="lm")
    params = [p for p in model.parameters() if p.requires_grad]
    reducer = GradReducer([params], dist.group.WORLD, bucket_mb=DEFAULT_BUCKET_MB)
    algorithm = AlgorithmConfig()

    def backward(batch: TrainBatch) -> None:
        logits_BRV = losses.model_response_outputs(model, batch, packing=False)
        loss, _ = losses.response_actor_loss(logits_BRV, batch, algorithm, 1.0)
        loss.backward()

    times: dict[str, list[tuple[float, float]]] = {"whole": [], "bucketed": []}
    for step in range(rounds + 1):
        micro = [_batch(16, 100 * step + 2 * rank + k, cfg.vocab_size) for k in range(2)]
        for way in ("whole", "bucketed") if step % 2 == 0 else ("bucketed", "whole"):
            model.zero_grad(set_to_none=True)
            backward(micro[0])
            dist.barrier()
            start = time.perf_counter()
            if way == "bucketed":
                reducer.arm()
            backward(micro[1])
            done_backward = time.perf_counter()
            if way == "whole":
                flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
                dist.all_reduce(flat)
                for p, chunk in zip(params, flat.split([p.numel() for p in params]), strict=True):
                    assert p.grad is not None
                    p.grad.copy_(chunk.view_as(p))
            else:
                reducer.finish()
                reducer.wait()
            end = time.perf_counter()
            if step > 0:
                times[way].append((end - start, end - done_backward))
    if rank == 0:
        grad_bytes = sum(p.numel() * p.element_size() for p in params)
        largest = max(b.numel for b in reducer.buckets) * params[0].element_size()
        queue.put({"times": times, "grad_bytes": grad_bytes, "largest_bucket": largest,
                   "buckets": len(reducer.buckets)})  # fmt: skip


def measure_reduction(shape: str, rounds: int) -> dict[str, float]:
    result = run_two_ranks(_reduce_worker, shape, rounds)
    times = result["times"]
    out = {f"{way}_{what}_ms": statistics.median(t[i] for t in times[way]) * 1e3
           for way in times for i, what in enumerate(("total", "exposed"))}  # fmt: skip
    out["total_ratio"] = out["whole_total_ms"] / out["bucketed_total_ms"]
    out.update(grad_mib=result["grad_bytes"] / 2**20, largest_bucket_mib=result["largest_bucket"] / 2**20,
               buckets=result["buckets"])  # fmt: skip
    return out


def measure(shape: str, rounds: int) -> dict[str, float]:
    result = run_two_ranks(_worker, shape, rounds)
    rows = result["rows"]
    serial = [r["train/measured_makespan_s"] for r in rows["serial_1f1b"]]
    fused = [r["train/measured_makespan_s"] for r in rows["fused"]]
    fiw = [r["train/measured_makespan_s"] for r in rows["fused_fiw"]]
    ratios = [s / f for s, f in zip(serial, fused, strict=True)]
    fiw_ratio = statistics.median(f / w for f, w in zip(fused, fiw, strict=True))
    fiw_pred_ratio = result["predicted_fused"] / result["predicted_fiw"]
    pred_ratio = result["predicted_serial"] / result["predicted_fused"]
    meas_ratio = statistics.median(ratios)
    replay = {n: [r["replay_s"] for r in rows[n]] for n in rows}
    return {
        "replay_ratio": statistics.median(
            s / f for s, f in zip(replay["serial_1f1b"], replay["fused"], strict=True)
        ),
        "comm_overhead_serial": statistics.median(
            m / r - 1 for m, r in zip(serial, replay["serial_1f1b"], strict=True)
        ),
        "comm_overhead_fused": statistics.median(
            m / r - 1 for m, r in zip(fused, replay["fused"], strict=True)
        ),
        "predicted_serial_ms": result["predicted_serial"] * 1e3,
        "predicted_fused_ms": result["predicted_fused"] * 1e3,
        "measured_serial_ms": statistics.median(serial) * 1e3,
        "measured_fused_ms": statistics.median(fused) * 1e3,
        "predicted_ratio": pred_ratio,
        "measured_ratio": meas_ratio,
        "measured_over_predicted": meas_ratio / pred_ratio,
        "overhead_serial": statistics.median(serial) / result["predicted_serial"] - 1,
        "overhead_fused": statistics.median(fused) / result["predicted_fused"] - 1,
        "bubble_serial": statistics.median(r["train/bubble_ratio"] for r in rows["serial_1f1b"]),
        "bubble_fused": statistics.median(r["train/bubble_ratio"] for r in rows["fused"]),
        # split backward: F/B over F/I/W (> 1: F/I/W faster)
        "predicted_fiw_ms": result["predicted_fiw"] * 1e3,
        "measured_fiw_ms": statistics.median(fiw) * 1e3,
        "fiw_predicted_ratio": fiw_pred_ratio,
        "fiw_measured_ratio": fiw_ratio,
        "fiw_measured_over_predicted": fiw_ratio / fiw_pred_ratio,
        "fiw_replay_ratio": statistics.median(
            f / w for f, w in zip(replay["fused"], replay["fused_fiw"], strict=True)
        ),
        "bubble_fiw": statistics.median(r["train/bubble_ratio"] for r in rows["fused_fiw"]),
        "auto_picks_fiw": float(result["predicted_fiw"] < result["predicted_fused"]),
    }


def run(quick: bool = False, shapes: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Figures per shape (`default`, ...): the training step's columns; per `SHAPE/grad_reduction`: the reduction's."""
    shapes = shapes or (["default"] if quick else ["default", "wide256", "wide512"])
    rounds = 4 if quick else 12
    out: dict[str, dict[str, float]] = {}
    print(
        f"{'shape':<9} {'pred serial/fused ms':>21} {'meas serial/fused ms':>21} {'pred x':>7} {'meas x':>7} "
        f"{'meas/pred':>9} {'replay x':>8} {'comm+book s/f':>14} {'bubble s/f':>11}"
    )
    for shape in shapes:
        r = measure(shape, rounds)
        out[shape] = r
        print(
            f"{shape:<9} {r['predicted_serial_ms']:>9.1f} / {r['predicted_fused_ms']:<9.1f} "
            f"{r['measured_serial_ms']:>9.1f} / {r['measured_fused_ms']:<9.1f} {r['predicted_ratio']:>7.2f} "
            f"{r['measured_ratio']:>7.2f} {r['measured_over_predicted']:>9.2f} "
            f"{r['replay_ratio']:>8.2f} {r['comm_overhead_serial']:>+6.0%}/{r['comm_overhead_fused']:<+6.0%} "
            f"{r['bubble_serial']:>5.2f}/{r['bubble_fused']:<5.2f}",
            flush=True,
        )
    print(
        f"\n{'shape':<9} {'pred F/B | F/I/W ms':>21} {'meas F/B | F/I/W ms':>21} {'pred x':>7} {'meas x':>7} "
        f"{'meas/pred':>9} {'replay x':>8} {'bubble F/I/W':>12} {'auto keeps':>10}"
    )
    for shape in shapes:
        r = out[shape]
        print(
            f"{shape:<9} {r['predicted_fused_ms']:>9.1f} | {r['predicted_fiw_ms']:<9.1f} "
            f"{r['measured_fused_ms']:>9.1f} | {r['measured_fiw_ms']:<9.1f} {r['fiw_predicted_ratio']:>7.2f} "
            f"{r['fiw_measured_ratio']:>7.2f} {r['fiw_measured_over_predicted']:>9.2f} {r['fiw_replay_ratio']:>8.2f} "
            f"{r['bubble_fiw']:>12.2f} {'F/I/W' if r['auto_picks_fiw'] else 'F/B':>10}",
            flush=True,
        )
    print(
        f"\n{'shape':<9} {'grads MiB':>9} {'buckets':>7} {'whole ms (exposed)':>19} {'bucketed ms (exposed)':>22} "
        f"{'whole/bucketed':>14} {'transient MiB w/b':>18}"
    )
    for shape in shapes:
        g = measure_reduction(shape, rounds)
        out[f"{shape}/grad_reduction"] = g
        print(
            f"{shape:<9} {g['grad_mib']:>9.2f} {g['buckets']:>7.0f} {g['whole_total_ms']:>9.1f} "
            f"({g['whole_exposed_ms']:>6.1f})   {g['bucketed_total_ms']:>9.1f} ({g['bucketed_exposed_ms']:>6.1f})      "
            f"{g['total_ratio']:>10.2f}   {g['grad_mib']:>7.2f} / {g['largest_bucket_mib']:<6.2f}",
            flush=True,
        )
    return out


if __name__ == "__main__":
    run(quick="--quick" in sys.argv, shapes=[a for a in sys.argv[1:] if not a.startswith("--")] or None)
