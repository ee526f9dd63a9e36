"""Tensor parallelism inside the pipeline runtime: pp=2 x tp=2 on 4 gloo ranks (float64).

One 4-process run (each spawn costs seconds on this machine):
- the executor over tp-sharded stages (fused and serial 1F1B schedules; kv heads split, then replicated):
  every shard's gradient, the gradient norms and the loss statistics equal the single-process oracle;
- `PipelineStrategy` with pipeline.actor_tp = critic_tp = 2 over pp-sharded models (packing on), for
  pipeline=fused and serial_1f1b: each rank holds at most 1/(pp*tp) of every model plus the embedding / head
  share, the updates equal `PlainStrategy` on whole models, the generation weights reassembled from the shards
  equal the trained weights on every rank, and a sharded checkpoint (one file per stage and tp rank) resumes
  bit-identically.
"""

from __future__ import annotations

import pathlib
import tempfile
from typing import Any

import pytest
import torch
from runtime_helpers import random_batch, run_distributed
from test_runtime_sharded import _edge_bytes, _load

from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.models import ModelConfig, Transformer, resident_bytes, save_pretrained

pytestmark = pytest.mark.distributed


def _check_executor(rank: int, kind: str, kv_heads: int) -> None:
    from test_runtime_tp_merged import check_executor_against_oracle

    from rlhfuse.runtime.layout import ModelParallel, ParallelLayout

    layout = ParallelLayout(ModelParallel(2, 2), ModelParallel(2, 2), dp=1, world_size=4, microbatches=2)
    cfg = ModelConfig.tiny(num_layers=2, num_kv_heads=kv_heads, attention_bias=True)
    check_executor_against_oracle(rank, layout, cfg, kind, f"kv_heads={kv_heads}")


