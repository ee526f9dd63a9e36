"""The planner's per-rank memory model (`rlhfuse.planner.memory`) against what the runtime builds.

Each rank's modules are built in this one process with the runtime's own pieces, the way `rlhfuse-train` builds
them under pipeline=fused (`rlhfuse.trainer.build`): the layout's held stages (`pipeline_layout(...).held_stages`,
as `sharded_construction`), `from_pretrained(stages=...)` for the Actor, Ref, Critic and Reward (as
`load_models`) and a whole generation copy, `cast_models` for bf16-true, `prepare_generation_copy` (the copy in
bf16 under both bf16 precisions), `shard_transformer` for tp (as
`PipelineStrategy.tp_shard`, the pipeline inferencer's Ref / Reward and `InstanceGenerator`),
`RankStages` + `StageOptimizers` (one step, so AdamW's states exist) and the `MemoryMetrics` callback that logs
`memory/param_bytes` and `memory/optimizer_bytes`. No process group is needed to build a rank's shard.
The predicted bytes must equal the built ones exactly, per rank and per component.

pipeline=fsdp needs a process group (FSDP2 shards over one): one test spawns 2 gloo ranks, which shard the four
models as `ShardedStrategy` does (`shard_model`, after `cast_models` / `prepare_generation_copy` / the strategy's
`cast_copy` of the generation copy), build the optimizers (`build_optimizer`), run one forward, backward and
step, and measure what `MemoryMetrics` measures, on each rank.
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

from rlhfuse.core.optim import MasterWeightAdamW, OptimConfig
from rlhfuse.models import ModelConfig, Transformer, from_pretrained, save_pretrained, stage_ranges
from rlhfuse.planner.memory import (
    bytes_per_param,
    compute_bytes,
    dim0_rows,
    fsdp_kept_units,
    fsdp_padded_count,
    fsdp_padded_units,
    fsdp_rank_memories,
    fsdp_rank_memory,
    fsdp_shard_count,
    fsdp_units,
    layer_ranges,
    rank_memories,
    rank_memory,
    shard_count,
)
from rlhfuse.planner.specs import ModelSpec
from rlhfuse.runtime.partition import RankStages
from rlhfuse.runtime.stage_optimizers import StageOptimizers
from rlhfuse.runtime.tensor_parallel import shard_transformer
from rlhfuse.testing.processes import gloo_rank, spawn_ranks
from rlhfuse.trainer.build import cast_models, prepare_generation_copy
from rlhfuse.trainer.callbacks import MemoryMetrics
from rlhfuse.trainer.models import Models, ModelsConfig
from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
from rlhfuse.trainer.strategies.pipelines.training import pipeline_layout


def default_config(**overrides: object) -> ModelConfig:
    """The default job's embedded tiny model (conf/model/tiny.yaml, the synthetic task's vocabulary)."""
    from rlhfuse.data.synthetic import build_tokenizer

    m = ModelsConfig()
    base = dict(
        vocab_size=build_tokenizer().vocab_size, hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
    )  # fmt: skip
    base.update(overrides)
    return ModelConfig.tiny(**base)  # type: ignore[arg-type]


def build_rank(
    root: pathlib.Path,
    rank: int,
    world: int,
    pp: tuple[int, int],
    tp: tuple[int, int],
    gen_tp: int,
    precision: str,
) -> dict[str, float]:
    """What one rank of the runtime holds, measured on the modules it builds (tp: the Actor's and the Critic's;
    unequal: the smaller-tp model's stages merged, each rank its sub-stage's shard)."""
    layout = pipeline_layout(
        PipelineConfig(actor_pp=pp[0], critic_pp=pp[1], actor_tp=tp[0], critic_tp=tp[1]), world, 4, 1
    )
    held = layout.held_stages(rank)
    actor_s, critic_s = (layout.stages("actor"), held["actor"]), (layout.stages("critic"), held["critic"])
    models = Models(
        actor=from_pretrained(root / "sft", stages=actor_s),
        ref=from_pretrained(root / "sft", stages=actor_s).requires_grad_(False),
        reward=from_pretrained(root / "rm", head="value", stages=critic_s).requires_grad_(False),
        critic=from_pretrained(root / "rm", head="value", stages=critic_s),
        tokenizer=None,  # type: ignore[arg-type]
        sft_path=root / "sft",
        generation=from_pretrained(root / "sft").requires_grad_(False),
    )
    if precision == "bf16-true":
        cast_models(models, torch.bfloat16)
    prepare_generation_copy(models, torch.float32 if precision == "32-true" else torch.bfloat16)

    def shard(m: Transformer, like: str) -> Transformer:  # as PipelineStrategy.tp_shard
        t = layout.model_tp(like)
        return shard_transformer(m, layout.tp_rank(rank, like), t) if t > 1 else m

    actor, ref = shard(models.actor, "actor"), shard(models.ref, "actor")
    critic, reward = shard(models.critic, "critic"), shard(models.reward, "critic")
    generation = models.generation
    assert generation is not None
    if gen_tp > 1:
        generation = shard_transformer(generation, rank % gen_tp, gen_tp)
    stages = RankStages(layout, rank, {"actor": actor, "critic": critic})
    optims = StageOptimizers(stages, OptimConfig(precision=precision), total_steps=4)  # type: ignore[arg-type]
    grads = 0
    for m in ("actor", "critic"):
        for p in stages.parameters(m):
            p.grad = torch.zeros_like(p)
            grads += p.numel() * p.element_size()
        optims.optims[m].step()
    metrics: dict[str, float] = {}
    MemoryMetrics(
        lambda: [actor, critic, ref, reward, generation], lambda: list(optims.optims.values())
    ).on_metrics(None, metrics)
    masters = sum(
        t.numel() * t.element_size()
        for o in optims.optims.values()
        if isinstance(o, MasterWeightAdamW)
        for t in o.masters
    )
    metrics.update(gradients=float(grads), master_weights=float(masters))
    # the planner's entry for this rank: pipeline rank v's sub-rank j (`local_stages`; equal tp: j = 0)
    width = max(layout.merge("actor"), layout.merge("critic"))
    sub = (rank % layout.tp) // min(tp)
    metrics["local"] = float((layout.pipeline_rank(rank) % layout.group_size) * width + sub)
    return metrics


LAYOUTS = [
    # (actor_pp, critic_pp), tp, generator.tp, precision, model overrides
    ((1, 1), 1, 1, "32-true", {}),
    ((2, 2), 1, 1, "32-true", {}),
    ((2, 2), 2, 2, "32-true", {}),
    ((2, 1), 2, 1, "bf16-true", {}),
    ((2, 2), 2, 2, "bf16-mixed", {}),  # fp32 trained and frozen weights beside a bf16 generation copy
    # merged stages (unequal tp): the tp=1 model's two consecutive stages on one tp=2 group, and the mirror
    ((2, 4), (2, 1), 2, "32-true", dict(num_layers=4)),
    ((4, 2), (1, 2), 1, "bf16-true", dict(num_layers=4, vocab_size=127)),
    # grouped-query attention with kv heads replicated over tp=2, q/k/v biases, an odd vocabulary (padded rows),
    # 3 layers on 2 stages (the first stage takes the extra layer)
    (
        (2, 2),
        2,
        2,
        "bf16-true",
        dict(num_heads=4, num_kv_heads=1, architecture="qwen2", vocab_size=127, num_layers=3),
    ),
    # mixtures of experts: Qwen3-MoE with 4 experts (a dense second layer), 2 whole experts per rank in training
    # and generation; Mixtral with 3 experts, each split over its width (96 of 192 per rank), a whole generation
    # copy
    (
        (2, 2),
        2,
        2,
        "32-true",
        dict(architecture="qwen3_moe", num_experts=4, moe_intermediate_size=24, mlp_only_layers=(1,)),
    ),
    ((1, 1), 2, 1, "bf16-true", dict(architecture="mixtral", num_experts=3)),
]


@pytest.mark.parametrize(("pp", "tp", "gen_tp", "precision", "overrides"), LAYOUTS)
def test_predicted_bytes_per_rank_equal_what_the_runtime_builds(
    tmp_path: pathlib.Path,
    pp: tuple[int, int],
    tp: int | tuple[int, int],
    gen_tp: int,
    precision: str,
    overrides: dict,
) -> None:
    tps = tp if isinstance(tp, tuple) else (tp, tp)
    cfg = default_config(**overrides)
    torch.manual_seed(0)
    save_pretrained(Transformer(cfg, head="lm"), tmp_path / "sft")
    save_pretrained(Transformer(cfg, head="value"), tmp_path / "rm")
    spec = ModelSpec.from_config(cfg)
    predicted = rank_memories(
        spec,
        spec,
        actor_pp=pp[0],
        critic_pp=pp[1],
        actor_tp=tps[0],
        critic_tp=tps[1],
        gen_tp=gen_tp,
        precision=precision,
        reward=spec,
    )
    world = max(p * t for p, t in zip(pp, tps))
    assert len(predicted) * min(tps) == world
    for rank in range(world):
        built = build_rank(tmp_path, rank, world, pp, tps, gen_tp, precision)
        want = predicted[int(built["local"])]
        got = {
            "param_bytes": built["memory/param_bytes"],
            "optimizer_bytes": built["memory/optimizer_bytes"],
            "gradients": built["gradients"],
            "master_weights": built["master_weights"],
        }
        assert got == {
            "param_bytes": want.param_bytes,
            "optimizer_bytes": want.optimizer_bytes,
            "gradients": want.gradients,
            "master_weights": want.master_weights,
        }, f"rank {rank} of pp={pp} tp={tp} generator.tp={gen_tp} {precision}"


def test_a_mixture_holds_whole_experts_when_tp_divides_them_and_slices_otherwise() -> None:
    """One layer of 8 experts of width 96, hidden 64 (the router, 8 x 64, replicated): tp 2 and 4 hold 4 and 2
    whole experts (3 x 64 x 96, 3 tensors each), tp 3 a third of every expert's width (3 x 64 x 32, 24 tensors)."""
    import dataclasses

    from rlhfuse.planner.memory import expert_shard

    spec = ModelSpec("moe", layers=1, hidden=64, heads=12, head_size=16, ffn=128, vocab=12, experts=8,
                     expert_ffn=96, experts_per_token=2, moe_layers=(True,))  # fmt: skip
    no_mlp = dataclasses.replace(spec, ffn=0, moe_layers=(False,))  # a dense MLP of width 0: 3 empty tensors
    assert [expert_shard(spec, tp) for tp in (1, 2, 3, 4)] == [(8, 96), (4, 96), (8, 32), (2, 96)]
    for tp, params, tensors in (
        (1, 8 * 64 + 8 * 3 * 64 * 96, 1 + 8 * 3),
        (2, 8 * 64 + 4 * 3 * 64 * 96, 1 + 4 * 3),
        (3, 8 * 64 + 8 * 3 * 64 * 32, 1 + 8 * 3),
        (4, 8 * 64 + 2 * 3 * 64 * 96, 1 + 2 * 3),
    ):
        n, rest = shard_count(spec, "lm", tp=tp), shard_count(no_mlp, "lm", tp=tp)
        assert (n.params - rest.params, n.tensors - rest.tensors + 3) == (params, tensors), tp


