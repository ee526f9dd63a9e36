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
        "pipeline.split_backward=true",  # the zero-bubble F/I/W schedule, executed
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
    assert "fused schedule from measured stage times (2 micro-batches), F/I/W (split backward)" in out
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


@pytest.mark.timeout(300)
def test_pp2_tp2_generator_tp2_trains_with_four_processes(tmp_path: Path) -> None:
    """The issue's command shape on the smoke job: pp=2 x tp=2 on 4 ranks with generation instances of 2 ranks;
    the Actor exported from the tp-shard generation copies is whole and trained."""
    exe = Path(sys.executable).with_name("rlhfuse-train")
    run_dir = tmp_path / "run"
    cmd = [
        str(exe), "experiment=smoke", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=2",
        "pipeline=fused", "distributed.nproc_per_node=4", "pipeline.actor_tp=2", "pipeline.critic_tp=2",
        "generator.tp=2", "iterations=1", "distributed.timeout_s=60", "checkpoint.export_hf=true",
        f"model.warmstart.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 ranks = 1 fused group(s) x 2 pipeline ranks x tp=2" in proc.stdout + proc.stderr
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert row["memory/param_bytes"] > 0 and row["weight_sync/bytes_per_rank"] > 0
    assert math.isfinite(row["loss/policy"]) and math.isfinite(row["loss/value"])
    exported = from_pretrained(run_dir / "actor_hf")
    start = from_pretrained(next((tmp_path / "cache").glob("*/sft")), head="lm")
    assert exported.lm_head.weight.shape == start.lm_head.weight.shape  # whole, padding dropped
    assert not any(p.is_meta for p in exported.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(exported.parameters(), start.parameters(), strict=True))


@pytest.mark.timeout(240)
def test_generator_tp2_over_training_tp1_trains_with_two_processes(tmp_path: Path) -> None:
    """generator.tp=2 with pipeline.actor_tp=1 (pp=2 on 2 ranks): one generation instance over both ranks,
    sampling vocabulary-parallel with top-k and top-p, its shards resharded from the training stages after each
    update; the exported Actor is whole and trained."""
    exe = Path(sys.executable).with_name("rlhfuse-train")
    run_dir = tmp_path / "run"
    cmd = [
        str(exe), "experiment=smoke", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=2",
        "pipeline=fused", "distributed.nproc_per_node=2", "generator.tp=2", "generator.top_k=20", "generator.top_p=0.9", "iterations=2", "distributed.timeout_s=60",
        "checkpoint.export_hf=true", f"model.warmstart.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss/policy"]) and math.isfinite(r["loss/value"])
        assert r["weight_sync/bytes_per_rank"] > 0 and r["time/weight_sync"] >= 0
    exported = from_pretrained(run_dir / "actor_hf")
    start = from_pretrained(next((tmp_path / "cache").glob("*/sft")), head="lm")
    # each rank received its tp shard (half) of the stage it lacks, about a quarter of the Actor (a whole
    # generation copy would take the whole stage, about half)
    whole = sum(t.numel() * t.element_size() for t in start.state_dict().values())
    assert rows[0]["weight_sync/bytes_per_rank"] < 0.35 * whole, (
        rows[0]["weight_sync/bytes_per_rank"],
        whole,
    )
    assert not any(p.is_meta for p in exported.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(exported.parameters(), start.parameters(), strict=True))


def test_pipeline_config_errors_name_the_fix() -> None:
    cfg = compose_config(["pipeline=fused", "distributed.nproc_per_node=3", "checkpoint.every=5"])
    with pytest.raises(ValueError) as err:
        validate(cfg)
    msg = str(err.value)
    assert "actor.pp * tp * dp = 2 * 1 * 1 = 2 != world size 3" in msg
    assert "checkpoint" not in msg  # pipeline strategies write sharded checkpoints (test_runtime_checkpoint)
    cfg = compose_config(["distributed.nproc_per_node=2"])
    with pytest.raises(ValueError, match="pipeline=plain runs in one process"):
        validate(cfg)
    cfg = compose_config(["pipeline=serial_1f1b", "distributed.nproc_per_node=2", "pipeline.actor_pp=4"])
    with pytest.raises(ValueError, match=r"pipeline.actor_pp=4 exceeds model.num_layers=2"):
        validate(cfg)
    validate(compose_config(["pipeline=fused", "distributed.nproc_per_node=2"]))
    cfg = compose_config(["pipeline=fused", "distributed.nproc_per_node=2", "pipeline.split_backward=maybe"])
    with pytest.raises(ValueError, match=r"pipeline.split_backward='maybe' is not one of auto, true, false"):
        validate(cfg)
    assert (
        compose_config(["pipeline=fused", "pipeline.split_backward=false"]).pipeline.split_backward is False
    )


