"""Pipeline strategies with data.packing (stages run packed sequences) and activation checkpointing: gradients,
losses and updates equal the padded single-process ones, and so do pipelined inference's log-probs, values and
scores (gloo, 2 ranks, float64)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from runtime_helpers import random_batch, run_distributed

from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.pipeline import greedy
from rlhfuse.runtime.batch_split import split_minibatch
from rlhfuse.runtime.executor import PipelineExecutor, StepWork, ppo_losses
from rlhfuse.runtime.layout import ModelParallel, ParallelLayout, build_process_groups
from rlhfuse.runtime.lower import lower_checked
from rlhfuse.runtime.partition import stages_for_rank

pytestmark = pytest.mark.distributed


def _models() -> dict[str, Transformer]:
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(num_layers=2)
    return {"actor": Transformer(cfg, head="lm").double(), "critic": Transformer(cfg, head="value").double()}


def _executor_check(rank: int, world: int, checkpointing: str) -> None:
    layout = ParallelLayout(ModelParallel(2), ModelParallel(2), 1, world, 4)
    groups = build_process_groups(layout, timeout_s=120)
    models = _models()
    oracle = copy.deepcopy(models)  # padded, nothing recomputed
    for model in models.values():
        model.packing, model.activation_checkpointing = True, checkpointing  # type: ignore[assignment]
    losses = ppo_losses(AlgorithmConfig(entropy_coef=0.01))
    batch = random_batch(9, seed=3)
    micro, weights, _ = split_minibatch(batch, 1, 4, balance=True)
    problem = layout.problem()
    stages = stages_for_rank(layout, rank, models)
    executor = PipelineExecutor(
        rank, lower_checked(problem, greedy(problem), dp=1), problem, stages, losses=losses,
        p2p_groups=groups.p2p, grad_groups=groups.grad, timeout_s=120,
    )  # fmt: skip
    result = executor.run(StepWork(micro, weights))
    want = {"loss/policy": 0.0, "loss/value": 0.0}
    for m, w in zip(micro[0], weights[0], strict=True):
        for name in ("actor", "critic"):
            loss, stats = losses[name](oracle[name](m.input_ids_BT, attention_mask_BT=m.attention_mask_BT), m)
            (loss * w).backward()
            key = "loss/policy" if name == "actor" else "loss/value"
            want[key] += stats.metrics()[key] * w
    for name in ("actor", "critic"):
        names = {id(p): n for n, p in models[name].named_parameters()}
        ref = dict(oracle[name].named_parameters())
        for (m, _, _), mod in stages.items():
            if m == name:
                for p in mod.parameters():
                    assert p.grad is not None, names[id(p)]
                    torch.testing.assert_close(p.grad, ref[names[id(p)]].grad, rtol=1e-10, atol=1e-12)
    for key, value in want.items():
        assert result.stats.metrics()[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key


def _strategy_check(rank: int, world: int) -> None:
    """PipelineStrategy, packed and fully checkpointed, vs a padded PlainStrategy: same updates."""
    from lightning.fabric import Fabric

    from rlhfuse.core.optim import OptimConfig
    from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
    from rlhfuse.trainer.strategies.pipelines.training import PipelineStrategy
    from rlhfuse.trainer.strategies.plain.training import PlainStrategy

    models = _models()
    plain_models = copy.deepcopy(models)
    for model in models.values():
        model.packing = True  # what the trainer's builder sets for data.packing=true
    algo = AlgorithmConfig()
    cfg = PipelineConfig(
        name="fused", optim=OptimConfig(warmup_steps=1, activation_checkpointing="full"), microbatches=2,
        search_budget_s=0.0,
    )  # fmt: skip
    fused = PipelineStrategy(
        models["actor"], models["critic"], cfg, algo, total_steps=4, mini_batch_size=8, micro_batch_size=4,
        schedule="fused", timeout_s=120, log=lambda _: None,
    )  # fmt: skip
    assert models["actor"].activation_checkpointing == "full"
    plain = PlainStrategy(
        plain_models["actor"], plain_models["critic"], OptimConfig(warmup_steps=1), algo,
        fabric=Fabric(accelerator="cpu", devices=1), total_steps=4, micro_batch_size=4,
    )  # fmt: skip
    for step in range(2):
        batch = random_batch(8, seed=31 + step)
        got, want = fused.train_step(batch).metrics(), plain.train_step(batch).metrics()
        for key in ("loss/policy", "loss/value", "actor/grad_norm", "critic/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (step, key)
        fused.actor_weights()
        for name in ("actor", "critic"):
            for p, q in zip(models[name].parameters(), plain_models[name].parameters(), strict=True):
                err = float((p - q).abs().max())
                assert math.isfinite(err) and err < 2e-5, (step, name, err)


def _inference_check(rank: int, world: int) -> None:
    """PipelineInferencer over packed stages vs the padded ModelInferencer: log-probs, values, scores."""
    from rlhfuse.core.inference import InferencerConfig
    from rlhfuse.core.types import Rollout
    from rlhfuse.data.synthetic import build_tokenizer
    from rlhfuse.trainer.strategies.pipelines.inference import PipelineInferencer
    from rlhfuse.trainer.strategies.plain.inference import ModelInferencer

    torch.manual_seed(3)
    cfg = ModelConfig.tiny(num_layers=2)
    heads = {"actor": "lm", "ref": "lm", "critic": "value", "reward": "value"}
    models = {name: Transformer(cfg, head=head).double() for name, head in heads.items()}
    batch = random_batch(7, seed=5)
    prompt = 5  # random_batch's prompt width: left-padded prompts, right-padded responses
    rollout = Rollout(
        batch.input_ids_BT[:, :prompt], batch.attention_mask_BT[:, :prompt], batch.input_ids_BT[:, prompt:],
        batch.attention_mask_BT[:, prompt:], torch.arange(7), torch.zeros(7, dtype=torch.long),
        torch.ones(7, dtype=torch.bool),
    )  # fmt: skip
    config, tokenizer = InferencerConfig(truncated_score=None), build_tokenizer()
    oracle = ModelInferencer(
        config, actor=models["actor"], ref=models["ref"], critic=models["critic"], reward_model=models["reward"],
        rewards=None, tokenizer=tokenizer, temperature=0.7,
    ).infer(rollout)  # fmt: skip
    for model in models.values():
        model.packing = True
    layout = ParallelLayout(ModelParallel(2), ModelParallel(2), 1, world, 2)
    got = PipelineInferencer(
        config, layout, models, rewards=None, tokenizer=tokenizer, temperature=0.7, timeout_s=60,
        log=lambda _: None,
    ).infer(rollout)  # fmt: skip
    for name in ("logprobs_BR", "ref_logprobs_BR", "values_BR", "scores_B"):
        torch.testing.assert_close(
            getattr(got, name), getattr(oracle, name), rtol=1e-10, atol=1e-12, msg=name
        )


def _worker(rank: int, world: int) -> None:
    for checkpointing in ("none", "selective"):
        _executor_check(rank, world, checkpointing)
    _strategy_check(rank, world)
    _inference_check(rank, world)


@pytest.mark.timeout(300)
def test_packed_pipeline_equals_padded_single_process() -> None:
    run_distributed(_worker, 2, timeout=280)
