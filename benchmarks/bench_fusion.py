"""Inter-stage fusion: generation + inference, serial vs fused (migration + freed-instance inference), measured
with 2 generation instances as 2 gloo processes on this machine, and the Rt sweep of the simulator at paper scale.

Measured parts: `experiment=longtail`'s and the default job's warm-started models (SFT Actor, Ref, Reward,
Critic; long-tailed response lengths) and first batch, one process per instance, one thread each. Serial = each
instance generates its half, then infers it; fused (`fused_generate_infer`) = the ranks watch the unfinished count
asynchronously, at Rt the tail moves (KV transfer) to one instance, and the other infers its finished samples and
then steals the destination's finished, not yet inferred ones. Per round serial, then fused at each Rt; the time
is rank 0's start to the last inference output (all-gathered). Same samples, same outputs (checked per round).

Simulated part: the planner's Figure-9 sweep (`rlhfuse.planner.compare`, 13B / 33B on 32 x 8 H100), and the Rt
tuner's sweep on the same batch fed the cost model's profile: one simulator, two sources of costs.

Measured parts report, per Rt, the paired speedup serial / fused of Gen+Inf, whether the samples are identical,
and fused against the ideal-overlap bound of the same round (docs/generation.md).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from rlhfuse.generation.engine import EngineStats
from rlhfuse.testing.processes import leave_after_success


def _worker(
    rank: int,
    port: int,
    out: str,
    rounds: int,
    fractions: tuple[float, ...],
    overrides: tuple[str, ...],
    backend: str = "engine",
) -> None:
    import torch.distributed as dist

    from rlhfuse.data.collate import collate_prompts
    from rlhfuse.data.prompts import PromptLoader, load_prompts
    from rlhfuse.data.synthetic import SyntheticTask
    from rlhfuse.generation import GenerationEngine, SamplingParams, requests_for
    from rlhfuse.generation.fusion import fused_generate_infer
    from rlhfuse.trainer import compose_config
    from rlhfuse.trainer.models import load_models
    from rlhfuse.trainer.strategies.plain.inference import ModelInferencer
    from rlhfuse.trainer.warmstart import warm_start

    torch.set_num_threads(1)
    cfg = compose_config(list(overrides))
    task = SyntheticTask(seed=cfg.seed, max_new_tokens=cfg.generator.sampling.max_new_tokens,
                         length_median=cfg.data.length_median, length_sigma=cfg.data.length_sigma,
                         phrase_length=cfg.data.phrase_length)  # fmt: skip
    sft, reward = warm_start(cfg.model, task, seed=cfg.seed, log=lambda _: None)
    models = load_models(cfg.model, sft_path=str(sft), reward_path=str(reward), device=torch.device("cpu"))
    tok = models.tokenizer
    prompts = collate_prompts(
        PromptLoader(load_prompts(cfg.data, tok, seed=cfg.seed), cfg.data.prompts_per_iteration, seed=cfg.seed)
        .next_batch(), tok.pad_id)  # fmt: skip
    inferencer = ModelInferencer(cfg.inferencer, actor=models.actor, ref=models.ref, critic=models.critic,
                                 reward_model=models.reward, rewards=None, tokenizer=tok, temperature=1.0)  # fmt: skip
    params = SamplingParams(
        max_new_tokens=cfg.generator.sampling.max_new_tokens, stop_token_ids=(tok.eos_id,)
    )
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))  # fmt: skip
    batch = cfg.data.prompts_per_iteration * cfg.data.samples_per_prompt
    width = prompts.input_ids_BP.shape[1]
    mechanism = "kv"
    if backend == "vllm":  # one engine per rank in the job's world, built once as an RLHF run builds it
        from rlhfuse.generation.vllm_engine import VLLMPool

        config = dataclasses.replace(cfg.generator, name="vllm")
        config.vllm.vllm_kv_cache_gb = 0.25
        pool = VLLMPool(models.actor, config, max_prompt_len=width, seed=0)
        (vllm,) = pool.instances(1, width, batch, params)
        mechanism = "reprefill"
    results: dict[str, list[float]] = {}
    # per round: (this rank's generation end, its inference seconds, Gen+Inf, samples it stole) from the start
    breakdown: dict[str, list[tuple[float, float, float, int]]] = {}
    identical: list[bool] = []
    lengths: list[int] = []
    for r in range(rounds + 1):  # round 0 warms up
        serial_ids = None
        for name, fraction in (("serial", 0.0), *((f"fused Rt {f:.0%}", f) for f in fractions)):
            requests = requests_for(
                prompts, samples_per_prompt=cfg.data.samples_per_prompt, seed=0, iteration=r
            )
            if backend == "vllm":
                engine = vllm
                engine.stats = EngineStats()
            else:
                engine = GenerationEngine(models.actor, params, num_slots=len(requests),
                                          max_len=width + params.max_new_tokens)  # fmt: skip
            threshold = round(fraction * len(requests))
            dist.barrier()
            res = fused_generate_infer(engine, inferencer, requests, threshold=threshold, bs_max=len(requests),
                                       mechanism=mechanism, micro_batch=16, pad_token_id=tok.pad_id)  # fmt: skip
            ids = res.experience.rollout.response_ids_BR
            if serial_ids is None:
                serial_ids = ids
            else:
                identical.append(torch.equal(ids, serial_ids))
            if r > 0:
                results.setdefault(name, []).append(res.gen_inf_s)
                breakdown.setdefault(name, []).append((res.generation_s, res.inference_s, res.gen_inf_s,
                                                       res.stolen))  # fmt: skip
            if r == 1 and name == "serial":
                lengths = res.experience.rollout.response_lengths_B.tolist()
    torch.save(
        {"results": results, "lengths": lengths, "breakdown": breakdown, "identical": identical},
        f"{out}.{rank}",
    )
    if backend == "vllm":
        pool.close()
    leave_after_success()


def _measured(
    quick: bool, overrides: tuple[str, ...] = (), label: str = "default job", backend: str = "engine"
) -> dict[str, Any]:
    """The serial / fused rollout of `backend`'s instances (engine | vllm): lengths, serial_ms, identical,
    bound_ms and per Rt (`rt10`, `rt20`, `rt40`) median_ms, speedup (paired median), speedup_min, speedup_max,
    bound_over_fused, own_bound_over_fused and each rank's split (`ranks`: gen_ms, inf_ms, wait_ms, stolen)."""
    rounds = 2 if quick else 5
    fractions = (0.1, 0.2, 0.4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "fusion.pt")
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_worker, args=(r, port, out, rounds, fractions, overrides, backend))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(900)
        if any(p.exitcode != 0 for p in procs):
            for p in procs:
                if p.is_alive():
                    p.kill()
            raise RuntimeError(f"fusion benchmark workers failed: exit codes {[p.exitcode for p in procs]}")
        data, peer = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    lengths = sorted(data["lengths"])
    print(f"{label}, {backend} instances, first batch: {len(lengths)} samples, response length p50 "
          f"{lengths[len(lengths) // 2]}, p90 {lengths[int(0.9 * len(lengths))]}, max {lengths[-1]}; 2 instances = "
          f"2 gloo processes, {rounds} rounds")  # fmt: skip
    serial = data["results"]["serial"]
    same = all(data["identical"]) and all(peer["identical"])
    print(f"  serial generation then inference: median {statistics.median(serial) * 1e3:7.1f} ms; fused samples "
          f"identical to serial in every round: {same}")  # fmt: skip
    # the ideal-overlap bound of a round, from the serial run's per-rank generation G_r and inference I_r: no
    # rollout ends before the slowest rank's generation, nor before all the work shared evenly over the ranks
    serial_rows = list(zip(data["breakdown"]["serial"], peer["breakdown"]["serial"], strict=True))
    bounds = [max(max(a[0], b[0]), (a[0] + a[1] + b[0] + b[1]) / 2) for a, b in serial_rows]
    print(f"  ideal-overlap bound max(max_r G_r, sum_r (G_r + I_r) / 2): median {statistics.median(bounds) * 1e3:7.1f}"
          " ms")  # fmt: skip
    figures: dict[str, Any] = {
        "samples": len(lengths),
        "lengths": {
            "p50": lengths[len(lengths) // 2],
            "p90": lengths[int(0.9 * len(lengths))],
            "max": lengths[-1],
        },
        "rounds": rounds,
        "serial_ms": statistics.median(serial) * 1e3,
        "identical": same,
        "bound_ms": statistics.median(bounds) * 1e3,
    }
    for name, times in data["results"].items():
        if name == "serial":
            continue
        ratios = [s / f for s, f in zip(serial, times, strict=True)]
        of_bound = [b / f for b, f in zip(bounds, times, strict=True)]
        # the same bound from the fused round's own work (its generation includes the migrated tail)
        own = [max(max(a[0], b[0]), (a[0] + a[1] + b[0] + b[1]) / 2)
               for a, b in zip(data["breakdown"][name], peer["breakdown"][name], strict=True)]  # fmt: skip
        of_own = [b / f for b, f in zip(own, times, strict=True)]
        figures[_key(name)] = {
            "median_ms": statistics.median(times) * 1e3, "speedup": statistics.median(ratios),
            "speedup_min": min(ratios), "speedup_max": max(ratios), "bound_over_fused": statistics.median(of_bound),
            "own_bound_over_fused": statistics.median(of_own),
        }  # fmt: skip
        print(f"  {name:>14}: median {statistics.median(times) * 1e3:7.1f} ms | speedup vs serial: paired "
              f"median {statistics.median(ratios):.2f}x, min {min(ratios):.2f}x, max {max(ratios):.2f}x | "
              f"bound / fused: median {statistics.median(of_bound):.2f} (own-work bound "
              f"{statistics.median(of_own):.2f})")  # fmt: skip
    print("  where the time goes, per rank (medians over the rounds, ms): generation = to this rank's last decode "
          "step; inference = its infer calls; waiting = the rest of Gen+Inf (count watch, migration, waiting for "
          "work, the final all-gather); stolen = samples it inferred for a destination")  # fmt: skip
    for name in data["breakdown"]:
        parts = []
        for rank, d in enumerate((data, peer)):
            gen, inf, total, stolen = (
                statistics.median(x[i] for x in d["breakdown"][name]) for i in range(4)
            )
            parts.append(f"rank {rank}: gen {gen * 1e3:6.1f} inf {inf * 1e3:6.1f} wait "
                         f"{(total - gen - inf) * 1e3:6.1f} stolen {stolen:4.0f}")  # fmt: skip
            split = {
                "gen_ms": gen * 1e3,
                "inf_ms": inf * 1e3,
                "wait_ms": (total - gen - inf) * 1e3,
                "stolen": stolen,
            }
            figures.setdefault(_key(name), {}).setdefault("ranks", []).append(split)
        print(f"  {name:>14}: " + " | ".join(parts))
    print(f"  1-minute load average after the run: {os.getloadavg()[0]:.2f}")
    return figures


def _key(name: str) -> str:
    """`serial` and `fused Rt 10%` -> `serial`, `rt10`."""
    return name if name == "serial" else "rt" + name.removeprefix("fused Rt ").removesuffix("%")


def _simulated() -> dict[str, Any]:
    """The one Gen+Inf simulator at paper scale: the planner's sweep on its cost model (`rlhfuse.planner.compare`),
    and the Rt tuner's sweep (`rlhfuse.generation.tuning.simulate`, measured-cost path) fed the cost model's
    profile (`CostProfile.of`) on the same batch: the same timeline code, the cost figures fitted."""
    import numpy as np

    from rlhfuse.generation.tuning import CostProfile, simulate
    from rlhfuse.planner import CostModel, RLHFModels, Workload, cluster, compare, model
    from rlhfuse.planner.plan_simulator import ModeledCosts, Samples, rt_values

    models, spec = RLHFModels(model("13b"), model("33b")), cluster("h100", 32, 8)
    comp = compare(models, spec, Workload(max_len=1024))
    print("planner (rlhfuse.planner.compare, 13B/33B, 32x8 H100, max len 1024): fused Gen+Inf by Rt")
    for frac, seconds in comp.rlhfuse.sweep:
        print(f"  Rt {frac:4.0%}  {seconds:7.3f} s")
    print(f"  RLHFuse-Base Gen+Inf: {comp.base.breakdown.gen_inf:.3f} s")
    cost, tp = CostModel(spec), comp.rlhfuse.gen_tp
    drawn = Workload(max_len=1024).sample()
    samples = Samples(np.full(len(drawn), 128, dtype=np.int64), drawn.response)
    planner = ModeledCosts(cost, models.actor, tp, 128 + 1024, 0.0, models, group=tp)
    profile = CostProfile.of(planner, samples)
    lengths, bs_max = samples.response.tolist(), cost.bs_max(models.actor, tp)
    from rlhfuse.planner import gen_inf_fused, gen_inf_serial

    serial_p = gen_inf_serial(cost, models, samples, tp, tp, max_context=1152, resident_bytes=0.0).end
    serial_t = simulate(lengths, 128, planner.instances, 0, profile, bs_max=bs_max, slots=10**6).gen_inf_s
    print(f"tuner vs planner on the same batch (512 samples, prompts 128, gen tp {tp}, {planner.instances} "
          f"instances, no training state resident): serial {serial_t:.3f} vs {serial_p:.3f} s")  # fmt: skip
    figures: dict[str, Any] = {
        "planner_sweep": {f"rt{round(frac * 100)}": seconds for frac, seconds in comp.rlhfuse.sweep},
        "planner_base_s": comp.base.breakdown.gen_inf,
        "serial": {"tuner_s": serial_t, "planner_s": serial_p},
    }
    for frac, rt in rt_values((0.05, 0.1, 0.2, 0.4, 0.6, 0.8), len(lengths)):
        t = simulate(lengths, 128, planner.instances, rt, profile, bs_max=bs_max, slots=10**6).gen_inf_s
        p = gen_inf_fused(cost, models, samples, tp, rt, max_context=1152, resident_bytes=0.0).end
        print(f"  Rt {frac:4.0%}: tuner {t:.3f} s, planner {p:.3f} s ({t / p - 1:+.1%})")
        figures[f"rt{round(frac * 100)}"] = {"tuner_s": t, "planner_s": p, "difference": t / p - 1}
    return figures


def _tail_rate(stats: EngineStats, rt: int) -> tuple[float, int, float]:
    """Decode tokens/s over the tail (steps with at most `rt` running samples): (rate, tokens, seconds)."""
    tail = [(n, t) for b, n, t in zip(stats.batch_sizes, stats.step_tokens, stats.step_seconds, strict=True)
            if b <= rt]  # fmt: skip
    tokens, seconds = sum(n for n, _ in tail), sum(t for _, t in tail)
    return (tokens / seconds if seconds > 0 else 0.0), tokens, seconds


def _speculative(quick: bool) -> dict[str, Any]:
    """Speculation on the tail of experiment=longtail, one instance: the warm-started Actor decodes the first
    batch with generator.speculative=off, auto (and ngram), rounds alternating; the tail = steps with at most 20%
    of the batch running."""
    from rlhfuse.data.collate import collate_prompts
    from rlhfuse.data.prompts import PromptLoader, load_prompts
    from rlhfuse.data.synthetic import SyntheticTask
    from rlhfuse.data.tokenizer import Tokenizer
    from rlhfuse.generation import GenerationEngine, SamplingParams, requests_for
    from rlhfuse.models import from_pretrained
    from rlhfuse.trainer import compose_config
    from rlhfuse.trainer.warmstart import warm_start

    torch.set_num_threads(1)
    cfg = compose_config(["experiment=longtail"])
    task = SyntheticTask(seed=cfg.seed, max_new_tokens=cfg.generator.sampling.max_new_tokens,
                         length_median=cfg.data.length_median, length_sigma=cfg.data.length_sigma,
                         phrase_length=cfg.data.phrase_length)  # fmt: skip
    sft, _ = warm_start(cfg.model, task, seed=cfg.seed, log=print)
    actor = from_pretrained(sft, head="lm").eval().requires_grad_(False)
    tok = Tokenizer.from_dir(sft)
    prompts = collate_prompts(
        PromptLoader(load_prompts(cfg.data, tok, seed=cfg.seed), cfg.data.prompts_per_iteration, seed=cfg.seed)
        .next_batch(), tok.pad_id)  # fmt: skip
    k = cfg.generator.engine.speculative_tokens
    rounds = 1 if quick else 5
    # sampled, as the job samples (greedy decoding of this Actor runs every sample to the cap: no tail)
    for label in ("sampled (temperature 1)",):
        params = SamplingParams.of(cfg.generator.sampling, tok.eos_id)
        runs: dict[str, list[tuple[float, float, float, float]]] = {}
        identical: dict[str, list[bool]] = {}
        off_tokens: dict[int, list[int]] = {}
        lengths: list[int] = []
        for r in range(rounds):
            for mode in ("off", "auto", "ngram"):
                requests = requests_for(prompts, samples_per_prompt=cfg.data.samples_per_prompt, seed=cfg.seed,
                                        iteration=r)  # fmt: skip
                rt = round(0.2 * len(requests))
                engine = GenerationEngine(actor, params, num_slots=len(requests),
                                          max_len=prompts.input_ids_BP.shape[1] + params.max_new_tokens,
                                          speculative=mode, speculative_tokens=k)  # fmt: skip
                engine.add(requests)
                start = time.perf_counter()
                while engine.has_work():
                    engine.step()
                wall = time.perf_counter() - start
                st = engine.stats
                rate, _, _ = _tail_rate(st, rt)
                accept = st.spec_accepted / st.spec_proposed if st.spec_proposed else 0.0
                per_step = sum(st.step_tokens) / max(sum(st.batch_sizes), 1)
                runs.setdefault(mode, []).append((rate, wall, accept, per_step))
                tokens = {q.row: q.tokens for q in requests}
                if mode == "off":  # the first of each round
                    off_tokens = tokens
                    lengths = sorted(len(t) for t in tokens.values())
                else:
                    identical.setdefault(mode, []).append(tokens == off_tokens)
        n = len(lengths)
        print(f"speculation on the tail of experiment=longtail, {label}: one instance, {n} samples, lengths p50 "
              f"{lengths[n // 2]}, p90 {lengths[int(0.9 * n)]}, p99 {lengths[min(n - 1, int(0.99 * n))]}, max "
              f"{lengths[-1]}; k={k}, {rounds} round(s), tail = steps with <= 20% of the batch running")  # fmt: skip
        off = runs["off"]
        figures: dict[str, Any] = {
            "samples": n, "rounds": rounds, "k": k,
            "lengths": {"p50": lengths[n // 2], "p90": lengths[int(0.9 * n)], "max": lengths[-1]},
        }  # fmt: skip
        for mode in ("off", "auto", "ngram"):
            got = runs[mode]
            tail = statistics.median(g[0] for g in got)
            wall = statistics.median(g[1] for g in got)
            figures[mode] = {"tail_tok_s": tail, "whole_batch_s": wall}
            line = f"  {mode:>5}: tail decode {tail:7.0f} tokens/s, whole batch {wall:6.2f} s"
            if mode != "off":
                ratios = [g[0] / o[0] for g, o in zip(got, off, strict=True)]
                walls = [o[1] / g[1] for g, o in zip(got, off, strict=True)]
                same = all(identical[mode])
                figures[mode] |= {
                    "tail_speedup": statistics.median(ratios), "tail_speedup_min": min(ratios),
                    "whole_batch_speedup": statistics.median(walls),
                    "accept_rate": statistics.median(g[2] for g in got),
                    "tokens_per_step": statistics.median(g[3] for g in got), "identical": same,
                }  # fmt: skip
                line += (f" | tail speedup paired median {statistics.median(ratios):.2f}x (min {min(ratios):.2f}x), "
                         f"whole batch {statistics.median(walls):.2f}x | accept rate "
                         f"{statistics.median(g[2] for g in got):.2f}, tokens/step "
                         f"{statistics.median(g[3] for g in got):.2f} | tokens identical to off: {same}")  # fmt: skip
            print(line)
    return figures


def whole_runs(quick: bool, generator: str, settings: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """`rlhfuse-train experiment=longtail generator.instances=2` once per setting (rounds alternating between
    them), each a whole run: the median of `time/generation_inference` (generation + inference, what migration
    and speculation change) over its iterations past the first, and each setting's ratio to the first one's.
    The runs draw the same samples at first and drift apart later (float rounding: docs/generation.md, "What
    stays identical"), and the policy's response lengths grow over a run, so the medians are also given per
    1000 generated tokens of each iteration (its samples x mean response length)."""
    import json
    import subprocess
    import sys

    iterations, rounds = (3, 1) if quick else (8, 2)
    medians: dict[str, list[float]] = {name: [] for name in settings}
    per_token: dict[str, list[float]] = {name: [] for name in settings}
    migrating: dict[str, list[float]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name, overrides in settings.items():
                run_dir = Path(tmp) / f"{name.replace('=', '-')}-{r}"
                cmd = [sys.executable, "-m", "rlhfuse.trainer.train_command", "experiment=longtail", f"generator={generator}",
                       "generator.instances=2", f"iterations={iterations}", "logger=quiet", *overrides,
                       f"hydra.run.dir={run_dir}"]  # fmt: skip
                done = subprocess.run(
                    cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
                )
                if done.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
                rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
                later = rows[1:]
                medians[name].append(statistics.median(row["time/generation_inference"] for row in later))
                per_token[name].append(statistics.median(
                    1000 * row["time/generation_inference"] / (row["response_length/mean"] * row["throughput/samples_per_s"]
                                                               * row["time/iteration"]) for row in later
                ))  # fmt: skip
                migrating[name].append(
                    sum(row.get("migration/threshold", 0) > 0 for row in later) / len(later)
                )
    first = next(iter(settings))
    print(f"whole runs, experiment=longtail generator={generator} generator.instances=2, {iterations} iterations, "
          f"{rounds} round(s): median time/generation_inference over iterations 2..{iterations}")  # fmt: skip
    figures: dict[str, Any] = {"iterations": iterations, "rounds": rounds}
    for name in settings:
        ratio = statistics.median(a / b for a, b in zip(medians[first], medians[name], strict=True))
        token_ratio = statistics.median(a / b for a, b in zip(per_token[first], per_token[name], strict=True))
        print(f"  {name:>22}: {statistics.median(medians[name]):6.3f} s ({first} / this {ratio:.2f}x) | "
              f"{statistics.median(per_token[name]):6.3f} s per 1000 tokens ({first} / this {token_ratio:.2f}x) | "
              f"migrating in {statistics.median(migrating[name]):.0%} of the iterations")  # fmt: skip
        figures[name.split("=")[0] + "_" + name.split("=")[1]] = {
            "gen_inf_s": statistics.median(medians[name]), "ratio": ratio,
            "per_1000_tokens_s": statistics.median(per_token[name]), "per_token_ratio": token_ratio,
            "migrating": statistics.median(migrating[name]),
        }  # fmt: skip
    print(f"  1-minute load average after the runs: {os.getloadavg()[0]:.2f}")
    return figures


def run(quick: bool = False) -> dict[str, Any]:
    """Figures: `whole_runs.{migration_off,migration_auto,speculative_auto}` (gen_inf_s, ratio = off / this,
    per_1000_tokens_s, per_token_ratio, migrating); `speculative` (off / auto / ngram: tail_tok_s, whole_batch_s,
    tail_speedup, ...); `default_job` and `longtail` (the 2-process serial / fused rollout, `_measured`);
    `simulated` (the planner's and the tuner's sweeps at paper scale)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return {
        "whole_runs": whole_runs(
            quick,
            "engine",
            {
                "migration=off": ("migration=off",),
                "migration=auto": ("migration=auto",),
                "speculative=auto": ("migration=off", "generator.speculative=auto"),
            },
        ),
        "speculative": _speculative(quick),
        "default_job": _measured(quick),
        "longtail": _measured(quick, ("experiment=longtail",), "experiment=longtail"),
        "simulated": _simulated(),
    }
