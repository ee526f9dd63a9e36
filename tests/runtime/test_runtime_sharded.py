"""Sharded construction under the pipeline strategies (2 gloo ranks, pp=2): each rank materialises only its
stages of the Actor, Ref, Critic and Reward (read from safetensors with `safe_open`, the rest meta), trains
exactly like whole models, syncs the generation copy by per-stage broadcasts from the owners, and saves / resumes
its shard bit-identically; pipeline inference over the shards equals whole-model inference."""

from __future__ import annotations

import copy
import pathlib
import tempfile

import pytest
import torch
from runtime_helpers import random_batch, run_distributed

from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.models import ModelConfig, Transformer, from_pretrained, resident_bytes, save_pretrained

pytestmark = pytest.mark.distributed


def _edge_bytes(model: Transformer) -> int:
    """The embedding / final norm / head share: what the first and last stages hold besides their layers."""
    heads = [
        model.embed_tokens,
        model.norm,
        getattr(model, "lm_head", None),
        getattr(model, "value_head", None),
    ]
    return resident_bytes(*heads)


def _load(folder: pathlib.Path, held: dict[str, set[int]] | None) -> dict[str, Transformer]:
    def one(name: str, head: str, placed: str) -> Transformer:
        stages = None if held is None else (2, held[placed])
        return from_pretrained(folder / name, head=head, dtype=torch.float64, stages=stages)

    return {
        "actor": one("sft", "lm", "actor"),
        "ref": one("sft", "lm", "actor"),
        "critic": one("rm", "value", "critic"),
        "reward": one("rm", "value", "critic"),
    }


