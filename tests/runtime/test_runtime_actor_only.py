"""Critic-free algorithms under the pipeline strategies: the Actor's pipeline alone (1F1B; nothing to fuse it
with), updates and inference equal to the single-process ones, sharded checkpoints without any Critic state."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from runtime_helpers import random_batch, run_distributed

from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.core.types import TrainBatch
from rlhfuse.pipeline import serial_one_f_one_b
from rlhfuse.runtime.layout import ModelParallel, actor_only_layout
from rlhfuse.runtime.plan import ACTOR_ONLY_NOTE, PlanOptions, StageProfile, plan_fused
from rlhfuse.trainer.strategies.pipelines.checkpoint import expected_record, layout_record


def test_actor_only_layout_plans_the_actor_alone_and_fused_falls_back_to_1f1b() -> None:
    layout = actor_only_layout(ModelParallel(2), 1, 2, 4)
    problem = layout.problem()
    assert problem.model_names() == ["actor"]
    assert [k[0] for r in range(2) for k in layout.trained_stages_on(r)] == ["actor", "actor"]
    assert set(layout.grad_groups) == {("actor", 0), ("actor", 1)}  # no Critic group is created
    # the critic slot places only a Reward model's inference: the Actor's stages reversed
    assert layout.held_stages(0) == {"actor": {0}, "critic": {1}}
    profile = StageProfile.from_means(
        layout, 4, {("actor", s, k): 0.01 * (s + 1) for s in (0, 1) for k in "FB"}
    )
    assert StageProfile.from_json(profile.to_json()) == profile
    plan = plan_fused(layout, profile, 4, PlanOptions(search_budget_s=0.0))
    assert plan.schedule == serial_one_f_one_b(plan.problem) and plan.note == ACTOR_ONLY_NOTE
    assert plan.predicted_s == plan.predicted_serial_s
    # a checkpoint of this layout records no Critic: a run with one cannot resume it (and the reverse)
    record = layout_record(layout, {"actor": [(0, 1), (1, 2)]})
    assert record["trained"] == ["actor"] and "critic" not in record
    assert "critic" not in expected_record(layout, {"actor": 2}) and "trained" in expected_record(
        layout, None
    )


def _grpo_batch(seed: int) -> TrainBatch:
    """A random mini-batch with Ref log-probs (the KL enters the loss: algorithm.kl_loss_coef > 0)."""
    batch = random_batch(8, seed=seed)
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch.old_logprobs_BR.shape, generator=g, dtype=torch.float64)
    ref = batch.old_logprobs_BR + 0.05 * noise
    return dataclasses.replace(batch, ref_logprobs_BR=ref)


def _strategies(actor_pp: int, schedule: str, total_steps: int = 4):  # type: ignore[no-untyped-def]
    """A critic-free (GRPO) pipeline strategy and the single-process oracle on copies of one float64 Actor."""
    from lightning.fabric import Fabric

    from rlhfuse.core.optim import OptimConfig
    from rlhfuse.models import ModelConfig, Transformer
    from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
    from rlhfuse.trainer.strategies.pipelines.training import PipelineStrategy
    from rlhfuse.trainer.strategies.plain.training import PlainStrategy

    torch.manual_seed(0)
    actor = Transformer(ModelConfig.tiny(num_layers=2), head="lm").double()
    oracle_actor = copy.deepcopy(actor)
    algo = AlgorithmConfig(name="grpo", kl_loss_coef=0.05)
    # critic_pp=3 divides nothing: a layout with a Critic would be refused; the Actor-only one ignores it
    cfg = PipelineConfig(
        name=schedule,
        optim=OptimConfig(warmup_steps=1, grad_clip=0.5),
        actor_pp=actor_pp,
        critic_pp=3,
        microbatches=2,
        search_budget_s=0.0,
    )
    pipe = PipelineStrategy(
        actor, None, cfg, algo, total_steps=total_steps, mini_batch_size=8, micro_batch_size=4,
        schedule=schedule, timeout_s=120, log=lambda _: None,
    )  # fmt: skip
    oracle = PlainStrategy(
        oracle_actor, None, cfg.optim, algo, fabric=Fabric(accelerator="cpu", devices=1),
        total_steps=total_steps, micro_batch_size=4,
    )  # fmt: skip
    return pipe, oracle, actor, oracle_actor


def _equivalence(rank: int, world: int) -> None:
    """serial_1f1b with actor_pp=2 (one pipeline over both ranks) and fused with actor_pp=1 (two data-parallel
    Actor replicas: 1F1B, nothing to fuse with): two GRPO updates equal to PlainStrategy's, no Critic anywhere."""
    for actor_pp, schedule in ((2, "serial_1f1b"), (1, "fused")):
        pipe, oracle, actor, oracle_actor = _strategies(actor_pp, schedule)
        assert pipe.layout.trained == ("actor",) and pipe.layout.dp == world // actor_pp
        assert {m for m, _, _ in pipe.stages} == {"actor"} and set(pipe.optimizers.optims) == {"actor"}
        for step in range(2):
            batch = _grpo_batch(11 + step)
            got, want = pipe.train_step(batch).metrics(), oracle.train_step(batch).metrics()
            assert "loss/value" not in got and "critic/grad_norm" not in got
            for key in ("loss/policy", "actor/grad_norm", "lr"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (schedule, step, key)
            pipe.actor_weights()
            for (name, p), q in zip(actor.named_parameters(), oracle_actor.parameters(), strict=True):
                if p.is_meta:
                    continue
                # the oracle's losses run in float32 (the pipeline keeps float64): AdamW turns those ~1e-7
                # gradient differences into ~1e-6 weight differences; a wrong update moves weights by ~lr
                err = float((p - q).abs().max())
                assert err < 2e-5, f"{schedule} step {step} actor.{name}: max error {err:.3g}"
        assert set(pipe.state_dict()) == {"actor", "rank", "world_size", "actor_optim", "actor_sched"}


def _resume(rank: int, world: int, root: str) -> None:
    """Saved after one step and resumed into a fresh strategy, steps 2-3 equal an uninterrupted run's bit for
    bit; the shards hold the Actor's stages and optimizer only, the manifest no Critic."""
    batches = [_grpo_batch(40 + i) for i in range(3)]
    straight = _strategies(2, "serial_1f1b")[0]
    want = [straight.train_step(b).metrics() for b in batches]
    first = _strategies(2, "serial_1f1b")[0]
    first.train_step(batches[0])
    path = first.checkpointer.save(root, 1, {"trainer": {"iteration": 1}})
    torch.distributed.barrier()
    shard = path / f"rank_{rank:05d}"
    weights = safetensors.torch.load_file(str(shard / "stages.safetensors"))
    assert weights and all(k.startswith(f"actor.r0.s{rank}.") for k in weights)
    state = torch.load(shard / "state.pt", weights_only=True)
    assert not [k for k in state if "critic" in k] and "actor_optim" in state
    layout = json.loads((path / "meta.json").read_text())["layout"]
    assert layout["trained"] == ["actor"] and "critic" not in layout
    resumed = _strategies(2, "serial_1f1b")[0]
    assert resumed.checkpointer.load(path)["trainer"] == {"iteration": 1} and resumed.steps == 1
    got = [resumed.train_step(b).metrics() for b in batches[1:]]
    for g, w in zip(got, want[1:], strict=True):
        for key in ("loss/policy", "actor/grad_norm", "lr", "train/microbatches"):
            assert g[key] == w[key], (rank, key, g[key], w[key])
    for key, module in straight.stages.items():
        for p, q in zip(module.parameters(), resumed.stages[key].parameters(), strict=True):
            assert torch.equal(p, q), (rank, key)


def _inference(rank: int, world: int) -> None:
    """Inference on the Actor-only layouts: Actor/Ref log-probs and Reward scores (the Reward on the critic
    slot, the Actor's stages reversed) equal the single-process inferencer's; values 0, no Critic forward."""
    from test_runtime_inference import _rollout

    from rlhfuse.core.inference import InferencerConfig
    from rlhfuse.data.synthetic import build_tokenizer
    from rlhfuse.models import ModelConfig, Transformer
    from rlhfuse.trainer.strategies.pipelines.inference import PipelineInferencer
    from rlhfuse.trainer.strategies.plain.inference import ModelInferencer

    torch.manual_seed(3)
    heads = {"actor": "lm", "ref": "lm", "reward": "value"}
    models = {n: Transformer(ModelConfig.tiny(num_layers=2), head=h).double() for n, h in heads.items()}
    tokenizer = build_tokenizer()
    for pp, dp in ((2, 1), (1, 2)):
        config = InferencerConfig(truncated_score=-5.0)
        rollout = _rollout(9, seed=pp)
        oracle = ModelInferencer(
            config, actor=models["actor"], ref=models["ref"], critic=None, reward_model=models["reward"],
            rewards=None, tokenizer=tokenizer, temperature=0.7,
        ).infer(rollout)  # fmt: skip
        layout = actor_only_layout(ModelParallel(pp), dp, world, 2)
        got = PipelineInferencer(
            config, layout, models, rewards=None, tokenizer=tokenizer, temperature=0.7, timeout_s=60,
            log=lambda _: None,
        ).infer(rollout)  # fmt: skip
        for name in ("logprobs_BR", "ref_logprobs_BR", "values_BR", "scores_B"):
            a, b = getattr(got, name), getattr(oracle, name)
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"rank {rank} pp={pp}: {name}")
        assert not bool(got.values_BR.any()) and bool(got.scores_B.abs().sum() > 0)


def _worker(rank: int, world: int, root: str) -> None:
    _equivalence(rank, world)
    _inference(rank, world)
    _resume(rank, world, root)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_critic_free_pipeline_trains_and_infers_as_single_process_and_resumes_without_critic(
    tmp_path: Path,
) -> None:
    run_distributed(_worker, 2, str(tmp_path / "ckpt"), timeout=220)