def test_layer_ranges_are_the_runtime_split() -> None:
    for layers in range(1, 25):
        for pp in range(1, layers + 1):
            assert layer_ranges(layers, pp) == stage_ranges(layers, pp), (layers, pp)


def test_shard_count_counts_every_tensor_of_a_whole_model() -> None:
    for overrides in (
        {},
        dict(architecture="qwen2"),
        dict(attention_bias=True),
        dict(tie_word_embeddings=True),
    ):
        cfg = default_config(**overrides)
        for head in ("lm", "value"):
            model = Transformer(cfg, head=head)
            unique = {id(p): p for p in model.parameters()}.values()
            n = shard_count(ModelSpec.from_config(cfg), head)
            assert (n.params, n.tensors) == (sum(p.numel() for p in unique), len(unique)), (overrides, head)


def test_edge_stages_vocab_padding_and_the_generation_copy_show_in_the_busiest_rank() -> None:
    spec = ModelSpec("m", layers=4, hidden=64, heads=4, ffn=128, vocab=1001, kv_heads=2)
    one = rank_memories(spec, spec, precision="32-true", reward=spec)[0]
    pp2 = rank_memories(spec, spec, actor_pp=2, critic_pp=2, precision="32-true", reward=spec)
    # the stages partition the models; rank 0 holds the Actor's embedding and the Critic's last stage (a value
    # head), rank 1 the Actor's LM head and the Critic's embedding: two vocabulary tables, the busiest rank
    assert pp2[0].trained_weights + pp2[1].trained_weights == one.trained_weights
    assert pp2[1].trained_weights - pp2[0].trained_weights == 4 * 1001 * 64 - 4 * 64
    assert rank_memory(spec, spec, actor_pp=2, critic_pp=2, reward=spec) == pp2[1]
    # vocabulary padded to a multiple of tp: 1001 rows -> 501 per rank
    tp2 = shard_count(spec, "lm", tp=2)
    assert (
        tp2.params - shard_count(ModelSpec("m", 4, 64, 4, 128, vocab=1002, kv_heads=2), "lm", tp=2).params
        == 0
    )
    # the whole generation copy does not shrink with training tp; generator.tp = 2 halves it (padded vocab)
    whole = rank_memories(spec, spec, actor_tp=2, gen_tp=1, reward=spec)[0]
    half = rank_memories(spec, spec, actor_tp=2, gen_tp=2, reward=spec)[0]
    assert whole.generation_weights == 4 * shard_count(spec, "lm").params
    assert half.generation_weights == 4 * tp2.params
    # offload moves the frozen weights out of the resident bytes, into the inference phase
    off = rank_memories(spec, spec, offload=True, reward=spec)[0]
    assert off.frozen_weights == 0 and off.frozen_offloaded == one.frozen_weights
    assert off.resident == one.resident - one.frozen_weights


