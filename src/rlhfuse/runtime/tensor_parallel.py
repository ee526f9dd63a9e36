"""Megatron-style tensor parallelism of the project's `Transformer` (no DTensor: the model's own modules are
sliced in place, so the forward code is the one of `rlhfuse.models`).

`shard_transformer(model, rank, tp, group)` returns a copy of `model` holding rank `rank`'s shard:

- attention: q / k / v column-parallel by heads, o row-parallel; kv heads are split when tp divides them and
  replicated otherwise (tp a multiple of them: each rank holds the one kv head its query heads read, and
  `sync_replicated_grads` sums that head's weight gradients over the ranks sharing it);
- MLP: gate / up column-parallel over the intermediate size, down row-parallel;
- mixture-of-experts MLP (`ParallelMoEBlock`, one of the two layouts of `MOE_SPLITS`, chosen by `expert_split`):
  the router replicated (the hidden states entering an MLP are the same on every rank, so every rank routes
  every token the same way and no token moves between ranks), and
  - tp divides the expert count (`ExpertParallelMoEBlock`, expert parallelism over the tp group): rank r holds
    X / tp whole experts, [r X / tp, (r + 1) X / tp), and runs only those, full width, on their tokens; an
    `ExpertHeldElsewhere` (no tensors) takes the place of each other expert, so a shard's state dict names its
    own experts only (`_split` and `_twins` describe the rest: the whole tensor at its owner, none elsewhere);
  - otherwise (`WidthSplitMoEBlock`, Megatron's expert tensor parallelism: Mixtral's 8 experts at tp = 16, a
    3-expert model at tp = 2): every expert split like a dense MLP over its own intermediate size, each rank
    running 1 / tp of every expert;
  either way the block copies its input to the group once and sums its weighted partial output over the group
  once (one all-reduce forward, one backward per block, whatever the expert count), and the router's weight
  gradient is a partial sum (each rank saw its own experts' or slices' outputs only) until
  `sync_replicated_grads` sums it. Whole experts are chosen wherever they fit, not configured: the same FLOPs
  and the same bytes per rank as the width split, in X / tp full-width expert calls instead of X calls 1 / tp
  as wide (fewer, larger kernels), and no constraint on the expert width; the price is load imbalance (a rank
  whose experts got more tokens computes longer, and the block's all-reduce waits for it). Both layouts keep
  every token on every rank: an all-to-all dispatch of tokens to their experts' ranks would only pay across
  data-parallel ranks, whose inputs differ;
- embedding and LM head vocabulary-parallel: rank r holds rows [r * V_p / tp, (r + 1) * V_p / tp) of the
  vocabulary padded to V_p, a multiple of tp (padded rows are zero and their logits are masked to -inf, so they
  are never sampled and carry no probability); the LM head returns this rank's slice of the logits only;
- norms and the value head replicated (the value head reads the replicated final hidden state); Qwen3's per-head
  q / k norms too, but they see this rank's heads only, so each rank's gradient is a partial sum over its heads
  (`HeadParallelRMSNorm`, summed over the group by `sync_replicated_grads`).

The vocabulary-parallel read-outs (`vocab_parallel_logprobs`, `vocab_parallel_entropy`, `vocab_parallel_argmax`)
never gather the full logits: one max, one sum and one chosen-logit reduction over the group.

Legend: B batch rows, T tokens, D width, V vocabulary (Vl: this rank's slice), X experts.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar

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
    for name, value in widths:
        if value % tp:
            problems.append(
                f"{key}={tp} does not divide the model's {name}={value} ({value} % {tp} = {value % tp}): "
                f"set {key} to a divisor of {value}"
            )
    x, f = config.num_experts, config.expert_intermediate_size
    if any(config.is_moe_layer(i) for i in layers) and x % tp and f % tp:
        problems.append(
            f"{key}={tp} does not divide the model's expert intermediate size={f} ({f} % {tp} = {f % tp}: every "
            f"expert split over its width) nor its num_experts={x} ({x} % {tp} = {x % tp}: whole experts per "
            f"rank): set {key} to a divisor of {x} or of {f}"
        )
    return problems


ExpertSplit = Literal["experts", "width"]
"""How `shard_transformer` splits a mixture's experts over a tp group: "experts", whole experts per rank (expert
parallelism, `ExpertParallelMoEBlock`), or "width", every expert over its intermediate size (expert tensor
parallelism, `WidthSplitMoEBlock`)."""


def expert_split(num_experts: int, tp: int) -> ExpertSplit:
    """Whole experts per rank when tp divides the expert count, every expert over its width otherwise (the module
    docstring says why; `rlhfuse.planner.memory.expert_shard` counts the same)."""
    return "experts" if num_experts % tp == 0 else "width"


class TensorSplit(NamedTuple):
    """How one tensor of the whole model is held over a tp group: along `dim`, position p holds [lo, hi) =
    `bounds[p]` of its `full` rows (an empty range: none of it, a whole expert another position holds)."""

    dim: int
    bounds: list[tuple[int, int]]
    full: int


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
    """id(parameter) -> how many ranks of the tp group hold an identical copy of it: 1 for the split weights and
    the whole experts, tp / kv heads for a replicated kv head, tp for everything replicated (norms, row-parallel
    biases, the value head). A gradient norm over the group divides each parameter's squared norm by it."""
    out = {id(p): tp for p in module.parameters()}
    for sub in module.modules():
        if isinstance(sub, ColumnParallelLinear):
            copies = 1 if sub.replicated is None else tp // sub.replicated[1]
            for p in (sub.weight, sub.bias):
                if p is not None:
                    out[id(p)] = copies
        elif isinstance(sub, RowParallelLinear | VocabParallelEmbedding):
            out[id(sub.weight)] = 1
        elif isinstance(sub, ExpertParallelMoEBlock):  # whole experts, each on one rank of the group
            for e in sub.computed:
                for p in sub.experts[e].parameters():
                    out[id(p)] = 1
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