def _check_strategy(rank: int, world: int, root: pathlib.Path, schedule: str) -> None:
    from lightning.fabric import Fabric

    from rlhfuse.core.optim import OptimConfig
    from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
    from rlhfuse.trainer.strategies.pipelines.training import PipelineStrategy, pipeline_layout
    from rlhfuse.trainer.strategies.plain.training import PlainStrategy

    cfg = PipelineConfig(
        name=schedule, optim=OptimConfig(warmup_steps=1, grad_clip=0.5), actor_tp=2, critic_tp=2,
        microbatches=2, search_budget_s=0.0,
    )  # fmt: skip
    layout = pipeline_layout(cfg, world, 8, 4)
    assert layout.tp == 2 and layout.dp == 1 and layout.tp_groups == ((0, 1), (2, 3))
    held = layout.held_stages(rank)
    sharded, whole = _load(root, held), _load(root, None)
    for model in sharded.values():
        model.packing = True

    def make(models: dict[str, Transformer]) -> PipelineStrategy:
        return PipelineStrategy(
            models["actor"], models["critic"], cfg, AlgorithmConfig(), total_steps=4, mini_batch_size=8,
            micro_batch_size=4, schedule=schedule, timeout_s=120, log=lambda _: None,
        )  # fmt: skip

    fused = make(sharded)
    # memory: this rank's tp shard of its stage holds <= 1/(pp*tp) of each model + the embedding / head share
    for name in ("actor", "critic"):
        mine, full = resident_bytes(fused.models[name]), resident_bytes(whole[name])
        assert mine <= full / 4 + _edge_bytes(whole[name]), (rank, name, mine, full)
        assert mine < full / 2, (rank, name, mine, full)
    plain = PlainStrategy(
        whole["actor"], whole["critic"], cfg.optim, AlgorithmConfig(),
        fabric=Fabric(accelerator="cpu", devices=1), total_steps=4, micro_batch_size=4,
    )  # fmt: skip
    vocab = whole["actor"].config.vocab_size
    for step in range(2):
        batch = random_batch(8, seed=11 + step, vocab=vocab)
        got, want = fused.train_step(batch).metrics(), plain.train_step(batch).metrics()
        for key in ("loss/policy", "loss/value", "actor/grad_norm", "critic/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (schedule, step, key)
        weights = fused.actor_weights()  # the generation copy (generator.tp = 1): whole tensors
        for name, q in plain.actor.named_parameters():
            err = float((weights[name] - q).abs().max())
            assert err < 2e-5, (rank, schedule, step, name, err)
        assert fused.weight_sync_bytes > 0

    if schedule == "fused":
        _check_generation(rank, world, fused, plain.actor)

    # sharded save (one shard per stage and tp rank), a fresh strategy resumes bit-identically
    ckpt = root / f"ckpt-{schedule}"
    path = fused.checkpointer.save(ckpt, 2, {"trainer": {"iteration": 2}})
    assert len(list(path.glob("rank_*"))) == 4
    again = _load(root, held)
    for model in again.values():
        model.packing = True
    resumed = make(again)
    resumed.checkpointer.load(path)
    for name in ("actor", "critic"):
        for (n, p), q in zip(
            fused.models[name].named_parameters(), resumed.models[name].parameters(), strict=True
        ):
            assert p.is_meta == q.is_meta and (p.is_meta or torch.equal(p, q)), (rank, name, n)
    batch = random_batch(8, seed=40, vocab=vocab)
    a, b = fused.train_step(batch).metrics(), resumed.train_step(batch).metrics()
    for key in ("loss/policy", "loss/value", "actor/grad_norm", "critic/grad_norm"):
        assert a[key] == b[key], (schedule, key)
    full_a, full_b = fused.state_dict(), resumed.state_dict()
    for name in ("actor", "critic"):
        assert full_a[name].keys() == full_b[name].keys()
        assert all(torch.equal(full_a[name][k], full_b[name][k]) for k in full_a[name]), name
    # the whole state loads back into the shards (state_dict / load_state_dict round trip)
    resumed.load_state_dict(full_a)
    for name in ("actor", "critic"):
        for p, q in zip(fused.models[name].parameters(), resumed.models[name].parameters(), strict=True):
            assert p.is_meta or torch.equal(p, q), name


def _check_generation(rank: int, world: int, fused: Any, trained: Transformer) -> None:
    """generator.tp = 2: each instance (2 ranks) receives exactly its tp shard of the stage it lacks, equal to
    the trained weights' shard on every instance, and the two instances' rollouts equal one whole-model
    generator's (greedy and sampled)."""
    from rlhfuse.core.sampling import SamplingConfig
    from rlhfuse.core.types import PromptBatch
    from rlhfuse.generation.batched import InstanceGenerator, SamplingGenerator
    from rlhfuse.runtime.tensor_parallel import shard_transformer

    shard = fused.shards.shard_state("actor")
    mine = fused.models["actor"]
    want = shard_transformer(trained, rank % 2, 2, fused.groups.tp).state_dict()
    assert shard.keys() == want.keys()
    for name, value in shard.items():
        err = float((value - want[name]).abs().max())
        assert err < 2e-5, (rank, name, err)  # the trained weights' shard (PlainStrategy: float32 losses)
    live = mine.state_dict(keep_vars=True)
    lacking = sum(t.numel() * t.element_size() for t in live.values() if t.is_meta)
    assert fused.shards.received_bytes == lacking > 0  # its shard of the missing stage, no whole tensor
    for name, t in live.items():
        if not t.is_meta:
            assert torch.equal(shard[name], t), name  # held stages: its own live shard
    whole = fused.actor_weights()  # generation_tp = 1: whole tensors
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, trained.config.vocab_size, (3, 5), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    prompts = PromptBatch(ids * mask, mask, torch.tensor([4, 9, 2]))
    for temperature in (0.0, 0.8):
        # sampled: generator.max_batch_size=2 splits each instance's 3 samples into chunks of 2 and 1
        cfg = SamplingConfig(
            max_new_tokens=6, temperature=temperature, max_batch_size=2 if temperature else 0
        )
        args: dict[str, Any] = dict(eos_token_id=1, pad_token_id=0, samples_per_prompt=2, seed=3)
        tp_gen = InstanceGenerator(trained, cfg, tp=2, group=fused.groups.tp, **args)
        tp_gen.load_weights(shard)
        one = SamplingGenerator(trained, SamplingConfig(max_new_tokens=6, temperature=temperature), **args)
        one.load_weights(whole)
        chunks = list(tp_gen.generate(prompts, iteration=1))
        assert len(chunks) == (4 if temperature else 2)  # world / generator.tp instances, 3 samples each
        (ref,) = list(one.generate(prompts, iteration=1))
        offset = 0
        for chunk in chunks:  # each instance's rows, in order; its own response width
            for row in range(len(chunk)):
                i, length = offset + row, int(chunk.response_mask_BR[row].sum())
                assert length == int(ref.response_mask_BR[i].sum()), (rank, temperature, i)
                got, exp = chunk.response_ids_BR[row, :length], ref.response_ids_BR[i, :length]
                assert torch.equal(got, exp), (rank, temperature, i)
            offset += len(chunk)
        assert offset == len(ref)
        assert torch.equal(torch.cat([c.prompt_index_B for c in chunks]), ref.prompt_index_B)


def _worker(rank: int, world: int, folder: str) -> None:
    _check_executor(rank, "greedy", kv_heads=2)  # the fused (greedy) schedule, kv heads split
    _check_executor(rank, "serial", kv_heads=1)  # serial 1F1B, the one kv head replicated over the tp group
    _check_executor(rank, "greedy+split", kv_heads=1)  # the fused F/I/W schedule, kv head replicated
    for schedule in ("fused", "serial_1f1b"):
        _check_strategy(rank, world, pathlib.Path(folder), schedule)


@pytest.mark.timeout(420)
def test_pp2_tp2_on_four_ranks_equals_the_oracle_and_resumes_bit_identically() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(num_layers=2)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        save_pretrained(Transformer(cfg, head="lm"), root / "sft")
        save_pretrained(Transformer(cfg, head="value"), root / "rm")
        run_distributed(_worker, 4, tmp, timeout=400.0)
