"""A new user's first hour with the command line and Hydra: bad overrides and config files are one line with
exit status 2 (naming the key, the file and the intended key or option); a user's own config folder composes
beside the shipped groups (`compose_config(config_dir=...)`, `--config-dir`); the shipped configs are
`pkg://rlhfuse.conf` from an installed wheel; the run folder's rlhfuse-train.log holds the console's lines."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rlhfuse.trainer import compose_config

ROOT = Path(__file__).resolve().parents[2]

MY_EXPERIMENT = """\
# @package _global_
experiment: mine
iterations: 2
generator:
  {key}: 8
"""


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "RLHFUSE_DEBUG", "HYDRA_FULL_ERROR"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "rlhfuse.trainer.train_command", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=280)


def _my_conf(tmp_path: Path, key: str) -> Path:
    folder = tmp_path / "my_conf"
    (folder / "experiment").mkdir(parents=True)
    (folder / "experiment" / "mine.yaml").write_text(MY_EXPERIMENT.format(key=key))
    return folder


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("rlhfuse-train: error: "), lines
    return lines[0].removeprefix("rlhfuse-train: error: ")


def test_a_wrong_type_is_one_line_naming_the_key_and_the_type(tmp_path):
    run = tmp_path / "run"
    line = _one_error_line(_cli("iterations=three", f"hydra.run.dir={run}", cwd=tmp_path))
    assert line == "iterations=three: expected an int"
    assert not run.exists()
    with pytest.raises(ValueError, match=r"^generator\.max_new_tokens=lots: expected an int$"):
        compose_config(["generator.max_new_tokens=lots"])
    with pytest.raises(ValueError, match=r"^iterations=three: expected an int$"):
        compose_config(["iterations=three"])


def test_a_misspelt_group_option_names_the_choices_and_the_intended_one(tmp_path):
    line = _one_error_line(_cli("algorithm=gpro", cwd=tmp_path))
    assert line == (
        "algorithm=gpro is not an option of algorithm (choices: cispo, dapo, dr_grpo, grpo, gspo, ppo, "
        "reinforce_pp, rloo); did you mean algorithm=grpo?"
    )
    with pytest.raises(
        ValueError, match=r"^model=tny is not an option of model .*did you mean model=tiny\?$"
    ):
        compose_config(["model=tny"])


def test_an_unparsable_override_is_one_line(tmp_path):
    line = _one_error_line(_cli("iterations=[1", cwd=tmp_path))
    assert line.startswith("iterations=[1: cannot parse this override"), line


def test_a_users_experiment_composes_beside_the_shipped_groups(tmp_path):
    folder = _my_conf(tmp_path, "max_new_tokens")
    cfg = compose_config(["experiment=mine", "algorithm=grpo"], config_dir=folder)
    assert cfg.experiment == "mine" and cfg.iterations == 2 and cfg.generator.sampling.max_new_tokens == 8
    assert cfg.algorithm.name == "grpo"  # a shipped group beside the user's experiment
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        compose_config(config_dir=tmp_path / "missing")


def test_an_unknown_key_in_a_users_experiment_names_the_file_and_the_closest_key(tmp_path):
    folder = _my_conf(tmp_path, "max_new_toknes")
    mine = folder / "experiment" / "mine.yaml"
    with pytest.raises(ValueError) as err:
        compose_config(["experiment=mine"], config_dir=folder)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        f"{mine}: generator.max_new_toknes is not a configuration key (did you mean generator.max_new_tokens?"
    ), message
    line = _one_error_line(_cli("--config-dir", str(folder), "experiment=mine", cwd=tmp_path))
    assert line.startswith(f"{mine}: generator.max_new_toknes is not a configuration key"), line
    assert "did you mean generator.max_new_tokens?" in line


def test_the_shipped_configs_are_pkg_rlhfuse_conf_from_a_clone(tmp_path):
    """The same `@hydra.main(config_path="pkg://rlhfuse.conf")` script runs against a clone's editable install: the
    package's search path reaches the repository's `conf/` (the wheel ships it inside the package)."""
    script = tmp_path / "my_train.py"
    script.write_text(
        "import hydra\n"
        "from rlhfuse.trainer.hydra import to_config\n\n\n"
        '@hydra.main(config_path="pkg://rlhfuse.conf", config_name="config", version_base="1.3")\n'
        "def main(cfg):\n"
        "    import rlhfuse.conf\n\n"
        "    print('composed', to_config(cfg).iterations, 'from', rlhfuse.conf.__file__)\n\n\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = [
        sys.executable,
        str(script),
        "experiment=smoke",
        "iterations=5",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    out = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"composed 5 from {ROOT / 'conf' / '__init__.py'}" in out.stdout, out.stdout[-2000:]


@pytest.mark.slow
def test_the_shipped_configs_are_pkg_rlhfuse_conf_from_a_wheel(tmp_path):
    """A user's own `@hydra.main(config_path="pkg://rlhfuse.conf")` script composes the shipped configuration
    from an installed wheel (Hydra's pkg:// search path needs `rlhfuse.conf` to be a package)."""
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("rlhfuse-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # the wheel's files as an installer lays them out
    script = tmp_path / "app" / "my_train.py"
    script.parent.mkdir()
    script.write_text(
        "import hydra\n"
        "from rlhfuse.trainer.hydra import to_config\n\n\n"
        '@hydra.main(config_path="pkg://rlhfuse.conf", config_name="config", version_base="1.3")\n'
        "def main(cfg):\n"
        "    print('composed', to_config(cfg).iterations)\n\n\n"
        "main()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}  # ahead of the checkout's editable path
    args = [sys.executable, str(script), "--cfg", "job", "experiment=smoke", "iterations=5"]
    out = subprocess.run(args, capture_output=True, text=True, env=env, cwd=script.parent, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "\niterations: 5\n" in out.stdout and "\nexperiment: smoke\n" in out.stdout, out.stdout[-2000:]
    where = [sys.executable, "-c", "import rlhfuse.conf as c; print(c.__file__)"]
    found = subprocess.run(where, capture_output=True, text=True, env=env, check=True).stdout
    assert found.startswith(str(site)), found  # the wheel's copy, not the checkout's conf/


@pytest.mark.slow
def test_the_run_log_holds_the_console_lines(tmp_path):
    run = tmp_path / "run"
    proc = _cli("experiment=smoke", "logger.print_every=1", f"hydra.run.dir={run}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run / "rlhfuse-train.log").read_text()
    console = [x for x in proc.stderr.splitlines() if x.startswith(("rlhfuse", "iter ", "warm start"))]
    assert any(x.startswith("rlhfuse: experiment 'smoke'") for x in console), console
    assert sum(x.startswith("iter ") for x in console) == 3 and console[-1].startswith(
        "rlhfuse-train: done in "
    )
    for line in console:
        assert f" - {line}\n" in log, (line, log)
    # a failure keeps a used folder: its error line is in the log too
    failed = _cli("experiment=smoke", "generator.max_new_tokens=0", f"hydra.run.dir={run}", cwd=tmp_path)
    assert failed.returncode == 2
    assert "rlhfuse-train: error: " in (run / "rlhfuse-train.log").read_text().split(log, 1)[1]


@pytest.mark.slow
def test_done_in_is_per_job_of_a_multirun(tmp_path):
    """The second job of `-m` counts its own time, not the first job's too: before, 'done in' was the process's
    time, so the second (shorter) job never reported less than the first."""
    proc = _cli(
        "-m", "experiment=smoke", "iterations=3,1", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = [x for x in proc.stderr.splitlines() if x.startswith("rlhfuse-train: done in ")]
    first, second = (float(x.removeprefix("rlhfuse-train: done in ").split("s", 1)[0]) for x in done)
    assert "1 iterations this run" in done[1] and second < first, done
    assert all((tmp_path / "sweep" / job / "rlhfuse-train.log").stat().st_size > 0 for job in ("0", "1"))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_two_process_run_prints_start_up_once_and_keeps_one_log(tmp_path):
    run = tmp_path / "run"
    proc = _cli("experiment=smoke", "pipeline=fused", "model.num_layers=2", "distributed.nproc_per_node=2",
                "distributed.timeout_s=60", f"hydra.run.dir={run}", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("rlhfuse: experiment 'smoke'") == 1, proc.stderr[-3000:]
    assert proc.stderr.count("rlhfuse-train: done in ") == 1, proc.stderr[-3000:]
    assert sorted(p.name for p in run.glob("*.log")) == ["rlhfuse-train.log"]
    log = (run / "rlhfuse-train.log").read_text()
    assert log.count("rlhfuse: experiment 'smoke'") == 1 and log.count("rlhfuse-train: done in ") == 1
