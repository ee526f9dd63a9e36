"""exact=true (issue 44): one key that makes every model's forward batch-invariant (model.attention_backend=exact,
`rlhfuse.models.exact`), checked before anything is built; then a run whose tail migrates between two generation
instances, with inference fused into the tail, trains the same parameters, bit for bit, as the serial run, and
logs no sampler-trainer mismatch at all. The negative twin (exact=false) ends with other parameters."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhfuse.trainer import compose_config, validate
from rlhfuse.trainer.run_config import resolve_components


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(ValueError) as err:
        validate(resolve_components(compose_config(list(overrides)), log=lambda _: None))
    return [line.removeprefix("  - ") for line in str(err.value).splitlines()[1:]]


def test_exact_true_computes_with_the_exact_backend_and_says_so():
    lines: list[str] = []
    cfg = resolve_components(compose_config(["exact=true", "device=cpu"]), log=lines.append)
    assert cfg.exact and cfg.model.attention_backend == "exact"
    assert any("model.attention_backend=sdpa -> exact" in line for line in lines), lines
    validate(cfg)
    assert compose_config([]).exact is False


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.attention_backend=te"], "exact=true computes attention with model.attention_backend=exact"),
        (["model.lora.rank=4"], "exact=true with model.lora"),
        (["generator=vllm"], "exact=true with generator=vllm uses vLLM's batch-invariant mode"),
        (["pipeline=fused", "distributed.nproc_per_node=2", "pipeline.actor_tp=2"],
         "exact=true with pipeline.actor_tp=2"),
    ],
)  # fmt: skip
def test_what_exact_cannot_keep_is_refused_naming_the_key(overrides: list[str], message: str) -> None:
    problems = _problems("exact=true", "device=cpu", *overrides)
    assert any(p.startswith(message) and "exact=false" in p for p in problems), problems


def _run(tmp_path: Path, name: str, *overrides: str) -> tuple[str, list[dict[str, float]]]:
    exe = Path(sys.executable).with_name("rlhfuse-train")
    run = tmp_path / name
    done = subprocess.run(
        [str(exe), "experiment=smoke", "iterations=4", "generator=engine", "generator.instances=2",
         "generator.stop_token_ids=[10,20,30,40,50]",  # responses end at spread lengths: a tail to migrate
         "checkpoint.export_hf=true", f"model.warmstart.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}",
         *overrides],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    digest = hashlib.sha256((run / "actor_hf" / "model.safetensors").read_bytes()).hexdigest()
    return digest, [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_a_migrating_fused_run_trains_the_serial_runs_parameters_bit_for_bit(tmp_path: Path) -> None:
    fused = ("migration=fixed", "migration.threshold=5")
    serial = ("migration=off",)
    exact_fused, rows = _run(tmp_path, "exact-fused", "exact=true", *fused)
    exact_serial, serial_rows = _run(tmp_path, "exact-serial", "exact=true", *serial)
    assert exact_fused == exact_serial
    for row in rows + serial_rows:  # the sampler's log-probs are the trainer's, bit for bit
        assert row["rollout/logprob_abs_diff_max"] == 0.0 and row["rollout/mismatch_kl"] == 0.0
    # the twin: without exact=true, the fused rollout's batches round differently and the parameters drift
    plain_fused, plain_rows = _run(tmp_path, "plain-fused", *fused)
    plain_serial, _ = _run(tmp_path, "plain-serial", *serial)
    assert plain_fused != plain_serial
    assert all(row["rollout/logprob_abs_diff_max"] > 0 for row in plain_rows)
