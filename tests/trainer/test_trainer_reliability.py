"""Reliability (issue 18): checkpoints belong to a run and rotation never deletes this run's newest ones,
metrics.jsonl holds one row per iteration of one run, stale temporary folders go at start. Resume (issue 25):
run.json records the resolved configuration; a resume names each changed key, applies the mutable ones (a new
learning rate reaches the loaded optimizer) and refuses the others, and `iterations` not above the checkpoint's."""

import json
import logging
import shutil

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
from rlhfuse.core.optim import OptimConfig, build_optimizer, set_peak_lr
from rlhfuse.trainer import build_trainer, compose_config
from rlhfuse.trainer.logging import JsonlLogger
from rlhfuse.trainer.resume import MUTABLE_ON_RESUME, config_record, is_mutable
from rlhfuse.trainer.train_command import USER_ERRORS


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmstart-cache"))


def _smoke(cache_dir, run_dir, *overrides):
    cfg = compose_config(["experiment=smoke", f"model.warmstart.cache_dir={cache_dir}", *overrides])
    return build_trainer(cfg, run_dir=run_dir, log=lambda _: None)


# constant peak LR: the optimizer's lr after a resume is the configured value itself
LR = ("checkpoint.every=1", "pipeline.lr_schedule=constant", "pipeline.warmup_steps=0")


@pytest.fixture(scope="module")
def trained(cache_dir, tmp_path_factory):
    """A run folder after `iterations=2 checkpoint.every=1` (checkpoints at 1 and 2): copy it to change it."""
    run_dir = tmp_path_factory.mktemp("trained")
    _smoke(cache_dir, run_dir, "iterations=2", *LR).fit()
    return run_dir


