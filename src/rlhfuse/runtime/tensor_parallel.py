"""Megatron-style tensor parallelism of the project's `Transformer` (no DTensor: the model's own modules are
sliced in place, so the forward code is the one of `rlhfuse.models`).

`shard_transformer(model, rank, tp, group)` returns a copy of `model` holding rank `rank`'s shard:

- attention: q / k / v column-parallel by heads, o row-parallel; kv heads are split when tp divides them and
  replicated otherwise (tp a multiple of them: each rank holds the one kv head its query heads read, and
  `sync_replicated_grads` sums that head's weight gradients over the ranks sharing it);
- MLP: gate / up column-parallel over the intermediate size, down row-parallel;
- mixture-of-experts MLP (`ParallelMoEBlock`): the router replicated, every expert split like a dense MLP over
  its own intermediate size (every rank holds 1 / tp of every expert, Megatron's expert tensor parallelism, not
  whole experts per rank); the block copies its input to the group once and sums its weighted partial output
  over the group once, so a block costs one all-reduce forward and one backward whatever the expert count; the
  router's weight gradient is then a partial sum (each rank saw its slices' outputs) until
  `sync_replicated_grads` sums it;
- embedding and LM head vocabulary-parallel: rank r holds rows [r * V_p / tp, (r + 1) * V_p / tp) of the
  vocabulary padded to V_p, a multiple of tp (padded rows are zero and their logits are masked to -inf, so they
  are never sampled and carry no probability); the LM head returns this rank's slice of the logits only;
- norms and the value head replicated (the value head reads the replicated final hidden state); Qwen3's per-head
  q / k norms too, but they see this rank's heads only, so each rank's gradient is a partial sum over its heads
  (`HeadParallelRMSNorm`, summed over the group by `sync_replicated_grads`).

The vocabulary-parallel read-outs (`vocab_parallel_logprobs`, `vocab_parallel_entropy`, `vocab_parallel_argmax`)
never gather the full logits: one max, one sum and one chosen-logit reduction over the group.

Legend: B batch rows, T tokens, D width, V vocabulary (Vl: this rank's slice).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlhfuse import distributed
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.models.transformer import MoEBlock, RMSNorm


def tp_problems(config: ModelConfig, tp: int, key: str) -> list[str]:
    """What stops `config` from being split `tp` ways (each with the arithmetic and the key to change)."""
    problems: list[str] = []
    if tp < 1:
        return [f"{key}={tp} must be >= 1"]
    kv = config.num_kv_heads
    if kv % tp and tp % kv:
        problems.append(
            f"{key}={tp} neither divides the model's num_kv_heads={kv} ({kv} % {tp} = {kv % tp}: split) nor is a "
            f"multiple of it ({tp} % {kv} = {tp % kv}: replicated): set {key} to a divisor or a multiple of {kv}"
        )
    widths = [("num_heads", config.num_heads)]
    layers = range(config.num_layers)
    if any(not config.is_moe_layer(i) for i in layers):  # a dense MLP somewhere
        widths.append(("intermediate_size", config.intermediate_size))
    if any(config.is_moe_layer(i) for i in layers):  # every expert is split over its own width
        widths.append(("expert intermediate size", config.expert_intermediate_size))
    for name, value in widths:
        if value % tp:
            problems.append(
                f"{key}={tp} does not divide the model's {name}={value} ({value} % {tp} = {value % tp}): "
                f"set {key} to a divisor of {value}"
            )
    return problems


@dataclass(frozen=True)
class VocabShard:
    """Rank `rank`'s rows [start, start + size) of the padded vocabulary; `valid` of them are real tokens."""

    start: int
    size: int
    valid: int

    @staticmethod
    def of(vocab: int, rank: int, tp: int) -> VocabShard:
        padded = -(-vocab // tp) * tp
        size = padded // tp
        start = rank * size
        return VocabShard(start, size, max(0, min(vocab, start + size) - start))


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T (+ b_local): the output features [lo, hi) of a linear layer; the input's gradient is
    summed over the group."""

    def __init__(self, full: nn.Linear, lo: int, hi: int, group: Any, rows: int | None = None) -> None:
        super().__init__()
        self.group, self.lo, self.hi = group, lo, hi
        self.full_rows = int(full.weight.shape[0])
        self.bounds: list[tuple[int, int]] = [(lo, hi)]
        """Every rank's [lo, hi) of the full rows (set by `shard_transformer`): what `unshard_state` reassembles."""
        self.replicated: tuple[int, int] | None = None
        """(kv head, kv heads) when this slice is a kv head other ranks hold too (`sync_replicated_grads`)."""
        weight = full.weight.detach()[lo:hi]
        if rows is not None and rows > weight.shape[0]:  # vocabulary padding: zero rows
            weight = torch.cat([weight, weight.new_zeros(rows - weight.shape[0], weight.shape[1])])
        self.weight = nn.Parameter(weight.clone(), requires_grad=full.weight.requires_grad)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach()[lo:hi].clone())

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(distributed.copy_to_group(x, self.group), self.weight, self.bias)


