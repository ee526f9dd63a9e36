"""Unequal tensor parallelism: the model with the smaller tp has consecutive stages merged onto the larger-tp
groups (the paper's placement), on 4 gloo ranks (float64).

One 4-process run covers both mirror cases, actor pp=2 tp=2 with critic pp=4 tp=1, and actor pp=4 tp=1 with
critic pp=2 tp=2, and a merged model with tp > 1 (actor pp=1 tp=4, critic pp=2 tp=2: both critic stages on the
one 4-rank group, each over its own 2 ranks; executor and inference, strategy with pipeline=fused):
- the executor over merged stages (fused and serial 1F1B schedules): every shard's gradient, the gradient norms
  and the loss statistics equal the single-process oracle;
- `PipelineStrategy` over pp-sharded models for pipeline=fused and serial_1f1b: each rank holds at most
  1/(pp*tp) of every model plus the embedding / head share, the updates equal `PlainStrategy` on whole models,
  the generation weights equal the trained weights on every rank, and a sharded checkpoint resumes
  bit-identically.
The layout's placement and validation are pure (tested in one process).
"""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
import torch
from runtime_helpers import random_batch, run_distributed
from test_runtime_sharded import _edge_bytes
from test_runtime_tensor_parallel import _shard_of

from rlhfuse.core.advantages import AlgorithmConfig
from rlhfuse.models import ModelConfig, Transformer, from_pretrained, resident_bytes, save_pretrained
from rlhfuse.pipeline import greedy, serial_one_f_one_b
from rlhfuse.runtime.layout import ModelParallel, ParallelLayout
from rlhfuse.runtime.lower import lower_checked
from rlhfuse.runtime.plan import StageProfile

# (actor pp, actor tp), (critic pp, critic tp): the two mirror cases on 4 ranks
CASES = (((2, 2), (4, 1)), ((4, 1), (2, 2)))
# a merged model with tp > 1: the Critic's two stages of tp=2 merged onto the Actor's one tp=4 group
WIDE = ((1, 4), (2, 2))


def _layout(case: tuple[tuple[int, int], tuple[int, int]], world: int = 4) -> ParallelLayout:
    (ap, at), (cp, ct) = case
    return ParallelLayout(
        ModelParallel(ap, at), ModelParallel(cp, ct), dp=1, world_size=world, microbatches=2
    )


