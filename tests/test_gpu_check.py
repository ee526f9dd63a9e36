"""`make gpu-check`'s row logic on the CPU (benchmarks/gpu_check.py): the rows are functions of (device, backend)
that size themselves by the device, so the dry run (`make gpu-check-dry`) runs every row's code here (the 2-rank
rows on gloo, the GQA row on the CPU's attention kernels) and fails when a row's call no longer matches the code
it calls; the performance rows hold their targets; the quick tier fits 10 minutes; a missing core dependency is
a FAIL and a missing extra a SKIP; a row past its limit is killed and fails; the JSON figures file; the exit
status. The CUDA-only parts skip themselves by device."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:  # benchmarks/ is a folder of the repository, not of the installed package
    sys.path.append(REPO)

import benchmarks.gpu_check as gpu_check  # noqa: E402

CPU = torch.device("cpu")


# The rows a CPU cannot run, and why: the dry run's only SKIPs (vLLM's CPU build runs under `make test-vllm`; the
# real checkpoint where `make real-model` has converted it).
CUDA_ONLY = {
    "flash backend": ("flash-attn not installed", "flash-attn kernels run on CUDA only"),
    "te backend": ("transformer-engine not installed", "transformer-engine kernels run on CUDA only"),
    "fsdp cpu_offload": (f"CUDA only: {gpu_check.CPU_OFFLOAD_NEEDS_CUDA}",),
    "vllm": ("vllm not installed",),
    "real checkpoint": (gpu_check.real_model_missing(),),
}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_the_dry_run_runs_every_rows_code_on_the_cpu_and_passes(tmp_path: Path) -> None:
    """`make gpu-check-dry`: every row's code, in one process on the CPU, the same table; every row PASSes but
    those that need CUDA-only things, which SKIP saying why. Then the figures of some rows: PipelineStrategy on
    2 gloo ranks equals PlainStrategy step by step; the decode row times every batch size."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(tmp_path / "dry.json")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=380,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    print(done.stdout, f"dry run: {seconds:.0f} s", sep="\n")
    rows = {r["check"]: r for r in json.loads((tmp_path / "dry.json").read_text())["rows"]}
    assert list(rows) == list(gpu_check.CHECKS)
    failed = {name: r["detail"] for name, r in rows.items() if r["status"] == "FAIL"}
    assert not failed and done.returncode == 0, (failed, done.stderr[-3000:])
    skipped = {name: r["detail"] for name, r in rows.items() if r["status"] == "SKIP"}
    assert set(skipped) <= set(CUDA_ONLY), skipped
    assert all(skipped[name] in CUDA_ONLY[name] for name in skipped), skipped
    for name in gpu_check.CHECKS:
        assert f"\n{name} " in "\n" + done.stdout, f"{name} missing from the table"
    train = rows["pp=2 train step"]
    assert "fused pp=2 = PlainStrategy for 3 steps" in train["detail"]
    assert train["figures"]["train_tokens_per_s"] > 0 and train["figures"]["train_tokens_per_step"] > 0
    gqa = rows["gqa attention"]["detail"]
    assert "4 q / 2 kv heads" in gqa and "unmasked" in gqa and "padded" in gqa
    decode = rows["engine decode"]["figures"]
    steps = decode["decode_step_ms"]
    assert list(steps) == ["1", "4"] and all(ms > 0 for ms in steps.values()), steps
    assert decode["decode_tokens_per_s"] > 0 and decode["prefill_tokens_per_s"] > 0
    assert rows["pp=2 inference"]["status"] == "PASS"  # it called the inferencers with a removed argument
    assert "fused pp=3 = PlainStrategy for 2 steps" in rows["pp=3 train step"]["detail"]
    fused_job = rows["fused job"]["detail"]
    assert "pipeline=fused on 2 ranks" in fused_job and "train/bubble_ratio" in fused_job, fused_job
    real = rows["real checkpoint"]  # a SKIP where `make real-model` has not run
    assert real["status"] == "SKIP" or "4 greedy tokens, fp32 engine vs trainer" in real["detail"], real


