"""End to end: the smoke run against golden metrics, bit-identical resume, NaN stops, CLI overrides."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from rlhfuse.core.checkpoint import list_checkpoints
from rlhfuse.trainer import NonFiniteError, build_trainer, compose_config

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "smoke_metrics.json"
REQUIRED = [
    "iteration",
    "reward/mean",
    "kl/mean",
    "loss/policy",
    "loss/value",
    "response_length/mean",
    "response_length/p50",
    "response_length/p99",
    "response_length/max",
    "time/generation",
    "time/inference",
    "time/training",
    "time/iteration",
    "throughput/samples_per_s",
    "throughput/tokens_per_s",
]


def _deterministic(row):
    """Metrics that must be reproducible (timings and throughput are not)."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmstart-cache"))


def _smoke(cache_dir, run_dir, *overrides):
    cfg = compose_config(["experiment=smoke", f"model.warmstart.cache_dir={cache_dir}", *overrides])
    return build_trainer(cfg, run_dir=run_dir, log=lambda _: None)


def test_smoke_run_matches_golden_metrics(cache_dir, tmp_path):
    """Regenerate after an intended change with `RLHFUSE_UPDATE_GOLDEN=1 pytest tests/trainer -k golden`."""
    history = _smoke(cache_dir, tmp_path).fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(history) == 3
    for row in rows:
        assert set(REQUIRED) <= set(row), set(REQUIRED) - set(row)
        assert all(math.isfinite(v) for v in row.values())
    got = [_deterministic(r) for r in rows]
    if os.environ.get("RLHFUSE_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    expected = json.loads(GOLDEN.read_text())
    assert [sorted(r) for r in got] == [sorted(r) for r in expected]
    for g, e in zip(got, expected):
        for key in e:
            assert g[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6), key


def test_resume_is_bit_identical_and_crosses_the_epoch_boundary(cache_dir, tmp_path, crash_after):
    # 8 prompts, 4 per iteration: the checkpoint at iteration 2 sits exactly at the end of data epoch 0.
    common = ["iterations=4", "checkpoint.every=2", "data.num_prompts=8", "pipeline.lr_schedule=cosine"]
    straight = _smoke(cache_dir, tmp_path / "a", *common)
    straight_history = straight.fit()

    interrupted = _smoke(cache_dir, tmp_path / "b", *common)
    interrupted.callbacks.append(crash_after(at=3))
    interrupted.fabric._callbacks = interrupted.callbacks
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit()
    assert [p.name for p in list_checkpoints(tmp_path / "b" / "checkpoints")] == ["iter_00000002"]

    resumed = _smoke(cache_dir, tmp_path / "b", *common, "resume=auto")
    resumed_history = resumed.fit()
    assert resumed.prompts.epoch == straight.prompts.epoch == 1  # iterations 3-4 trained data epoch 1
    assert [_deterministic(r) for r in resumed_history] == [_deterministic(r) for r in straight_history[2:]]
    rows_b = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows_b] == [1, 2, 3, 4]  # the crashed run's row 3 was replaced
    for key in ("actor", "critic"):
        a = safetensors.torch.load_file(
            str(tmp_path / "a" / "checkpoints" / "iter_00000004" / f"{key}.safetensors")
        )
        b = safetensors.torch.load_file(
            str(tmp_path / "b" / "checkpoints" / "iter_00000004" / f"{key}.safetensors")
        )
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_nan_reward_stops_with_the_iteration_and_metric_and_saves_nothing(cache_dir, tmp_path):
    trainer = _smoke(
        cache_dir,
        tmp_path,
        "inferencer.use_reward_model=false",
        "inferencer.reward_fn=rlhfuse_test_rewards:nan_reward",
        "checkpoint.every=1",
    )
    with pytest.raises(NonFiniteError, match=r"iteration 1: reward/mean is nan"):
        trainer.fit()
    assert list_checkpoints(tmp_path / "checkpoints") == []


