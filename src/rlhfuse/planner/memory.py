"""What one rank holds under `rlhfuse.runtime`'s layouts, counted by component (bytes): the planner's memory model.

It counts the tensors the runtime builds (docs/distributed.md), not an average per parameter:

- **Pipeline stages.** Layers are split into contiguous ranges the way `rlhfuse.models.split_stages` splits
  equal-cost layers (`layer_ranges`: the earlier stages take the extra layer); the embedding sits on the first
  stage, the final norm and the head (LM head: vocab x hidden; value head: hidden) on the last. In a fused group of
  max(pp) ranks the model with more stages (the Actor on ties) is placed in rank order and the other's replicas
  reversed over blocks of its pp (`rlhfuse.runtime.ParallelLayout.local_placement`), so rank 0 holds the Actor's
  embedding and the Critic's last stage: the busiest rank is found by walking the group (`rank_memories`).
  The Ref is placed like the Actor and the Reward like the Critic (both frozen, no optimizer).
- **Merged stages** (unequal Actor / Critic tp, `rlhfuse.pipeline.colocation`): with T the larger tp and t the
  smaller, the smaller-tp model's T / t consecutive stages share one T-wide pipeline rank, sub-stage j on its
  ranks j*t .. j*t + t - 1 (its tp shard at tp t); the placement above is then over merged stages, and each
  rank holds its own sub-stage (`local_stages`), 1 / (pp * tp) of each model.
- **Tensor parallelism** (`rlhfuse.runtime.tensor_parallel.shard_transformer`): q / k / v / gate / up split by
  rows, o / down by columns; kv heads split when tp divides them, otherwise one kv head per rank (replicated);
  the embedding and LM head hold ceil(vocab / tp) rows each (the vocabulary padded to a multiple of tp); norms,
  the value head and the o bias are replicated. Every decoder block also holds its two RMSNorm weights. A
  mixture's router is replicated; its experts are held whole, experts / tp per rank, when tp divides the expert
  count, and each split over its width (every expert's gate / up by rows, down by columns) otherwise
  (`expert_shard`).
- **The generation copy**: the whole Actor with `gen_tp = 1`, its `gen_tp` shard (all layers, padded vocabulary)
  otherwise; frozen; bf16 under both bf16 precisions, fp32 under 32-true (`generation_bytes`; the trainer's
  `rlhfuse.core.optim.generation_dtype`), and its KV cache in the same dtype.
- **Precision** (`pipeline.optim.precision`): `32-true` / `bf16-mixed` keep fp32 weights (4 bytes), fp32
  gradients (4) and AdamW's two fp32 moments (8); `bf16-true` keeps bf16 weights (2) and gradients (2), an fp32
  master copy (4, `MasterWeightAdamW`) and two fp32 moments (8). AdamW also keeps one fp32 step counter per
  parameter tensor (4 bytes), which `memory/optimizer_bytes` counts. Frozen models hold weights only, in the
  weights' dtype; the generation copy holds weights only, in bf16 under bf16-mixed too.
- **Offload** (`inferencer.offload_frozen`): the Ref and the Reward live in host memory and come onto the device
  for inference only.
- **Phases.** Gradients exist from the first backward to the optimizer step (`zero_grad(set_to_none=True)`),
  activations during training, the KV cache during generation, offloaded frozen weights during inference; the
  weights, the master copies and the optimizer moments stay resident throughout. `RankMemory.peak` is the
  resident bytes plus the largest phase.
- **pipeline=fsdp** (`fsdp_rank_memories`; `rlhfuse.distributed.fsdp.shard_model`): no stages; every model is
  sharded over the world, each tensor on dim 0 (FSDP2's `torch.chunk` split, `dim0_rows`: ceil(rows / world) rows
  per rank in rank order, the last ranks fewer or none). Each rank allocates its weight shards and its sharded
  gradients padded to ceil(rows / world) rows (`fsdp_padded_count`: the same on every rank); AdamW's moments and
  the master copies are made from the unpadded shard (`fsdp_shard_count`: rank 0 holds the most), and every rank
  keeps one step counter per tensor, an empty shard's too. Under bf16-mixed the shards stay fp32 (FSDP's
  param_dtype=bf16 casts what it gathers); under bf16-true they are bf16. Each rank also holds the whole
  generation copy (`generator.instances` = world, `generator.tp` = 1). What FSDP gathers, in the compute dtype,
  makes two phases of its own: inference (after generation, every rank its share in lockstep forwards of the
  sharded models) gathers a unit at a time (two with the next one prefetched) and keeps what a forward without
  gradients does not free (`fsdp_kept_units`: the trained models' roots; every layer with
  `reshard_after_forward=False`) beside the KV cache (`rollout_gathered`); training gathers the trained models'
  roots and two layers at a time, or every layer from its forward to its backward with
  `reshard_after_forward=False` (and then the frozen models' layers, which inference left gathered), and keeps
  unsharded gradients: the whole trained models' while several micro-batches accumulate (FSDP's no-sync
  accumulation), two layers' otherwise (`train_gathered`). These phases are estimates, but for what stays
  gathered after inference; the resident bytes are exact.

`memory/param_bytes` of the runtime is `RankMemory.param_bytes` (weights of the four models and the generation
copy materialised on the rank; offloaded frozen weights are host tensors, which the metric counts too: see
`param_bytes`) and `memory/optimizer_bytes` is `RankMemory.optimizer_bytes` (moments and step counters; the
masters are not optimizer state). `tests/planner/test_planner_memory.py` checks both against modules the runtime
builds, exactly (pipeline=fsdp on 2 gloo ranks, per rank: the metric itself logs the most any rank holds).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

from rlhfuse.pipeline.colocation import Colocation
from rlhfuse.planner.specs import ModelSpec

Precision = Literal["32-true", "bf16-mixed", "bf16-true"]
PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", "bf16-true")

ADAM_STEP_BYTES = 4
"""AdamW's `step` counter: one fp32 scalar per parameter tensor."""


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter element of a trained model under one precision (frozen models hold `weight` only)."""

    weight: int
    grad: int
    master: int
    moments: int = 8
    """AdamW's exp_avg and exp_avg_sq, fp32."""

    @property
    def train_state(self) -> int:
        return self.weight + self.grad + self.master + self.moments


