"""`LocalFabric`, the Fabric of a run of one process without Lightning: a run built with it trains the bits a run
built with Lightning's own `Fabric(devices=1)` trains (32-true and bf16-mixed), its seeding draws what
Lightning's `seed_everything` draws, and a one-process run never imports Lightning."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.utilities.seed import seed_everything

import rlhfuse.trainer.build as build
from rlhfuse.runtime.local import LocalFabric
from rlhfuse.trainer import build_trainer, compose_config


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmstart-cache"))


def _fit(tmp_path, cache_dir, precision: str) -> tuple[list[dict[str, float]], dict[str, torch.Tensor], type]:
    cfg = compose_config(
        [
            "experiment=smoke",
            f"model.warmstart.cache_dir={cache_dir}",
            "iterations=2",
            f"pipeline.precision={precision}",
        ]
    )
    trainer = build_trainer(cfg, run_dir=tmp_path, log=lambda _: None)
    rows = trainer.fit()
    params = {n: p.detach().clone() for n, p in trainer.strategy.actor.named_parameters()}  # type: ignore[attr-defined]
    return rows, params, type(trainer.fabric)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_one_process_run_trains_the_bits_lightnings_fabric_trains(
    tmp_path, cache_dir, monkeypatch, precision
):
    local_rows, local_params, local_type = _fit(tmp_path / "local", cache_dir, precision)
    assert local_type is LocalFabric

    def lightning_fabric(config, layout, device):  # what make_fabric built for one process before LocalFabric
        return Fabric(accelerator="cpu", devices=1, precision=precision)

    monkeypatch.setattr(build, "make_fabric", lightning_fabric)
    rows, params, fabric_type = _fit(tmp_path / "lightning", cache_dir, precision)
    assert fabric_type is Fabric
    assert set(params) == set(local_params)
    for name, value in params.items():
        assert torch.equal(local_params[name], value), name
    keys = ("reward/mean", "loss/policy", "loss/value", "actor/grad_norm", "critic/grad_norm")
    assert [[r[k] for k in keys] for r in local_rows] == [[r[k] for k in keys] for r in rows]


def test_seeding_draws_what_lightnings_seed_everything_draws():
    def draws() -> tuple[float, float, list[float]]:
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    seed_everything(7, verbose=False)
    theirs = draws()
    assert LocalFabric().seed_everything(7) == 7
    assert draws() == theirs


def test_local_fabric_autocasts_only_under_bf16_mixed():
    x, w = torch.ones(2, 3), torch.ones(3, 4)
    with LocalFabric(precision="32-true").autocast():
        assert (x @ w).dtype == torch.float32
    with LocalFabric(precision="bf16-mixed").autocast():
        assert (x @ w).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"LocalFabric\(precision='16-mixed'\): known are"):
        LocalFabric(precision="16-mixed")  # type: ignore[arg-type]