def test_nan_loss_stops_before_the_optimizer_step(cache_dir, tmp_path):
    trainer = _smoke(cache_dir, tmp_path)
    before = {k: v.clone() for k, v in trainer.strategy.actor_weights().items()}
    original = trainer.strategy.train_step

    def poisoned(batch):
        batch.advantages_BR[:] = float("nan")
        return original(batch)

    trainer.strategy.train_step = poisoned
    with pytest.raises(NonFiniteError, match=r"iteration 1, PPO epoch 1: loss/policy is nan"):
        trainer.fit()
    after = trainer.strategy.actor_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_rule_reward_by_import_path_and_hf_export(cache_dir, tmp_path):
    trainer = _smoke(
        cache_dir,
        tmp_path,
        "inferencer.reward_fn=rlhfuse_test_rewards:constant_reward",
        "inferencer.reward_weights=[2.0]",
        "checkpoint.export_hf=true",
        "iterations=1",
    )
    (row,) = trainer.fit()
    assert row["reward/mean"] != 0.0
    from rlhfuse.models import from_pretrained

    exported = from_pretrained(tmp_path / "actor_hf", head="lm")
    weights = trainer.strategy.actor_weights()
    assert all(torch.equal(exported.state_dict()[k], weights[k]) for k in weights)
    assert (tmp_path / "actor_hf" / "tokenizer.json").is_file()


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    return subprocess.run(
        [sys.executable, "-m", "rlhfuse.trainer.train_command", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
    )


def test_cli_overrides_and_config_errors(cache_dir, tmp_path):
    run = tmp_path / "run"
    ok = _cli(
        "experiment=smoke",
        "algorithm.kl_coef=0.05",
        "generator.max_new_tokens=8",
        f"model.warmstart.cache_dir={cache_dir}",
        f"hydra.run.dir={run}",
        cwd=tmp_path,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "mini-batches" in ok.stderr and "gradient-accumulation" in ok.stderr  # derived counts printed
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["response_length/max"] <= 8 for r in rows)
    hparams = json.loads((run / "hparams.json").read_text())
    assert hparams["algorithm"]["kl_coef"] == 0.05 and hparams["run_dir"] == str(run)

    bad = _cli("experiment=smoke", "data.mini_batch_size=3", "data.micro_batch_size=2", cwd=tmp_path)
    assert bad.returncode == 2
    assert "data.mini_batch_size=3 must divide" in bad.stderr and "data.micro_batch_size=2" in bad.stderr
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("metrics.jsonl"))


def test_missing_model_and_checkpoint_files_are_clear_errors(cache_dir, tmp_path):
    from rlhfuse.core.errors import CheckpointError
    from rlhfuse.data.synthetic import SyntheticTask, build_tokenizer

    sft = tmp_path / "sft"
    build_tokenizer().save(sft)  # a tokenizer but no weights
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in SyntheticTask().prompts(8)))
    cfg = compose_config(
        ["experiment=hf_local", f"model.sft_path={sft}", f"model.reward_path={sft}", f"data.path={prompts}"]
    )
    with pytest.raises(FileNotFoundError, match=r"model\.sft_path=.*no config\.json"):
        build_trainer(cfg, run_dir=tmp_path / "run", log=lambda _: None)
    trainer = _smoke(cache_dir, tmp_path / "r", f"resume={tmp_path / 'no_such_checkpoint'}")
    with pytest.raises(CheckpointError, match=r"not a complete rlhfuse checkpoint"):
        trainer.fit()


def test_a_callback_that_does_not_subclass_callback_is_refused_with_its_hooks(cache_dir, tmp_path):
    class Probe:  # a duck-typed callback: its hook would silently never run under a typo'd name
        def on_iteration_end(self, trainer, iteration, metrics): ...

    cfg = compose_config(["experiment=smoke", f"model.warmstart.cache_dir={cache_dir}"])
    with pytest.raises(
        TypeError, match=r"callbacks \['Probe'\] do not subclass rlhfuse.core.protocols.Callback"
    ):
        build_trainer(cfg, run_dir=tmp_path, log=lambda _: None, callbacks=[Probe()])
