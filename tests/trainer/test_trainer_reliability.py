"""Reliability (issue 18): checkpoints belong to a run and rotation never deletes this run's newest ones,
metrics.jsonl holds one row per iteration of one run, stale temporary folders go at start."""

import json
import logging

import pytest
import torch

from rlhfuse.core.checkpoint import (
    RUN_FILE,
    clean_stale,
    list_checkpoints,
    read_runs,
    save_checkpoint,
)
from rlhfuse.core.errors import CheckpointError
from rlhfuse.trainer import build_trainer, compose_config
from rlhfuse.trainer.logging import JsonlLogger


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmstart-cache"))


def _smoke(cache_dir, run_dir, *overrides):
    cfg = compose_config(["experiment=smoke", f"model.warmstart.cache_dir={cache_dir}", *overrides])
    return build_trainer(cfg, run_dir=run_dir, log=lambda _: None)


def _state(value):
    return {"actor": {"w": torch.full((2,), value)}, "critic": {"w": torch.full((2,), value)}}


def _names(directory):
    return [p.name for p in list_checkpoints(directory)]


def _iterations(run_dir):
    return [json.loads(x)["iteration"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_rotation_keeps_the_newest_of_this_run_not_the_highest_names(tmp_path):
    for it in (19, 20):  # an earlier run's checkpoints in the same folder
        save_checkpoint(tmp_path, it, _state(float(it)), run="old")
    for it in (1, 2, 3):
        save_checkpoint(tmp_path, it, _state(float(it)), keep=2, run="new")
    assert _names(tmp_path) == ["iter_00000002", "iter_00000003", "iter_00000019", "iter_00000020"]
    assert [p.name for p in list_checkpoints(tmp_path, run="new")] == ["iter_00000002", "iter_00000003"]


def test_a_fresh_run_over_another_runs_checkpoints_is_refused_unless_overwrite(cache_dir, tmp_path):
    _smoke(cache_dir, tmp_path, "iterations=2", "checkpoint.every=1").fit()
    with pytest.raises(CheckpointError, match=r"resume=auto to continue it.*checkpoint\.overwrite=true"):
        _smoke(cache_dir, tmp_path, "iterations=2", "checkpoint.every=1")
    # overwrite: the new run's checkpoints are its own; the old run's ones past them are never pruned
    trainer = _smoke(cache_dir, tmp_path, "iterations=1", "checkpoint.every=1", "checkpoint.overwrite=true")
    trainer.fit()
    runs = read_runs(tmp_path)
    assert len(runs) == 2 and runs[0].id == trainer.run.id and runs[0].start_iteration == 0
    assert _names(tmp_path / "checkpoints") == ["iter_00000001", "iter_00000002"]
    assert _iterations(tmp_path) == [1]  # started afresh, not appended to the old run's rows
    # resume=auto continues the new run (its iter_1), not the old run's higher iter_2
    resumed = _smoke(cache_dir, tmp_path, "iterations=2", "checkpoint.every=1", "resume=auto")
    assert resumed.fit()[0]["iteration"] == 2 and resumed.run.id == trainer.run.id
    assert _iterations(tmp_path) == [1, 2]


def test_resume_from_an_older_explicit_checkpoint_branches_and_auto_follows_the_branch(cache_dir, tmp_path):
    common = ("checkpoint.every=1", "checkpoint.keep=2")
    first = _smoke(cache_dir, tmp_path, "iterations=3", *common)
    first.fit()
    assert _names(tmp_path / "checkpoints") == ["iter_00000002", "iter_00000003"]
    branch = _smoke(
        cache_dir, tmp_path, "iterations=3", *common, f"resume={tmp_path}/checkpoints/iter_00000002"
    )
    branch.fit()
    (current, earlier) = read_runs(tmp_path)
    assert current.id == branch.run.id != earlier.id == first.run.id
    assert current.resumed_from["iteration"] == 2 and current.resumed_from["run"] == first.run.id
    # the branch's iter_3 replaced the abandoned one; auto continues the branch
    assert list_checkpoints(tmp_path / "checkpoints", run=branch.run.id)[-1].name == "iter_00000003"
    again = _smoke(cache_dir, tmp_path, "iterations=4", *common, "resume=auto")
    assert again.fit()[0]["iteration"] == 4 and again.run.id == branch.run.id
    assert _iterations(tmp_path) == [1, 2, 3, 4]


def test_resume_auto_without_a_checkpoint_starts_metrics_afresh_and_stale_folders_go(cache_dir, tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i}) + "\n" for i in (1, 2, 1)))
    ckpt = tmp_path / "checkpoints"
    (ckpt / ".tmp-iter_00000001-4242").mkdir(parents=True)  # a save killed before its rename
    save_checkpoint(ckpt, 7, _state(7.0))
    (ckpt / "iter_00000007" / "actor.safetensors").unlink()  # a prune killed midway
    trainer = _smoke(cache_dir, tmp_path, "iterations=2", "resume=auto")
    assert trainer.fit()[0]["iteration"] == 1
    assert _iterations(tmp_path) == [1, 2]
    assert sorted(p.name for p in ckpt.iterdir()) == []
    assert (tmp_path / RUN_FILE).is_file()


def test_torn_last_metrics_row_is_dropped_with_a_warning_naming_the_file(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1, "x": 1}\n{"iteration": 2, "x": 2}\n{"iteration": 2, "x": 3}\n{"itera')
    logger = JsonlLogger(path)
    with caplog.at_level(logging.WARNING):
        logger.truncate_after(2)
    assert f"{path}:4: dropped a malformed last row" in caplog.text
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        {"iteration": 1, "x": 1},
        {"iteration": 2, "x": 3},
    ]
    logger.log_metrics({"iteration": 3, "x": 4})
    logger.log_metrics({"iteration": 3, "x": 5})  # never two rows for one iteration
    assert [json.loads(x)["x"] for x in path.read_text().splitlines()] == [1, 3, 5]
    assert not list(tmp_path.glob(".*tmp"))


def test_clean_stale_keeps_complete_checkpoints(tmp_path):
    save_checkpoint(tmp_path, 1, _state(1.0))
    (tmp_path / ".trash-iter_00000000-1").mkdir()
    (tmp_path / "iter_00000005").mkdir()
    assert clean_stale(tmp_path) == [".trash-iter_00000000-1", "iter_00000005"]
    assert _names(tmp_path) == ["iter_00000001"]


def test_csv_sink_keeps_the_resumed_runs_rows(cache_dir, tmp_path):
    common = ("checkpoint.every=2", "logger=default", "logger.progress=false")
    _smoke(cache_dir, tmp_path, "iterations=3", *common).fit()  # checkpoint at 2, row 3 is past it
    _smoke(cache_dir, tmp_path, "iterations=4", *common, "resume=auto").fit()
    rows = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    steps = [int(float(r.split(",")[header.index("step")])) for r in rows[1:]]
    assert steps == [1, 2, 3, 4]
