"""The Makefile's targets and the Triton interpreter: the test targets and gpu-check's dry run (the kernels on
the CPU) set TRITON_INTERPRET=1, the run targets (train, bench, gpu-check) do not, so on a GPU the kernels run
compiled. Checked by running make with stand-in
virtual environments whose tools print the variable they see."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("pytest", "rlhfuse-train", "python", "ruff", "mypy")


def _venv(folder: Path) -> Path:
    (folder / "bin").mkdir(parents=True)
    for tool in TOOLS:
        script = folder / "bin" / tool
        script.write_text(f'#!/bin/sh\necho "{tool} TRITON_INTERPRET=${{TRITON_INTERPRET-unset}}"\n')
        script.chmod(0o755)
    (folder / ".rlhfuse-installed").touch()  # newer than pyproject.toml and the Makefile: nothing to install
    return folder


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
@pytest.mark.parametrize(
    "target, expected",
    [
        ("test", {"ruff TRITON_INTERPRET=1", "mypy TRITON_INTERPRET=1", "pytest TRITON_INTERPRET=1"}),
        ("pytest", {"pytest TRITON_INTERPRET=1"}),
        ("test-vllm", {"pytest TRITON_INTERPRET=1"}),
        ("train", {"rlhfuse-train TRITON_INTERPRET=unset"}),
        ("bench", {"python TRITON_INTERPRET=unset"}),
        ("gpu-check", {"python TRITON_INTERPRET=0"}),
        ("gpu-check-dry", {"python TRITON_INTERPRET=1"}),
    ],
)
def test_only_the_test_targets_interpret_the_triton_kernels(tmp_path, target, expected) -> None:
    venv, vllm = _venv(tmp_path / "venv"), _venv(tmp_path / "venv-vllm")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MAKEFLAGS", "MAKELEVEL")}
    result = subprocess.run(
        ["make", "-s", "--no-print-directory", "-C", str(ROOT), target, f"VENV={venv}", f"VLLM_VENV={vllm}",
         f"GPU_PYTHON={venv}/bin/python"],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert set(result.stdout.split("\n")) - {""} == expected, result.stdout + result.stderr
