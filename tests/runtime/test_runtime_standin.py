"""The pipeline paths on the stand-in device (`rlhfuse.testing.standin`: computes on the CPU, refuses any mix with
CPU tensors, as CUDA does): a fused pp=2 training step and pipeline inference over 2 gloo ranks, with the layout's
device the stand-in, equal to the same step on the CPU. A CPU tensor created in either path (a buffer, a
statistic, a message) would raise `DeviceMixError` naming the op."""

from __future__ import annotations

import copy

import pytest
import torch
from runtime_helpers import random_batch, run_distributed

from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.core.inference import InferencerConfig
from rlhfuse.data.synthetic import build_tokenizer
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.pipeline import greedy
from rlhfuse.runtime.batch_split import split_minibatch
from rlhfuse.runtime.executor import PipelineExecutor, StepWork, ppo_losses
from rlhfuse.runtime.layout import ModelParallel, ParallelLayout, build_process_groups
from rlhfuse.runtime.lower import lower_checked
from rlhfuse.runtime.partition import stages_for_rank
from rlhfuse.testing.standin import StandinTensor, recording, standin_device
from rlhfuse.trainer.strategies.pipelines.inference import PipelineInferencer

pytestmark = pytest.mark.distributed


def _worker(rank: int, world: int) -> None:
    import test_runtime_inference as inference_tests

    device = standin_device()
    layout = ParallelLayout(ModelParallel(2), ModelParallel(2), 1, world, 2, device=str(device))
    groups = build_process_groups(layout, timeout_s=60)
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(num_layers=2)
    on_cpu = {
        "actor": Transformer(cfg, head="lm").double(),
        "critic": Transformer(cfg, head="value").double(),
    }
    on_standin = {name: copy.deepcopy(model).to(device) for name, model in on_cpu.items()}
    assert all(isinstance(p, StandinTensor) for m in on_standin.values() for p in m.parameters())
    problem = layout.problem()
    program = lower_checked(problem, greedy(problem))
    micro, weights, _ = split_minibatch(random_batch(6, seed=2), 1, 2)
    work = StepWork(micro, weights).with_layouts(packed=False)
    results = []
    for models, step_work in ((on_cpu, work), (on_standin, work.to(device))):
        executor = PipelineExecutor(
            rank, program, problem, stages_for_rank(layout, rank, models),
            losses=ppo_losses(AlgorithmConfig(entropy_coef=0.01)), p2p_groups=groups.p2p,
            grad_groups=groups.grad, timeout_s=60,
        )  # fmt: skip
        with recording() as rec:
            results.append(executor.run(step_work))
    assert rec.host_reads == 1  # the stand-in's step: the statistics and norms, read together
    cpu, standin = results
    assert standin.stats == pytest.approx(cpu.stats, rel=1e-9, abs=1e-12)
    assert standin.grad_norm == pytest.approx(cpu.grad_norm, rel=1e-9)
    for (name, model), twin in zip(on_cpu.items(), on_standin.values(), strict=True):
        for (key, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
            if p.grad is not None:
                assert isinstance(q.grad, StandinTensor), f"{name}.{key}"
                torch.testing.assert_close(q.grad.cpu(), p.grad, msg=f"{name}.{key}")

    # pipeline inference: Actor, Ref, Critic and Reward over the same layout, on the stand-in
    four_cpu = inference_tests._models()
    four_standin = {name: copy.deepcopy(model).to(device) for name, model in four_cpu.items()}
    rollout = inference_tests._rollout(9, seed=4)
    config = InferencerConfig(truncated_score=-5.0)
    tokenizer = build_tokenizer()
    out = [
        PipelineInferencer(
            config, layout, models, rewards=None, tokenizer=tokenizer, temperature=0.7, timeout_s=60,
            log=lambda _: None,
        ).infer(rollout)
        for models in (four_cpu, four_standin)
    ]  # fmt: skip
    for name in ("logprobs_BR", "ref_logprobs_BR", "values_BR", "scores_B"):
        got, want = getattr(out[1], name), getattr(out[0], name)
        assert isinstance(got, StandinTensor), name
        torch.testing.assert_close(got.cpu(), want, msg=name)


def test_pipeline_training_and_inference_run_on_the_standin_device() -> None:
    run_distributed(_worker, 2, timeout=240)
