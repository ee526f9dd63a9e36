"""Host syncs of a training step: the executor reads the step's statistics and gradient norms once, and the
stages' forwards read no mask value when the step hands them the micro-batches' host-computed layouts.

Counted with `rlhfuse.core.syncs.SyncCounter`, the CPU standing in for the device (every read counts)."""

from __future__ import annotations

import datetime

import pytest
import torch
from runtime_helpers import random_batch

from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.core.syncs import SyncCounter
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.pipeline import greedy
from rlhfuse.runtime.batch_split import split_minibatch
from rlhfuse.runtime.executor import PipelineExecutor, StepWork, ppo_losses
from rlhfuse.runtime.layout import ModelParallel, ParallelLayout
from rlhfuse.runtime.lower import lower_checked
from rlhfuse.runtime.partition import stages_for_rank


def _executor(microbatches: int, packing: bool) -> tuple[PipelineExecutor, StepWork]:
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(num_layers=2)
    models = {"actor": Transformer(cfg, head="lm"), "critic": Transformer(cfg, head="value")}
    for model in models.values():
        model.packing = packing
    layout = ParallelLayout(ModelParallel(1), ModelParallel(1), 1, 1, microbatches)
    problem = layout.problem()
    executor = PipelineExecutor(
        0,
        lower_checked(problem, greedy(problem)),
        problem,
        stages_for_rank(layout, 0, models),
        losses=ppo_losses(AlgorithmConfig(entropy_coef=0.01)),
    )
    micro, weights, _ = split_minibatch(
        random_batch(2 * microbatches, seed=1, dtype=torch.float32), 1, microbatches
    )
    return executor, StepWork(micro, weights)


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("microbatches", [2, 4])
def test_a_training_step_makes_one_host_sync(microbatches: int, packing: bool) -> None:
    executor, work = _executor(microbatches, packing)
    laid_out = work.with_layouts(packed=packing)  # from the host masks, before they would move to the device
    with SyncCounter("cpu") as counter:
        executor.run(laid_out)
    assert counter.count == 1, dict(counter.by_kind)  # the statistics and norms, read together
    # without the host-computed layouts every stage forward reads its mask (the cost the layouts remove)
    with SyncCounter("cpu") as counter:
        executor.run(work)
    assert counter.count > 1 + microbatches, dict(counter.by_kind)


class _Work:
    """A point-to-point handle that records how it was waited for."""

    def __init__(self) -> None:
        self.waits: list[object] = []

    def wait(self, timeout: object = None) -> bool:
        self.waits.append(timeout)
        return True


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_stream_waits_stream_ordered_on_cuda_and_bounded_elsewhere(device: str) -> None:
    """On NCCL (a CUDA device) a receive's wait only orders the device stream (`work.wait()`): a
    `wait(timeout=...)` there blocks the host until the op finishes, a host sync per receive that keeps the
    pipeline from queueing ahead. On gloo the wait stays bounded, naming the instruction when it times out."""
    from rlhfuse.runtime.layout import RankGeometry
    from rlhfuse.runtime.streams import StreamComm

    comm = StreamComm(
        RankGeometry(0, 1, {"actor": 1, "critic": 1}), {}, lambda m: (1,),
        dtype=torch.float32, device=torch.device(device), timeout_s=7.0,
    )  # fmt: skip
    work = _Work()
    comm.wait(work, "WAIT RECV actor.g0.r0.s1:act0 <- 1")
    assert work.waits == ([None] if device == "cuda" else [datetime.timedelta(seconds=7.0)])