def generation_bytes(precision: str) -> int:
    """Bytes per element of the generation copy and its KV cache: 2 (bf16) under bf16-mixed and bf16-true,
    4 under 32-true (the trainer's `generation_dtype`)."""
    bytes_per_param(precision)  # refuses an unknown precision
    return 4 if precision == "32-true" else 2


def bytes_per_param(precision: str) -> BytesPerParam:
    if precision in ("32-true", "bf16-mixed"):
        return BytesPerParam(weight=4, grad=4, master=0)
    if precision == "bf16-true":
        return BytesPerParam(weight=2, grad=2, master=4)
    raise ValueError(
        f"precision={precision!r} is unknown: use one of {', '.join(PRECISIONS)} (pipeline.optim.precision; "
        "auto is bf16-mixed on CUDA, 32-true on the CPU)"
    )


def layer_ranges(layers: int, pp: int) -> list[tuple[int, int]]:
    """The runtime's split of `layers` equal-cost layers into `pp` contiguous stages
    (`rlhfuse.models.stage_ranges`): the balanced split whose cuts are as late as possible, built from the last
    stage back (each takes as few layers as keeps the busiest stage at ceil(layers / pp))."""
    return list(_layer_ranges(layers, pp))


@functools.lru_cache(maxsize=4096)
def _layer_ranges(layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    if not 1 <= pp <= layers:
        raise ValueError(
            f"pp={pp} must be between 1 and the model's layers={layers} (a stage holds >= 1 layer)"
        )
    out: list[tuple[int, int]] = []
    stop = layers
    for k in range(pp, 0, -1):
        start = 0 if k == 1 else min(stop - 1, (k - 1) * -(-stop // k))
        out.append((start, stop))
        stop = start
    return tuple(out[::-1])


@dataclass(frozen=True)
class ShardCount:
    """Parameter elements and parameter tensors of one (stage, tp rank) shard of a model."""

    params: int = 0
    tensors: int = 0

    def __add__(self, other: ShardCount) -> ShardCount:
        return ShardCount(self.params + other.params, self.tensors + other.tensors)


def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    """kv heads one tp rank holds: split when tp divides them, one (replicated) when tp is a multiple of them."""
    kv = model.n_kv_heads
    if kv % tp == 0:
        return kv // tp
    if tp % kv == 0:
        return 1
    raise ValueError(f"tp={tp} neither divides kv_heads={kv} nor is a multiple of it")


def expert_shard(model: ModelSpec, tp: int) -> tuple[int, int]:
    """(experts, intermediate size of each) one tp rank holds of a mixture of experts: experts / tp whole ones
    when tp divides the expert count, every expert's 1 / tp slice of its width otherwise (the runtime's
    `rlhfuse.runtime.tensor_parallel.expert_split`)."""
    if model.experts % tp == 0:
        return model.experts // tp, model.expert_ffn
    return model.experts, model.expert_ffn // tp


@functools.lru_cache(maxsize=65536)
def shard_count(
    model: ModelSpec, head: str, *, pp: int = 1, stage: int | None = None, tp: int = 1
) -> ShardCount:
    """Elements and tensors of stage `stage` of `pp` (None: every stage) of `model`'s tp-rank shard (`tp = 1`:
    the whole stage). Every tp rank of a stage holds the same count (uneven splits are refused by the runtime)."""
    h, e = model.hidden, model.head_dim
    q, kv = model.heads // tp * e, kv_heads_per_rank(model, tp) * e
    qkv_bias = q + 2 * kv if model.qkv_bias else 0
    # attention, its biases and norms, the block's two norms (Qwen3's q / k norms replicated on every tp rank)
    attention = ShardCount(
        h * q
        + 2 * h * kv
        + q * h
        + 2 * h
        + qkv_bias
        + (h if model.o_bias else 0)
        + (2 * e if model.qk_norm else 0),
        6 + (3 if model.qkv_bias else 0) + (1 if model.o_bias else 0) + (2 if model.qk_norm else 0),
    )
    dense = ShardCount(3 * h * (model.ffn // tp), 3)
    # a mixture: the router replicated; whole experts, or every expert's slice of its width (`expert_shard`)
    experts, expert_ffn = expert_shard(model, tp)
    mixture = ShardCount(h * model.experts + 3 * h * expert_ffn * experts, 1 + 3 * experts)
    ranges = _layer_ranges(model.layers, pp)
    stages = range(pp) if stage is None else [stage]
    vocab_rows = -(-model.vocab // tp) if tp > 1 else model.vocab
    out = ShardCount()
    for s in stages:
        start, stop = ranges[s]
        for layer in range(start, stop):
            out += attention + (mixture if model.is_moe(layer) else dense)
        if s == 0:
            out += ShardCount(vocab_rows * h, 1)
        if s == pp - 1:
            out += ShardCount(h, 1)  # final norm
            if head == "lm" and not model.tied:
                out += ShardCount(vocab_rows * h, 1)
            elif head != "lm":
                out += ShardCount(h, 1)  # value head, replicated
    return out


@dataclass(frozen=True)
class ModelLayout:
    """One model's pipeline stages and tensor-parallel degree on the runtime's layout."""

    model: ModelSpec
    head: str
    pp: int = 1
    tp: int = 1


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds, by component (see the module docstring for what each counts)."""

    trained_weights: float = 0.0
    gradients: float = 0.0
    master_weights: float = 0.0
    optimizer_states: float = 0.0
    """AdamW's moments and step counters of the trained stages."""
    frozen_weights: float = 0.0
    """Ref + Reward stages resident on the device (0 with offload)."""
    frozen_offloaded: float = 0.0
    """Ref + Reward stages kept in host memory, on the device only for inference."""
    generation_weights: float = 0.0
    kv_cache: float = 0.0
    activations: float = 0.0
    rollout_gathered: float = 0.0
    """pipeline=fsdp: the units inference gathers beside the KV cache (`fsdp_rollout_gathered`; 0 otherwise)."""
    train_gathered: float = 0.0
    """pipeline=fsdp: the units training gathers and their unsharded gradients (`fsdp_train_gathered`)."""

    @property
    def param_bytes(self) -> float:
        """What the runtime's `memory/param_bytes` counts on this rank: the four models' materialised weights
        (offloaded ones too: the metric reads the modules, wherever their tensors live) and the generation copy."""
        return self.trained_weights + self.frozen_weights + self.frozen_offloaded + self.generation_weights

    @property
    def optimizer_bytes(self) -> float:
        """What the runtime's `memory/optimizer_bytes` counts: the optimizer states (masters excluded)."""
        return self.optimizer_states

    @property
    def resident(self) -> float:
        """Device bytes held through the whole iteration: weights, masters and optimizer states."""
        return (
            self.trained_weights
            + self.master_weights
            + self.optimizer_states
            + self.frozen_weights
            + self.generation_weights
        )

    @property
    def train_state(self) -> float:
        """The trained models' weights, gradients, masters and optimizer states."""
        return self.trained_weights + self.gradients + self.master_weights + self.optimizer_states

    @property
    def training(self) -> float:
        """What training adds to the resident bytes: gradients, activations (and pipeline=fsdp's gathered layers
        and unsharded gradients)."""
        return self.gradients + self.activations + self.train_gathered

    @property
    def rollout(self) -> float:
        """What generation adds: the KV cache (and pipeline=fsdp's gathered models)."""
        return self.kv_cache + self.rollout_gathered

    @property
    def peak(self) -> float:
        """Device peak: resident bytes + the largest phase (training: gradients + activations; generation: the
        KV cache; inference: the offloaded frozen weights swapped in; pipeline=fsdp's gathered weights in the
        phase that gathers them)."""
        return self.resident + max(self.training, self.rollout, self.frozen_offloaded)

    def components(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}

    def __add__(self, other: RankMemory) -> RankMemory:
        return RankMemory(**{k: v + getattr(other, k) for k, v in self.components().items()})


def trained_bytes(lay: ModelLayout, stage: int, precision: str) -> RankMemory:
    """One trained model's stage `stage` on one tp rank: weights, gradients, masters, optimizer states."""
    b = bytes_per_param(precision)
    n = shard_count(lay.model, lay.head, pp=lay.pp, stage=stage, tp=lay.tp)
    return RankMemory(
        trained_weights=n.params * b.weight,
        gradients=n.params * b.grad,
        master_weights=n.params * b.master,
        optimizer_states=n.params * b.moments + n.tensors * ADAM_STEP_BYTES,
    )


def frozen_bytes(lay: ModelLayout, stage: int | None, precision: str, offload: bool) -> RankMemory:
    """One frozen model's stage (None: the whole model) on one tp rank: weights only."""
    nbytes = shard_count(lay.model, lay.head, pp=lay.pp, stage=stage, tp=lay.tp).params
    nbytes *= bytes_per_param(precision).weight
    return RankMemory(frozen_offloaded=nbytes) if offload else RankMemory(frozen_weights=nbytes)


def local_stages(
    actor_pp: int, critic_pp: int, actor_tp: int = 1, critic_tp: int | None = None
) -> list[tuple[int, int]]:
    """(Actor stage, Critic-slot stage) on each distinct rank of a fused group (`Colocation.local_stages`): the
    model with more (merged) stages (the Actor on ties) in rank order, the other's replicas reversed over blocks.
    Equal tp: one entry per pipeline rank; unequal tp (the smaller-tp model's stages merged): entry v * merge + j
    for sub-rank j of pipeline rank v."""
    critic_tp = actor_tp if critic_tp is None else critic_tp
    lay = Colocation(actor_pp, actor_tp, critic_pp, critic_tp)
    if (reason := lay.problem()) is not None:
        raise ValueError(
            f"actor_pp={actor_pp} tp={actor_tp} and critic_pp={critic_pp} tp={critic_tp} cannot be co-located: "
            f"{reason} (the larger number of merged stages must be a multiple of the smaller)"
        )
    return lay.local_stages()


def kv_cache_bytes(model: ModelSpec, tokens: float, tp: int, dtype_bytes: int) -> float:
    """K and V of `tokens` cached positions on one rank of a generation instance of `tp` ranks (its kv heads)."""
    return 2.0 * model.layers * kv_heads_per_rank(model, tp) * model.head_dim * dtype_bytes * tokens


def rank_memories(
    actor: ModelSpec,
    critic: ModelSpec | None,
    *,
    actor_pp: int = 1,
    critic_pp: int = 1,
    actor_tp: int = 1,
    critic_tp: int | None = None,
    gen_tp: int = 1,
    precision: str = "32-true",
    offload: bool = False,
    reward: ModelSpec | None = None,
    ref: bool = True,
    kv_tokens: float = 0.0,
    activations: float = 0.0,
) -> list[RankMemory]:
    """Each distinct rank of one fused group (`local_stages`: one entry per pipeline rank when the tp degrees are
    equal, every tp rank of a stage holding the same; with unequal tp the smaller-tp model's consecutive stages
    are merged onto one pipeline rank, sub-stage j on its sub-rank j: entry v * merge + j): the Actor and (when `critic`) the Critic trained, the Ref placed like the Actor (when `ref`), the
    Reward (`reward`, e.g. the Critic's shape; None: no reward model) like the Critic with `critic_pp` stages,
    the generation copy of `gen_tp` (one whole Actor at 1), `kv_tokens` cached positions of its instance and
    `activations` bytes of training activations per rank (estimates: the planner's cost model gives them)."""
    critic_tp = actor_tp if critic_tp is None else critic_tp
    a = ModelLayout(actor, "lm", actor_pp, actor_tp)
    gen = ModelLayout(actor, "lm", 1, gen_tp)
    weight = generation_bytes(precision)
    generation = shard_count(actor, "lm", tp=gen_tp).params * weight
    out = []
    for sa, sc in local_stages(actor_pp, critic_pp, actor_tp, critic_tp):
        mem = trained_bytes(a, sa, precision)
        if critic is not None:
            mem += trained_bytes(ModelLayout(critic, "value", critic_pp, critic_tp), sc, precision)
        if ref:
            mem += frozen_bytes(a, sa, precision, offload)
        if reward is not None:
            mem += frozen_bytes(ModelLayout(reward, "value", critic_pp, critic_tp), sc, precision, offload)
        mem += RankMemory(
            generation_weights=generation,
            kv_cache=kv_cache_bytes(actor, kv_tokens, gen.tp, weight),
            activations=activations,
        )
        out.append(mem)
    return out


def rank_memory(
    actor: ModelSpec, critic: ModelSpec | None, **kwargs: float | int | str | bool | None
) -> RankMemory:
    """The busiest rank of `rank_memories` (largest `peak`)."""
    return max(rank_memories(actor, critic, **kwargs), key=lambda m: m.peak)  # type: ignore[arg-type]


# ---- pipeline=fsdp -------------------------------------------------------------------------------------------
Unit = tuple[tuple[int, int], ...]
"""One FSDP unit's parameter tensors as (rows, elements per row): dim 0 is what FSDP2 shards."""


@functools.lru_cache(maxsize=1024)
def fsdp_units(model: ModelSpec, head: str) -> tuple[Unit, ...]:
    """Every parameter tensor of the whole model by FSDP unit (`rlhfuse.distributed.fsdp.shard_model`): the root
    first (the embedding, the final norm and the head: an LM head is vocab x hidden unless tied, a value head one
    row of hidden), then each decoder layer (nn.Linear weights are out x in: q / k / v / gate / up have a row per
    output channel, o and down one per hidden channel; biases and norms are one row of one element per channel)."""
    h, e = model.hidden, model.head_dim
    q, kv = model.heads * e, model.n_kv_heads * e
    root: list[tuple[int, int]] = [(model.vocab, h), (h, 1)]
    if head == "lm":
        root += [] if model.tied else [(model.vocab, h)]
    else:
        root.append((1, h))
    attention: list[tuple[int, int]] = [(h, 1), (q, h), (kv, h), (kv, h), (h, q), (h, 1)]  # + both norms
    if model.qkv_bias:
        attention += [(q, 1), (kv, 1), (kv, 1)]
    if model.o_bias:
        attention.append((h, 1))
    if model.qk_norm:
        attention += [(e, 1), (e, 1)]
    dense = [(model.ffn, h), (model.ffn, h), (h, model.ffn)]
    f = model.expert_ffn
    mixture = [(model.experts, h)] + [(f, h), (f, h), (h, f)] * model.experts
    layers = tuple(tuple(attention + (mixture if model.is_moe(i) else dense)) for i in range(model.layers))
    return (tuple(root), *layers)


def dim0_rows(rows: int, world: int, rank: int) -> int:
    """Rows of a `rows`-row tensor that rank `rank` of `world` holds under FSDP2 (`torch.chunk` on dim 0):
    ceil(rows / world) per rank in rank order, the last ranks fewer or none."""
    chunk = -(-rows // world)
    return max(0, min(chunk, rows - rank * chunk))


@functools.lru_cache(maxsize=4096)
def fsdp_shard_count(model: ModelSpec, head: str, world: int, rank: int) -> ShardCount:
    """Elements of rank `rank`'s unpadded dim-0 shard of every tensor (what AdamW's moments and the master copies
    are made from) and the tensors (an empty shard's too: each keeps a step counter)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be in [0, {world}) (pipeline=fsdp over world={world} ranks)")
    out = ShardCount()
    for unit in fsdp_units(model, head):
        out += ShardCount(sum(dim0_rows(r, world, rank) * c for r, c in unit), len(unit))
    return out


@functools.lru_cache(maxsize=4096)
def fsdp_padded_units(model: ModelSpec, head: str, world: int) -> tuple[int, ...]:
    """Elements each rank allocates per FSDP unit, root first: every tensor's shard padded to ceil(rows / world)
    rows (the same on every rank; FSDP2 pads a short or empty shard so that its all-gather is even). The weight
    shards and the sharded gradients (one reduce-scatter output per unit) take this many elements; a gathered
    unit `world` times as many."""
    return tuple(sum(-(-r // world) * c for r, c in unit) for unit in fsdp_units(model, head))


def fsdp_padded_count(model: ModelSpec, head: str, world: int) -> int:
    """Elements of every padded shard of the model on one rank (`fsdp_padded_units`)."""
    return sum(fsdp_padded_units(model, head, world))


def compute_bytes(precision: str) -> int:
    """Bytes per element of what pipeline=fsdp gathers: the compute dtype (bf16 under bf16-mixed, FSDP's
    param_dtype, and bf16-true; fp32 under 32-true)."""
    return generation_bytes(precision)


def reduce_bytes(precision: str) -> int:
    """Bytes per element of pipeline=fsdp's unsharded gradients: FSDP's reduce dtype (fp32 under bf16-mixed,
    the gradient's dtype otherwise)."""
    return bytes_per_param(precision).grad


def fsdp_trained_bytes(model: ModelSpec, head: str, world: int, rank: int, precision: str) -> RankMemory:
    """One trained model on rank `rank` of pipeline=fsdp: padded weight shards and sharded gradients, the masters
    and AdamW's states of the unpadded shard."""
    b = bytes_per_param(precision)
    padded = fsdp_padded_count(model, head, world)
    local = fsdp_shard_count(model, head, world, rank)
    return RankMemory(
        trained_weights=padded * b.weight,
        gradients=padded * b.grad,
        master_weights=local.params * b.master,
        optimizer_states=local.params * b.moments + local.tensors * ADAM_STEP_BYTES,
    )


def fsdp_kept_units(trained: bool, layers: int, *, reshard_after_forward: bool = True) -> tuple[int, ...]:
    """Units of a sharded model (0: the root, 1..`layers`: the decoder layers) that stay gathered after a forward
    without gradients (inference), until a backward frees them (`rlhfuse.distributed.fsdp.shard_model`): FSDP2
    frees a unit after its forward only where it reshards after forward, which a trained model's root never does
    (its backward needs it); a trained model's layers do with `reshard_after_forward`; a frozen model (no
    backward) frees every unit after each forward."""
    if not trained:
        return ()
    return (0,) if reshard_after_forward else (0, *range(1, layers + 1))


def fsdp_rollout_gathered(
    trained: Sequence[tuple[ModelSpec, str]],
    frozen: Sequence[tuple[ModelSpec, str]],
    world: int,
    precision: str,
    *,
    reshard_after_forward: bool = True,
) -> float:
    """What pipeline=fsdp's inference (`rlhfuse.trainer.strategies.fsdp.inference.ShardedInference`: lockstep forwards of the sharded
    models after generation) gathers on one rank beside its shards, in the compute dtype: the units that stay
    gathered after their forward (`fsdp_kept_units`), and the two largest of the others (one computing, the next
    prefetched: an estimate of FSDP2's buffers)."""
    kept, rest = 0, []
    for models, is_trained in ((trained, True), (frozen, False)):
        for m, h in models:
            units = fsdp_padded_units(m, h, world)
            keep = set(fsdp_kept_units(is_trained, m.layers, reshard_after_forward=reshard_after_forward))
            kept += sum(n for i, n in enumerate(units) if i in keep)
            rest += [n for i, n in enumerate(units) if i not in keep]
    two = sum(sorted(rest, reverse=True)[:2])
    return float(world * (kept + two) * compute_bytes(precision))


def fsdp_train_gathered(
    trained: Sequence[tuple[ModelSpec, str]],
    world: int,
    precision: str,
    *,
    reshard_after_forward: bool = True,
    microbatches: int = 1,
) -> float:
    """What pipeline=fsdp's training gathers on one rank beside its shards (an estimate of FSDP2's buffers): the
    trained models' root units (kept from their forward to their backward), and their layers: with
    `reshard_after_forward` the largest two (one computing, the next prefetched), else every layer (each kept from
    its forward to its backward); in the compute dtype (a frozen model frees each unit after its forward:
    `fsdp_kept_units`). Plus the unsharded gradients in the
    reduce dtype: the whole trained models' while `microbatches` > 1 accumulate without a reduction (FSDP's
    no-sync accumulation), else the largest two layers' (one layer's gradients and its reduce-scatter input)."""
    gather, reduce = compute_bytes(precision), reduce_bytes(precision)
    units = [fsdp_padded_units(m, h, world) for m, h in trained]
    roots = sum(u[0] for u in units)
    layers = sorted((n for u in units for n in u[1:]), reverse=True)
    two = sum(layers[:2])
    held = two if reshard_after_forward else sum(layers)
    grads = sum(sum(u) for u in units) if microbatches > 1 else two
    return float(world * ((roots + held) * gather + grads * reduce))


def fsdp_rank_memories(
    actor: ModelSpec,
    critic: ModelSpec | None,
    *,
    world: int,
    precision: str = "32-true",
    reward: ModelSpec | None = None,
    ref: bool = True,
    reshard_after_forward: bool = True,
    microbatches: int = 1,
    kv_tokens: float = 0.0,
    activations: float = 0.0,
) -> list[RankMemory]:
    """Each rank of pipeline=fsdp over `world` ranks: the Actor and (when `critic`) the Critic sharded and
    trained, the Ref (when `ref`) and the Reward (`reward`; None: no reward model) sharded and frozen, the
    whole generation copy, `kv_tokens` cached positions of the rank's generation instance, `activations` bytes
    of training activations, and the gathered phases (`fsdp_rollout_gathered` beside the KV cache;
    `fsdp_train_gathered`, `microbatches` per rank and mini-batch). The weights and gradients are the same on
    every rank; rank 0 holds the most optimizer state (the full first chunk of every tensor)."""
    if world < 1:
        raise ValueError(f"world={world} must be >= 1 (pipeline=fsdp: one rank per generation instance)")
    trained = [(actor, "lm")] + ([] if critic is None else [(critic, "value")])
    frozen = ([(actor, "lm")] if ref else []) + ([] if reward is None else [(reward, "value")])
    weight, gen = bytes_per_param(precision).weight, generation_bytes(precision)
    shared = RankMemory(
        frozen_weights=sum(fsdp_padded_count(m, h, world) for m, h in frozen) * weight,
        generation_weights=shard_count(actor, "lm").params * gen,
        kv_cache=kv_cache_bytes(actor, kv_tokens, 1, gen),
        activations=activations,
        rollout_gathered=fsdp_rollout_gathered(
            trained, frozen, world, precision, reshard_after_forward=reshard_after_forward
        ),
        train_gathered=fsdp_train_gathered(
            trained,
            world,
            precision,
            reshard_after_forward=reshard_after_forward,
            microbatches=microbatches,
        ),
    )
    out = []
    for rank in range(world):
        mem = shared
        for m, h in trained:
            mem += fsdp_trained_bytes(m, h, world, rank, precision)
        out.append(mem)
    return out


def fsdp_rank_memory(
    actor: ModelSpec, critic: ModelSpec | None, **kwargs: float | int | str | bool | None
) -> RankMemory:
    """The busiest rank of `fsdp_rank_memories` (largest `peak`: rank 0)."""
    return max(fsdp_rank_memories(actor, critic, **kwargs), key=lambda m: m.peak)  # type: ignore[arg-type]
