"""The critic-free (Actor-only) pipeline with tensor parallelism: `ParallelLayout.trained == ("actor",)` with
pipeline.actor_tp = 2, on 4 gloo ranks (float64), one process group for both layouts:

- serial_1f1b with actor_pp=2 x tp=2 (each rank its tp shard of one stage, loaded pp-sharded as `rlhfuse-train`
  loads it) and fused with actor_pp=1 x tp=2 (two data-parallel tp groups: 1F1B, nothing to fuse with);
- two GRPO updates (KL in the loss) equal `PlainStrategy`'s on the whole model: loss, gradient norm, learning
  rate, the whole weights reassembled from the shards (`actor_weights`, generator.tp = 1) and each rank's shard
  for generator.tp = 2 (`shard_state` over the training tp group, and `Resharder`) after every step;
- mixtures of experts the same way: Qwen3-MoE with 4 experts (2 whole experts per rank) and Mixtral with 3
  (every expert split over its width);
- what each rank holds equals the planner's memory model (`rlhfuse.planner.memory.rank_memories` for an Actor
  alone): parameter bytes of the trained shard and AdamW's state bytes after a step, exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import tempfile

import pytest
import torch
from runtime_helpers import random_batch, run_distributed

from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.core.types import TrainBatch
from rlhfuse.models import ModelConfig, Transformer, from_pretrained, resident_bytes, save_pretrained

pytestmark = pytest.mark.distributed

CONFIG = dict(num_layers=2, vocab_size=127)  # an odd vocabulary: padded rows on the second tp rank


def _grpo_batch(seed: int, vocab: int) -> TrainBatch:
    batch = random_batch(8, seed=seed, vocab=vocab)
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch.old_logprobs_BR.shape, generator=g, dtype=torch.float64)
    return dataclasses.replace(batch, ref_logprobs_BR=batch.old_logprobs_BR + 0.05 * noise)


def _check(rank: int, world: int, root: pathlib.Path, actor_pp: int, schedule: str) -> None:
    from lightning.fabric import Fabric

    from rlhfuse.core.optim import OptimConfig
    from rlhfuse.planner.memory import rank_memories
    from rlhfuse.planner.specs import ModelSpec
    from rlhfuse.runtime.reshard import Resharder
    from rlhfuse.runtime.tensor_parallel import shard_transformer
    from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
    from rlhfuse.trainer.strategies.pipelines.training import PipelineStrategy, pipeline_layout
    from rlhfuse.trainer.strategies.plain.training import PlainStrategy

    algo = AlgorithmConfig(name="grpo", kl_loss_coef=0.05)
    cfg = PipelineConfig(
        name=schedule, optim=OptimConfig(warmup_steps=1, grad_clip=0.5), actor_pp=actor_pp, critic_pp=3,
        actor_tp=2, critic_tp=2, microbatches=2, search_budget_s=0.0,
    )  # fmt: skip
    layout = pipeline_layout(cfg, world, 8, 4, critic=False)
    assert layout.trained == ("actor",) and layout.tp == 2 and layout.dp == world // (2 * actor_pp)
    held = layout.held_stages(rank)["actor"]
    actor = from_pretrained(root / "sft", dtype=torch.float64, stages=(actor_pp, held))
    whole = from_pretrained(root / "sft", dtype=torch.float64)
    pipe = PipelineStrategy(
        actor, None, cfg, algo, total_steps=4, mini_batch_size=8, micro_batch_size=4, schedule=schedule,
        timeout_s=120, log=lambda _: None,
    )  # fmt: skip
    assert pipe.layout.trained == ("actor",) and set(pipe.optimizers.optims) == {"actor"}
    assert {m for m, _, _ in pipe.stages} == {"actor"}
    oracle = PlainStrategy(
        copy.deepcopy(whole), None, cfg.optim, algo, fabric=Fabric(accelerator="cpu", devices=1),
        total_steps=4, micro_batch_size=4,
    )  # fmt: skip
    vocab = whole.config.vocab_size
    for step in range(2):
        batch = _grpo_batch(21 + step, vocab)
        got, want = pipe.train_step(batch).metrics(), oracle.train_step(batch).metrics()
        assert "loss/value" not in got and "critic/grad_norm" not in got
        for key in ("loss/policy", "actor/grad_norm", "lr"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (schedule, step, key)
        # the oracle's losses run in float32 (the pipeline keeps float64): AdamW turns those ~1e-7 gradient
        # differences into ~1e-6 weight differences; a wrong update moves weights by ~lr
        weights = pipe.actor_weights()
        for name, q in oracle.actor.named_parameters():
            err = float((weights[name] - q).abs().max())
            assert err < 2e-5, (rank, schedule, step, name, err)
        mine = pipe.shards.shard_state("actor")
        expected = shard_transformer(oracle.actor, layout.tp_rank(rank), 2).state_dict()
        assert mine.keys() == expected.keys()
        for name, value in mine.items():
            err = float((value - expected[name]).abs().max())
            assert err < 2e-5, (rank, schedule, step, "shard", name, err)
        resharded = Resharder(pipe.layout, rank, pipe.models["actor"], 2).run()
        expected = shard_transformer(oracle.actor, rank % 2, 2).state_dict()
        assert resharded.keys() == expected.keys()
        for name, value in resharded.items():
            err = float((value - expected[name]).abs().max())
            assert err < 2e-5, (rank, schedule, step, "resharded", name, err)
    # the planner's memory model: this rank's trained shard and its optimizer state, byte for byte
    spec = ModelSpec.from_config(whole.config)
    local = layout.pipeline_rank(rank) % layout.group_size
    predicted = rank_memories(
        spec, None, actor_pp=actor_pp, critic_pp=actor_pp, actor_tp=2, ref=False, reward=None,
        precision="32-true",
    )[local]  # fmt: skip
    optim = pipe.optimizers.optims["actor"]
    state = sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values())
    # float64 weights: twice the fp32 bytes the planner counts
    assert resident_bytes(pipe.models["actor"]) == 2 * predicted.trained_weights, (rank, schedule)
    moments = state - 4 * len(optim.state)  # AdamW's fp32 step counters, one per tensor
    assert moments == 2 * (predicted.optimizer_bytes - 4 * len(optim.state)), (rank, schedule)


def _worker(rank: int, world: int, folder: str) -> None:
    _check(rank, world, pathlib.Path(folder), 2, "serial_1f1b")
    _check(rank, world, pathlib.Path(folder), 1, "fused")


@pytest.mark.timeout(300)
def test_actor_only_pipeline_with_tp2_equals_the_single_process_oracle() -> None:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(Transformer(ModelConfig.tiny(**CONFIG), head="lm"), pathlib.Path(tmp) / "sft")
        run_distributed(_worker, 4, tmp, timeout=280.0)


def _moe_worker(rank: int, world: int, folder: str) -> None:
    _check(rank, world, pathlib.Path(folder), 1, "serial_1f1b")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "moe",
    [
        # 4 experts at tp 2: 2 whole experts per rank (`ExpertParallelMoEBlock`); a dense second layer
        dict(architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             mlp_only_layers=(1,)),
        # 3 experts at tp 2: every expert split over its width (`WidthSplitMoEBlock`)
        dict(architecture="mixtral", num_experts=3, num_experts_per_tok=2, intermediate_size=96),
    ],
    ids=["whole-experts", "width-split"],
)  # fmt: skip
def test_a_mixture_of_experts_actor_with_tp2_equals_the_single_process_oracle(moe: dict) -> None:
    """A mixture of experts over the 2 ranks of its tp group in either layout, the router's gradient summed: the
    same updates, shards (the weight sync reassembling or resharding the experts) and memory as above."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(Transformer(ModelConfig.tiny(**moe, **CONFIG), head="lm"), pathlib.Path(tmp) / "sft")
        run_distributed(_moe_worker, 2, tmp, timeout=280.0)
