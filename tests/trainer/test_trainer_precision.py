"""pipeline.precision on CPU: bf16-true's fp32 master weights and optimizer states, and bf16-mixed / bf16-true
training within a stated tolerance of fp32 (one strategy step, and a whole smoke run end to end)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from lightning.fabric import Fabric

from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.core.optim import MasterWeightAdamW, OptimConfig, build_optimizer
from rlhfuse.core.types import TrainBatch
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.trainer import build_trainer, compose_config
from rlhfuse.trainer.strategies.plain.training import PlainStrategy

# bf16 keeps 8 bits of mantissa (relative step 2^-8 = 0.4%). Measured on these steps: value losses ~1e-3 relative,
# policy losses ~5e-4 absolute from fp32; the tolerances leave room for other CPUs and BLAS builds.
LOSS_RTOL = 0.01
POLICY_ATOL = 0.005


def test_bf16_parameters_get_fp32_masters_and_states_that_keep_small_updates():
    weight = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    optim, _ = build_optimizer([weight], 1e-4, OptimConfig(weight_decay=0.0, warmup_steps=0), total_steps=100)
    assert isinstance(optim, MasterWeightAdamW)
    for _ in range(3):  # each step moves the weight by ~1e-4, below bf16's ulp of 2^-7 at 1.0
        weight.grad = torch.ones_like(weight)
        optim.step()
        optim.zero_grad()
    (master,) = optim.masters
    assert master.dtype == torch.float32 and weight.dtype == torch.bfloat16
    assert float(master[0]) == pytest.approx(1 - 3e-4, rel=1e-3)  # the fp32 master moved ...
    assert float(weight.detach()[0]) == 1.0  # ... the bf16 weight rounds back to 1
    assert all(v.dtype == torch.float32 for s in optim.state.values() for v in s.values() if v.dim() > 0)
    state = copy.deepcopy(optim.state_dict())
    fresh = MasterWeightAdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], lr=1e-4)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.masters[0], master)  # resume continues from the fp32 values


def _batch() -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (4, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, 8:] = 0
    response_BR = mask[:, 4:].float()

    def field(scale: float) -> torch.Tensor:
        return torch.randn(response_BR.shape, generator=gen) * scale * response_BR

    return TrainBatch(ids, mask, response_BR, field(0.1) - 4.6 * response_BR, field(1), field(1), field(1))


def _step_losses(precision: str, steps: int = 3) -> list[tuple[float, float]]:
    torch.manual_seed(0)
    config = ModelConfig.tiny(vocab_size=100)
    actor, critic = Transformer(config, "lm"), Transformer(config, "value")
    if precision == "bf16-true":
        actor, critic = actor.to(torch.bfloat16), critic.to(torch.bfloat16)
    strategy = PlainStrategy(
        actor, critic, OptimConfig(warmup_steps=0, actor_lr=1e-3, critic_lr=1e-3), AlgorithmConfig(),
        fabric=Fabric(accelerator="cpu", devices=1, precision="bf16-mixed" if precision == "bf16-mixed" else "32-true"),
        total_steps=steps, micro_batch_size=2, packing=True,
    )  # fmt: skip
    return [
        (s.loss.policy_loss, s.loss.value_loss)
        for s in (strategy.train_step(copy.deepcopy(_batch())) for _ in range(steps))
    ]


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_training_steps_stay_within_tolerance_of_fp32(precision):
    reference, got = _step_losses("32-true"), _step_losses(precision)
    for (policy, value), (ref_policy, ref_value) in zip(got, reference, strict=True):
        assert math.isfinite(policy) and math.isfinite(value)
        assert value == pytest.approx(ref_value, rel=LOSS_RTOL)
        # the policy loss is a small difference of ratios: compare on the scale of its advantages (~1)
        assert policy == pytest.approx(ref_policy, abs=POLICY_ATOL)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_smoke_run_end_to_end_on_cpu(tmp_path_factory, precision):
    cache = str(tmp_path_factory.mktemp("warmstart-cache"))
    runs = {}
    for p in ("32-true", precision):
        run_dir = tmp_path_factory.mktemp(p)
        cfg = compose_config(
            ["experiment=smoke", f"model.warmstart.cache_dir={cache}", f"pipeline.precision={p}"]
        )
        trainer = build_trainer(cfg, run_dir=run_dir, log=lambda _: None)
        actor = trainer.strategy.actor  # type: ignore[attr-defined]
        assert next(actor.parameters()).dtype == (torch.bfloat16 if p == "bf16-true" else torch.float32)
        trainer.fit()
        runs[p] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trainer_models = runs[precision]
    assert len(trainer_models) == len(runs["32-true"])
    for row in trainer_models:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))
    # the first iteration trains on rollouts of the same warm-started weights: its value loss within tolerance
    first, ref_first = trainer_models[0], runs["32-true"][0]
    assert first["loss/value"] == pytest.approx(ref_first["loss/value"], rel=0.1)
