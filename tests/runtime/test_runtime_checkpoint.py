"""Sharded checkpoints of the pipeline strategies: a resumed `pipeline=fused` run continues bit-identically, a
layout mismatch is refused before any work naming the file, and a rank failing mid-save leaves the previous
checkpoint intact (gloo, 2 processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from runtime_helpers import run_distributed

from rlhfuse.core.checkpoint import list_checkpoints, load_checkpoint
from rlhfuse.core.errors import CheckpointError
from rlhfuse.trainer import compose_config
from rlhfuse.trainer.strategies.pipelines.checkpoint import check_resume, load_sharded, save_sharded

LAYOUT = {"world_size": 2, "dp": 1, "microbatches": 2, "actor": {"pp": 2, "layers": [[0, 1], [1, 2]]}}


def _train(tmp: Path, run: str, *overrides: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("rlhfuse-train")
    cmd = [
        str(exe),
        "experiment=smoke",
        "model.num_layers=2",
        "pipeline=fused",
        "pipeline.microbatches=2",
        "pipeline.search_budget_s=0.5",
        # constant LR: the LR of a step does not depend on the total number of iterations, so a 2-iteration
        # run resumed to 3 must equal a straight 3-iteration run
        "pipeline.lr_schedule=constant",
        "pipeline.warmup_steps=0",
        "distributed.nproc_per_node=2",
        "distributed.timeout_s=60",
        "checkpoint.every=2",
        "checkpoint.export_hf=true",
        f"model.warmstart.cache_dir={tmp / 'cache'}",
        f"hydra.run.dir={tmp / run}",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env, cwd=tmp)


def _deterministic(row: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/", "train/"))}


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_fused_resume_continues_bit_identically_and_refuses_another_layout(tmp_path: Path) -> None:
    straight = _train(tmp_path, "a")
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    first = _train(tmp_path, "b", "iterations=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    ckpt = tmp_path / "b" / "checkpoints" / "iter_00000002"
    assert sorted(p.name for p in ckpt.iterdir()) == ["meta.json", "rank_00000", "rank_00001"]
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["kind"] == "pipeline" and meta["iteration"] == 2
    assert (
        meta["layout"]["actor"] == {"pp": 2, "layers": [[0, 1], [1, 2]]} and meta["layout"]["world_size"] == 2
    )
    resumed = _train(tmp_path, "b", "resume=auto")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "1 iterations this run" in resumed.stdout + resumed.stderr

    rows = {
        run: [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in "ab"
    }
    assert [r["iteration"] for r in rows["b"]] == [1, 2, 3]
    assert [_deterministic(r) for r in rows["b"]] == [_deterministic(r) for r in rows["a"]]
    for rank in (0, 1):  # every rank's stages after iteration 3, and the exported Actor, bit for bit
        name = f"checkpoints/iter_00000003/rank_{rank:05d}/stages.safetensors"
        a = safetensors.torch.load_file(str(tmp_path / "a" / name))
        b = safetensors.torch.load_file(str(tmp_path / "b" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    a = safetensors.torch.load_file(str(tmp_path / "a" / "actor_hf" / "model.safetensors"))
    b = safetensors.torch.load_file(str(tmp_path / "b" / "actor_hf" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], b0) for k, b0 in _sft_weights(tmp_path).items())  # it did train

    # another layout: refused before any process is launched or model built, in one line naming the checkpoint
    # and the key (run.json records the configuration; `check_resume_config`)
    other = _train(tmp_path, "b", "resume=auto", "pipeline.critic_pp=1", "iterations=4")
    out = other.stdout + other.stderr
    assert other.returncode == 2, out[-3000:]
    assert f"{tmp_path / 'b' / 'checkpoints' / 'iter_00000003'}" in out.replace("\n", "")
    assert "pipeline.critic_pp: 2 -> 1" in out
    assert "Starting with 2 processes" not in out
    # the single-process loader names what the folder is and how to resume it
    with pytest.raises(CheckpointError, match="sharded pipeline checkpoint"):
        load_checkpoint(ckpt)


def _sft_weights(tmp: Path) -> dict[str, torch.Tensor]:
    (sft,) = [p for p in (tmp / "cache").rglob("model.safetensors") if "sft" in str(p)]
    return safetensors.torch.load_file(str(sft))


def test_resume_check_names_every_mismatch(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints" / "iter_00000004"
    ckpt.mkdir(parents=True)
    saved = {**LAYOUT, "critic": {"pp": 2, "layers": [[0, 1], [1, 2]]}}
    (ckpt / "meta.json").write_text(json.dumps({"kind": "pipeline", "iteration": 4, "layout": saved}))
    same = compose_config(["pipeline=fused", "distributed.nproc_per_node=2", "model.num_layers=2",
                           "pipeline.microbatches=2", "resume=auto"])  # fmt: skip
    assert check_resume(same.pipeline_run(), same.resume, tmp_path / "checkpoints") == ckpt
    never = compose_config(["pipeline=fused"])
    assert check_resume(never.pipeline_run(), never.resume, tmp_path / "checkpoints") is None  # resume=never
    other = compose_config(["pipeline=fused", "distributed.nproc_per_node=2", "model.num_layers=4",
                            "pipeline.critic_pp=1", "pipeline.microbatches=4", f"resume={ckpt}"])  # fmt: skip
    with pytest.raises(CheckpointError) as err:
        check_resume(other.pipeline_run(), other.resume, tmp_path / "elsewhere")
    msg = str(err.value)
    assert str(ckpt / "meta.json") in msg
    for part in (
        "microbatches: saved 2, this run 4",
        "actor.layers: saved [[0, 1], [1, 2]], this run [[0, 2], [2, 4]]",
        "critic.pp: saved 2, this run 1",
        "resume with distributed.nproc_per_node=2 pipeline.actor_pp=2 pipeline.critic_pp=2",
    ):
        assert part in msg, msg
    (ckpt / "meta.json").write_text(json.dumps({"format": 1, "iteration": 4, "sha256": {}}))
    with pytest.raises(CheckpointError, match="single-process checkpoint"):
        check_resume(same.pipeline_run(), same.resume, tmp_path / "checkpoints")


def _save_worker(rank: int, world: int, root: str) -> None:
    directory = Path(root)
    weights = {"w": torch.full((3,), float(rank))}

    def state(it: int) -> dict[str, object]:
        return {"rank": rank, "it": it, "exp_avg": torch.arange(4.0) + rank}

    save_sharded(directory, 2, weights=weights, state=state(2), layout=LAYOUT, keep=2)
    # a rank that cannot write its shard: every rank raises, the previous checkpoint stays, nothing half-written
    bad = {"w": torch.tensor([float("nan")])} if rank == 1 else weights
    with pytest.raises(CheckpointError, match=r"rank 1 could not save its shard: CheckpointError: refusing"):
        save_sharded(directory, 4, weights=bad, state=state(4), layout=LAYOUT)
    torch.distributed.barrier()
    assert [p.name for p in list_checkpoints(directory)] == ["iter_00000002"]
    assert sorted(p.name for p in directory.iterdir()) == ["iter_00000002"]
    got, st, it = load_sharded(directory / "iter_00000002", LAYOUT)
    assert it == 2 and st["rank"] == rank and torch.equal(got["w"], weights["w"])
    assert torch.equal(st["exp_avg"], torch.arange(4.0) + rank)
    # another layout: every rank refuses, naming the manifest
    with pytest.raises(
        CheckpointError, match=r"iter_00000002/meta.json was saved with another pipeline layout"
    ):
        load_sharded(directory / "iter_00000002", {**LAYOUT, "dp": 2})
    # a tampered shard on one rank: every rank stops (none continues alone into the next collective)
    torch.distributed.barrier()
    if rank == 0:
        shard = directory / "iter_00000002" / "rank_00001" / "stages.safetensors"
        shard.write_bytes(shard.read_bytes()[:-4])
    torch.distributed.barrier()
    with pytest.raises(CheckpointError, match=r"rank_00001/stages.safetensors does not match its SHA-256"):
        load_sharded(directory / "iter_00000002", LAYOUT)


def _strategy_resume_worker(rank: int, world: int, root: str) -> None:
    """PipelineStrategy with a token budget (two micro-batch counts, each with its own plan): saved after
    2 steps and resumed into fresh models, steps 3-4 equal an uninterrupted strategy's, bit for bit."""
    from runtime_helpers import random_batch

    from rlhfuse.core.advantages import AlgorithmConfig
    from rlhfuse.core.optim import OptimConfig
    from rlhfuse.models import ModelConfig, Transformer
    from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
    from rlhfuse.trainer.strategies.pipelines.training import PipelineStrategy

    def make() -> PipelineStrategy:
        torch.manual_seed(0)
        cfg = ModelConfig.tiny(num_layers=2)
        actor, critic = Transformer(cfg, head="lm").double(), Transformer(cfg, head="value").double()
        pcfg = PipelineConfig(
            name="fused", optim=OptimConfig(warmup_steps=2), microbatches=2, search_budget_s=0.0
        )
        return PipelineStrategy(
            actor, critic, pcfg, AlgorithmConfig(), total_steps=8, mini_batch_size=16, micro_batch_size=4,
            micro_batch_tokens=24, timeout_s=60, log=lambda _: None,
        )  # fmt: skip

    batches = [random_batch(size, seed=40 + i) for i, size in enumerate((16, 8, 16, 8))]
    straight = make()
    want = [straight.train_step(b).metrics() for b in batches]
    assert len({w["train/microbatches"] for w in want}) >= 2  # several counts, several plans
    first = make()
    for b in batches[:2]:
        first.train_step(b).metrics()
    path = first.checkpointer.save(root, 2, {"trainer": {"iteration": 2}})
    resumed = make()
    state = resumed.checkpointer.load(path)
    assert state["trainer"] == {"iteration": 2} and resumed.steps == 2
    got = [resumed.train_step(b).metrics() for b in batches[2:]]
    for g, w in zip(got, want[2:], strict=True):
        for key in (
            "loss/policy",
            "loss/value",
            "actor/grad_norm",
            "critic/grad_norm",
            "lr",
            "train/microbatches",
        ):
            assert g[key] == w[key], (rank, key, g[key], w[key])
    for key, module in straight.stages.items():
        for p, q in zip(module.parameters(), resumed.stages[key].parameters(), strict=True):
            assert torch.equal(p, q), (rank, key)


def _save_workers(rank: int, world: int, root: str) -> None:
    _save_worker(rank, world, str(Path(root) / "shards"))
    _strategy_resume_worker(rank, world, str(Path(root) / "strategy"))


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_sharded_save_is_all_or_nothing_and_a_resumed_strategy_is_exact(tmp_path: Path) -> None:
    run_distributed(_save_workers, 2, str(tmp_path / "ckpt"), timeout=160)
