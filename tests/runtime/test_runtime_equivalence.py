"""Fused and serial-1F1B pipelined gradients equal single-process gradients (gloo, float64, 2 and 4 ranks)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from runtime_helpers import random_batch, random_schedule, run_distributed

from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.pipeline import greedy, serial_one_f_one_b
from rlhfuse.runtime.balance import split_minibatch
from rlhfuse.runtime.executor import PipelineExecutor, StepWork, ppo_losses
from rlhfuse.runtime.layout import ModelParallel, ParallelLayout, build_process_groups
from rlhfuse.runtime.lower import lower_checked
from rlhfuse.runtime.partition import stages_for_rank
from rlhfuse.trainer.advantages import AlgorithmConfig

pytestmark = pytest.mark.distributed


def _models(layers: int) -> dict[str, Transformer]:
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(num_layers=layers)
    return {
        "actor": Transformer(cfg, head="lm").double(),
        "critic": Transformer(cfg, head="value").double(),
    }


def _check_scenario(
    rank: int, world: int, actor_pp: int, critic_pp: int, dp: int, mbs: int, kind: str
) -> None:
    layout = ParallelLayout(ModelParallel(actor_pp), ModelParallel(critic_pp), dp, world, mbs)
    groups = build_process_groups(layout, timeout_s=30)
    models = _models(max(actor_pp, critic_pp, 2))
    oracle = copy.deepcopy(models)
    algo = AlgorithmConfig(entropy_coef=0.01)
    losses = ppo_losses(algo)
    batch = random_batch(dp * mbs * 2 + 1, seed=7)
    micro, weights, _ = split_minibatch(batch, dp, mbs, balance=kind != "serial")
    problem = layout.problem()
    if kind == "serial":
        schedule = serial_one_f_one_b(problem)
    elif kind == "greedy":
        schedule = greedy(problem)
    else:
        schedule = random_schedule(problem, seed=int(kind.split(":")[1]))
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
        timeout_s=30,
    )
    result = executor.run(StepWork(micro, weights))

    # single-process oracle: the full models over every micro-batch of every group
    want_stats = {"loss/policy": 0.0, "loss/value": 0.0}
    for g in range(dp):
        for m, w in zip(micro[g], weights[g], strict=True):
            for name in ("actor", "critic"):
                out = oracle[name](m.input_ids_BT, attention_mask_BT=m.attention_mask_BT)
                loss, stats = losses[name](out, m)
                (loss * w).backward()
                key = "loss/policy" if name == "actor" else "loss/value"
                want_stats[key] += stats[key] * w
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
        assert result.stats[key] == pytest.approx(value, rel=1e-10, abs=1e-12), f"{where}: {key}"


def _two_rank_worker(rank: int, world: int) -> None:
    for kind in ("serial", "greedy", "random:1", "random:2", "random:3"):
        _check_scenario(rank, world, 2, 2, 1, 4, kind)
    for kind in ("greedy", "random:4"):
        _check_scenario(rank, world, 2, 1, 1, 4, kind)  # two critic replicas, one per rank
        _check_scenario(rank, world, 1, 2, 1, 2, kind)  # the Critic is the larger model
    _check_scenario(rank, world, 1, 1, 2, 2, "greedy")  # data parallelism only


def _four_rank_worker(rank: int, world: int) -> None:
    _check_scenario(rank, world, 2, 1, 2, 2, "random:5")  # critic replicas x data parallelism
    _check_scenario(rank, world, 4, 2, 1, 4, "greedy")  # 4-stage actor, 2 reversed critic replicas


@pytest.mark.timeout(120)
def test_two_ranks_equal_single_process() -> None:
    run_distributed(_two_rank_worker, 2, timeout=100)


@pytest.mark.timeout(120)
def test_four_ranks_equal_single_process() -> None:
    run_distributed(_four_rank_worker, 4, timeout=100)