class HeadParallelRMSNorm(RMSNorm):
    """A per-head RMSNorm (Qwen3's q_norm / k_norm) applied to this rank's heads: the weight is the same on every
    rank, its gradient a partial sum over this rank's heads until `sync_replicated_grads` sums it over the group."""

    @classmethod
    def of(cls, full: RMSNorm) -> HeadParallelRMSNorm:
        norm = cls(int(full.weight.shape[0]), full.eps, full.offset)
        norm.weight = nn.Parameter(full.weight.detach().clone(), requires_grad=full.weight.requires_grad)
        return norm


def sync_replicated_grads(model: nn.Module, group: Any = None) -> None:
    """Sum the gradients of replicated kv heads over the ranks sharing each head (one all-reduce per tensor:
    every rank writes its gradient into its head's slot of a zero buffer), and the per-head norms' and the
    routers' partial gradients over the group. Call after backward, before the optimizer step; a no-op when
    every kv head is split and no layer normalises its heads or routes to experts."""
    for module in model.modules():
        if isinstance(module, HeadParallelRMSNorm) and module.weight.grad is not None:
            distributed.all_reduce(module.weight.grad, group=group)
        if isinstance(module, ParallelMoEBlock) and module.gate.weight.grad is not None:
            distributed.all_reduce(module.gate.weight.grad, group=group)
        if isinstance(module, ColumnParallelLinear) and module.replicated is not None:
            head, heads = module.replicated
            for p in (module.weight, module.bias):
                if p is None or p.grad is None:
                    continue
                buf = p.grad.new_zeros((heads, *p.grad.shape))
                buf[head] = p.grad
                distributed.all_reduce(buf, group=group)
                p.grad.copy_(buf[head])


