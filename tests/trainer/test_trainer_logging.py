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


def test_csv_logger_is_fabrics_and_tensorboard_names_its_dependency(tmp_path):
    import importlib.util

    from lightning.fabric.loggers import CSVLogger

    from rlhfuse.trainer.logging import LoggerConfig, build_loggers

    (jsonl, csv) = build_loggers(LoggerConfig(backends=["jsonl", "csv"]), tmp_path)
    assert isinstance(jsonl, JsonlLogger) and isinstance(csv, CSVLogger)
    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        assert build_loggers(LoggerConfig(backends=["tensorboard"]), tmp_path)
    else:
        with pytest.raises(ImportError, match="pip install tensorboard"):
            build_loggers(LoggerConfig(backends=["tensorboard"]), tmp_path)