def _worker(rank: int, world: int, folder: str) -> None:
    from lightning.fabric import Fabric

    from rlhfuse import distributed
    from rlhfuse.core.optim import OptimConfig
    from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
    from rlhfuse.trainer.strategies.pipelines.training import PipelineStrategy, pipeline_layout
    from rlhfuse.trainer.strategies.plain.training import PlainStrategy

    root = pathlib.Path(folder)
    cfg = PipelineConfig(
        name="fused", optim=OptimConfig(warmup_steps=1, grad_clip=0.5), microbatches=2, search_budget_s=0.0
    )
    layout = pipeline_layout(cfg, world, 8, 4)
    held = layout.held_stages(rank)
    assert held == {"actor": {rank}, "critic": {1 - rank}}  # the critic's stages are reversed over the ranks
    sharded, whole = _load(root, held), _load(root, None)

    # memory: each model's resident bytes <= 1/2 of the whole model's + its embedding / head share
    for name, model in sharded.items():
        mine, full = resident_bytes(model), resident_bytes(whole[name])
        assert mine <= full / 2 + _edge_bytes(whole[name]), (rank, name, mine, full)
        assert mine < full, (rank, name)
        assert any(p.is_meta for p in model.parameters()), name
    total = sum(resident_bytes(m) for m in sharded.values())
    bound = sum(resident_bytes(m) / 2 + _edge_bytes(m) for m in whole.values())
    assert total <= bound, (rank, total, bound)

    # pipeline inference over the sharded four models equals whole-model inference in this process
    from test_runtime_inference import _rollout

    from rlhfuse.core.inference import InferencerConfig
    from rlhfuse.data.synthetic import build_tokenizer
    from rlhfuse.trainer.strategies.pipelines.inference import PipelineInferencer
    from rlhfuse.trainer.strategies.plain.inference import ModelInferencer

    config, tokenizer, rollout = (
        InferencerConfig(truncated_score=-5.0),
        build_tokenizer(),
        _rollout(9, seed=5),
    )
    got = PipelineInferencer(
        config, layout, sharded, rewards=None, tokenizer=tokenizer, temperature=0.7, timeout_s=60,
        log=lambda _: None,
    ).infer(rollout)  # fmt: skip
    want = ModelInferencer(
        config, actor=whole["actor"], ref=whole["ref"], critic=whole["critic"], reward_model=whole["reward"],
        rewards=None, tokenizer=tokenizer, temperature=0.7,
    ).infer(rollout)  # fmt: skip
    for field in ("logprobs_BR", "ref_logprobs_BR", "values_BR", "scores_B"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=1e-9, atol=1e-9)

    algo = AlgorithmConfig()
    fused = PipelineStrategy(
        sharded["actor"], sharded["critic"], cfg, algo,
        total_steps=4, mini_batch_size=8, micro_batch_size=4, schedule="fused", timeout_s=120,
        log=lambda _: None,
    )  # fmt: skip
    assert fused.shards.sharded
    plain = PlainStrategy(
        whole["actor"], whole["critic"], cfg.optim, algo,
        fabric=Fabric(accelerator="cpu", devices=1), total_steps=4, micro_batch_size=4,
    )  # fmt: skip
    generation = copy.deepcopy(whole["ref"])  # a full generation copy, as the generator holds
    for step in range(2):
        batch = random_batch(8, seed=11 + step, vocab=whole["actor"].config.vocab_size)
        got, want = fused.train_step(batch).metrics(), plain.train_step(batch).metrics()
        for key in ("loss/policy", "loss/value", "actor/grad_norm", "critic/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (step, key)
        weights = fused.actor_weights()
        generation.load_state_dict(weights, strict=True)  # the resharded generation weights
        trained = dict(sharded["actor"].named_parameters())
        for (name, p), q in zip(generation.named_parameters(), plain.actor.parameters(), strict=True):
            if not trained[name].is_meta:  # this rank owns the stage: bit-identical to what it trained
                assert torch.equal(p, trained[name]), (rank, step, name)
            err = float(
                (p - q).abs().max()
            )  # and every stage equals the whole-model update (see equivalence)
            assert err < 2e-5, (rank, step, name, err)
        # each rank received exactly the stage it does not own; the metric is the most any rank received
        other = sum(
            t.numel() * t.element_size() for n, t in trained.items() if n in weights and trained[n].is_meta
        )
        most = torch.tensor([float(other)], dtype=torch.float64)
        distributed.all_reduce(most, op="max")
        assert fused.weight_sync_bytes == float(most) > 0

    # data parallelism only (pp=1, dp=2): every rank holds every stage, so the sync moves nothing
    dp_cfg = PipelineConfig(name="fused", optim=cfg.optim, actor_pp=1, critic_pp=1, microbatches=1)
    dp_models = _load(root, None)
    dp = PipelineStrategy(
        dp_models["actor"], dp_models["critic"], dp_cfg, algo,
        total_steps=4, mini_batch_size=8, micro_batch_size=4, schedule="fused", timeout_s=120,
        log=lambda _: None,
    )  # fmt: skip
    dp.train_step(random_batch(8, seed=21, vocab=whole["actor"].config.vocab_size))
    synced = dp.actor_weights()
    assert dp.weight_sync_bytes == 0.0
    assert all(torch.equal(synced[n], p) for n, p in dp_models["actor"].named_parameters())

    # sharded save, then a fresh sharded strategy resumes bit-identically (weights and the next step)
    ckpt = root / "ckpt"
    path = fused.checkpointer.save(ckpt, 2, {"trainer": {"iteration": 2}})
    again = _load(root, held)
    resumed = PipelineStrategy(
        again["actor"], again["critic"], cfg, algo,
        total_steps=4, mini_batch_size=8, micro_batch_size=4, schedule="fused", timeout_s=120,
        log=lambda _: None,
    )  # fmt: skip
    resumed.checkpointer.load(path)
    for name in ("actor", "critic"):
        for (n, p), q in zip(sharded[name].named_parameters(), again[name].parameters(), strict=True):
            assert p.is_meta == q.is_meta and (p.is_meta or torch.equal(p, q)), (rank, name, n)
    batch = random_batch(8, seed=40, vocab=whole["actor"].config.vocab_size)
    a, b = fused.train_step(batch).metrics(), resumed.train_step(batch).metrics()
    assert a["loss/policy"] == b["loss/policy"] and a["actor/grad_norm"] == b["actor/grad_norm"]
    full_a, full_b = fused.state_dict(), resumed.state_dict()
    for name in ("actor", "critic"):
        assert full_a[name].keys() == full_b[name].keys()
        assert all(torch.equal(full_a[name][k], full_b[name][k]) for k in full_a[name]), name


@pytest.mark.timeout(300)
def test_pp2_ranks_hold_half_the_weights_train_exactly_sync_and_resume() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(num_layers=4)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        save_pretrained(Transformer(cfg, head="lm"), root / "sft")
        save_pretrained(Transformer(cfg, head="value"), root / "rm")
        run_distributed(_worker, 2, tmp, timeout=240.0)


def test_sharded_load_reads_only_the_held_stages(tmp_path: pathlib.Path) -> None:
    """Single process: stage 1 of 2 materialises layers 2..3, the final norm and head; the rest stays meta and
    equals nothing read (the values that are read equal the whole model's)."""
    torch.manual_seed(1)
    model = Transformer(ModelConfig.tiny(num_layers=4), head="lm")
    save_pretrained(model, tmp_path / "m")
    part = from_pretrained(tmp_path / "m", stages=(2, {1}))
    whole = from_pretrained(tmp_path / "m")
    real = sorted(n for n, p in part.named_parameters() if not p.is_meta)
    assert real and all(n.startswith(("layers.2.", "layers.3.", "norm.", "lm_head.")) for n in real), real
    assert any(n.startswith("layers.3.") for n in real) and "embed_tokens.weight" not in real
    ref = dict(whole.named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in part.named_parameters() if not p.is_meta)
    with pytest.raises(ValueError, match="ties its embedding"):
        tied = Transformer(ModelConfig.tiny(num_layers=2, tie_word_embeddings=True), head="lm")
        save_pretrained(tied, tmp_path / "t")
        from_pretrained(tmp_path / "t", stages=(2, {0}))
