"""Fused and serial-1F1B pipelined gradients equal single-process gradients (gloo, float64, 2 and 4 ranks)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from runtime_helpers import random_batch, random_schedule, run_distributed

from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.pipeline import Kind, greedy, serial_one_f_one_b, split_each_backward
from rlhfuse.pipeline.simulate import is_split
from rlhfuse.runtime.batch_split import split_minibatch
from rlhfuse.runtime.executor import PipelineExecutor, StepWork, ppo_losses
from rlhfuse.runtime.layout import ModelParallel, ParallelLayout, build_process_groups
from rlhfuse.runtime.lower import lower_checked
from rlhfuse.runtime.partition import stages_for_rank
from rlhfuse.runtime.plan import serial_schedule

pytestmark = pytest.mark.distributed


def _models(layers: int) -> dict[str, Transformer]:
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(num_layers=layers)
    return {
        "actor": Transformer(cfg, head="lm").double(),
        "critic": Transformer(cfg, head="value").double(),
    }


def _check_scenario(
    rank: int,
    world: int,
    actor_pp: int,
    critic_pp: int,
    dp: int,
    mbs: int,
    kind: str,
    bucket_mb: float = 25.0,
) -> None:
    layout = ParallelLayout(ModelParallel(actor_pp), ModelParallel(critic_pp), dp, world, mbs)
    groups = build_process_groups(layout, timeout_s=120)
    models = _models(max(actor_pp, critic_pp, 2))
    oracle = copy.deepcopy(models)
    algo = AlgorithmConfig(entropy_coef=0.01)
    losses = ppo_losses(algo)
    batch = random_batch(dp * mbs * 2 + 1, seed=7)
    micro, weights, _ = split_minibatch(batch, dp, mbs, balance=kind != "serial")
    problem = layout.problem()
    split = kind.endswith("+split")  # F/I/W: each B split into its input and weight gradients
    base = kind.removesuffix("+split")
    if base == "serial":
        schedule = serial_one_f_one_b(problem)
        schedule = split_each_backward(schedule) if split else schedule
    elif base == "zb_h1":  # each model's ZB-H1, one after the other (serial 1F1B's split form)
        schedule = serial_schedule(problem, split_backward=True)
    elif base == "greedy":
        schedule = greedy(problem, split_backward=split)
    else:
        schedule = random_schedule(problem, seed=int(base.split(":")[1]), split_backward=split)
    assert any(a.kind is Kind.W for _, _, a in schedule.actions()) == split, kind
    program = lower_checked(problem, schedule, dp=dp)
    stages = stages_for_rank(layout, rank, models)
    executor = PipelineExecutor(
        rank,
        program,
        problem,
        stages,
        losses=losses,
        p2p_groups=groups.p2p,
        grad_groups=groups.grad,
        timeout_s=120,
        grad_bucket_mb=bucket_mb,
    )
    result = executor.run(StepWork(micro, weights))
    for key, reducer in executor.reducers.items():
        # every parameter gets a gradient: each bucket is launched inside the last backward, none after it
        assert reducer.launched_in_backward == len(reducer.buckets), (rank, key, len(reducer.buckets))
        assert bucket_mb >= 1 or len(reducer.buckets) > 2, (rank, key)

    # single-process oracle: the full models over every micro-batch of every group
    want_stats = {"loss/policy": 0.0, "loss/value": 0.0}
    for g in range(dp):
        for m, w in zip(micro[g], weights[g], strict=True):
            for name in ("actor", "critic"):
                out = oracle[name](m.input_ids_BT, attention_mask_BT=m.attention_mask_BT)
                loss, stats = losses[name](out, m)
                (loss * w).backward()
                key = "loss/policy" if name == "actor" else "loss/value"
                want_stats[key] += stats.metrics()[key] * w
    where = f"rank {rank} {kind} actor.pp={actor_pp} critic.pp={critic_pp} dp={dp} M={mbs}"
    for name in ("actor", "critic"):
        names = {id(p): n for n, p in models[name].named_parameters()}
        ref = dict(oracle[name].named_parameters())
        checked = 0
        for (m, _, _), mod in stages.items():
            if m != name:
                continue
            for p in mod.parameters():
                assert p.grad is not None, f"{where}: {name}.{names[id(p)]} has no gradient"
                torch.testing.assert_close(p.grad, ref[names[id(p)]].grad, rtol=1e-10, atol=1e-12, msg=where)
                checked += 1
        assert checked > 0, where
        total = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in oracle[name].parameters()))
        assert result.grad_norm[name] == pytest.approx(total, rel=1e-10), where
    for key, value in want_stats.items():
        assert result.stats.metrics()[key] == pytest.approx(value, rel=1e-10, abs=1e-12), f"{where}: {key}"


def _two_rank_worker(rank: int, world: int, *then: Callable[[int, int], None]) -> None:
    for kind in ("serial", "greedy", "random:1", "random:2", "random:3"):
        _check_scenario(rank, world, 2, 2, 1, 4, kind)
    for kind in ("serial+split", "zb_h1+split", "greedy+split", "random:6+split", "random:7+split"):  # F/I/W
        _check_scenario(rank, world, 2, 2, 1, 4, kind)
    for kind in ("greedy", "random:4", "random:8+split"):
        _check_scenario(rank, world, 2, 1, 1, 4, kind)  # two critic replicas, one per rank
        _check_scenario(rank, world, 1, 2, 1, 2, kind)  # the Critic is the larger model
    _check_scenario(rank, world, 1, 1, 2, 2, "greedy")  # data parallelism only
    _check_scenario(rank, world, 1, 1, 2, 2, "greedy", bucket_mb=0.002)  # ... in 2 KiB gradient buckets
    _check_scenario(rank, world, 2, 2, 1, 4, "greedy+split", bucket_mb=0.002)  # F/I/W, buckets launched in W
    for worker in then:
        worker(rank, world)


def _four_rank_worker(rank: int, world: int) -> None:
    _check_scenario(
        rank, world, 2, 1, 2, 2, "random:5", bucket_mb=0.002
    )  # critic replicas x dp, 2 KiB buckets
    _check_scenario(rank, world, 4, 2, 1, 4, "greedy")  # 4-stage actor, 2 reversed critic replicas
    _check_scenario(rank, world, 4, 2, 1, 4, "greedy+split")  # ... F/I/W
    _check_scenario(rank, world, 2, 1, 2, 2, "random:9+split", bucket_mb=0.002)  # F/I/W, replicas x dp


@pytest.mark.timeout(300)
def test_two_ranks_equal_single_process_strategy_and_failing_rank() -> None:
    """One 2-process run (each spawn costs seconds): executor equivalence over layouts and schedules, then
    PipelineStrategy vs PlainStrategy, measured activation memory vs the simulator, then a silent rank
    stopping the other within its timeout."""
    run_distributed(
        _two_rank_worker,
        2,
        _strategy_worker,
        _token_budget_worker,
        _memory_worker,
        _failing_rank_worker,
        timeout=280,
    )


@pytest.mark.timeout(300)
def test_four_ranks_equal_single_process() -> None:
    run_distributed(_four_rank_worker, 4, timeout=280)


def _strategy_worker(rank: int, world: int) -> None:
    """PipelineStrategy (profiling step, then the searched schedule) vs PlainStrategy: same weights."""
    from lightning.fabric import Fabric

    from rlhfuse.core.optim import OptimConfig
    from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
    from rlhfuse.trainer.strategies.pipelines.training import PipelineStrategy
    from rlhfuse.trainer.strategies.plain.training import PlainStrategy

    models = _models(2)
    plain_models = copy.deepcopy(models)
    algo = AlgorithmConfig()
    # auto: the profiling step splits odd micro-batches' backwards; true: the planned schedule is F/I/W
    for schedule, split in (
        ("fused", "auto"),
        ("serial_1f1b", False),
        ("fused", True),
        ("serial_1f1b", True),
    ):
        cfg = PipelineConfig(
            name=schedule,
            optim=OptimConfig(warmup_steps=1, grad_clip=0.5),
            microbatches=2,
            search_budget_s=0.0,
            split_backward=split,  # type: ignore[arg-type]
        )
        fused = PipelineStrategy(
            models["actor"],
            models["critic"],
            cfg,
            algo,
            total_steps=4,
            mini_batch_size=8,
            micro_batch_size=4,
            schedule=schedule,
            timeout_s=120,
            log=lambda _: None,
        )
        plain = PlainStrategy(
            plain_models["actor"],
            plain_models["critic"],
            cfg.optim,
            algo,
            fabric=Fabric(accelerator="cpu", devices=1),
            total_steps=4,
            micro_batch_size=4,
        )
        for step in range(2):
            batch = random_batch(8, seed=11 + step)
            got, want = fused.train_step(batch).metrics(), plain.train_step(batch).metrics()
            for key in ("loss/policy", "loss/value", "actor/grad_norm", "critic/grad_norm", "lr"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (schedule, step, key)
            assert got["train/measured_makespan_s"] > 0 and 0 <= got["train/bubble_ratio"] < 1
            assert math.isfinite(got["train/predicted_makespan_s"])
            if split != "auto":  # (auto: whichever the measured times predict shorter)
                assert is_split(fused.plan.schedule) == split, (schedule, split, step)
            fused.actor_weights()  # gathers both models on every rank
            for name in ("actor", "critic"):
                for (n, p), q in zip(
                    models[name].named_parameters(), plain_models[name].parameters(), strict=True
                ):
                    # PlainStrategy computes its losses in float32 (the pipeline keeps float64): AdamW turns those
                    # ~1e-7 gradient differences into ~1e-6 weight differences; a wrong LR, step count or stage
                    # update moves weights by ~lr = 5e-4
                    err = float((p - q).abs().max())
                    assert err < 2e-5, f"{schedule} step {step} {name}.{n}: max error {err:.3g}"


def _token_budget_worker(rank: int, world: int) -> None:
    """A token budget: each step's micro-batch count follows its mini-batch's tokens (planned once per count
    from the profiled times) and the updates still equal PlainStrategy's (its own token-budget packing)."""
    from lightning.fabric import Fabric

    from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
    from rlhfuse.trainer.strategies.pipelines.training import PipelineStrategy
    from rlhfuse.trainer.strategies.plain.training import PlainStrategy

    models = _models(2)
    plain_models = copy.deepcopy(models)
    algo = AlgorithmConfig()
    cfg = PipelineConfig(name="fused", actor_pp=2, critic_pp=1, microbatches=2, search_budget_s=0.0)
    kwargs = dict(total_steps=4, micro_batch_size=4, micro_batch_tokens=24)
    fused = PipelineStrategy(
        models["actor"], models["critic"], cfg, algo, mini_batch_size=16, schedule="fused", timeout_s=120,
        log=lambda _: None, **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip
    plain = PlainStrategy(
        plain_models["actor"], plain_models["critic"], cfg.optim, algo, fabric=Fabric(accelerator="cpu", devices=1),
        **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip
    counts, schedules = [], []
    for step, size in enumerate((16, 8, 16)):
        batch = random_batch(size, seed=21 + step)
        tokens = int(batch.attention_mask_BT.sum())
        got, want = fused.train_step(batch).metrics(), plain.train_step(batch).metrics()
        wanted = max(1, math.ceil(tokens / 24))
        expected = min(math.ceil(wanted / 2) * 2, size // 2 * 2)  # a multiple of the 2 critic replicas
        assert got["train/microbatches"] == expected, (step, tokens, got["train/microbatches"])
        counts.append(got["train/microbatches"])
        schedules.append(fused.schedule)
        assert got["train/microbatch_imbalance"] >= 0
        for key in ("loss/policy", "loss/value", "actor/grad_norm", "critic/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (step, key)
        fused.actor_weights()
        for name in ("actor", "critic"):
            for p, q in zip(models[name].parameters(), plain_models[name].parameters(), strict=True):
                assert float((p - q).abs().max()) < 2e-5, (step, name)
    # three steps, two counts: the first count's plan (from the profiling step) is reused on the third step
    assert counts[0] != counts[1] and counts[2] == counts[0]
    assert schedules[2] is schedules[0] and schedules[1] is not schedules[0]
    assert {counts[0], counts[1]} <= set(fused.plans)
    assert (
        fused.profile is not None and fused.profile.microbatches == counts[0]
    )  # profiled once, on the first step


def _failing_rank_worker(rank: int, world: int) -> None:
    """Rank 1 never runs its stream (as if it had crashed): rank 0 stops with a PipelineError naming the wait
    within its timeout instead of hanging."""
    import time

    from rlhfuse.runtime.executor import PipelineError

    layout = ParallelLayout(ModelParallel(2), ModelParallel(2), 1, world, 2)
    groups = build_process_groups(layout, timeout_s=30)
    if rank == 1:
        time.sleep(4.0)
        return
    models = _models(2)
    problem = layout.problem()
    program = lower_checked(problem, greedy(problem))
    executor = PipelineExecutor(
        rank,
        program,
        problem,
        stages_for_rank(layout, rank, models),
        losses=ppo_losses(AlgorithmConfig()),
        p2p_groups=groups.p2p,
        grad_groups=groups.grad,
        timeout_s=1.0,
    )
    micro, weights, _ = split_minibatch(random_batch(4), 1, 2)
    start = time.monotonic()
    with pytest.raises(PipelineError, match=r"rank 0: WAIT RECV .* timed out after 1s"):
        executor.run(StepWork(micro, weights))
    assert time.monotonic() - start < 3.5


def _memory_worker(rank: int, world: int) -> None:
    """Peak activation bytes measured with saved-tensor hooks equal the simulator's peak for the same schedule,
    with each stage's activation set to the bytes one micro-batch saves there (equal-shape micro-batches); F/I/W
    schedules hold a micro-batch's activation until its W, as the simulator counts it."""
    from rlhfuse.pipeline import simulate

    layout = ParallelLayout(ModelParallel(2), ModelParallel(2), 1, world, 4)
    groups = build_process_groups(layout, timeout_s=30)
    models = _models(2)
    batch = random_batch(8, seed=5)
    batch.attention_mask_BT[:] = 1  # no padding: every micro-batch has the same shape
    batch.response_mask_BR[:] = 1
    micro, weights, _ = split_minibatch(batch, 1, 4, balance=False)
    problem = layout.problem()
    stages = stages_for_rank(layout, rank, models)
    peaks = []
    split = (greedy(problem, split_backward=True), random_schedule(problem, 10, split_backward=True))  # F/I/W
    for schedule in (serial_one_f_one_b(problem), greedy(problem), random_schedule(problem, 9), *split):
        executor = PipelineExecutor(
            rank,
            lower_checked(problem, schedule),
            problem,
            stages,
            losses=ppo_losses(AlgorithmConfig()),
            p2p_groups=groups.p2p,
            grad_groups=groups.grad,
            timeout_s=30,
            track_memory=True,
        )
        result = executor.run(StepWork(micro, weights))
        per_stage: dict[tuple[str, int], set[int]] = {}
        for (a, _), nbytes in result.action_bytes.items():
            per_stage.setdefault((a.model, a.stage), set()).add(nbytes)
        assert all(len(v) == 1 and min(v) > 0 for v in per_stage.values()), per_stage
        activation = {
            m: [min(per_stage.get((m, s), {1})) for s in range(layout.stages(m))] for m in ("actor", "critic")
        }
        sim = simulate(layout.problem(activation=activation), schedule)
        assert result.peak_activation_bytes == pytest.approx(sim.peak_per_rank[rank], rel=1e-9), (
            rank,
            schedule,
        )
        peaks.append(result.peak_activation_bytes)
        for module in stages.values():
            module.zero_grad(set_to_none=True)
    assert len(set(peaks)) > 1  # the schedules hold different amounts: the comparison is not vacuous
