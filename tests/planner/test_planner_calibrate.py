"""`rlhfuse-plan calibrate --from gpu_check.json`: a GPU's achieved-rate factors fitted to make gpu-check's
figures, written as a device file that `--device FILE` and `plan_device=FILE` (plan=auto) price plans with.

The synthetic file is written by the cost model itself with known factors on H200 peaks (what a GPU with those
factors would measure), so the fit must give them back; and the real file of gpu_check's CPU rows is read."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from rlhfuse.planner.calibrate import GpuFigures, calibrate_from
from rlhfuse.planner.cost import CostModel
from rlhfuse.planner.plan_command import main
from rlhfuse.planner.specs import (
    DEFAULT_EFFICIENCY,
    H200,
    ClusterSpec,
    DeviceProfile,
    Efficiency,
    ModelSpec,
    device_profile,
)

TRUE = dataclasses.replace(
    DEFAULT_EFFICIENCY, decode_mbu=0.42, decode_step_overhead=3.1e-3, prefill_mfu=0.31, train_mfu=0.12
)
DECODE = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_layers": 8, "num_heads": 16,
          "num_kv_heads": 4, "head_dim": 64}  # fmt: skip
TRAIN = {"vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536, "num_layers": 4, "num_heads": 8,
         "num_kv_heads": 2, "head_dim": 64}  # fmt: skip


def _spec(shape: dict[str, int]) -> ModelSpec:
    return ModelSpec("m", shape["num_layers"], shape["hidden_size"], shape["num_heads"], shape["intermediate_size"],
                     shape["vocab_size"], shape["num_kv_heads"], shape["head_dim"])  # fmt: skip


def synthetic_figures(eff: Efficiency = TRUE) -> dict[str, Any]:
    """What make gpu-check would write on an H200 that achieves `eff`."""
    cost = CostModel(ClusterSpec(H200, 1, 1), eff)
    decode, train = _spec(DECODE), _spec(TRAIN)
    prompt, warm, steps = 64, 2, 32
    context = prompt + warm + (steps - 1) / 2
    step_ms = {str(b): float(cost.decode_step_time(decode, 1, b, b * context)) * 1e3 for b in (1, 8, 32, 128)}
    prefill_s = cost.prefill_time(decode, [512] * 32, 1)
    samples, tokens = 32, 32 * 256
    flops = 3 * (
        cost.forward_flops(train, [256] * samples) + cost.forward_flops(train, [256] * samples, "value")
    )
    train_s = cost.compute_time(flops, 1, eff.train_mfu, tokens)
    return {
        "device": "NVIDIA H200",
        "figures": {
            "decode_step_ms": step_ms,
            "decode_model": {**DECODE, "prompt": prompt, "warm_steps": warm, "steps": steps, "dtype": "bf16"},
            "prefill_batch": [32, 512],
            "prefill_tokens_per_s": 32 * 512 / prefill_s,
            "train_model": TRAIN,
            "train_samples": samples,
            "train_tokens_per_step": tokens,
            "train_step_s": train_s,
            "train_devices": 1,
            "allreduce_busbw_GBps": {"1": 1.5, "16": 2.5},
            "allreduce_transport": "loopback",
        },
    }


@pytest.fixture
def figures_file(tmp_path: Path) -> Path:
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(synthetic_figures()))
    return path


def test_the_fit_gives_back_the_factors_the_measurements_came_from(figures_file: Path) -> None:
    cal = calibrate_from(figures_file)
    eff = cal.profile.eff
    assert cal.preset == "h200" and "matches H200" in cal.preset_reason
    assert eff.decode_mbu == pytest.approx(TRUE.decode_mbu, rel=0.02)
    assert eff.decode_step_overhead == pytest.approx(TRUE.decode_step_overhead, rel=0.02)
    assert eff.prefill_mfu == pytest.approx(TRUE.prefill_mfu, rel=1e-6)
    assert eff.train_mfu == pytest.approx(TRUE.train_mfu, rel=1e-6)
    assert eff.link_eff == DEFAULT_EFFICIENCY.link_eff  # measured over loopback: not an NVLink figure
    assert max(abs(r.error) for r in cal.rows) < 0.02, cal.report()
    report = cal.report()
    assert "decode step bs 128" in report and "loopback" in report and "pipeline bubble" in report
    # the peaks stay the datasheet's; only the factors are fitted
    assert cal.profile.device.peak_flops == H200.peak_flops and cal.profile.device.hbm_bw == H200.hbm_bw


def test_a_slower_gpu_fits_lower_factors_and_the_preset_can_be_named(tmp_path: Path) -> None:
    slow = dataclasses.replace(TRUE, decode_mbu=0.2, decode_step_overhead=8e-3, prefill_mfu=0.15)
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(synthetic_figures(slow)))
    cal = calibrate_from(path, preset="h200")
    assert cal.profile.eff.decode_mbu == pytest.approx(0.2, rel=0.02)
    assert cal.profile.eff.decode_step_overhead == pytest.approx(8e-3, rel=0.02)
    assert cal.profile.eff.prefill_mfu == pytest.approx(0.15, rel=1e-6)


def test_the_device_file_round_trips_and_bad_files_name_the_file_and_key(
    tmp_path: Path, figures_file: Path
) -> None:
    profile = calibrate_from(figures_file).profile
    path = profile.save(tmp_path / "h200.json")
    assert DeviceProfile.load(path) == profile == device_profile(str(path))
    assert device_profile("h100").source == "preset"
    data = json.loads(path.read_text())
    data["efficiency"]["decode_mbu"] = 1.5
    del data["device"]["hbm_bw"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"bad.json: device: missing keys \['hbm_bw'\]"):
        DeviceProfile.load(bad)
    data["device"]["hbm_bw"] = 4.8e12
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"bad.json: efficiency.decode_mbu=1.5 must be in \(0, 1\]"):
        DeviceProfile.load(bad)
    with pytest.raises(ValueError, match=r"is not a device file .* `rlhfuse-plan calibrate --from"):
        DeviceProfile.from_dict({"device": {}}, "x.json")
    with pytest.raises(ValueError, match="does not exist"):
        device_profile(str(tmp_path / "none.json"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda f: f.pop("decode_step_ms"), "figures.decode_step_ms .* is missing: rerun `make gpu-check`"),
        (lambda f: f["decode_model"].pop("num_kv_heads"), "figures.decode_model must give the model's"),
        (lambda f: f.update(train_step_s=0), r"figures.train_step_s=0 must be a positive number"),
        (lambda f: f.pop("prefill_batch"), r"figures.prefill_batch \[batch, length\]"),
    ],
)
def test_a_figures_file_without_a_figure_names_it_and_the_fix(
    tmp_path: Path, edit: Any, message: str
) -> None:
    data = synthetic_figures()
    edit(data["figures"])
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        GpuFigures.load(path)


def test_cli_writes_the_device_file_and_plan_prices_with_it(
    tmp_path: Path, figures_file: Path, capsys: Any
) -> None:
    out = tmp_path / "h200-calibrated.json"
    assert main(["calibrate", "--from", str(figures_file), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "decode_mbu" in printed
    common = ["plan", "--nodes", "1", "--actor", "7b", "--critic", "7b", "--max-len", "256",
              "--global-batch", "64", "--mini-batch", "32"]  # fmt: skip
    assert main([*common, "--device", "h200", "--json", str(tmp_path / "preset.json")]) == 0
    assert main([*common, "--device", str(out), "--json", str(tmp_path / "fitted.json")]) == 0
    preset = json.loads((tmp_path / "preset.json").read_text())
    fitted = json.loads((tmp_path / "fitted.json").read_text())
    # the fitted GPU decodes and trains slower than the preset assumes: both systems' iterations take longer
    for system in ("plan", "base_plan"):
        assert fitted[system]["breakdown_s"]["total"] > preset[system]["breakdown_s"]["total"], system
    assert main(["calibrate", "--from", str(tmp_path / "none.json")]) == 2
    assert "does not exist: write it with `make gpu-check`" in capsys.readouterr().err


def test_the_cpu_rows_of_gpu_check_write_a_file_calibrate_reads(tmp_path: Path) -> None:
    """The figures gpu_check really writes (its decode row on the CPU, a train row's keys) are what the fit reads."""
    import sys

    repo = str(Path(__file__).resolve().parents[2])
    if repo not in sys.path:
        sys.path.append(repo)
    import benchmarks.gpu_check as gpu_check
    import torch

    decode = gpu_check.run_row("engine decode", torch.device("cpu"), "gloo")
    assert decode.status == "PASS", decode
    train = synthetic_figures()["figures"]
    keys = ("train_model", "train_samples", "train_tokens_per_step", "train_step_s", "train_devices")
    rows = [decode, gpu_check.Row("pp=2 train step", "PASS", "ok", 1.0, {k: train[k] for k in keys})]
    path = tmp_path / "gpu_check.json"
    gpu_check.write_json(path, rows, torch.device("cpu"))
    cal = calibrate_from(path, preset="h100")
    assert [r.phase for r in cal.rows][:2] == ["decode step bs 1", "decode step bs 4"]
    assert "no all-reduce figure" in cal.report()