def test_merged_placement_gives_each_rank_its_sub_stages() -> None:
    layout = _layout(CASES[0])
    assert (layout.tp, layout.merge("actor"), layout.merge("critic")) == (2, 1, 2)
    assert layout.merged_stages("critic") == 2 and layout.group_size == 2
    # the critic's merged stages reversed over the pipeline ranks: merged 0 (stages 0, 1) on ranks 2, 3
    held = [layout.held_stages(r) for r in range(4)]
    assert [h["actor"] for h in held] == [{0}, {0}, {1}, {1}]
    assert [h["critic"] for h in held] == [{2}, {3}, {0}, {1}]
    assert [layout.rank("critic", 0, 0, s) for s in range(4)] == [2, 3, 0, 1]
    assert [layout.rank("actor", 0, 0, 1, t) for t in range(2)] == [2, 3]
    assert layout.model_tp_groups("critic") == ((0,), (1,), (2,), (3,))
    assert layout.tp_groups == ((0, 1), (2, 3))
    assert layout.grad_groups[("critic", 1)] == (3,) and layout.grad_groups[("actor", 1)] == (2, 3)
    mirror = _layout(CASES[1])
    assert [mirror.held_stages(r)["actor"] for r in range(4)] == [{0}, {1}, {2}, {3}]
    assert [mirror.held_stages(r)["critic"] for r in range(4)] == [{1}, {1}, {0}, {0}]
    # every (model, stage, tp shard) on exactly one rank of the group
    for lay in (layout, mirror):
        seen = sorted((m, s, lay.tp_rank(r, m)) for r in range(4) for m, _, s in lay.stages_on(r))
        want = sorted(
            (m, s, t)
            for m in ("actor", "critic")
            for s in range(lay.stages(m))
            for t in range(lay.model_tp(m))
        )
        assert seen == want
    # the schedule problem is over merged stages; a merged stage's time is the sum of its sub-stages'
    profile = StageProfile(
        2,
        {"actor": (1.0, 2.0), "critic": (0.1, 0.2, 0.3, 0.4)},
        {"actor": (2.0, 4.0), "critic": (1, 2, 3, 4)},
    )
    problem = profile.problem(layout, 2)
    critic = problem.model("critic")
    assert critic.stages == 2 and critic.forward == pytest.approx((0.3, 0.7)) and critic.backward == (3, 7)
    assert problem.model("actor").forward == (1.0, 2.0)
    lower_checked(problem, greedy(problem), dp=1)
    # a merged model with tp > 1: actor pp=2 tp=4, critic pp=4 tp=2 (two critic stages per 4-rank group, each
    # tensor-parallel over its own 2 ranks)
    wide = ParallelLayout(ModelParallel(2, 4), ModelParallel(4, 2), dp=1, world_size=8, microbatches=2)
    assert (wide.merge("critic"), wide.merged_stages("critic"), wide.group_size) == (2, 2, 2)
    assert [sorted(wide.held_stages(r)["critic"]) for r in range(8)] == [
        [2],
        [2],
        [3],
        [3],
        [0],
        [0],
        [1],
        [1],
    ]
    assert [wide.tp_rank(r, "critic") for r in range(4)] == [0, 1, 0, 1]
    assert [wide.position("critic", r) for r in range(4)] == [0, 0, 1, 1]
    assert wide.model_tp_groups("critic")[:2] == ((0, 1), (2, 3)) and wide.tp_groups == (
        (0, 1, 2, 3),
        (4, 5, 6, 7),
    )
    assert wide.grad_groups[("critic", 1)] == (6, 7) and wide.tp_grad_groups[("critic", 1, 1)] == (7,)
    # two fused groups: dp = 2 over 8 ranks
    two = ParallelLayout(ModelParallel(2, 2), ModelParallel(4, 1), dp=2, world_size=8, microbatches=2)
    assert two.grad_groups[("critic", 0)] == (2, 6) and two.tp_grad_groups[("actor", 0, 1)] == (1, 5)


def test_merged_layout_errors_list_every_problem_with_the_key() -> None:
    with pytest.raises(ValueError) as err:
        ParallelLayout(ModelParallel(2, 4), ModelParallel(2, 1), dp=1, world_size=8)
    assert "critic.pp=2 must be a multiple of actor.tp / critic.tp = 4 / 1 = 4" in str(err.value)
    with pytest.raises(ValueError) as err:
        ParallelLayout(ModelParallel(2, 3), ModelParallel(2, 2), dp=1, world_size=6)
    assert "critic.tp=2 must divide actor.tp=3" in str(err.value) and "[1, 3]" in str(err.value)
    with pytest.raises(ValueError) as err:
        ParallelLayout(ModelParallel(2, 2), ModelParallel(4, 1), dp=1, world_size=6, microbatches=0)
    text = str(err.value)
    assert "microbatches=0" in text
    with pytest.raises(ValueError) as err:
        ParallelLayout(ModelParallel(2, 2), ModelParallel(4, 1), dp=1, world_size=6)
    assert "2 * 2 * 1 = 4 != world size 6" in str(err.value)


def _shards(
    layout: ParallelLayout, rank: int, full: dict[str, Transformer], groups: object
) -> dict[str, Transformer]:
    from rlhfuse.runtime.tensor_parallel import shard_transformer

    out = {}
    for m, model in full.items():
        t = layout.model_tp(m)
        if t == 1:  # a copy: the oracle's whole model keeps its own gradients
            out[m] = copy.deepcopy(model)
        else:
            out[m] = shard_transformer(model, layout.tp_rank(rank, m), t, groups.tp_of(m))  # type: ignore[attr-defined]
    return out


def _check_executor(rank: int, case: tuple[tuple[int, int], tuple[int, int]], kind: str) -> None:
    cfg = ModelConfig.tiny(num_layers=4, num_kv_heads=2, attention_bias=True)
    check_executor_against_oracle(rank, _layout(case), cfg, kind, str(case))


