"""`rlhfuse-train pipeline=fused distributed.nproc_per_node=2`: Fabric launches 2 processes, rank 0 logs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhfuse.models import from_pretrained
from rlhfuse.trainer import compose_config, validate

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(240)
def test_fused_pipeline_trains_with_two_processes(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("rlhfuse-train")
    run_dir = tmp_path / "run"
    cmd = [
        str(exe),
        "experiment=smoke",
        "model.num_layers=2",
        "pipeline=fused",
        "pipeline.microbatches=2",
        "pipeline.search_budget_s=0.5",
        "distributed.nproc_per_node=2",
        "distributed.timeout_s=60",
        "checkpoint.export_hf=true",  # the sharded Actor is exported from the generation copy
        f"model.warmstart.cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "Starting with 2 processes" in out
    assert "actor: 1 x pp=2 on [[0, 1]]; critic: 1 x pp=2 on [[1, 0]]" in out
    # inference runs over the same layout (Ref placed like the Actor, Reward like the Critic)
    assert "inference over the pipeline layout: actor on [[0, 1]]; ref on [[0, 1]]; critic on [[1, 0]]" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]  # rank 0 alone writes the metrics
    for r in rows:
        for key in (
            "train/predicted_makespan_s",
            "train/measured_makespan_s",
            "train/bubble_ratio",
            "loss/value",
        ):
            assert math.isfinite(r[key]) and r[key] >= 0 if key != "loss/value" else math.isfinite(r[key])
        assert 0 <= r["train/bubble_ratio"] < 1
        # sharded construction: each rank holds its stages + the generation copy; the sync moves one stage
        assert r["memory/param_bytes"] > 0 and r["memory/optimizer_bytes"] > 0
        assert r["weight_sync/bytes_per_rank"] > 0 and r["time/weight_sync"] >= 0
    exported = from_pretrained(run_dir / "actor_hf")  # whole (no meta tensor) and trained (not the start)
    start = from_pretrained(next((tmp_path / "cache").glob("*/sft")), head="lm")
    assert not any(p.is_meta for p in exported.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(exported.parameters(), start.parameters(), strict=True))


def test_pipeline_config_errors_name_the_fix() -> None:
    cfg = compose_config(["pipeline=fused", "distributed.nproc_per_node=3", "checkpoint.every=5"])
    with pytest.raises(ValueError) as err:
        validate(cfg)
    msg = str(err.value)
    assert "actor.pp * dp = 2 * 1 = 2 != world size 3" in msg
    assert "checkpoint" not in msg  # pipeline strategies write sharded checkpoints (test_runtime_checkpoint)
    cfg = compose_config(["distributed.nproc_per_node=2"])
    with pytest.raises(ValueError, match="pipeline=plain runs in one process"):
        validate(cfg)
    cfg = compose_config(["pipeline=serial_1f1b", "distributed.nproc_per_node=2", "pipeline.actor_pp=4"])
    with pytest.raises(ValueError, match=r"pipeline.actor_pp=4 exceeds model.num_layers=2"):
        validate(cfg)
    validate(compose_config(["pipeline=fused", "distributed.nproc_per_node=2"]))
