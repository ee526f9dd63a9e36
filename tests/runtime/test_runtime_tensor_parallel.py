"""Tensor parallelism of the project's Transformer (tp=2 on 2 gloo ranks, float64) equals the single-process
oracle: logits (this rank's vocabulary slice, padded rows zero), chosen-token log-probs, entropy, values,
gradients of every shard, one AdamW step, greedy tokens; each rank holds what the planner's memory model counts
(a mixture: its own whole experts, or every expert's slice of its width), and the shards reassemble into the
stepped whole model (`unshard_state`, the weight sync's and the export's source) and back (`shard_state`); the
resharding plan between whole-expert and width-split layouts covers every generation slice; and the split's
arithmetic errors name the key."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from runtime_helpers import run_distributed

from rlhfuse.models import ModelConfig, Transformer

pytestmark = pytest.mark.distributed

VOCAB = 127  # odd: padded to 128 for tp=2, rank 1 holds 63 real rows and one padded row


def _shard_of(
    full: torch.nn.Module, shard: torch.nn.Module, name: str, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the shard's tensor, the matching slice of the full model's) for parameter `name` ("weight" / "bias" of a
    module) and `what` ("data" / "grad")."""
    from rlhfuse.runtime.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    module_name, _, leaf = name.rpartition(".")
    mine_mod, full_mod = dict(shard.named_modules())[module_name], dict(full.named_modules())[module_name]
    mine, ref = getattr(getattr(mine_mod, leaf), what), getattr(getattr(full_mod, leaf), what)
    if isinstance(mine_mod, ColumnParallelLinear):
        n = mine_mod.hi - mine_mod.lo
        assert mine[n:].abs().max() == 0 if len(mine) > n else True  # padded vocabulary rows stay zero
        return mine[:n], ref[mine_mod.lo : mine_mod.hi]
    if isinstance(mine_mod, RowParallelLinear) and leaf == "weight":
        return mine, ref[:, mine_mod.lo : mine_mod.hi]
    if isinstance(mine_mod, VocabParallelEmbedding):
        s = mine_mod.shard
        return mine[: s.valid], ref[s.start : s.start + s.valid]
    return mine, ref


def _worker(rank: int, world: int) -> None:
    # biases: column and row split; kv heads split (2 of 2), then replicated (1 kv head for 2 ranks)
    _check(rank, world, ModelConfig.tiny(num_layers=2, vocab_size=VOCAB, attention_bias=True))
    _check(rank, world, ModelConfig.tiny(num_layers=2, vocab_size=VOCAB, num_kv_heads=1, attention_bias=True))
    # Qwen3: per-head q / k norms (partial gradients summed over the group), a windowed second layer
    windowed = dict(sliding_window=4, layer_types=("full_attention", "sliding_attention"))
    _check(rank, world, ModelConfig.tiny(architecture="qwen3", num_layers=2, vocab_size=VOCAB, **windowed))
    _check(
        rank, world, ModelConfig.tiny(architecture="qwen3", num_layers=2, vocab_size=VOCAB, num_kv_heads=1)
    )
    # Gemma 3: offset q / k norms (their partial gradients too), sandwich norms, scaled embeddings, local rope
    gemma3 = dict(hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=24, local_rope_theta=100.0)
    _check(rank, world, ModelConfig.tiny(architecture="gemma3_text", vocab_size=VOCAB, **windowed, **gemma3))
    # Gemma 2: soft-capped scores (the explicit path) and logits, read off the vocabulary slices
    caps = dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    _check(rank, world, ModelConfig.tiny(architecture="gemma2", vocab_size=VOCAB, **windowed, **caps))
    # mixtures of experts, the router's partial gradient summed: Qwen3-MoE with a dense second layer and top-2 of
    # 4 renormalised, 2 whole experts per rank; top-1 of 8, 4 whole experts per rank, most of them given no token
    # (each still gets its zero gradient); Mixtral top-2 of 3 (an odd expert count), every expert split over its
    # width
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    _check(rank, world, ModelConfig.tiny(architecture="qwen3_moe", num_layers=2, vocab_size=VOCAB,
                                         mlp_only_layers=(1,), **moe))  # fmt: skip
    _check(rank, world, ModelConfig.tiny(architecture="qwen3_moe", num_layers=1, vocab_size=VOCAB, num_experts=8,
                                         num_experts_per_tok=1, moe_intermediate_size=24))  # fmt: skip
    _check(rank, world, ModelConfig.tiny(architecture="mixtral", vocab_size=VOCAB, num_experts=3))