def check_executor_against_oracle(
    rank: int, layout: ParallelLayout, cfg: ModelConfig, kind: str, label: str
) -> None:
    """The executor over this rank's stages (tp shards, merged or not; `kind`: greedy = the fused schedule, or
    serial 1F1B; greedy+split = the fused F/I/W schedule) against the float64 single-process oracle: every shard's gradient, the gradient norms, the loss
    statistics (also `test_runtime_tp_pipeline`'s equal-tp check)."""
    from rlhfuse.core.step_losses import actor_loss
    from rlhfuse.runtime.batch_split import split_minibatch
    from rlhfuse.runtime.executor import PipelineExecutor, StepWork, ppo_losses
    from rlhfuse.runtime.layout import build_process_groups
    from rlhfuse.runtime.partition import stages_for_rank

    groups = build_process_groups(layout, timeout_s=120)
    torch.manual_seed(0)
    full = {"actor": Transformer(cfg, head="lm").double(), "critic": Transformer(cfg, head="value").double()}
    shards = _shards(layout, rank, full, groups)
    algo = AlgorithmConfig(entropy_coef=0.01)
    actor_tp = layout.model_tp("actor") > 1
    losses = ppo_losses(
        algo,
        vocab=shards["actor"].vocab_shard if actor_tp else None,
        tp_group=groups.tp_of("actor"),
    )
    oracle_losses = ppo_losses(algo)

    def exact(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
        return torch.log_softmax(logits / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)

    def entropy(logits: torch.Tensor) -> torch.Tensor:
        return -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)

    oracle_losses["actor"] = lambda out, m: actor_loss(out, m, algo, logprobs_fn=exact, entropy_fn=entropy)
    if not actor_tp:  # the executor's Actor on whole logits: the same float64 read-outs
        losses["actor"] = oracle_losses["actor"]
    batch = random_batch(5, seed=7)
    micro, weights, _ = split_minibatch(batch, 1, 2, balance=True)
    problem = layout.problem()
    split = kind.endswith("+split")  # F/I/W: the split-backward twin (sub-stages pass gradients in I)
    schedule = serial_one_f_one_b(problem) if kind == "serial" else greedy(problem, split_backward=split)
    program = lower_checked(problem, schedule, dp=1)
    stages = stages_for_rank(layout, rank, shards)
    result = PipelineExecutor(
        rank, program, problem, stages, losses=losses, p2p_groups=groups.p2p, grad_groups=groups.grad,
        timeout_s=120, tp=layout.tp, tp_group=groups.tp,
        model_tp={m: layout.model_tp(m) for m in full}, model_tp_groups=groups.model_tp,
    ).run(StepWork(micro, weights))  # fmt: skip

    want_stats = {"loss/policy": 0.0, "loss/value": 0.0, "policy/entropy": 0.0}
    for m, w in zip(micro[0], weights[0], strict=True):
        for name in ("actor", "critic"):
            loss, stats = oracle_losses[name](
                full[name](m.input_ids_BT, attention_mask_BT=m.attention_mask_BT), m
            )
            (loss * w).backward()
            for key in want_stats:
                want_stats[key] += stats.metrics().get(key, 0.0) * w
    where = f"rank {rank} {label} {kind}"
    for name in ("actor", "critic"):
        names = {id(p): n for n, p in shards[name].named_parameters()}
        whole = dict(full[name].named_parameters())
        checked, bad = 0, []
        for (m, _, _), mod in stages.items():
            if m != name:
                continue
            for p in mod.parameters():
                n = names[id(p)]
                if layout.model_tp(name) > 1:
                    mine, want = _shard_of(full[name], shards[name], n, "grad")
                else:  # a copy of the whole model: this stage's gradients are the oracle's
                    mine, want = p.grad, whole[n].grad
                if not torch.allclose(mine, want, rtol=1e-10, atol=1e-12):
                    bad.append((n, float((mine - want).abs().max()), float(want.abs().max())))
                checked += 1
        assert not bad, (where, name, bad)  # (parameter, max |difference|, max |gradient|)
        assert checked > 0, where
        total = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in full[name].parameters()))
        assert result.grad_norm[name] == pytest.approx(total, rel=1e-10), (where, name)
    got = result.stats.metrics()
    for key, value in want_stats.items():
        assert got[key] == pytest.approx(value, rel=1e-10, abs=1e-12), (where, key)


