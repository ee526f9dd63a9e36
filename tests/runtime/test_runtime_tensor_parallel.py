"""Tensor parallelism of the project's Transformer (tp=2 on 2 gloo ranks, float64) equals the single-process
oracle: logits (this rank's vocabulary slice, padded rows zero), chosen-token log-probs, entropy, values,
gradients of every shard, one AdamW step, greedy tokens; and the split's arithmetic errors name the key."""

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
    # mixtures of experts: every expert split over its width, the router's partial gradient summed; Qwen3-MoE
    # with a dense second layer and top-2 of 4 renormalised, Mixtral top-2 of 3 (an odd expert count)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    _check(rank, world, ModelConfig.tiny(architecture="qwen3_moe", num_layers=2, vocab_size=VOCAB,
                                         mlp_only_layers=(1,), **moe))  # fmt: skip
    _check(rank, world, ModelConfig.tiny(architecture="mixtral", vocab_size=VOCAB, num_experts=3))


def _check(rank: int, world: int, cfg: ModelConfig) -> None:
    from rlhfuse.core.sampling import sample_from
    from rlhfuse.runtime.tensor_parallel import (
        shard_transformer,
        sync_replicated_grads,
        vocab_parallel_argmax,
        vocab_parallel_entropy,
        vocab_parallel_logprobs,
    )
    from rlhfuse.runtime.vocab_sampling import vocab_parallel_filtered_sample

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
    for name, _ in tp.named_parameters():
        mine, want = _shard_of(full, tp, name, "data")
        torch.testing.assert_close(
            mine, want, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"rank {rank} step {name}: {m}"
        )
    # the step moved the weights (equal slices after a no-op step would prove nothing)
    fresh = shard_transformer(untouched, rank, world)
    assert not torch.equal(fresh.lm_head.weight, tp.lm_head.weight)


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