def tp_copies(module: nn.Module, tp: int) -> dict[int, int]:
    """id(parameter) -> how many ranks of the tp group hold an identical copy of it: 1 for the split weights,
    tp / kv heads for a replicated kv head, tp for everything replicated (norms, row-parallel biases, the value
    head). A gradient norm over the group divides each parameter's squared norm by it."""
    out = {id(p): tp for p in module.parameters()}
    for sub in module.modules():
        if isinstance(sub, ColumnParallelLinear):
            copies = 1 if sub.replicated is None else tp // sub.replicated[1]
            for p in (sub.weight, sub.bias):
                if p is not None:
                    out[id(p)] = copies
        elif isinstance(sub, RowParallelLinear | VocabParallelEmbedding):
            out[id(sub.weight)] = 1
    return out


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_local W[:, lo:hi]^T, then the (replicated) bias."""

    def __init__(self, full: nn.Linear, lo: int, hi: int, group: Any) -> None:
        super().__init__()
        self.group, self.lo, self.hi = group, lo, hi
        self.full_cols = int(full.weight.shape[1])
        self.bounds: list[tuple[int, int]] = [(lo, hi)]
        """Every rank's [lo, hi) of the full columns (set by `shard_transformer`)."""
        self.weight = nn.Parameter(
            full.weight.detach()[:, lo:hi].clone(), requires_grad=full.weight.requires_grad
        )
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        y = distributed.reduce_from_group(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class LocalColumnLinear(ColumnParallelLinear):
    """A column-parallel expert projection (gate / up) inside `ParallelMoEBlock`, which has copied the input to
    the group already: no communication of its own."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class LocalRowLinear(RowParallelLinear):
    """A row-parallel expert projection (down) inside `ParallelMoEBlock`: its partial output is summed over the
    group once per block, after the experts' outputs are weighted and added (so it carries no bias)."""

    def __init__(self, full: nn.Linear, lo: int, hi: int, group: Any) -> None:
        if full.bias is not None:
            raise ValueError("an expert's down projection with a bias cannot be summed once per block")
        super().__init__(full, lo, hi, group)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class ParallelMoEBlock(MoEBlock):
    """`MoEBlock` over a tensor-parallel group (see the module docstring): the same routing on every rank (its
    input is the same), each expert run on its tokens over this rank's slice of its width, one all-reduce of the
    weighted sum."""

    group: Any

    @classmethod
    def of(cls, full: MoEBlock, config: ModelConfig, group: Any) -> ParallelMoEBlock:
        """A block holding `full`'s router and experts (not copied: `shard_transformer` splits the experts'
        projections in place after)."""
        with torch.device("meta"):
            block = cls(config)
        block.gate, block.experts, block.group = full.gate, full.experts, group
        return block

    def forward(self, x_BTD: Tensor) -> Tensor:
        partial_BTD = super().forward(distributed.copy_to_group(x_BTD, self.group))
        return distributed.reduce_from_group(partial_BTD, self.group)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + size) of the (padded) table; ids elsewhere look up zeros, summed over the group."""

    def __init__(self, full: nn.Embedding, shard: VocabShard, group: Any) -> None:
        super().__init__()
        self.shard, self.group = shard, group
        self.full_rows = int(full.weight.shape[0])
        self.bounds: list[tuple[int, int]] = [(shard.start, shard.start + shard.valid)]
        rows = full.weight.detach()[shard.start : shard.start + shard.valid]
        pad = rows.new_zeros(shard.size - shard.valid, rows.shape[1])
        self.weight = nn.Parameter(torch.cat([rows, pad]).clone(), requires_grad=full.weight.requires_grad)

    def forward(self, ids_BT: Tensor) -> Tensor:
        local_BT = ids_BT - self.shard.start
        outside_BT = (local_BT < 0) | (local_BT >= self.shard.size)
        x_BTD = F.embedding(local_BT.clamp(0, self.shard.size - 1), self.weight)
        x_BTD = x_BTD * (~outside_BT).unsqueeze(-1).to(x_BTD.dtype)
        return distributed.reduce_from_group(x_BTD, self.group)


def shard_transformer(model: Transformer, rank: int, tp: int, group: Any = None) -> Transformer:
    """A copy of `model` holding rank `rank`'s tensor-parallel shard (see the module docstring)."""
    cfg = model.config
    problems = tp_problems(cfg, tp, "tp")
    if problems:
        raise ValueError("cannot split the model tensor-parallel:\n  - " + "\n  - ".join(problems))
    if model.head == "lm" and cfg.tie_word_embeddings and tp > 1:
        raise ValueError("a tied embedding / LM head is not split tensor-parallel yet: untie it or use tp=1")
    out = copy.deepcopy(model)
    e = cfg.resolved_head_dim
    h, f = cfg.num_heads // tp, cfg.intermediate_size // tp
    split_kv = cfg.num_kv_heads % tp == 0
    k = cfg.num_kv_heads // tp if split_kv else 1

    def first_kv(r: int) -> int:
        """The first kv head rank r holds (replicated: the one its query heads read)."""
        return r * k if split_kv else r * h // (cfg.num_heads // cfg.num_kv_heads)

    def spans(width: int, start: Any = None) -> list[tuple[int, int]]:
        starts = [start(r) if start else r * width for r in range(tp)]
        return [(lo, lo + width) for lo in starts]

    q_spans, f_spans = spans(h * e), spans(f)
    expert_spans = spans(cfg.expert_intermediate_size // tp) if cfg.num_experts else []
    kv_spans = spans(k * e, lambda r: first_kv(r) * e)

    def column(
        full: nn.Linear,
        bounds: list[tuple[int, int]],
        kind: type[ColumnParallelLinear] = ColumnParallelLinear,
    ) -> ColumnParallelLinear:
        mod = kind(full, *bounds[rank], group)
        mod.bounds = bounds
        return mod

    def row(
        full: nn.Linear, bounds: list[tuple[int, int]], kind: type[RowParallelLinear] = RowParallelLinear
    ) -> RowParallelLinear:
        mod = kind(full, *bounds[rank], group)
        mod.bounds = bounds
        return mod

    for layer in out.layers:
        attn: Any = layer.self_attn
        attn.q_proj = column(attn.q_proj, q_spans)
        attn.k_proj = column(attn.k_proj, kv_spans)
        attn.v_proj = column(attn.v_proj, kv_spans)
        if not split_kv:
            for proj in (attn.k_proj, attn.v_proj):
                proj.replicated = (first_kv(rank), cfg.num_kv_heads)
        attn.o_proj = row(attn.o_proj, q_spans)
        if attn.qk_norm:
            attn.q_norm, attn.k_norm = (
                HeadParallelRMSNorm.of(attn.q_norm),
                HeadParallelRMSNorm.of(attn.k_norm),
            )
        attn.num_heads, attn.num_kv_heads = h, k
        mlp: Any = layer.mlp
        if isinstance(mlp, MoEBlock):
            layer.mlp = ParallelMoEBlock.of(mlp, cfg, group)
            expert: Any
            for expert in mlp.experts:
                expert.gate_proj = column(expert.gate_proj, expert_spans, LocalColumnLinear)
                expert.up_proj = column(expert.up_proj, expert_spans, LocalColumnLinear)
                expert.down_proj = row(expert.down_proj, expert_spans, LocalRowLinear)
            continue
        mlp.gate_proj = column(mlp.gate_proj, f_spans)
        mlp.up_proj = column(mlp.up_proj, f_spans)
        mlp.down_proj = row(mlp.down_proj, f_spans)
    shards = [VocabShard.of(cfg.vocab_size, r, tp) for r in range(tp)]
    vocab_spans = [(sh.start, sh.start + sh.valid) for sh in shards]
    shard = shards[rank]
    embed = VocabParallelEmbedding(model.embed_tokens, shard, group)
    embed.bounds = vocab_spans
    out.embed_tokens = embed  # type: ignore[assignment]
    if model.head == "lm":
        head = ColumnParallelLinear(
            model.lm_head, shard.start, shard.start + shard.valid, group, rows=shard.size
        )
        head.bounds = vocab_spans
        out.lm_head = head  # type: ignore[assignment]
    out.vocab_shard = shard  # type: ignore[assignment]
    out.tp_group = group  # type: ignore[assignment]
    return out


def _split(module: nn.Module) -> dict[str, tuple[int, list[tuple[int, int]], int]]:
    """state-dict name -> (split dim, every rank's [lo, hi) along it, full size) of the split tensors of a
    shard (`shard_transformer`); tensors not listed are replicated."""
    out: dict[str, tuple[int, list[tuple[int, int]], int]] = {}
    for name, sub in module.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(sub, ColumnParallelLinear | VocabParallelEmbedding):
            out[prefix + "weight"] = (0, sub.bounds, sub.full_rows)
            if getattr(sub, "bias", None) is not None:
                out[prefix + "bias"] = (0, sub.bounds, sub.full_rows)
        elif isinstance(sub, RowParallelLinear):
            out[prefix + "weight"] = (1, sub.bounds, sub.full_cols)
    return out


def full_shapes(module: nn.Module) -> dict[str, torch.Size]:
    """state-dict name -> the whole model's shape of every tensor of a shard (meta ones included)."""
    split = _split(module)
    out: dict[str, torch.Size] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        shape = list(t.shape)
        if name in split:
            dim, _, size = split[name]
            shape[dim] = size
        out[name] = torch.Size(shape)
    return out


def unshard_state(module: nn.Module, group: Any = None) -> dict[str, Tensor]:
    """Collective over the tp group: the whole tensors of the shard's materialised entries (split ones
    all-gathered and reassembled, padded vocabulary rows dropped; replicated ones this rank's own), and meta
    tensors of the whole shape for the entries held elsewhere (other pipeline stages)."""
    split, shapes = _split(module), full_shapes(module)
    out: dict[str, Tensor] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if t.is_meta:
            out[name] = torch.empty(shapes[name], dtype=t.dtype, device="meta")
        elif name not in split:
            out[name] = t.detach()
        else:
            dim, bounds, _ = split[name]
            parts = distributed.all_gather(t.detach().contiguous(), group=group)
            whole = t.new_empty(shapes[name])
            for (lo, hi), part in zip(bounds, parts, strict=True):
                whole.narrow(dim, lo, hi - lo).copy_(part.narrow(dim, 0, hi - lo))
            out[name] = whole
    return out


def shard_state(module: nn.Module, rank: int, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of `unshard_state` for rank `rank`: this rank's slice of every whole tensor in `state` (padded
    vocabulary rows zero), for the entries materialised in `module`."""
    split = _split(module)
    out: dict[str, Tensor] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if t.is_meta:
            continue
        if name not in split:
            out[name] = state[name]
            continue
        dim, bounds, _ = split[name]
        lo, hi = bounds[rank]
        mine = torch.zeros_like(t)
        mine.narrow(dim, 0, hi - lo).copy_(state[name].narrow(dim, lo, hi - lo))
        out[name] = mine
    return out


def mask_padded_vocab(logits_BTV: Tensor, shard: VocabShard) -> Tensor:
    """This rank's logits with the padded rows at -inf."""
    if shard.valid == shard.size:
        return logits_BTV
    keep = torch.arange(shard.size, device=logits_BTV.device) < shard.valid
    return logits_BTV.masked_fill(~keep, float("-inf"))


def vocab_parallel_logsumexp(logits_BTV: Tensor, shard: VocabShard, group: Any = None) -> Tensor:
    """log sum_v exp(logit_v) over the whole vocabulary, from each rank's slice (differentiable)."""
    logits_BTV = mask_padded_vocab(logits_BTV, shard)
    m_BT = distributed.max_over_group(logits_BTV.max(dim=-1).values, group)
    local_BT = (logits_BTV - m_BT.unsqueeze(-1)).exp().sum(dim=-1)
    return m_BT + distributed.reduce_from_group(local_BT, group).log()


def vocab_parallel_logprobs(
    logits_BTV: Tensor, ids_BT: Tensor, shard: VocabShard, group: Any = None, temperature: float = 1.0
) -> Tensor:
    """log softmax(logits / temperature)[ids]: the chosen tokens' log-probs, never gathering the logits."""
    logits_BTV = logits_BTV / temperature
    local_BT = ids_BT - shard.start
    inside_BT = (local_BT >= 0) & (local_BT < shard.valid)
    chosen_BT = logits_BTV.gather(-1, local_BT.clamp(0, shard.size - 1).unsqueeze(-1)).squeeze(-1)
    chosen_BT = distributed.reduce_from_group(chosen_BT * inside_BT.to(chosen_BT.dtype), group)
    return chosen_BT - vocab_parallel_logsumexp(logits_BTV, shard, group)


def vocab_parallel_entropy(logits_BTV: Tensor, shard: VocabShard, group: Any = None) -> Tensor:
    """Entropy of softmax(logits) per position, m + log S - N / S with S = sum_v exp(l_v - m) and
    N = sum_v exp(l_v - m) l_v: both sums reduced over the group before they are combined, so that every
    rank's gradient of the replicated result reaches its own slice exactly (padded rows carry no probability)."""
    masked = mask_padded_vocab(logits_BTV, shard)
    m_BT = distributed.max_over_group(masked.max(dim=-1).values, group)
    e_BTV = (masked - m_BT.unsqueeze(-1)).exp()
    s_BT = distributed.reduce_from_group(e_BTV.sum(dim=-1), group)
    n_BT = distributed.reduce_from_group((e_BTV * masked.masked_fill(e_BTV == 0, 0.0)).sum(dim=-1), group)
    return m_BT + s_BT.log() - n_BT / s_BT


def vocab_parallel_argmax(logits_BV: Tensor, shard: VocabShard, group: Any = None) -> Tensor:
    """Greedy tokens (global ids; ties to the lowest id) from each rank's slice: one max and one min reduction."""
    masked = mask_padded_vocab(logits_BV.detach(), shard)
    best_B = distributed.max_over_group(masked.max(dim=-1).values, group)
    ids = torch.arange(shard.size, device=masked.device) + shard.start
    big = torch.iinfo(torch.int64).max
    mine_B = torch.where(masked == best_B.unsqueeze(-1), ids, torch.full_like(ids, big)).min(dim=-1).values
    distributed.all_reduce(mine_B, op="min", group=group)
    return mine_B