def _copy(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


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


def test_run_json_records_the_resolved_configuration_with_callables_by_name(trained):
    def my_reward(samples):
        return [0.0 for _ in samples]

    (run,) = read_runs(trained)
    assert run.config is not None and run.config["pipeline"]["actor_lr"] == 5e-4  # keyed as on the CLI
    assert run.config["iterations"] == 2 and run.config["model"]["hidden_size"] == 32
    cfg = compose_config(["experiment=smoke"])
    cfg.inferencer.reward_fn = my_reward  # the Python API may hold a function
    record = config_record(cfg)
    name = f"{__name__}:test_run_json_records_the_resolved_configuration_with_callables_by_name.<locals>.my_reward"
    assert record["inferencer"]["reward_fn"] == name
    assert json.loads(json.dumps(record)) == record  # JSON as it is, the same in every process
    assert is_mutable("pipeline.actor_lr") and is_mutable("logger.progress") and is_mutable("eval.every")
    assert not is_mutable("pipeline.actor_pp") and not is_mutable("model.hidden_size")
    assert len(MUTABLE_ON_RESUME) == len(set(MUTABLE_ON_RESUME))


def test_resume_with_a_changed_lr_names_it_in_one_warning_and_the_optimizer_uses_it(
    cache_dir, trained, tmp_path, caplog
):
    run_dir = _copy(trained, tmp_path)
    resumed = _smoke(cache_dir, run_dir, "iterations=3", *LR, "resume=auto", "pipeline.actor_lr=1e-3")
    with caplog.at_level(logging.WARNING):
        resumed.resume()
    lines = [r.getMessage() for r in caplog.records if "changed configuration" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "pipeline.actor_lr: 0.0005 -> 0.001" in lines[0] and "iterations: 2 -> 3" in lines[0], lines[0]
    assert "iter_00000002" in lines[0] and "resume:" not in lines[0]
    strategy = resumed.strategy
    assert resumed.iteration == 2 and strategy.actor_sched.last_epoch > 0  # the checkpoint's schedule step
    assert strategy.actor_optim.param_groups[0]["lr"] == 1e-3  # not the checkpoint's 5e-4
    assert strategy.actor_sched.base_lrs == [1e-3] and strategy.actor_sched.get_last_lr() == [1e-3]
    assert strategy.critic_optim.param_groups[0]["lr"] == 5e-4  # unchanged key, unchanged lr
    assert read_runs(run_dir)[0].config["pipeline"]["actor_lr"] == 1e-3  # the record follows the attempt
    (row,) = resumed.fit()
    assert row["iteration"] == 3 and row["lr"] == 1e-3


def test_resume_refuses_a_changed_model_or_algorithm_key_in_one_line_naming_each(cache_dir, trained):
    before = (trained / RUN_FILE).read_text()
    with pytest.raises(CheckpointError) as err:  # from build_trainer: before any model is built
        _smoke(cache_dir, trained, "iterations=3", *LR, "resume=auto", "model.hidden_size=64",
               "algorithm.kl_coef=0.2", "pipeline.actor_lr=1e-3")  # fmt: skip
    msg = str(err.value)
    assert isinstance(err.value, USER_ERRORS) and "\n" not in msg  # the CLI prints it as one line, exit 2
    assert "model.hidden_size: 32 -> 64" in msg and "algorithm.kl_coef: " in msg and " -> 0.2" in msg, msg
    assert str(trained / "checkpoints" / "iter_00000002") in msg
    assert "pipeline.actor_lr: " not in msg  # a mutable key is not refused
    assert (trained / RUN_FILE).read_text() == before


def test_resume_refuses_iterations_not_above_the_checkpoints_naming_iterations(cache_dir, trained):
    ckpt = trained / "checkpoints" / "iter_00000002"
    for iterations in (1, 2):
        with pytest.raises(CheckpointError) as err:
            _smoke(cache_dir, trained, f"iterations={iterations}", *LR, "resume=auto")
        assert str(err.value) == (
            f"iterations={iterations} but the checkpoint {ckpt} is at iteration 2: set iterations above 2 to "
            "train more"
        )
    with pytest.raises(
        CheckpointError, match=r"iterations=1 but the checkpoint .*iter_00000001 is at iteration 1"
    ):
        _smoke(cache_dir, trained, "iterations=1", *LR, f"resume={trained / 'checkpoints' / 'iter_00000001'}")


def test_a_run_recorded_without_its_configuration_resumes_with_the_hash_warning(
    cache_dir, trained, tmp_path, caplog
):
    run_dir = _copy(trained, tmp_path)
    data = json.loads((run_dir / RUN_FILE).read_text())
    del data["run"]["config"]  # as run.json was written before it held the configuration
    (run_dir / RUN_FILE).write_text(json.dumps(data))
    resumed = _smoke(cache_dir, run_dir, "iterations=3", *LR, "resume=auto", "algorithm.kl_coef=0.2")
    with caplog.at_level(logging.WARNING):
        resumed.resume()
    assert "with a changed configuration (hash " in caplog.text and resumed.iteration == 2
    assert read_runs(run_dir)[0].config["algorithm"]["kl_coef"] == 0.2  # recorded from now on


def test_set_peak_lr_keeps_the_loaded_schedules_step_under_warmup_and_decay():
    config = OptimConfig(warmup_steps=2, lr_schedule="linear", min_lr_ratio=0.0)
    weight = torch.nn.Parameter(torch.ones(2))
    optim, sched = build_optimizer([weight], 1e-2, config, total_steps=6)
    for _ in range(3):  # past the 2 warmup steps: factor (1 - (3 - 2) / 4) = 0.75
        weight.grad = torch.ones(2)
        optim.step()
        sched.step()
    saved = (optim.state_dict(), sched.state_dict())
    optim, sched = build_optimizer([weight], 4e-2, config, total_steps=6)  # the resumed run's peak
    optim.load_state_dict(saved[0])
    sched.load_state_dict(saved[1])
    assert optim.param_groups[0]["lr"] == pytest.approx(0.75e-2)  # the checkpoint's peak came back
    set_peak_lr(optim, sched, 4e-2)
    assert sched.last_epoch == 3 and sched.base_lrs == [4e-2] and optim.param_groups[0]["initial_lr"] == 4e-2
    assert optim.param_groups[0]["lr"] == pytest.approx(0.75 * 4e-2) == sched.get_last_lr()[0]
    optim.step()
    sched.step()  # the next step follows the new peak: factor 0.5
    assert optim.param_groups[0]["lr"] == pytest.approx(0.5 * 4e-2)
