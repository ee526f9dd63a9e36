"""NCCL's point-to-point ordering emulated on gloo (`rlhfuse.distributed.ordering`): the old grouping (one group
per model, both directions on it) completes on plain gloo but times out under the emulation, naming the waiting
instruction; one group per model, direction and rank pair (what the runtime builds) completes under it, with one
stream per (group, rank pair) and with one per (group, rank)."""

from __future__ import annotations

import os

import pytest
import torch
from runtime_helpers import random_batch, run_distributed

from rlhfuse import distributed
from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.distributed import ordering
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.pipeline import serial_one_f_one_b
from rlhfuse.runtime.batch_split import split_minibatch
from rlhfuse.runtime.executor import PipelineError, PipelineExecutor, StepWork, ppo_losses
from rlhfuse.runtime.layout import ModelParallel, ParallelLayout, build_process_groups
from rlhfuse.runtime.lower import lower_checked
from rlhfuse.runtime.partition import stages_for_rank

pytestmark = pytest.mark.distributed


def _step(rank: int, layout: ParallelLayout, p2p: dict[tuple[str, str], object], grad: dict, timeout: float):
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(num_layers=2)
    models = {
        "actor": Transformer(cfg, head="lm").double(),
        "critic": Transformer(cfg, head="value").double(),
    }
    problem = layout.problem()
    executor = PipelineExecutor(
        rank,
        lower_checked(problem, serial_one_f_one_b(problem)),
        problem,
        stages_for_rank(layout, rank, models),
        losses=ppo_losses(AlgorithmConfig()),
        p2p_groups=p2p,
        grad_groups=grad,
        timeout_s=timeout,
    )
    micro, weights, _ = split_minibatch(random_batch(4, seed=3), 1, 2)
    return executor.run(StepWork(micro, weights))


def _worker(rank: int, world: int) -> None:
    assert ordering.enabled(), "the test suite runs with RLHFUSE_NCCL_ORDER=1 (tests/conftest.py)"
    layout = ParallelLayout(ModelParallel(2), ModelParallel(2), 1, world, 2)
    groups = build_process_groups(layout, timeout_s=60)
    # the old grouping: one group per model carrying activations and gradients
    owner = distributed.WorldGroups.current()
    old = {m: owner.group(("test", "old", m), range(world)) for m in ("actor", "critic")}
    one_per_model = {(m, d, 0, 1): old[m] for m in old for d in ("act", "grad")}

    os.environ[ordering.ENV] = "0"  # plain gloo runs every op at once: the old order completes
    plain = _step(rank, layout, one_per_model, groups.grad, 60)
    os.environ[ordering.ENV] = "1"

    # under NCCL's rule the same order hangs: rank 0 [recv dgrad0, send act1], rank 1 [recv act1, send dgrad0]
    fresh = {m: owner.group(("test", "fresh", m), range(world)) for m in ("actor", "critic")}
    with pytest.raises(
        PipelineError, match=r"rank \d: WAIT RECV actor.g0.r0.s\d:(act|dgrad)\d <- \d .*NCCL-ordering"
    ):
        _step(rank, layout, {(m, d, 0, 1): fresh[m] for m in fresh for d in ("act", "grad")}, groups.grad, 3)

    # one group per model, direction and rank pair: the runtime's own groups run it, with the same result as plain
    # gloo, under one stream per (group, rank pair) and under one stream per (group, rank)
    nccl = _step(rank, layout, groups.p2p, groups.grad, 60)
    assert nccl.stats == plain.stats and nccl.grad_norm == plain.grad_norm
    os.environ[ordering.ENV] = "rank"
    assert ordering.stream_model() == "rank"
    per_rank = _step(rank, layout, groups.p2p, groups.grad, 60)
    os.environ[ordering.ENV] = "1"
    assert per_rank.stats == plain.stats and per_rank.grad_norm == plain.grad_norm

    # NCCL matches by order alone: a tag or a receive from any rank on a device group is refused, naming the fix
    buf = torch.zeros(1)
    with pytest.raises(ValueError, match="cpu_group"):
        distributed.irecv(buf, None, group=groups.p2p[("actor", "act", 0, 1)])
    with pytest.raises(ValueError, match="cpu_group"):
        distributed.isend(buf, 1 - rank, group=groups.p2p[("actor", "act", 0, 1)], tag=3)
    assert ordering.is_control(distributed.cpu_group())  # control messages get their own gloo group


def test_old_order_times_out_under_the_nccl_emulation_and_direction_groups_run() -> None:
    run_distributed(_worker, 2, timeout=240)