@pytest.mark.parametrize(("kv_heads", "tp"), [(2, 1), (2, 2), (1, 2)])
def test_kv_cache_estimate_is_the_cache_a_generation_rank_allocates(kv_heads: int, tp: int) -> None:
    """The KV cache of `slots x max_len` positions on one rank of a generation instance of tp ranks: the K and V
    buffers the generation engine allocates for its shard (`Transformer.cache_config`: its kv heads; one
    replicated head when tp is a multiple of them), fp32 like the generation copy (the per-slot lengths and
    validity flags aside)."""
    from rlhfuse.models.cache import KVCache
    from rlhfuse.planner.memory import kv_cache_bytes

    cfg = default_config(num_heads=4, num_kv_heads=kv_heads, head_dim=16)
    model = Transformer(cfg, head="lm")
    shard = shard_transformer(model, tp - 1, tp) if tp > 1 else model
    cache_cfg = shard.cache_config()
    slots, max_len, block_size = 3, 40, 8
    # the block pool at its largest, every slot full (the pool grows to it on demand)
    cache = KVCache.allocate(
        cache_cfg, slots, max_len, dtype=next(shard.parameters()).dtype, block_size=block_size,
        num_blocks=slots * max_len // block_size,
    )  # fmt: skip
    built = sum(t.numel() * t.element_size() for t in (*cache.k_layers, *cache.v_layers))
    assert cache.num_blocks == cache.max_blocks
    spec = ModelSpec.from_config(cfg)
    assert kv_cache_bytes(spec, slots * max_len, tp, 4) == built  # the fp32 copy


