"""Asynchronous RL, split placement (`async.generation_ranks=1`, `rlhfuse.trainer.split`): one rank trains, one
generates, under torchrun through the Python API (`split_driver.py`). At staleness 0 the split run trains the
synchronous run's parameters bit for bit; at staleness 1 the colocated run's, no token older than one version; a
resume of a run stopped with a batch generated ahead equals the uninterrupted run; with partial rollouts a sync
made to land mid-batch continues it under the new version, no token older than the bound (a killed generation
rank: `test_trainer_rank_death.py`). The messages round-trip exactly (no process needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_trainer_async import ITERATIONS, WIDE, _actor, _model, _same, _trainer

from rlhfuse.core.stats import GenerationStats
from rlhfuse.core.types import FrozenInference, PromptBatch, Rollout
from rlhfuse.testing.processes import free_port, launch_env
from rlhfuse.trainer import compose_config
from rlhfuse.trainer.asynchronous import _Generated
from rlhfuse.trainer.split import pack_batch, pack_sync, unpack_batch, unpack_sync
from rlhfuse.trainer.validate import cross_component_problems

DRIVER = Path(__file__).with_name("split_driver.py")


def _split(tmp: Path, run: str, staleness: int, *flags: str) -> subprocess.CompletedProcess[str]:
    port = free_port()
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun), "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
        str(DRIVER), str(tmp / run), str(tmp / "cache"), str(tmp / "out" / run), str(staleness), *flags,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=launch_env(), cwd=tmp)


def _result(tmp: Path, run: str) -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor], list[dict]]:
    saved = torch.load(tmp / "out" / run / "actor.pt", weights_only=False)
    return saved["actor"], saved["ages"], json.loads((tmp / "out" / run / "history.json").read_text())


def _ok(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_the_split_placement_trains_the_colocated_runs_parameters_and_resumes_exactly(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    for staleness in (0, 1):  # one process: synchronous, and colocated with a bound of 1
        one = _trainer(tmp_path / f"one{staleness}", staleness=staleness)
        one.fit(_model(cache))
        _ok(_split(tmp_path, f"split{staleness}", staleness))
        actor, ages, history = _result(tmp_path, f"split{staleness}")
        assert _same(actor, _actor(one)), staleness
        assert [r["reward/mean"] for r in history] == [r["reward/mean"] for r in one.history]
        if staleness:  # iteration 1 from version 0, every later one exactly one version behind
            assert [int(ages[i].max()) for i in range(1, ITERATIONS + 1)] == [0, 1, 1, 1]
            assert [int(ages[i].min()) for i in range(1, ITERATIONS + 1)] == [0, 1, 1, 1]
        else:
            assert all(int(a.abs().max()) == 0 for a in ages.values())
    # Ref and Reward scoring each batch on the generation rank (async.frozen_inference=generation_ranks): the same
    _ok(_split(tmp_path, "frozen1", 1, "--frozen-on-generation-rank"))
    actor, _, history = _result(tmp_path, "frozen1")
    assert _same(actor, _actor(one))  # `one`: the colocated run at staleness 1
    assert [r["reward/mean"] for r in history] == [r["reward/mean"] for r in one.history]
    # stopped after iteration 2 with batch 3 generated ahead (by version 1), then resumed
    _ok(_split(tmp_path, "stopped", 1, "--stop-at", "2"))
    state = torch.load(
        tmp_path / "stopped" / "checkpoints" / "iter_00000002" / "state.pt", weights_only=False
    )
    ready = state["trainer"]["rollout"]["ready"]
    assert list(ready) == ["3"] and ready["3"]["version"] == 1
    _ok(_split(tmp_path, "stopped", 1, "--resume"))
    actor, _, history = _result(tmp_path, "stopped")
    assert [r["iteration"] for r in history] == [3, 4]
    assert _same(actor, _result(tmp_path, "split1")[0])
    # the generation rank's two in-process instances migrating the tail: still the synchronous run
    one = _trainer(tmp_path / "one_migrating", staleness=0, generator="engine_migrating", data=WIDE)
    one.fit(_model(cache))
    _ok(_split(tmp_path, "migrating", 0, "--generator", "engine_migrating", "--data", "wide"))
    actor, _, history = _result(tmp_path, "migrating")
    assert _same(actor, _actor(one))
    assert sum(r["migration/samples_moved"] for r in history) > 0


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_split_partial_rollout_continues_a_batch_under_the_next_version(tmp_path: Path) -> None:
    # the sync of version 1 made to land at batch 2's third decode step (the generation rank waits for its notice)
    _ok(_split(tmp_path, "partial", 1, "--partial", "--interrupt"))
    _, ages, history = _result(tmp_path, "partial")
    assert [r["iteration"] for r in history] == list(range(1, ITERATIONS + 1))
    assert sorted(set(ages[2].tolist())) == [0, 1]  # batch 2: version 0's tokens, then version 1's
    assert all(int(a.max()) <= 1 and int(a.min()) >= 0 for a in ages.values())  # none older than the bound


def _rollout(rows: int, with_versions: bool) -> Rollout:
    g = torch.Generator().manual_seed(rows)
    return Rollout(
        prompt_ids_BP=torch.randint(0, 50, (rows, 3), generator=g),
        prompt_mask_BP=torch.ones(rows, 3, dtype=torch.long),
        response_ids_BR=torch.randint(0, 50, (rows, 5), generator=g),
        response_mask_BR=torch.ones(rows, 5, dtype=torch.long),
        prompt_index_B=torch.arange(rows),
        sample_index_B=torch.zeros(rows, dtype=torch.long),
        finished_B=torch.ones(rows, dtype=torch.bool),
        sampler_logprobs_BR=-torch.rand(rows, 5, generator=g),
        versions_BR=torch.full((rows, 5), 3) if with_versions else None,
    )


def test_the_split_placements_messages_round_trip_exactly() -> None:
    weights = {"a.weight": torch.randn(3, 4), "b.bias": torch.randn(2).to(torch.bfloat16)}
    jobs = {4: PromptBatch(torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]]), torch.tensor([7]))}
    version, got_weights, got_jobs = unpack_sync(pack_sync(2, weights, jobs, "cpu"))
    assert version == 2 and list(got_weights) == list(weights)
    assert all(
        torch.equal(got_weights[k], weights[k]) and got_weights[k].dtype == weights[k].dtype for k in weights
    )
    assert list(got_jobs) == [4] and torch.equal(got_jobs[4].input_ids_BP, jobs[4].input_ids_BP)
    assert unpack_sync(pack_sync(0, {}, {}, "cpu")) == (0, {}, {})
    stats = GenerationStats(0.5, 3.0, 1.0, 8.0, 120.0, spec_accept_rate=0.25)
    frozen = [FrozenInference(-torch.rand(n, 5), torch.randn(n), torch.randn(n, 2)) for n in (2, 3)]
    for generated in (
        _Generated([_rollout(2, True), _rollout(3, False)], 3, 1.5, stats),
        _Generated([_rollout(1, False)], 0, 0.25, None),
        _Generated([_rollout(2, True), _rollout(3, False)], 1, 0.5, None, frozen),
    ):
        iteration, got = unpack_batch(pack_batch(6, generated, "cpu"))
        assert iteration == 6 and got.version == generated.version and got.seconds == generated.seconds
        assert got.stats == generated.stats
        assert (got.frozen is None) == (generated.frozen is None)
        for a, b in zip(got.frozen or [], generated.frozen or [], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values(), strict=True))
        for a, b in zip(got.chunks, generated.chunks, strict=True):
            for name, value in vars(b).items():
                other = getattr(a, name)
                assert (value is None and other is None) or torch.equal(other, value), name


def test_split_runs_are_checked_before_anything_is_built() -> None:
    def problems(*overrides: str) -> str:
        cfg = compose_config(list(overrides))
        return " ".join(cfg.problems() + cross_component_problems(cfg))

    assert not problems("async.generation_ranks=1", "async.max_staleness=1")
    assert "set async.generation_ranks=1" in problems("async.generation_ranks=2")
    assert not problems("async.generation_ranks=1", "async.max_staleness=1", "async.partial_rollout=true")
    assert not problems("async.generation_ranks=1", "async.frozen_inference=generation_ranks")
    assert "set async.generation_ranks=1 (or async.frozen_inference=training_ranks)" in problems(
        "async.max_staleness=1", "async.frozen_inference=generation_ranks"
    )
    assert "set distributed.nproc_per_node=2" in problems(
        "async.generation_ranks=1",
        "distributed.nproc_per_node=3",
        "generator=engine",
        "generator.instances=2",
    )
    assert "set distributed.nproc_per_node=2" in problems(
        "async.generation_ranks=1", "pipeline=fused", "distributed.nproc_per_node=2"
    )
    assert "set generator=engine or sampling" in problems("async.generation_ranks=1", "generator=vllm")