def _check_inference(rank: int, case: tuple[tuple[int, int], tuple[int, int]]) -> None:
    """Pipeline inference over merged stages (Ref placed like the Actor, Reward like the Critic, each sharded
    with its placement's tp) equals the single-process inferencer on the whole models."""
    from test_runtime_inference import _models, _rollout

    from rlhfuse.core.inference import InferencerConfig
    from rlhfuse.data.synthetic import build_tokenizer
    from rlhfuse.runtime.layout import build_process_groups
    from rlhfuse.runtime.tensor_parallel import shard_transformer
    from rlhfuse.trainer.strategies.pipelines.inference import PLACED_AS, PipelineInferencer
    from rlhfuse.trainer.strategies.plain.inference import ModelInferencer

    layout = _layout(case)
    groups = build_process_groups(layout, timeout_s=120)
    models = _models(layers=4)
    tokenizer = build_tokenizer()
    config = InferencerConfig(truncated_score=None)
    rollout = _rollout(10, seed=5)
    oracle = ModelInferencer(
        config, actor=models["actor"], ref=models["ref"], critic=models["critic"],
        reward_model=models["reward"], rewards=None, tokenizer=tokenizer, temperature=0.7,
    ).infer(rollout)  # fmt: skip
    placed = {}
    for name, model in models.items():
        like = PLACED_AS[name]
        t = layout.model_tp(like)
        placed[name] = (
            model if t == 1 else shard_transformer(model, layout.tp_rank(rank, like), t, groups.tp_of(like))
        )
    got = PipelineInferencer(
        config, layout, placed, rewards=None, tokenizer=tokenizer, temperature=0.7, timeout_s=60,
        log=lambda _: None,
    ).infer(rollout)  # fmt: skip
    for name in ("logprobs_BR", "ref_logprobs_BR", "values_BR", "scores_B"):
        a, b = getattr(got, name), getattr(oracle, name)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"rank {rank} {case}: {name}")
        assert bool(a.abs().sum() > 0), (rank, case, name)


def _load(root: pathlib.Path, layout: ParallelLayout, rank: int | None) -> dict[str, Transformer]:
    """The Actor (from sft/) and Critic (from rm/): this rank's stages (rank None: whole models)."""
    held = None if rank is None else layout.held_stages(rank)

    def one(name: str, head: str, placed: str) -> Transformer:
        stages = None if held is None else (layout.stages(placed), held[placed])
        return from_pretrained(root / name, head=head, dtype=torch.float64, stages=stages)

    return {"actor": one("sft", "lm", "actor"), "critic": one("rm", "value", "critic")}