_Block = TypeVar("_Block", bound="ParallelMoEBlock")


class ParallelMoEBlock(MoEBlock):
    """`MoEBlock` over a tensor-parallel group (see the module docstring): the same routing on every rank (its
    input is the same), the experts `computed` here run on their tokens, one all-reduce of the weighted sum. Built
    by one of the layouts of `MOE_SPLITS`."""

    group: Any
    computed: range
    """The experts this rank runs: every one (each over this rank's slice of its width), or its whole ones."""

    @classmethod
    def holding(cls: type[_Block], full: MoEBlock, config: ModelConfig, group: Any) -> _Block:
        """A block of this layout holding `full`'s router and experts (not copied: the layout's `shard` splits or
        drops the experts after)."""
        with torch.device("meta"):
            block = cls(config)
        block.gate, block.experts, block.group = full.gate, full.experts, group
        return block

    def forward(self, x_BTD: Tensor) -> Tensor:
        partial_BTD = self.expert_sum(distributed.copy_to_group(x_BTD, self.group), self.computed)
        return distributed.reduce_from_group(partial_BTD, self.group)


class WidthSplitMoEBlock(ParallelMoEBlock):
    """Every expert split over its intermediate size like a dense MLP (Megatron's expert tensor parallelism): gate
    / up column-parallel and down row-parallel over [r F / tp, (r + 1) F / tp), the block's one all-reduce
    summing the slices; every rank runs every expert."""

    @classmethod
    def shard(cls, full: MoEBlock, config: ModelConfig, rank: int, tp: int, group: Any) -> ParallelMoEBlock:
        block = cls.holding(full, config, group)
        width = config.expert_intermediate_size // tp
        spans = [(r * width, (r + 1) * width) for r in range(tp)]
        expert: Any
        for expert in block.experts:
            expert.gate_proj = LocalColumnLinear(expert.gate_proj, *spans[rank], group)
            expert.up_proj = LocalColumnLinear(expert.up_proj, *spans[rank], group)
            expert.down_proj = LocalRowLinear(expert.down_proj, *spans[rank], group)
            for proj in (expert.gate_proj, expert.up_proj, expert.down_proj):
                proj.bounds = spans
        block.computed = range(len(block.experts))
        return block


EXPERT_PROJECTIONS = (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1))
"""An expert's weights and the dimension of its intermediate size (gate / up: out x in; down: in x out)."""


class ExpertHeldElsewhere(nn.Module):
    """The place of an expert that position `owner` of the tp group holds (`ExpertParallelMoEBlock`): no tensors,
    so the shard's state dict, optimizer and gradients name its own experts only."""

    def __init__(self, owner: int) -> None:
        super().__init__()
        self.owner = owner

    def forward(self, x_MD: Tensor) -> Tensor:
        raise RuntimeError(
            f"this expert is held by tp position {self.owner}: a rank runs its own experts only"
        )

    def extra_repr(self) -> str:
        return f"owner={self.owner}"