def test_tensor_parallel_config_errors_list_every_problem() -> None:
    """pipeline.actor_tp / critic_tp / generator.tp: every problem in one error, each with its arithmetic and
    key, before any model is built; a valid pp=2 x tp=2 layout on 4 ranks passes."""
    cfg = compose_config(
        [
            "pipeline=fused",
            "distributed.nproc_per_node=6",
            "pipeline.actor_tp=3",
            "pipeline.critic_tp=2",
            "generator.tp=4",
            "model.intermediate_size=190",
        ]
    )
    with pytest.raises(ValueError) as err:
        validate(cfg)
    msg = str(err.value)
    # the model: 2 heads, 2 kv heads, intermediate 190
    assert "pipeline.actor_tp=3 does not divide the model's num_heads=2 (2 % 3 = 2)" in msg
    assert "pipeline.actor_tp=3 neither divides the model's num_kv_heads=2" in msg
    assert "pipeline.actor_tp=3 does not divide the model's intermediate_size=190 (190 % 3 = 1)" in msg
    assert "pipeline.critic_tp=2 does not divide the model's intermediate_size=190 (190 % 2 = 0)" not in msg
    assert "critic.tp=2 must divide actor.tp=3" in msg and "set critic.tp to one of [1, 3]" in msg
    assert "actor.pp * tp * dp = 2 * 3 * 1 = 6" not in msg  # 6 ranks = 2 stages x tp 3: the world fits
    assert "generator.tp=4 does not divide the world size 6 (6 % 4 = 2" in msg
    assert "generator.tp=4 != pipeline.actor_tp" not in msg  # any generation tp is resharded to
    cfg = compose_config(["pipeline=fused", "distributed.nproc_per_node=6", "pipeline.actor_tp=2"])
    cfg.pipeline.critic_tp = 2
    with pytest.raises(ValueError, match=r"actor.pp \* tp \* dp = 2 \* 2 \* 1 = 4 != world size 6"):
        validate(cfg)
    with pytest.raises(ValueError, match=r"pipeline.actor_tp=2 splits the model over ranks"):
        validate(compose_config(["pipeline.actor_tp=2"]))
    from rlhfuse.trainer.run_config import resolve_components

    tp2 = ["pipeline=fused", "distributed.nproc_per_node=4", "pipeline.actor_tp=2", "pipeline.critic_tp=2"]
    validate(resolve_components(compose_config(tp2), log=lambda _: None))
    # each rank a generation instance inferring its own samples needs whole models
    per_rank = resolve_components(
        compose_config([*tp2, "generator=engine", "generator.instances=4"]), log=lambda _: None
    )
    with pytest.raises(ValueError, match=r"inferencer=models .* needs whole models on every rank"):
        validate(per_rank)


def test_generation_tp_rules_name_the_layout_each_generator_can_run() -> None:
    """generator.tp > 1: vLLM's engines span generator.tp ranks of instances x tp processes (migration and the
    fused rollout between them); the engine generator has no tensor-parallel instances; a plain job's process
    count follows instances x tp. Each problem names the key and the fix."""

    def problems(*overrides: str) -> str:
        try:
            validate(compose_config(list(overrides)))
        except ValueError as err:
            return str(err)
        return ""

    vllm_tp = ["generator=vllm", "generator.tp=2"]
    assert "generator.tp" not in problems(*vllm_tp, "generator.instances=2", "migration=fixed")
    assert "generator.tp=2 does not divide" not in problems(*vllm_tp) and "with generator.tp" not in problems(
        *vllm_tp
    )
    launch = problems(*vllm_tp, "distributed.nproc_per_node=4")
    assert (
        "generator.instances=1 x generator.tp=2 (4 != 2)" in launch and "set generator.instances=2" in launch
    )
    pipelines = problems(*vllm_tp, "pipeline=serial_1f1b", "distributed.nproc_per_node=4")
    assert "the job needs 2 processes but has 4: set distributed.nproc_per_node=2" in pipelines
    engine = problems("generator=engine", "generator.instances=2", "generator.tp=2")
    assert (
        "generator=engine's instances are one rank each" in engine
        and "generator=vllm or generator.tp=1" in engine
    )
    from rlhfuse.trainer.topology import topology

    layout = topology(compose_config([*vllm_tp, "generator.instances=2"]))
    assert (layout.world, layout.instances, layout.weight_shards, layout.fused_rollout) == (4, 2, 1, True)
    sampling = topology(compose_config(["pipeline=fused", "distributed.nproc_per_node=4", "generator.tp=2"]))
    assert (sampling.instances, sampling.weight_shards) == (2, 2)