# ---- pipeline=fsdp -------------------------------------------------------------------------------------------
QWEN2_ODD = dict(num_heads=4, num_kv_heads=1, architecture="qwen2", vocab_size=127, num_layers=3)
FSDP_CASES = [
    # (model overrides, precision, reshard_after_forward): grouped-query attention with q/k/v biases, an odd
    # vocabulary (rank 1's embedding and LM-head shards one row short) and a value head of one row (rank 1's
    # shard empty), in each precision; a tied Qwen3-MoE (q/k norms, a dense first layer, three experts)
    (QWEN2_ODD, "32-true", True),
    (QWEN2_ODD, "bf16-mixed", True),
    (QWEN2_ODD, "bf16-true", False),
    (
        dict(architecture="qwen3_moe", num_experts=3, moe_intermediate_size=24, mlp_only_layers=(0,),
             tie_word_embeddings=True, head_dim=16),
        "32-true",
        True,
    ),
]  # fmt: skip


def _fsdp_rank(cfg: ModelConfig, precision: str, reshard_after_forward: bool) -> dict[str, float]:
    """One rank of pipeline=fsdp built with the runtime's pieces: what `MemoryMetrics` logs (collective: the most
    any rank holds), this rank's own figures, its gradients and masters, and what its models hold after a
    forward of each without gradients (inference, as `ShardedInference` runs them)."""
    from rlhfuse.core.optim import build_optimizer, generation_dtype
    from rlhfuse.distributed.fsdp import ShardingPolicy, local_tensor, shard_model
    from rlhfuse.models import cast_copy, resident_bytes

    torch.manual_seed(0)
    models = Models(
        actor=Transformer(cfg, head="lm"),
        ref=Transformer(cfg, head="lm").requires_grad_(False),
        reward=Transformer(cfg, head="value").requires_grad_(False),
        critic=Transformer(cfg, head="value"),
        tokenizer=None,  # type: ignore[arg-type]
        sft_path=pathlib.Path("."),
    )
    if precision == "bf16-true":
        cast_models(models, torch.bfloat16)
    prepare_generation_copy(models, generation_dtype(precision))
    if models.generation is None:  # as `fsdp_strategy`: a whole copy kept aside before the Actor is sharded
        models.generation = cast_copy(models.actor, generation_dtype(precision))
    policy = ShardingPolicy(
        param_dtype=torch.bfloat16 if precision == "bf16-mixed" else None,
        reshard_after_forward=reshard_after_forward,
    )
    sharded = [models.actor, models.critic, models.ref, models.reward]
    for model in sharded:
        shard_model(model, model.layers, policy, device_type="cpu", forward_methods=("packed_outputs",))
    config = OptimConfig(precision=precision)  # type: ignore[arg-type]
    optims = [build_optimizer(m.parameters(), 1e-3, config, 4)[0] for m in (models.actor, models.critic)]
    ids_BT = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    for model in (models.actor, models.critic):
        model(ids_BT).float().square().mean().backward()
    grads = {
        local_tensor(p.grad).untyped_storage().data_ptr(): local_tensor(p.grad).untyped_storage().nbytes()
        for m in (models.actor, models.critic)
        for p in m.parameters()
        if p.grad is not None
    }  # one reduce-scatter output per unit
    for optim in optims:
        optim.step()
    modules = [models.actor, models.ref, models.critic, models.reward, models.generation]
    metrics: dict[str, float] = {}
    MemoryMetrics(lambda: modules, lambda: optims).on_metrics(None, metrics)
    built = {
        **metrics,
        "param_bytes": float(resident_bytes(*modules)),
        "optimizer_bytes": float(
            sum(
                local_tensor(t).numel() * t.element_size()
                for o in optims
                for state in o.state.values()
                for t in state.values()
                if isinstance(t, torch.Tensor)
            )
        ),
        "gradients": float(sum(grads.values())),
        "master_weights": float(
            sum(local_tensor(t).numel() * t.element_size() for o in optims for t in getattr(o, "masters", []))
        ),
    }
    with torch.no_grad():  # inference: a unit still gathered shows its whole weights in place of its shard
        for model in sharded:
            model(ids_BT)
    built["after_inference"] = float(resident_bytes(*sharded))
    return built


