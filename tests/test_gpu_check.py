"""`make gpu-check`'s row logic on the CPU (benchmarks/gpu_check.py): the rows are functions of (device, backend)
that size themselves by the device, so the 2-rank pp=2 step runs here on gloo and the GQA row on the CPU's
attention kernels; a missing core dependency is a FAIL and a missing extra a SKIP; a row past its limit is
killed and fails; the JSON figures file; the exit status. The CUDA-only parts skip themselves by device."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:  # benchmarks/ is a folder of the repository, not of the installed package
    sys.path.append(REPO)

import benchmarks.gpu_check as gpu_check  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_the_pp2_train_step_row_runs_on_two_gloo_ranks() -> None:
    """PipelineStrategy on 2 spawned ranks equals PlainStrategy step by step (the row's own assertions)."""
    row = gpu_check.run_row("pp=2 train step", CPU, "gloo")
    assert row.status == "PASS", row
    assert "fused pp=2 = PlainStrategy for 3 steps" in row.detail
    assert row.figures["train_tokens_per_s"] > 0 and row.figures["train_tokens_per_step"] > 0


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_rank_that_fails_is_reported_by_rank_not_waited_for() -> None:
    """NCCL on the CPU (no NCCL in this build, or CUDA where the ranks expect the CPU): both ranks fail at
    start-up; the row says so per rank at once instead of waiting for its timeout."""
    row = gpu_check.run_row("nccl 2 ranks", CPU, "nccl")
    assert row.status == "FAIL" and "rank 0: " in row.detail and "rank 1: " in row.detail, row
    assert row.seconds < 40, row.seconds


def test_the_gqa_row_runs_the_non_math_kernels_of_the_cpu() -> None:
    row = gpu_check.run_row("gqa attention", CPU, "gloo")
    assert row.status == "PASS", row
    assert "4 q / 2 kv heads" in row.detail and "unmasked" in row.detail and "padded" in row.detail


def test_a_missing_core_dependency_fails_and_a_missing_extra_skips(monkeypatch: Any) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.setitem(sys.modules, "hydra", None)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "rlhfuse.core.syncs", None)
    rows = {r.check: r for r in gpu_check.run_checks(CPU, ["dependencies", "logprobs kernel", "gae kernel",
                                                          "offload", "flash backend", "decode syncs"])}  # fmt: skip
    deps = rows["dependencies"]
    assert deps.status == "FAIL" and "triton" in deps.detail and "hydra-core" in deps.detail, deps
    assert "flash-attn not installed" not in deps.detail  # extras are not dependencies
    for name in ("logprobs kernel", "gae kernel"):
        assert rows[name].status == "FAIL" and "triton is not installed" in rows[name].detail, rows[name]
    assert rows["offload"].status == "FAIL" and "hydra-core is not installed" in rows["offload"].detail
    assert (
        rows["flash backend"].status == "SKIP" and rows["flash backend"].detail == "flash-attn not installed"
    )
    decode = rows["decode syncs"]
    assert decode.status == "FAIL" and "rlhfuse.core.syncs.SyncCounter is missing" in decode.detail, decode


def test_the_engine_decode_row_times_every_batch_size() -> None:
    row = gpu_check.run_row("engine decode", CPU, "gloo")
    assert row.status == "PASS", row
    steps = row.figures["decode_step_ms"]
    assert list(steps) == ["1", "4"] and all(ms > 0 for ms in steps.values()), steps
    assert row.figures["decode_tokens_per_s"] > 0 and row.figures["prefill_tokens_per_s"] > 0


def test_dependencies_list_the_extras_when_the_core_is_there() -> None:
    row = gpu_check.run_row("dependencies", CPU, "gloo")
    assert row.status == "PASS", row
    assert f"torch {torch.__version__}" in row.detail and "triton" in row.detail and "extras:" in row.detail


@pytest.mark.timeout(120)
def test_rows_run_in_their_own_process_and_one_past_its_limit_fails() -> None:
    row = gpu_check.run_isolated("collectives", CPU, "gloo", limit_s=90)
    assert row.status == "PASS" and "backend gloo, device cpu" in row.detail, row
    slow = gpu_check.run_isolated(
        "gqa attention", CPU, "gloo", limit_s=0.5
    )  # torch alone takes longer to import
    assert slow.status == "FAIL" and slow.detail.startswith("timed out after 0 s"), slow


def test_the_json_file_holds_the_passing_rows_figures(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.default_out() == tmp_path / "gpu_check.json"
    monkeypatch.delenv("OUT")
    assert gpu_check.default_out() == Path("gpu_check.json")
    rows = [
        gpu_check.Row("engine decode", "PASS", "ok", 1.0, {"decode_step_ms": {"1": 2.5, "8": 3.0}}),
        gpu_check.Row(
            "nccl 2 ranks", "FAIL", "refused", 2.0, {"allreduce_busbw_GBps": {"1": 9.9}, "log_tail": "x"}
        ),
        gpu_check.Row("flash backend", "SKIP", "flash-attn not installed"),
    ]
    data = gpu_check.write_json(tmp_path / "sub" / "out.json", rows, CPU)
    assert json.loads((tmp_path / "sub" / "out.json").read_text()) == data
    assert data["figures"] == {
        "decode_step_ms": {"1": 2.5, "8": 3.0}
    }  # a failed row's figures are not figures
    assert [(r["check"], r["status"]) for r in data["rows"]] == [
        ("engine decode", "PASS"),
        ("nccl 2 ranks", "FAIL"),
        ("flash backend", "SKIP"),
    ]
    assert data["device"] == "cpu" and data["torch"] == torch.__version__


def test_exit_status_and_the_table(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    # a budget too small for any row: every row is a FAIL saying so, and the check exits 1
    assert gpu_check.main(["--device", "cpu", "--budget-s", "1", "gqa attention", "engine"]) == 1
    out = capsys.readouterr().out
    assert "gqa attention  FAIL  not run: the 1 s budget of the check was spent" in out
    assert json.loads((tmp_path / "gpu_check.json").read_text())["rows"][1]["status"] == "FAIL"
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "no such row"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    assert "nothing was checked" in capsys.readouterr().out