class ExpertParallelMoEBlock(ParallelMoEBlock):
    """Whole experts per rank (expert parallelism over the tp group): position p holds experts [p n, (p + 1) n),
    n = X / tp, untouched, and runs only those on their tokens, full width; every other expert's place holds an
    `ExpertHeldElsewhere`. Expert slot i of position p is expert p n + i, so every position holds the same
    number of same-shaped tensors: gathering slot i over the group reassembles tp whole experts
    (`unshard_state`)."""

    tp: int

    @classmethod
    def shard(cls, full: MoEBlock, config: ModelConfig, rank: int, tp: int, group: Any) -> ParallelMoEBlock:
        block = cls.holding(full, config, group)
        n = config.num_experts // tp
        block.tp, block.computed = tp, range(rank * n, (rank + 1) * n)
        block.experts = nn.ModuleList(
            e if i in block.computed else ExpertHeldElsewhere(i // n) for i, e in enumerate(full.experts)
        )
        return block

    def held_by(self, position: int) -> range:
        """The experts position `position` of the group holds."""
        n = len(self.computed)
        return range(position * n, (position + 1) * n)

    def splits(self) -> dict[str, TensorSplit]:
        """Name (relative to the block) -> split of every expert's weights, held here or elsewhere: the whole
        tensor at its owner, an empty range at every other position."""
        mine: Any = self.experts[self.computed[0]]
        width = int(mine.gate_proj.weight.shape[0])
        out: dict[str, TensorSplit] = {}
        for p in range(self.tp):
            bounds = [(0, width) if q == p else (0, 0) for q in range(self.tp)]
            for e in self.held_by(p):
                for proj, dim in EXPERT_PROJECTIONS:
                    out[f"experts.{e}.{proj}.weight"] = TensorSplit(dim, bounds, width)
        return out

    def twins(self) -> dict[str, tuple[str, ...]]:
        """Name (relative to the block) of each expert weight this rank holds -> the names of the weights every
        position holds in its place (the same slot and projection; position order, this rank's own among them)."""
        return {
            f"experts.{e}.{proj}.weight": tuple(
                f"experts.{self.held_by(p)[i]}.{proj}.weight" for p in range(self.tp)
            )
            for i, e in enumerate(self.computed)
            for proj, _ in EXPERT_PROJECTIONS
        }


MOE_SPLITS: dict[ExpertSplit, Callable[[MoEBlock, ModelConfig, int, int, Any], ParallelMoEBlock]] = {
    "experts": ExpertParallelMoEBlock.shard,
    "width": WidthSplitMoEBlock.shard,
}
"""Each layout of a mixture over the tp group: (whole block, config, rank, tp, group) -> this rank's block."""


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
    kv_spans = spans(k * e, lambda r: first_kv(r) * e)

    def column(full: nn.Linear, bounds: list[tuple[int, int]]) -> ColumnParallelLinear:
        mod = ColumnParallelLinear(full, *bounds[rank], group)
        mod.bounds = bounds
        return mod

    def row(full: nn.Linear, bounds: list[tuple[int, int]]) -> RowParallelLinear:
        mod = RowParallelLinear(full, *bounds[rank], group)
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
            layer.mlp = MOE_SPLITS[expert_split(cfg.num_experts, tp)](mlp, cfg, rank, tp, group)
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


def _split(module: nn.Module) -> dict[str, TensorSplit]:
    """state-dict name -> how it is split over the tp group, for every split tensor of the whole model that a
    shard (`shard_transformer`) stands for, held here or not (whole experts held elsewhere included); tensors not
    listed are replicated."""
    out: dict[str, TensorSplit] = {}
    for name, sub in module.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(sub, ColumnParallelLinear | VocabParallelEmbedding):
            out[prefix + "weight"] = TensorSplit(0, sub.bounds, sub.full_rows)
            if getattr(sub, "bias", None) is not None:
                out[prefix + "bias"] = TensorSplit(0, sub.bounds, sub.full_rows)
        elif isinstance(sub, RowParallelLinear):
            out[prefix + "weight"] = TensorSplit(1, sub.bounds, sub.full_cols)
        elif isinstance(sub, ExpertParallelMoEBlock):
            out.update({prefix + k: v for k, v in sub.splits().items()})
    return out


def _twins(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """state-dict name of each whole expert weight of a shard -> the names of the weights every position of the
    tp group holds in its place, in position order (`ExpertParallelMoEBlock.twins`)."""
    out: dict[str, tuple[str, ...]] = {}
    for name, sub in module.named_modules():
        if isinstance(sub, ExpertParallelMoEBlock):
            prefix = f"{name}." if name else ""
            for k, names in sub.twins().items():
                out[prefix + k] = tuple(prefix + n for n in names)
    return out


def full_shapes(module: nn.Module) -> dict[str, torch.Size]:
    """state-dict name -> the whole model's shape of every tensor of the whole model a shard stands for (meta
    ones and whole experts held elsewhere included), the same names in the same order on every position of the
    tp group (an expert weight stands for its twins, `_twins`)."""
    split, twins = _split(module), _twins(module)
    out: dict[str, torch.Size] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        shape = list(t.shape)
        if name in split:
            dim, _, size = split[name]
            shape[dim] = size
        for each in twins.get(name, (name,)):
            out[each] = torch.Size(shape)
    return out


def unshard_state(module: nn.Module, group: Any = None) -> dict[str, Tensor]:
    """Collective over the tp group: the whole tensors of the shard's materialised entries (split ones
    all-gathered and reassembled, padded vocabulary rows dropped; whole experts all-gathered slot by slot, each
    position's expert of the slot whole; replicated ones this rank's own), and meta tensors of the whole shape for
    the entries held elsewhere (other pipeline stages). Keyed like `full_shapes`."""
    split, shapes, twins = _split(module), full_shapes(module), _twins(module)
    out: dict[str, Tensor] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if t.is_meta:
            for each in twins.get(name, (name,)):
                out[each] = torch.empty(shapes[each], dtype=t.dtype, device="meta")
        elif name in twins:  # this slot's expert of every position: equal shapes, one all-gather
            parts = distributed.all_gather(t.detach().contiguous(), group=group)
            out.update(zip(twins[name], parts, strict=True))
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
    vocabulary rows zero; its own experts whole), for the entries materialised in `module`."""
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