def _check_strategy(
    rank: int, world: int, root: pathlib.Path, case: tuple[tuple[int, int], tuple[int, int]], schedule: str
) -> None:
    from lightning.fabric import Fabric

    from rlhfuse.core.optim import OptimConfig
    from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
    from rlhfuse.trainer.strategies.pipelines.training import PipelineStrategy, pipeline_layout
    from rlhfuse.trainer.strategies.plain.training import PlainStrategy

    (ap, at), (cp, ct) = case
    cfg = PipelineConfig(
        name=schedule, optim=OptimConfig(warmup_steps=1, grad_clip=0.5), actor_pp=ap, critic_pp=cp,
        actor_tp=at, critic_tp=ct, microbatches=2, search_budget_s=0.0,
    )  # fmt: skip
    layout = pipeline_layout(cfg, world, 8, 4)
    assert layout.tp == max(at, ct) and layout.dp == 1 and layout == _layout(case)
    sharded, whole = _load(root, layout, rank), _load(root, layout, None)

    def make(models: dict[str, Transformer]) -> PipelineStrategy:
        return PipelineStrategy(
            models["actor"], models["critic"], cfg, AlgorithmConfig(), total_steps=4, mini_batch_size=8,
            micro_batch_size=4, schedule=schedule, timeout_s=120, log=lambda _: None,
        )  # fmt: skip

    fused = make(sharded)
    where = (rank, case, schedule)
    # memory: this rank's tp shard of its (sub-)stage holds <= 1/(pp*tp) of each model + the embedding / head
    for name in ("actor", "critic"):
        mine, full = resident_bytes(fused.models[name]), resident_bytes(whole[name])
        assert mine <= full / 4 + _edge_bytes(whole[name]), (where, name, mine, full)
        assert mine < full / 2, (where, name, mine, full)
        if rank == 0:
            print(f"memory {case} {name}: {mine / full:.3f} of the whole model", flush=True)
    plain = PlainStrategy(
        whole["actor"], whole["critic"], cfg.optim, AlgorithmConfig(),
        fabric=Fabric(accelerator="cpu", devices=1), total_steps=4, micro_batch_size=4,
    )  # fmt: skip
    vocab = whole["actor"].config.vocab_size
    for step in range(2):
        batch = random_batch(8, seed=11 + step, vocab=vocab)
        got, want = fused.train_step(batch).metrics(), plain.train_step(batch).metrics()
        for key in ("loss/policy", "loss/value", "actor/grad_norm", "critic/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (where, step, key)
        weights = fused.actor_weights()  # the generation copy (generator.tp = 1): whole tensors
        for name, q in plain.actor.named_parameters():
            err = float((weights[name] - q).abs().max())
            assert err < 2e-5, (where, step, name, err)

    # sharded save (one shard per rank), a fresh strategy resumes bit-identically
    ckpt = root / f"ckpt-{schedule}-{ap}{at}{cp}{ct}"
    path = fused.checkpointer.save(ckpt, 2, {"trainer": {"iteration": 2}})
    assert len(list(path.glob("rank_*"))) == 4
    resumed = make(_load(root, layout, rank))
    resumed.checkpointer.load(path)
    for name in ("actor", "critic"):
        for (n, p), q in zip(
            fused.models[name].named_parameters(), resumed.models[name].parameters(), strict=True
        ):
            assert p.is_meta == q.is_meta and (p.is_meta or torch.equal(p, q)), (where, name, n)
    batch = random_batch(8, seed=40, vocab=vocab)
    a, b = fused.train_step(batch).metrics(), resumed.train_step(batch).metrics()
    for key in ("loss/policy", "loss/value", "actor/grad_norm", "critic/grad_norm"):
        assert a[key] == b[key], (where, key)
    full_a, full_b = fused.state_dict(), resumed.state_dict()
    for name in ("actor", "critic"):
        assert full_a[name].keys() == full_b[name].keys()
        assert all(torch.equal(full_a[name][k], full_b[name][k]) for k in full_a[name]), (where, name)


def _worker(rank: int, world: int, folder: str) -> None:
    for case in (*CASES, WIDE):
        _check_executor(rank, case, "greedy")
        _check_executor(rank, case, "serial")
        _check_inference(rank, case)
    _check_executor(rank, CASES[0], "greedy+split")  # merged stages, F/I/W
    for case in CASES:
        for schedule in ("fused", "serial_1f1b"):
            _check_strategy(rank, world, pathlib.Path(folder), case, schedule)
    _check_strategy(rank, world, pathlib.Path(folder), WIDE, "fused")


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_merged_stages_on_four_ranks_equal_the_oracle() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(num_layers=4)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        save_pretrained(Transformer(cfg, head="lm"), root / "sft")
        save_pretrained(Transformer(cfg, head="value"), root / "rm")
        run_distributed(_worker, 4, tmp, timeout=580.0)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_trainer_runs_merged_stages_with_four_processes(tmp_path: pathlib.Path) -> None:
    """`rlhfuse-train` with actor pp=4 tp=1 and critic pp=2 tp=2 (the Actor's stages merged two per tp group, so
    the generation instances of 2 ranks are resharded to from a tp-1 Actor), on the smoke job with 4 layers: it trains, each rank holds at most
    1/(pp*tp) of every model plus the embedding / head share (and its tp shard of the generation copy), and the
    exported Actor is whole and trained. It runs under the NCCL-ordering emulation's one stream per (group, rank).
    """
    exe = pathlib.Path(sys.executable).with_name("rlhfuse-train")
    run_dir = tmp_path / "run"
    cmd = [
        str(exe), "experiment=smoke", "model.num_layers=4", "model.num_heads=2", "model.num_kv_heads=2",
        "pipeline=fused", "distributed.nproc_per_node=4", "pipeline.actor_pp=4", "pipeline.critic_pp=2",
        "pipeline.actor_tp=1", "pipeline.critic_tp=2", "generator.tp=2", "iterations=1",
        "distributed.timeout_s=60", "checkpoint.export_hf=true",
        f"model.warmstart.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    # under the stricter of NCCL's stream models: one stream per (group, rank), whatever the peer
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLHFUSE_NCCL_ORDER": "rank"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "actor: 1 x pp=4 (tp=1: 2 consecutive stages merged per pipeline rank, 2 merged stages)" in out
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert math.isfinite(row["loss/policy"]) and math.isfinite(row["loss/value"])
    cache = next((tmp_path / "cache").glob("*/sft")).parent
    actor, critic = from_pretrained(cache / "sft", head="lm"), from_pretrained(cache / "reward", head="value")
    a, c = resident_bytes(actor), resident_bytes(critic)
    ea, ec = _edge_bytes(actor), _edge_bytes(critic)
    # Actor and Ref: 1/(4*1) + edge each; Critic and Reward: 1/(2*2) + edge each; generation copy: 1/2 + edge
    bound = 2 * (a / 4 + ea) + 2 * (c / 4 + ec) + a / 2 + ea
    assert 0 < row["memory/param_bytes"] <= bound, (row["memory/param_bytes"], bound, 3 * a + 2 * c)
    print(f"memory/param_bytes {row['memory/param_bytes']:.0f} vs whole models {3 * a + 2 * c}")
    assert row["weight_sync/bytes_per_rank"] > 0
    exported = from_pretrained(run_dir / "actor_hf")
    assert not any(p.is_meta for p in exported.parameters())
    assert any(not torch.equal(x, y) for x, y in zip(exported.parameters(), actor.parameters(), strict=True))


def test_trainer_validation_of_unequal_tp_names_the_keys() -> None:
    """Unequal tp passes validation where the layout can merge (tensor-parallel generation over a merged Actor
    included: it is resharded to); otherwise one error with the arithmetic."""
    from rlhfuse.trainer import compose_config, validate
    from rlhfuse.trainer.run_config import resolve_components

    base = ["pipeline=fused", "distributed.nproc_per_node=4", "model.num_layers=4"]
    merged = [
        *base,
        "pipeline.actor_pp=2",
        "pipeline.critic_pp=4",
        "pipeline.actor_tp=2",
        "pipeline.critic_tp=1",
    ]
    for gen_tp in (1, 2):
        validate(resolve_components(compose_config([*merged, f"generator.tp={gen_tp}"]), log=lambda _: None))
    mirror = [
        *base,
        "pipeline.actor_pp=4",
        "pipeline.critic_pp=2",
        "pipeline.actor_tp=1",
        "pipeline.critic_tp=2",
    ]
    validate(resolve_components(compose_config(mirror), log=lambda _: None))
    # 8 ranks: the Actor (pp=2, tp=2) merged onto the Critic's tp=4 groups, generating at any tp
    wide = ["pipeline=fused", "distributed.nproc_per_node=8", "model.num_layers=4", "model.num_heads=4"]
    wide += ["model.num_kv_heads=2", "pipeline.actor_pp=2"]
    wide += ["pipeline.critic_pp=2", "pipeline.actor_tp=2", "pipeline.critic_tp=4"]
    validate(resolve_components(compose_config(wide), log=lambda _: None))
    for gen_tp in (2, 4):
        validate(resolve_components(compose_config([*wide, f"generator.tp={gen_tp}"]), log=lambda _: None))
    bad = [
        *base,
        "pipeline.actor_pp=2",
        "pipeline.critic_pp=3",
        "pipeline.actor_tp=2",
        "pipeline.critic_tp=1",
    ]
    with pytest.raises(ValueError) as err:
        validate(resolve_components(compose_config(bad), log=lambda _: None))
    assert "critic.pp=3 must be a multiple of actor.tp / critic.tp = 2 / 1 = 2" in str(err.value)