def test_a_row_whose_call_no_longer_matches_the_code_fails_the_dry_run(monkeypatch: Any, capsys: Any) -> None:
    """A keyword the engine no longer takes (as `reward_fn` once broke the pp=2 inference row): the dry run's
    table shows the row's FAIL with the TypeError, and it exits 1."""
    from rlhfuse.generation import GenerationEngine

    original = GenerationEngine.__init__

    def renamed(self: Any, model: Any, params: Any, *, slots: int, max_len: int) -> None:
        original(self, model, params, num_slots=slots, max_len=max_len)

    monkeypatch.setattr(GenerationEngine, "__init__", renamed)
    assert gpu_check.main(["--dry-run", "engine decode", "gqa attention"]) == 1
    lines = {line.split("  ")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "FAIL  TypeError:" in lines["engine decode"], lines
    assert "unexpected keyword argument 'num_slots'" in lines["engine decode"]
    assert "  PASS  " in lines["gqa attention"]


def test_the_performance_rows_hold_their_targets(monkeypatch: Any) -> None:
    """A decode step reading the device more than the target, tokens/s below the floor, a KV pool past its
    fraction: each a FAIL naming the figure and the target (the decode-syncs row passed on any count >= 1)."""
    cpu = gpu_check.TARGETS["cpu"]
    strict = dataclasses.replace(
        cpu, decode_syncs_per_step=0.5, decode_tokens_per_s=1e12, kv_pool_fraction=0.5
    )  # fmt: skip
    monkeypatch.setitem(gpu_check.TARGETS, "cpu", strict)
    syncs = gpu_check.run_row("decode syncs", CPU, "gloo")
    assert syncs.status == "FAIL" and "(target <= 0.5" in syncs.detail, syncs
    decode = gpu_check.run_row("engine decode", CPU, "gloo")
    assert decode.status == "FAIL", decode
    assert "tokens/s at bs 4 (target >= 1,000,000,000,000)" in decode.detail
    assert "KV pool allocated / most in use 1.00 (target <= 0.5)" in decode.detail
    monkeypatch.setitem(gpu_check.TARGETS, "cpu", cpu)
    assert gpu_check.run_row("decode syncs", CPU, "gloo").status == "PASS"


def test_the_quick_tier_fits_ten_minutes_and_a_tier_has_time_for_every_row() -> None:
    quick, full = gpu_check.tier_rows("quick"), gpu_check.tier_rows("full")
    assert full == list(gpu_check.CHECKS) and set(quick) < set(full)
    assert gpu_check.budget_for(quick) <= gpu_check.QUICK_TIER_S <= 540, gpu_check.budget_for(quick)
    for names in (quick, full):  # the budget is the rows' limits: none is left "not run"
        assert gpu_check.budget_for(names) >= sum(gpu_check.CHECKS[n].limit_s for n in names)
    with pytest.raises(ValueError, match="unknown tier 'slow'"):
        gpu_check.tier_rows("slow")


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_rank_that_fails_is_reported_by_rank_not_waited_for() -> None:
    """NCCL on the CPU (no NCCL in this build, or CUDA where the ranks expect the CPU): both ranks fail at
    start-up; the row says so per rank at once instead of waiting for its timeout."""
    row = gpu_check.run_row("nccl 2 ranks", CPU, "nccl")
    assert row.status == "FAIL" and "rank 0: " in row.detail and "rank 1: " in row.detail, row
    assert row.seconds < 40, row.seconds


def test_ranks_sharing_a_gpu_that_nccl_refuses_skip_and_ranks_on_their_own_gpus_fail() -> None:
    """pp=3 and the fused job share the GPU: where this NCCL refuses that ("Duplicate GPU detected"), the row
    SKIPs saying so (the quick tier's 2-rank rows FAIL on the same cause); with a GPU per rank it is a FAIL."""

    def refused() -> gpu_check.Outcome:
        raise gpu_check.NcclRefused("NCCL refused 3 ranks on a GPU: Duplicate GPU detected : rank 1 and 0")

    with pytest.raises(gpu_check.Skip, match=r"3 ranks on 1 GPU\(s\), refused: NCCL refused 3 ranks"):
        gpu_check.on_shared_gpu(refused, world=3, gpus=1)
    with pytest.raises(gpu_check.NcclRefused):
        gpu_check.on_shared_gpu(refused, world=3, gpus=4)


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