def _fsdp_worker(rank: int, port: int, out_dir: str) -> None:

    with gloo_rank(rank, port, timeout_s=60):
        built = [_fsdp_rank(default_config(**o), p, r) for o, p, r in FSDP_CASES]
        torch.save(built, os.path.join(out_dir, f"rank{rank}.pt"))


def _after_inference(spec: ModelSpec, world: int, precision: str, reshard_after_forward: bool) -> float:
    """The four sharded models' bytes after inference by `fsdp_kept_units`: a kept unit gathered whole in the
    compute dtype, every other unit its padded shard in the weights' dtype."""
    weight, gather = bytes_per_param(precision).weight, compute_bytes(precision)
    total = 0.0
    for head, trained in (("lm", True), ("value", True), ("lm", False), ("value", False)):
        kept = fsdp_kept_units(trained, spec.layers, reshard_after_forward=reshard_after_forward)
        for i, n in enumerate(fsdp_padded_units(spec, head, world)):
            total += world * n * gather if i in kept else n * weight
    return total


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_fsdp_predicted_bytes_per_rank_equal_what_two_gloo_ranks_build(tmp_path: pathlib.Path) -> None:
    assert spawn_ranks(_fsdp_worker, str(tmp_path), timeout_s=200) == [0, 0]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    keys = ("param_bytes", "optimizer_bytes", "gradients", "master_weights")
    for i, (overrides, precision, reshard) in enumerate(FSDP_CASES):
        spec = ModelSpec.from_config(default_config(**overrides))
        predicted = fsdp_rank_memories(
            spec, spec, world=2, precision=precision, reward=spec, reshard_after_forward=reshard
        )
        for rank in range(2):
            built, want = ranks[rank][i], predicted[rank]
            assert {k: built[k] for k in keys} == {k: getattr(want, k) for k in keys}, (
                f"rank {rank} of {overrides} {precision}"
            )
            # the logged metrics: the most any rank holds (rank 0: the longer shards)
            assert built["memory/param_bytes"] == max(m.param_bytes for m in predicted)
            assert built["memory/optimizer_bytes"] == predicted[0].optimizer_bytes
            # what inference leaves gathered: the trained roots, and every layer without reshard_after_forward
            assert built["after_inference"] == _after_inference(spec, 2, precision, reshard)
        if overrides is QWEN2_ODD:  # the short and the empty shards: rank 1 holds less optimizer state
            assert predicted[1].optimizer_bytes < predicted[0].optimizer_bytes
        assert predicted[0].param_bytes == predicted[1].param_bytes  # padded shards: equal on every rank