def _held(rank: int, world: int, cfg: ModelConfig, shards: dict[str, torch.nn.Module]) -> None:
    """Each shard holds exactly what the planner's memory model counts (elements and tensors), and a mixture's
    block holds its layout's experts: rank r's X / tp whole ones [r X / tp, (r + 1) X / tp) when tp divides X
    (nothing in the other experts' places), otherwise every expert's width / tp slice."""
    from rlhfuse.planner.memory import shard_count
    from rlhfuse.planner.specs import ModelSpec
    from rlhfuse.runtime.tensor_parallel import (
        ExpertHeldElsewhere,
        ExpertParallelMoEBlock,
        WidthSplitMoEBlock,
        expert_split,
    )

    spec = ModelSpec.from_config(cfg)
    for head, shard in shards.items():
        params = list(shard.parameters())
        predicted = shard_count(spec, head, tp=world)
        assert (sum(p.numel() for p in params), len(params)) == (predicted.params, predicted.tensors), head
    x, f = cfg.num_experts, cfg.expert_intermediate_size
    blocks = [m for m in shards["lm"].modules() if isinstance(m, ExpertParallelMoEBlock | WidthSplitMoEBlock)]
    assert len(blocks) == sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    for block in blocks:
        experts = dict(block.named_parameters())
        if expert_split(x, world) == "experts":
            assert isinstance(block, ExpertParallelMoEBlock)
            mine = range(rank * x // world, (rank + 1) * x // world)
            assert {n.split(".")[1] for n in experts if n.startswith("experts.")} == {str(e) for e in mine}
            assert all(experts[f"experts.{e}.down_proj.weight"].shape == (cfg.hidden_size, f) for e in mine)
            others = [e for e in range(x) if e not in mine]
            assert all(isinstance(block.experts[e], ExpertHeldElsewhere) for e in others)
        else:
            assert isinstance(block, WidthSplitMoEBlock)
            assert all(experts[f"experts.{e}.gate_proj.weight"].shape == (f // world, cfg.hidden_size)
                       for e in range(x))  # fmt: skip


def _reassembled(rank: int, shard: torch.nn.Module, whole: torch.nn.Module) -> None:
    """The shards gathered into whole tensors (`unshard_state`, what the weight sync and the export read) are
    `whole`'s (to the step's tolerance), under its names and shapes (`full_shapes`); and `shard_state` cuts them
    back into exactly this shard."""
    from rlhfuse.runtime.tensor_parallel import full_shapes, shard_state, unshard_state

    want = whole.state_dict()
    got = unshard_state(shard)
    assert got.keys() == want.keys() == full_shapes(shard).keys()
    assert full_shapes(shard) == {k: v.shape for k, v in want.items()}
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-10, msg=f"rank {rank} {name}")
    mine, back = shard.state_dict(), shard_state(shard, rank, got)
    assert back.keys() == mine.keys()
    assert all(torch.equal(back[name], value) for name, value in mine.items()), rank


def _check(rank: int, world: int, cfg: ModelConfig) -> None:
    from rlhfuse.core.sampling import sample_from
    from rlhfuse.generation.vocab_parallel import vocab_parallel_filtered_sample
    from rlhfuse.runtime.tensor_parallel import (
        shard_transformer,
        sync_replicated_grads,
        vocab_parallel_argmax,
        vocab_parallel_entropy,
        vocab_parallel_logprobs,
    )

    torch.manual_seed(0)
    full = Transformer(cfg, head="lm").double()
    critic = Transformer(cfg, head="value").double()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 9), generator=g)
    targets = torch.randint(0, VOCAB, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    weights = torch.rand(3, 9, generator=g, dtype=torch.float64)
    untouched = copy.deepcopy(full)
    tp = shard_transformer(full, rank, world)
    tp_critic = shard_transformer(critic, rank, world)
    shard = tp.vocab_shard
    assert (shard.size, shard.valid) == ((64, 64) if rank == 0 else (64, 63))
    if not cfg.family.gemma:  # the planner does not count Gemma's sandwich norms
        _held(rank, world, cfg, {"lm": tp, "value": tp_critic})

    # forward: this rank's logits slice, chosen log-probs (temperature), entropy, values
    logits_full = full(ids, attention_mask_BT=mask)
    local = tp(ids, attention_mask_BT=mask)
    assert local.shape == (3, 9, 64)
    torch.testing.assert_close(
        local[..., : shard.valid], logits_full[..., shard.start : shard.start + shard.valid]
    )
    lp = vocab_parallel_logprobs(local, targets, shard, temperature=0.7)
    lp_full = F.log_softmax(logits_full / 0.7, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp, lp_full, rtol=1e-12, atol=1e-12)
    ent = vocab_parallel_entropy(local, shard)
    p_full = logits_full.softmax(-1)
    ent_full = -(p_full * logits_full.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(ent, ent_full, rtol=1e-12, atol=1e-12)
    values, values_full = tp_critic(ids, attention_mask_BT=mask), critic(ids, attention_mask_BT=mask)
    torch.testing.assert_close(values, values_full, rtol=1e-12, atol=1e-12)
    # greedy tokens, ties to the lowest id, from the slices
    assert torch.equal(vocab_parallel_argmax(local[:, -1], shard), logits_full[:, -1].argmax(-1))
    # sampled tokens: inverse CDF over the slices equals `sample_from` over the whole softmax
    flat_local, flat_full = local.detach().reshape(-1, 64), logits_full.detach().reshape(27, VOCAB)
    u = torch.rand(27, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    want_tokens = sample_from((flat_full / 0.7).softmax(-1), u)
    got = vocab_parallel_filtered_sample(flat_local, u, shard, vocab_size=VOCAB, temperature=0.7)
    assert torch.equal(got, want_tokens)
    assert len(set(want_tokens.tolist())) > 5  # varied tokens, on both ranks' slices
    assert (want_tokens >= 64).any() and (want_tokens < 64).any()

    # gradients of every shard, then one AdamW step
    opt, opt_full = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (tp, full))
    ((lp * weights).sum() + 0.01 * ent.sum()).backward()
    ((lp_full * weights).sum() + 0.01 * ent_full.sum()).backward()
    (values * weights).sum().backward()
    (values_full * weights).sum().backward()
    sync_replicated_grads(tp)
    sync_replicated_grads(tp_critic)
    for model, ref in ((tp, full), (tp_critic, critic)):
        names = [n for n, _ in model.named_parameters()]
        assert names and all(p.grad is not None for p in model.parameters())
        bad = []
        for name in names:
            mine, want = _shard_of(ref, model, name, "grad")
            if not torch.allclose(mine, want, rtol=1e-10, atol=1e-12):
                bad.append((name, float((mine - want).abs().max()), float(want.abs().max())))
        assert not bad, (rank, bad)  # (name, max |difference|, max |gradient|) of each mismatching shard
    opt.step()
    opt_full.step()
    # AdamW's first step moves a weight by lr * g / (|g| + eps): a gradient's rounding difference d comes out as
    # lr * eps * d / (|g| + eps)^2, 100 d for |g| = 1e-6 (a router row of an expert no token chose); a wrong
    # update is off by ~lr = 1e-2
    for name, _ in tp.named_parameters():
        mine, want = _shard_of(full, tp, name, "data")
        torch.testing.assert_close(
            mine, want, rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"rank {rank} step {name}: {m}"
        )
    # the step moved the weights (equal slices after a no-op step would prove nothing)
    fresh = shard_transformer(untouched, rank, world)
    assert not torch.equal(fresh.lm_head.weight, tp.lm_head.weight)
    _reassembled(rank, tp, full)
    _reassembled(rank, tp_critic, critic)


def test_tp2_equals_the_single_process_oracle() -> None:
    run_distributed(_worker, 2, timeout=120.0)


def test_split_arithmetic_names_the_key() -> None:
    from rlhfuse.runtime.tensor_parallel import VocabShard, shard_transformer, tp_problems

    cfg = ModelConfig.tiny(num_heads=6, num_kv_heads=3, head_dim=16, intermediate_size=128)
    problems = tp_problems(cfg, 4, "pipeline.actor_tp")
    assert problems == [
        "pipeline.actor_tp=4 neither divides the model's num_kv_heads=3 (3 % 4 = 3: split) nor is a multiple of "
        "it (4 % 3 = 1: replicated): set pipeline.actor_tp to a divisor or a multiple of 3",
        "pipeline.actor_tp=4 does not divide the model's num_heads=6 (6 % 4 = 2): set pipeline.actor_tp to a "
        "divisor of 6",
    ]
    assert tp_problems(cfg, 6, "pipeline.critic_tp")[0].startswith(
        "pipeline.critic_tp=6 does not divide the model's intermediate_size=128"
    )  # kv replicated: fine
    assert tp_problems(cfg, 3, "generator.tp") == [
        "generator.tp=3 does not divide the model's intermediate_size=128 (128 % 3 = 2): set generator.tp to a "
        "divisor of 128"
    ]
    with pytest.raises(ValueError, match="num_heads=6"):
        shard_transformer(Transformer(cfg), 0, 4)
    assert [VocabShard.of(10, r, 4) for r in range(4)] == [
        VocabShard(0, 3, 3), VocabShard(3, 3, 3), VocabShard(6, 3, 3), VocabShard(9, 3, 1)
    ]  # fmt: skip


# 6 experts: whole ones at tp 2 (3 per rank), split over their width at tp 4 (6 % 4 != 0, 32 % 4 == 0)
SIX_EXPERTS = ModelConfig.tiny(architecture="qwen3_moe", vocab_size=130, num_experts=6, moe_intermediate_size=32,
                               mlp_only_layers=(1,))  # fmt: skip


@pytest.mark.parametrize(("pp", "tp"), [(1, 2), (2, 2), (1, 4)])
def test_the_reshard_plan_moves_whole_experts_and_width_slices(pp: int, tp: int) -> None:
    """Every rank of 4 plans, from its own training shard (whole experts at tp 2, width slices at tp 4), exactly
    its generation slice of every tensor for generator.tp 1, 2 and 4 (whole experts at g = 2: nothing of another
    position's experts; width slices at g = 4), each piece from a holder of the training shard that holds it;
    the ranks plan the same pieces; and where both layouts hold the same whole experts on the same ranks
    (tp = g = 2, one stage) nothing moves."""
    from rlhfuse.runtime.reshard import Resharder
    from rlhfuse.runtime.tensor_parallel import _split, expert_split, full_shapes, shard_transformer
    from rlhfuse.trainer.strategies.pipelines.config import PipelineConfig
    from rlhfuse.trainer.strategies.pipelines.training import pipeline_layout

    world = 4
    assert (expert_split(6, 2), expert_split(6, 4)) == ("experts", "width")
    layout = pipeline_layout(
        PipelineConfig(actor_pp=pp, critic_pp=pp, actor_tp=tp, critic_tp=tp), world, 8, 4
    )
    with torch.device("meta"):
        whole = Transformer(SIX_EXPERTS, head="lm")
    models = [shard_transformer(whole, layout.tp_rank(r), tp) for r in range(world)]
    names = full_shapes(models[0]).keys()
    assert all(full_shapes(m).keys() == names for m in models)  # the same names, in the same order
    assert set(names) == set(whole.state_dict())
    for g in (1, 2, 4):
        plans = [Resharder(layout, r, models[r], g, ranks_per_node=0).plan for r in range(world)]
        assert all(p.pieces == plans[0].pieces for p in plans)
        gen = [_split(shard_transformer(whole, r % g, g)) if g > 1 else {} for r in range(world)]
        shapes = full_shapes(models[0])
        for rank in range(world):
            plan, t = plans[rank], layout.tp_rank(rank)
            for i, entry in enumerate(plan.entries):
                name = entry.names[0]
                mine = [p for p in plan.pieces if p.dst == rank and p.entry == i]
                dim = gen[rank][name].dim if name in gen[rank] else _split(models[0]).get(name, (0,))[0]
                covered = torch.zeros(shapes[name][dim], dtype=torch.int64)
                for p in mine:
                    covered[p.lo : p.hi] += 1
                    assert p.src in layout.tp_grad_groups[("actor", entry.stage, layout.tp_rank(p.src))]
                    lo, hi = (
                        entry.train.bounds[layout.tp_rank(p.src)] if entry.train else (0, shapes[name][dim])
                    )
                    assert lo <= p.lo < p.hi <= hi, (g, rank, name)
                lo, hi = gen[rank][name].bounds[rank % g] if name in gen[rank] else (0, shapes[name][dim])
                want = torch.zeros_like(covered)
                want[lo:hi] = 1
                assert torch.equal(covered, want), (pp, tp, g, rank, name)
                if ".experts." in name and tp == 2:  # expert e is whole on position e // 3 only
                    owner = int(name.split(".experts.")[1].split(".")[0]) // 3
                    assert all(layout.tp_rank(p.src) == owner for p in mine), (g, rank, name)
                # what this rank's own training shard holds never comes from another rank
                if rank in layout.tp_grad_groups[("actor", entry.stage, t)] and entry.train:
                    t_lo, t_hi = entry.train.bounds[t]
                    assert all(p.hi <= t_lo or p.lo >= t_hi for p in mine if p.src != rank), (rank, name)
        if (pp, tp, g) == (1, 2, 2):
            assert all(p.src == p.dst for p in plans[0].pieces)
