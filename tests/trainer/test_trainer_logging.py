"""Loggers: W&B offline without an API key (never hangs), CSV and JSONL sinks, progress lines."""

import time

import pytest

from rlhfuse.trainer import build_trainer, compose_config
from rlhfuse.trainer.logging import JsonlLogger, wandb_mode


def test_wandb_auto_mode_is_offline_without_an_api_key(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    start = time.perf_counter()
    assert wandb_mode("auto") in ("online", "offline")  # probes api.wandb.ai with a short timeout
    assert time.perf_counter() - start < 5
    assert wandb_mode("disabled") == "disabled"


def test_jsonl_truncate_after_keeps_earlier_rows(tmp_path):
    logger = JsonlLogger(tmp_path / "metrics.jsonl")
    for it in (1, 2, 3):
        logger.log_metrics({"iteration": it, "x": float(it)})
    logger.truncate_after(2)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2


@pytest.mark.slow
def test_smoke_run_logs_to_wandb_offline_and_csv(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cfg = compose_config(
        [
            "experiment=smoke",
            "logger=wandb",
            "logger.wandb_run_name=smoke-test",
            "logger.progress=false",
            f"model.warmstart.cache_dir={tmp_path / 'cache'}",
        ]
    )
    history = build_trainer(cfg, run_dir=tmp_path / "run", log=lambda _: None).fit()
    assert len(history) == 3
    assert list((tmp_path / "run").rglob("offline-run-*")), "no offline W&B run written"
    csv = next((tmp_path / "run" / "csv").rglob("metrics.csv")).read_text()
    assert "reward/mean" in csv.splitlines()[0] and len(csv.splitlines()) == 4
    assert "iter   3/3 reward" in capsys.readouterr().err


def test_csv_logger_is_fabrics(tmp_path):
    from lightning.fabric.loggers import CSVLogger

    from rlhfuse.trainer.logging import LoggerConfig, build_loggers

    (jsonl, csv) = build_loggers(LoggerConfig(backends=["jsonl", "csv"]), tmp_path)
    assert isinstance(jsonl, JsonlLogger) and isinstance(csv, CSVLogger)


def test_logger_tensorboard_writes_event_scalars(tmp_path):
    pytest.importorskip("tensorboard")  # the dev extra installs it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = compose_config(
        [
            "experiment=smoke",
            "logger=tensorboard",
            "logger.progress=false",
            "iterations=2",
            f"model.warmstart.cache_dir={tmp_path / 'cache'}",
        ]
    )
    history = build_trainer(cfg, run_dir=tmp_path / "run", log=lambda _: None).fit()
    (events,) = (tmp_path / "run" / "tensorboard").rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events.parent))
    accumulator.Reload()
    reward = accumulator.Scalars("reward/mean")
    assert [e.step for e in reward] == [1, 2]
    assert reward[-1].value == pytest.approx(history[-1]["reward/mean"], rel=1e-5)


def test_logger_tensorboard_without_the_package_is_one_line_before_anything_is_built(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("tensorboard") else real(name, *a),
    )
    cfg = compose_config(["experiment=smoke", "logger=tensorboard"])
    with pytest.raises(ValueError, match=r"pip install 'rlhfuse\[tensorboard\]'") as err:
        build_trainer(cfg, run_dir=tmp_path / "run", log=lambda _: None)
    assert "logger=tensorboard" in str(err.value)
    assert not (tmp_path / "run").exists()  # failed validation leaves no run folder