def test_fsdp_units_hold_every_tensor_and_shards_partition_them() -> None:
    """`fsdp_units` lists the tensors `shard_count` counts (root first, then the decoder layers as the model's
    `layers`); dim-0 shards partition every tensor, each padded to ceil(rows / world) rows."""
    for overrides in ({}, dict(architecture="qwen2", vocab_size=127), dict(tie_word_embeddings=True)):
        cfg = default_config(**overrides)
        spec = ModelSpec.from_config(cfg)
        for head in ("lm", "value"):
            model = Transformer(cfg, head=head)
            units = fsdp_units(spec, head)
            layer = [sorted(p.shape[0] for p in m.parameters()) for m in model.layers]
            assert [sorted(r for r, _ in u) for u in units[1:]] == layer, (overrides, head)
            whole = shard_count(spec, head)
            assert (sum(r * c for u in units for r, c in u), sum(map(len, units))) == (
                whole.params,
                whole.tensors,
            )
            for world in (1, 2, 3, 8):
                shards = [fsdp_shard_count(spec, head, world, r) for r in range(world)]
                assert sum(s.params for s in shards) == whole.params
                assert all(s.tensors == whole.tensors for s in shards)
                padded = fsdp_padded_count(spec, head, world)
                assert padded >= shards[0].params and padded * world >= whole.params
    # torch.chunk's split: 5 rows over 4 ranks are 2, 2, 1 and none
    assert [dim0_rows(5, 4, r) for r in range(4)] == [2, 2, 1, 0]
    assert [dim0_rows(1, 2, r) for r in range(2)] == [1, 0]


def test_fsdp_phases_gather_what_the_runtime_gathers() -> None:
    """Hand-derived phases of a 2-layer model with equal layers on 2 ranks (all but the one-row value head split
    evenly): inference keeps the trained roots gathered (and their layers with reshard_after_forward=False) beside
    the two largest other units; training gathers both trained roots and two layers (all trained layers with
    reshard_after_forward=False) and keeps two layers' unsharded gradients (the whole
    models' while several micro-batches accumulate); the resident shards are the same in every phase."""
    spec = ModelSpec("m", layers=2, hidden=64, heads=4, ffn=128, vocab=1000, kv_heads=2)
    lm = 2 * 1000 * 64 + 64  # embedding, final norm, LM head
    value = 1000 * 64 + 64 + 2 * 64  # the one-row value head padded to a row per rank: two rows gathered
    layer = (shard_count(spec, "lm").params - lm) // 2
    for precision, gather, reduce in (("32-true", 4, 4), ("bf16-mixed", 2, 4), ("bf16-true", 2, 2)):
        one = fsdp_rank_memory(spec, spec, world=2, precision=precision, reward=spec)
        # inference: both trained roots kept; the two largest others are the Ref's root and the Reward's
        assert one.rollout_gathered == (lm + value + lm + value) * gather
        assert one.train_gathered == (lm + value + 2 * layer) * gather + 2 * layer * reduce
        kept = fsdp_rank_memory(
            spec, spec, world=2, precision=precision, reward=spec, reshard_after_forward=False
        )
        # the trained models' layers kept too; a frozen model frees every unit after each forward
        assert kept.rollout_gathered == (lm + value + 4 * layer + lm + value) * gather
        assert kept.train_gathered == (lm + value + 4 * layer) * gather + 2 * layer * reduce
        accumulated = fsdp_rank_memory(spec, spec, world=2, precision=precision, microbatches=4)
        assert (
            accumulated.train_gathered
            == (lm + value + 2 * layer) * gather + (lm + value + 4 * layer) * reduce
        )
        assert one.peak == one.resident + max(one.training, one.rollout)
    # sharding halves the trained state; the generation copy stays whole
    a, b = (fsdp_rank_memory(spec, spec, world=w, precision="bf16-true") for w in (1, 2))
    assert b.train_state == pytest.approx(a.train_state / 2, rel=1e-3)
    assert a.generation_weights == b.generation_weights == 2 * shard_count(spec, "lm").params
