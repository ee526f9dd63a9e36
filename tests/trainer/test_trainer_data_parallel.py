"""PlainStrategy data-parallel over 2 gloo processes (one per generation instance): the same updated weights as
one process training on the whole mini-batches (float64), identical weights on both ranks, a non-finite loss on
one rank stops both; the launch arithmetic of pipeline=plain is validated with the fix named."""

from __future__ import annotations

import os

import pytest
import torch

from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.core.optim import OptimConfig
from rlhfuse.core.types import TrainBatch
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.testing.processes import gloo_rank, spawn_ranks
from rlhfuse.trainer import compose_config, validate

# the reductions as algorithm.loss_agg names them
AGG = {"token": "token-mean", "sequence": "seq-mean-token-mean"}

STEPS, MINI_BATCH = 3, 8  # three mini-batches: the second and third steps use AdamW's moments


def _models() -> tuple[Transformer, Transformer]:
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(num_layers=2)
    return Transformer(cfg, head="lm").double(), Transformer(cfg, head="value").double()


def _batch(seed: int, samples: int = MINI_BATCH, prompt: int = 5, response: int = 9) -> TrainBatch:
    """Left-padded prompts, right-padded responses of varied (long-tailed) lengths, float64."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (samples, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    resp = torch.zeros(samples, response, dtype=torch.float64)
    for b in range(samples):
        p_len = int(torch.randint(2, prompt + 1, (1,), generator=g))
        r_len = response if b == 0 else int(torch.randint(1, 4, (1,), generator=g))
        mask[b, : prompt - p_len] = 0
        mask[b, prompt + r_len :] = 0
        resp[b, :r_len] = 1
    ids[mask == 0] = 0

    def rand() -> torch.Tensor:
        return torch.randn(samples, response, generator=g, dtype=torch.float64)

    return TrainBatch(ids, mask, resp, -1.0 + 0.1 * rand(), 0.3 * rand(), rand(), rand())


def _strategy(actor, critic, reduction: str, group=None):
    from lightning.fabric import Fabric

    from rlhfuse.trainer.strategies.plain.training import PlainStrategy

    return PlainStrategy(
        actor,
        critic,
        OptimConfig(warmup_steps=1, grad_clip=0.5),
        AlgorithmConfig(loss_agg=AGG[reduction]),
        fabric=Fabric(accelerator="cpu", devices=1),
        total_steps=STEPS,
        micro_batch_size=2,
        group=group,
    )


def _train(reduction: str, group=None) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    actor, critic = _models()
    strategy = _strategy(actor, critic, reduction, group)
    stats = [strategy.train_step(_batch(seed)).metrics() for seed in range(STEPS)]
    weights = {f"actor.{k}": v for k, v in actor.state_dict().items()}
    weights.update({f"critic.{k}": v for k, v in critic.state_dict().items()})
    return weights, stats


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from rlhfuse.core.errors import NonFiniteError
    from rlhfuse.runtime.batch_split import karmarkar_karp, sample_costs

    with gloo_rank(rank, port, timeout_s=30):
        result: dict[str, object] = {}
        for reduction in ("token", "sequence"):
            result[reduction] = _train(reduction, dist.group.WORLD)
        # a NaN advantage in rank 1's share only: rank 0 must stop too, before its optimizer step
        actor, critic = _models()
        strategy = _strategy(actor, critic, "token", dist.group.WORLD)
        bad = _batch(7)
        costs = sample_costs(bad.attention_mask_BT.sum(dim=1).tolist())
        bad.advantages_BR[karmarkar_karp(costs, 2)[1]] = float("nan")
        before = [p.clone() for p in actor.parameters()]
        try:
            strategy.train_step(bad).metrics()
            result["nonfinite"] = "no error"
        except NonFiniteError as err:
            unchanged = all(torch.equal(p, q) for p, q in zip(actor.parameters(), before, strict=True))
            result["nonfinite"] = (str(err), unchanged)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_two_rank_plain_strategy_equals_one_process(tmp_path) -> None:
    assert spawn_ranks(_worker, str(tmp_path), timeout_s=150) == [0, 0]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for reduction in ("token", "sequence"):
        want_weights, want_stats = _train(reduction)
        (w0, s0), (w1, s1) = ranks[0][reduction], ranks[1][reduction]
        for name, want in want_weights.items():
            assert torch.equal(w0[name], w1[name]), f"{reduction}: ranks diverged on {name}"
            # an update from half the mini-batch or gradients averaged instead of weighted moves weights by
            # ~lr = 5e-4; reassociated float64 sums differ by ~1e-15
            assert torch.allclose(w0[name], want, rtol=0, atol=1e-12), f"{reduction}: {name}"
        assert any(not torch.equal(w0[n], _models()[0].state_dict()[n[6:]]) for n in w0 if n[:6] == "actor.")
        assert s0 == s1  # statistics are all-reduced: the same numbers on both ranks
        for got, want in zip(s0, want_stats, strict=True):
            for key in ("loss/policy", "loss/value", "actor/grad_norm", "critic/grad_norm", "lr"):
                assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), (reduction, key)
    message0, unchanged0 = ranks[0]["nonfinite"]
    message1, unchanged1 = ranks[1]["nonfinite"]
    assert "another data-parallel rank" in message0 and "loss/policy is nan" in message1
    assert unchanged0 and unchanged1


def test_plain_launch_arithmetic_names_the_fix(monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    validate(
        compose_config(["generator.instances=2", "migration=auto"])
    )  # nproc_per_node follows: 2 processes
    validate(compose_config(["generator.instances=2", "distributed.nproc_per_node=2"]))
    validate(compose_config(["generator.instances=2", "generator.in_process=true"]))
    cases = {
        "generator.instances=2 distributed.nproc_per_node=3": (
            "distributed.nproc_per_node gives 3 processes but generator.instances=2 (3 != 2): "
            "set generator.instances=3, or distributed.nproc_per_node=2"
        ),
        "generator.instances=2 generator.in_process=true distributed.nproc_per_node=2": (
            "generator.in_process=true steps every instance in this one process"
        ),
        "generator.instances=4 data.mini_batch_size=2": "data.mini_batch_size=2 < 4 processes",
    }
    for overrides, expected in cases.items():
        with pytest.raises(ValueError) as err:
            validate(compose_config(overrides.split()))
        assert expected in str(err.value), str(err.value)
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun: the launched world decides
    validate(compose_config(["generator.instances=2"]))
    with pytest.raises(
        ValueError, match=r"torchrun's WORLD_SIZE gives 2 processes but generator.instances=1"
    ):
        validate(compose_config([]))
