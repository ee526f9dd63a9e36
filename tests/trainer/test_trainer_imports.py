"""What start-up imports: `rlhfuse-train --help` and `--cfg job` compose the configuration without torch or
Lightning, and importing `rlhfuse.trainer` loads no heavy optional dependency. Each case runs in a fresh
interpreter and reads `sys.modules` (what is imported, not how long it takes: timings are benchmarks' business)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import rlhfuse.trainer
from rlhfuse.trainer.train_command import USER_ERRORS

HEAVY = ("torch", "lightning", "transformers", "peft", "vllm", "ortools", "numba")


def loaded_by(code: str, cwd: str | os.PathLike[str] | None = None) -> tuple[set[str], str]:
    """The modules of HEAVY that `code` imports in a fresh interpreter, and what it printed."""
    probe = f"{textwrap.dedent(code)}\nimport sys\nprint('loaded:', *[m for m in {HEAVY!r} if m in sys.modules])\n"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=240, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("loaded:"), done.stdout[-3000:]
    return set(last.split()[1:]), done.stdout


def command_line(*args: str) -> str:
    """`rlhfuse-train <args>` through its entry point, in the probe's process (Hydra ends with SystemExit(0))."""
    return f"""
        import sys
        from rlhfuse.trainer.train_command import main
        sys.argv = ["rlhfuse-train", *{list(args)!r}]
        try:
            main()
        except SystemExit as end:
            assert not end.code, end.code
        """


def test_help_imports_neither_torch_nor_lightning(tmp_path):
    loaded, out = loaded_by(command_line("--help"), cwd=tmp_path)
    assert "== Configuration groups ==" in out and "algorithm: " in out  # Hydra's help, with the config
    assert not loaded & {"torch", "lightning", "numba"}, loaded


def test_printing_the_config_imports_no_torch(tmp_path):
    loaded, out = loaded_by(
        command_line("--cfg", "job", "algorithm=grpo", "data.samples_per_prompt=4"), cwd=tmp_path
    )
    assert "name: grpo" in out and "samples_per_prompt: 4" in out
    assert not loaded & {"torch", "lightning", "numba"}, loaded


def test_importing_the_trainer_package_loads_no_heavy_dependency():
    loaded, _ = loaded_by("import rlhfuse.trainer")
    assert not loaded, loaded


def test_build_trainer_leaves_lightning_until_a_run_is_built():
    """Lightning (seconds) loads in `make_fabric` where a run launches several processes; optional extras and
    the schedule search's numba load where used."""
    loaded, _ = loaded_by("from rlhfuse.trainer import build_trainer")
    assert loaded == {"torch"}, loaded


def test_a_one_process_run_imports_no_lightning(tmp_path):
    """One process needs no launcher: its Fabric is `LocalFabric` (Lightning's import costs seconds). The CSV sink
    is Lightning's, so the run logs to metrics.jsonl only (logger=quiet)."""
    loaded, _ = loaded_by(
        f"""
        from rlhfuse.trainer import build_trainer, compose_config
        cfg = compose_config(["experiment=smoke", "iterations=1", "logger=quiet",
                              "model.warmstart.cache_dir={tmp_path / "cache"}"])
        assert len(build_trainer(cfg, run_dir="{tmp_path / "run"}", log=lambda _: None).fit()) == 1
        """
    )
    assert "torch" in loaded and "lightning" not in loaded, loaded


def test_every_public_name_is_importable_and_listed():
    for name in rlhfuse.trainer.__all__:
        assert getattr(rlhfuse.trainer, name) is not None, name
    assert set(rlhfuse.trainer.__all__) <= set(dir(rlhfuse.trainer))
    from rlhfuse.trainer import FusedPipelineStrategy, RLHFTrainer, validate
    from rlhfuse.trainer.parts import FusedPipelineStrategy as part
    from rlhfuse.trainer.trainer import RLHFTrainer as trainer_class

    assert FusedPipelineStrategy is part and RLHFTrainer is trainer_class
    import rlhfuse.trainer.validate as module_or_function

    assert callable(validate) and module_or_function is validate  # the function, as when imported eagerly
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        rlhfuse.trainer.nothing  # noqa: B018


def test_user_errors_cover_the_errors_it_does_not_import():
    """The command line's one-line errors (exit status 2) name the ValueError subclasses by their base."""
    from rlhfuse.data import DatasetError
    from rlhfuse.models import CheckpointError

    assert issubclass(DatasetError, USER_ERRORS) and issubclass(CheckpointError, USER_ERRORS)
