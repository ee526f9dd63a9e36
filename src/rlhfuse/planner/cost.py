"""Analytical cost model of transformer work on a cluster (seconds and bytes).

- Prefill, inference and training are compute-bound: FLOPs / (devices x peak x MFU), MFU falling for small GEMMs.
- A decode step is memory-bound: it reads every weight shard and the KV cache of the batch, so its time is flat
  in the batch size until the GEMMs become compute-bound at `bs_max` (the paper's BSmax), then grows linearly.
- Communication: ring all-reduce 2(n-1)/n x bytes / bandwidth + latency; point-to-point bytes / bandwidth. The
  data-parallel gradient all-reduce is charged only where it is exposed: the runtime reduces buckets during
  each stage's last backward (`exposed_grad_allreduce_time`).
- Memory: what a rank of `rlhfuse.runtime` holds, counted tensor by tensor (`rlhfuse.planner.memory`): the
  busiest pipeline stage's tp shard (embedding / head on the edge stages, vocabulary padded to a multiple of tp,
  kv heads replicated when tp does not divide them), per `precision` (bf16-true, the paper's Megatron mixed
  precision: bf16 weight and gradient, fp32 master copy, Adam m and v = 16 bytes per parameter; 32-true /
  bf16-mixed: fp32 weight, gradient, m and v = 16 too), the Ref and Reward resident unless `offload_frozen`,
  the generation copy of its tp; gradients only while training; activations follow Korthikanti et al. 2022 with sequence parallelism and flash attention
  (34 x tokens x hidden bytes per layer, divided by tp); with activation checkpointing
  (`pipeline.activation_checkpointing`) selective recomputation of the attention kernel and the MLP keeps 17
  (the MLP's 19 replaced by its 2-byte input) and full recomputation keeps each layer's input alone: 2.

FLOPs of one token: 2 x (matmul weights) + 4 x layers x hidden x context (QK^T and AV), the standard count
(Kaplan et al. 2020; Narayanan et al. 2021). Training = 3 x forward (backward is twice the forward).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from rlhfuse.pipeline.colocation import Colocation
from rlhfuse.planner.memory import (
    ModelLayout,
    RankMemory,
    compute_bytes,
    frozen_bytes,
    fsdp_padded_units,
    fsdp_rank_memories,
    generation_bytes,
    kv_cache_bytes,
    local_stages,
    reduce_bytes,
    shard_count,
    trained_bytes,
)
from rlhfuse.planner.specs import DEFAULT_EFFICIENCY, ClusterSpec, DeviceSpec, Efficiency, ModelSpec

TRAIN_STATE_BYTES_PER_PARAM = 16
# The runtime's gradient bucket (`pipeline.grad_bucket_mb`, default 25 MiB): what the last bucket reduces after
# the last backward, at least.
GRAD_BUCKET_BYTES = 25 * 2**20
"""Bytes of training state per parameter in every precision the runtime has (see `rlhfuse.planner.memory`); the
optimizer step's memory traffic reads and writes them once."""
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34
# bytes per token x hidden x layer (bf16) kept for backward under each activation_checkpointing mode
ACTIVATION_BYTES_BY_CHECKPOINTING = {"none": 34.0, "selective": 17.0, "full": 2.0}


def stage_fraction(model: ModelSpec, pp: int) -> float:
    """Share of the model on the busiest pipeline stage: ceil(layers / pp) / layers (1 / pp when pp divides the
    layers; otherwise the stage with the extra layer sets the pace and the memory peak)."""
    return -(-model.layers // pp) / model.layers


@dataclass(frozen=True)
class CostModel:
    """Costs of `ModelSpec` work on a `ClusterSpec`, with achieved-rate factors from `Efficiency`."""

    cluster: ClusterSpec
    eff: Efficiency = DEFAULT_EFFICIENCY
    activation_checkpointing: str = "none"
    """none | full | selective: what a training micro-batch keeps for backward (`activation_bytes`)."""
    precision: str = "bf16-true"
    """32-true | bf16-mixed | bf16-true (`pipeline.optim.precision`): bytes of weights, gradients, master copies
    and optimizer states (`rlhfuse.planner.memory.bytes_per_param`)."""
    offload_frozen: bool = True
    """Ref and Reward weights in host memory, swapped in for inference (the paper; `inferencer.offload_frozen`);
    False: resident on the device beside the trained models, sharded like them."""

    @property
    def device(self) -> DeviceSpec:
        return self.cluster.device

    # ---- FLOPs and bytes -------------------------------------------------------------------------------
    @staticmethod
    def matmul_flops_per_token(model: ModelSpec, head: str = "lm") -> float:
        """2 x weights touched by one token's GEMMs (blocks + head; embedding lookup is free)."""
        head_params = model.vocab * model.hidden if head == "lm" else model.hidden
        return 2.0 * (model.block_params(active=True) + head_params)

    def forward_flops(self, model: ModelSpec, seq_lens: ArrayLike, head: str = "lm") -> float:
        """Forward FLOPs of whole causal sequences of the given lengths (attention over s/2 on average)."""
        s = np.asarray(seq_lens, dtype=np.float64)
        attn = 4.0 * model.layers * model.hidden * (s * s / 2.0)
        return float(np.sum(s * self.matmul_flops_per_token(model, head) + attn))

    def weight_bytes(self, model: ModelSpec, head: str = "lm") -> float:
        return float(model.params(head) * self.device.dtype_bytes)

    def kv_bytes_per_token(self, model: ModelSpec) -> float:
        """K and V of every layer for one token."""
        return 2.0 * model.layers * model.n_kv_heads * model.head_dim * self.device.dtype_bytes

    def train_state_bytes(self, model: ModelSpec, head: str, tp: int, pp: int) -> float:
        """Weights, gradients, master copies and Adam states of the busiest stage's tp shard (no distributed
        optimizer): `rlhfuse.planner.memory.trained_bytes`."""
        lay = ModelLayout(model, head, pp, tp)
        return max(trained_bytes(lay, s, self.precision).train_state for s in range(pp))

    def generation_weight_bytes(self, actor: ModelSpec, gen_tp: int) -> float:
        """One device's share of a generation instance's Actor copy (its tp shard, padded vocabulary)."""
        per = generation_bytes(self.precision)
        return float(shard_count(actor, "lm", tp=gen_tp).params * per)

    def instance_kv_bytes_per_token(self, actor: ModelSpec, gen_tp: int) -> float:
        """K and V of one token over all ranks of a generation instance of `gen_tp` ranks, in the generation copy's
        dtype: each rank caches its kv heads (one replicated head per rank when gen_tp is a multiple of them)."""
        per = generation_bytes(self.precision)
        return gen_tp * kv_cache_bytes(actor, 1, gen_tp, per)

    def rank_memory(
        self,
        actor: ModelSpec,
        critic: ModelSpec,
        a: tuple[int, int],
        c: tuple[int, int],
        gen_tp: int | None = None,
        *,
        merged: bool = False,
    ) -> RankMemory:
        """The busiest device of a training layout (a, c = (tp, pp) of the Actor and the Critic), by component:
        both trained models, the Ref (like the Actor) and the Reward (like the Critic, the Critic's shape), and with
        `gen_tp` the generation copy (`busiest_rank`, cached: the search asks for the same layouts many times).
        `merged`: placed as `rlhfuse.runtime` places unequal tp (the smaller-tp model's stages merged)."""
        out = busiest_rank(self.precision, self.offload_frozen, actor, critic, a, c, merged)
        if gen_tp:
            out += RankMemory(generation_weights=self.generation_weight_bytes(actor, gen_tp))
        return out

    def activation_bytes(self, model: ModelSpec, tokens: float, tp: int, layers: float) -> float:
        """Activations one micro-batch of `tokens` keeps for backward on `layers` layers of one device."""
        try:
            per_token_hidden = ACTIVATION_BYTES_BY_CHECKPOINTING[self.activation_checkpointing]
        except KeyError:
            raise ValueError(
                f"activation_checkpointing={self.activation_checkpointing!r} is unknown: use one of "
                f"{', '.join(ACTIVATION_BYTES_BY_CHECKPOINTING)} (pipeline.activation_checkpointing)"
            ) from None
        return per_token_hidden * tokens * model.hidden * layers / tp * self.device.dtype_bytes / 2

    def usable_memory(self) -> float:
        return self.device.memory * (1.0 - self.eff.memory_reserve)

    # ---- compute ---------------------------------------------------------------------------------------
    def compute_time(self, flops: float, devices: int, ceiling: float, tokens_per_gemm: float) -> float:
        return flops / (devices * self.device.peak_flops * self.eff.mfu(ceiling, tokens_per_gemm))

    def prefill_time(self, model: ModelSpec, seq_lens: ArrayLike, tp: int, head: str = "lm") -> float:
        """Forward over whole sequences on one tp group (prefill, or Ref/RW/Critic inference), with TP comm."""
        s = np.asarray(seq_lens, dtype=np.float64)
        tokens = float(s.sum())
        if tokens == 0:
            return 0.0
        t = self.compute_time(self.forward_flops(model, s, head), tp, self.eff.prefill_mfu, tokens)
        t += model.layers * self.eff.layer_overhead
        return t + 2 * model.layers * self.allreduce_time(tokens * model.hidden * self.device.dtype_bytes, tp)

    def decode_step_time(
        self, model: ModelSpec, tp: int, batch: ArrayLike, context_tokens: ArrayLike
    ) -> NDArray:
        """Time of one decode step of `batch` sequences holding `context_tokens` KV entries in total.

        max(memory time, compute time) + TP all-reduces + fixed overheads; vectorised over its arguments.
        """
        b = np.asarray(batch, dtype=np.float64)
        ctx = np.asarray(context_tokens, dtype=np.float64)
        dev = self.device
        mem = (self.weight_bytes(model) + ctx * self.kv_bytes_per_token(model)) / (
            tp * dev.hbm_bw * self.eff.decode_mbu
        )
        flops = b * self.matmul_flops_per_token(model) + 4.0 * model.layers * model.hidden * ctx
        comp = flops / (tp * dev.peak_flops * self.eff.decode_mfu)
        comm = 2 * model.layers * self.allreduce_time_array(b * model.hidden * dev.dtype_bytes, tp)
        fixed = self.eff.decode_step_overhead + model.layers * self.eff.layer_overhead
        out: NDArray = np.where(b > 0, np.maximum(mem, comp) + comm + fixed, 0.0)
        return out

    def bs_max(self, model: ModelSpec, tp: int) -> int:
        """Decode batch at which the GEMMs become compute-bound (the weight read no longer hides them).

        Solves b x matmul_flops / (peak x decode_mfu) = weight_bytes / (hbm_bw x mbu), KV reads left out, as
        in the paper's definition (per-step latency flat up to BSmax).
        """
        dev = self.device
        b = (self.weight_bytes(model) / (dev.hbm_bw * self.eff.decode_mbu)) * (
            dev.peak_flops * self.eff.decode_mfu
        )
        return max(1, int(b / self.matmul_flops_per_token(model)))

    # ---- communication ---------------------------------------------------------------------------------
    def _link(self, inter_node: bool) -> tuple[float, float]:
        dev = self.device
        if inter_node:
            return dev.inter_bw * self.eff.link_eff, dev.inter_latency
        return dev.intra_bw * self.eff.link_eff, dev.intra_latency

    def allreduce_time(self, nbytes: float, n: int, inter_node: bool = False) -> float:
        """Ring all-reduce of `nbytes` on each of `n` devices."""
        if n <= 1:
            return 0.0
        bw, lat = self._link(inter_node)
        # NCCL uses a tree / NVLS algorithm for small messages inside a node: one latency; rings across nodes
        hops = 2 * (n - 1) if inter_node else 1
        return 2.0 * (n - 1) / n * nbytes / bw + hops * lat

    def allreduce_time_array(self, nbytes: NDArray, n: int, inter_node: bool = False) -> NDArray:
        if n <= 1:
            return np.zeros_like(nbytes)
        bw, lat = self._link(inter_node)
        out: NDArray = 2.0 * (n - 1) / n * nbytes / bw + lat
        return out

    def allgather_time(self, nbytes: float, n: int, inter_node: bool = False, collectives: int = 1) -> float:
        """Ring all-gather of `nbytes` in all (each of `n` devices contributing 1 / n) in `collectives` calls; a
        ring reduce-scatter moves the same bytes: (n - 1) / n x bytes / bandwidth + each call's latency."""
        if n <= 1:
            return 0.0
        bw, lat = self._link(inter_node)
        hops = n - 1 if inter_node else 1
        return (n - 1) / n * nbytes / bw + collectives * hops * lat

    def fsdp_gather_time(self, model: ModelSpec, head: str, world: int, dtype_bytes: int) -> float:
        """pipeline=fsdp: every unit of `model` all-gathered (or its gradients reduce-scattered) once over `world`
        ranks, `dtype_bytes` per element of the padded shards, one collective per unit (FSDP2's)."""
        units = fsdp_padded_units(model, head, world)
        nbytes = world * sum(units) * dtype_bytes
        return self.allgather_time(nbytes, world, world > self.cluster.gpus_per_node, len(units))

    def fsdp_rank_memory(
        self,
        actor: ModelSpec,
        critic: ModelSpec,
        world: int,
        *,
        reshard_after_forward: bool = True,
        microbatches: int = 1,
        kv_tokens: float = 0.0,
        activations: float = 0.0,
    ) -> RankMemory:
        """The busiest rank of pipeline=fsdp over `world` ranks (`rlhfuse.planner.memory.fsdp_rank_memories`:
        rank 0): the four models sharded (the Reward the Critic's shape), the whole generation copy, the
        rollout's KV cache of `kv_tokens` positions and training's `activations`, the gathered phases."""
        ranks = fsdp_rank_memories(
            actor, critic, world=world, precision=self.precision, reward=critic,
            reshard_after_forward=reshard_after_forward, microbatches=microbatches, kv_tokens=kv_tokens,
            activations=activations,
        )  # fmt: skip
        return max(ranks, key=lambda m: m.peak)

    def p2p_time(self, nbytes: float, inter_node: bool) -> float:
        bw, lat = self._link(inter_node)
        return nbytes / bw + lat

    def host_copy_time(self, nbytes_per_device: float) -> float:
        """CPU -> device copy (Ref/RW swap-in), every device copying its own shard in parallel."""
        return nbytes_per_device / (self.device.host_bw * self.eff.link_eff)

    def tp_is_intra_node(self, tp: int) -> bool:
        return tp <= self.cluster.gpus_per_node

    def group_inter_node(self, inner: int, size: int) -> bool:
        """Whether a group of `size` devices strided by `inner` (Megatron order tp, dp, pp) crosses nodes."""
        return inner * size > self.cluster.gpus_per_node

    # ---- training --------------------------------------------------------------------------------------
    def stage_times(
        self, model: ModelSpec, head: str, tp: int, pp: int, dp: int, micro_batch: int, seq_len: float
    ) -> tuple[float, float]:
        """(forward, backward) of one micro-batch on one pipeline stage, communication included.

        Compute: the busiest stage's share (`stage_fraction`) of the forward FLOPs on tp devices at training MFU; backward = 2 x forward compute.
        TP: 2 all-reduces of the activations per layer in forward and 2 in backward. PP: one activation
        (gradient) send per micro-batch per stage boundary, inter-node when tp x dp fills a node.
        """
        tokens = micro_batch * seq_len
        share = stage_fraction(model, pp)
        fwd_flops = self.forward_flops(model, [seq_len] * micro_batch, head) * share
        fwd = self.compute_time(fwd_flops, tp, self.eff.train_mfu, tokens)
        act = tokens * model.hidden * self.device.dtype_bytes
        tp_comm = 2 * (model.layers * share) * self.allreduce_time(act, tp)
        p2p = self.p2p_time(act / tp, self.group_inter_node(tp * dp, pp)) if pp > 1 else 0.0
        return fwd + tp_comm + p2p, 2 * fwd + tp_comm + p2p

    def grad_allreduce_time(self, model: ModelSpec, head: str, tp: int, pp: int, dp: int) -> float:
        """Data-parallel all-reduce of the bf16 gradients of one (tp, pp) shard, once per mini-batch."""
        return self.allreduce_time(self._grad_bytes(model, head, tp, pp), dp, self.group_inter_node(tp, dp))

    def exposed_grad_allreduce_time(
        self, model: ModelSpec, head: str, tp: int, pp: int, dp: int, overlap_s: float
    ) -> float:
        """The part of `grad_allreduce_time` the runtime's bucketed reduction leaves exposed
        (`rlhfuse.distributed.grad_buckets`): each bucket of `GRAD_BUCKET_BYTES` is launched as soon as its gradients
        are final in the stage's last backward, so the reduction overlaps that backward (`overlap_s`); what is
        left after it, and at least the last bucket's own all-reduce, adds to the step."""
        if dp <= 1:
            return 0.0
        inter = self.group_inter_node(tp, dp)
        nbytes = self._grad_bytes(model, head, tp, pp)
        last = self.allreduce_time(min(nbytes, GRAD_BUCKET_BYTES), dp, inter)
        return max(last, self.allreduce_time(nbytes, dp, inter) - overlap_s)

    def _grad_bytes(self, model: ModelSpec, head: str, tp: int, pp: int) -> float:
        return model.params(head) * stage_fraction(model, pp) / tp * self.device.dtype_bytes

    def fsdp_compute_bytes(self) -> int:
        """Bytes per element pipeline=fsdp gathers (the compute dtype of `precision`)."""
        return compute_bytes(self.precision)

    def fsdp_reduce_bytes(self) -> int:
        """Bytes per element pipeline=fsdp reduce-scatters (the reduce dtype of `precision`)."""
        return reduce_bytes(self.precision)

    def optimizer_step_time(self, model: ModelSpec, head: str, tp: int, pp: int) -> float:
        """Adam step: read and write the 16 bytes/param of training state once (memory-bound)."""
        nbytes = 2 * TRAIN_STATE_BYTES_PER_PARAM * model.params(head) * stage_fraction(model, pp) / tp
        return nbytes / (self.device.hbm_bw * self.eff.decode_mbu)

    # ---- task switching --------------------------------------------------------------------------------
    def reshard_time(self, model: ModelSpec, head: str, train_tp: int, train_pp: int, gen_tp: int) -> float:
        """Training (tp, pp) -> generation (gen_tp, pp=1) layout: each device gathers its generation shard.

        A device already holds 1/train_pp of the layers of its generation shard when the tp groups line up;
        the rest arrives over the network (all-to-all style, as the paper does), all devices in parallel.
        """
        shard = self.weight_bytes(model, head) / gen_tp
        have = 1.0 / train_pp if gen_tp == train_tp else 0.0
        missing = shard * (1.0 - have)
        if missing <= 0:
            return 0.0
        return self.p2p_time(missing, inter_node=train_pp * train_tp > self.cluster.gpus_per_node)

    def swap_in_time(self, models: list[tuple[ModelSpec, str]], tp: int) -> float:
        """Load the bf16 weights of `models` from CPU memory onto a tp group (each device its shard)."""
        return self.host_copy_time(sum(self.weight_bytes(m, h) for m, h in models) / tp)


@functools.lru_cache(maxsize=65536)
def busiest_rank(
    precision: str,
    offload: bool,
    actor: ModelSpec,
    critic: ModelSpec,
    a: tuple[int, int],
    c: tuple[int, int],
    merged: bool = False,
) -> RankMemory:
    """The device of a training layout holding most (`RankMemory.peak`), generation copy aside. With `merged`
    and a layout `rlhfuse.runtime` runs, its placement is walked rank by rank (`memory.local_stages` over merged
    stages: each rank its sub-stage of the smaller-tp model). Otherwise, where the pipelines nest (the larger pp
    a multiple of the smaller), the paper's co-located placement of pp stages is walked (a smaller tp: lockstep
    sub-replicas side by side); else each model's busiest stage is assumed on one device."""
    (a_tp, a_pp), (c_tp, c_pp) = a, c
    la, lc = ModelLayout(actor, "lm", a_pp, a_tp), ModelLayout(critic, "value", c_pp, c_tp)

    def on_rank(sa: int, sc: int) -> RankMemory:
        return (
            trained_bytes(la, sa, precision)
            + trained_bytes(lc, sc, precision)
            + frozen_bytes(la, sa, precision, offload)
            + frozen_bytes(lc, sc, precision, offload)
        )

    if merged and Colocation(a_pp, a_tp, c_pp, c_tp).problem() is None:
        stages = local_stages(a_pp, c_pp, a_tp, c_tp)
        return max((on_rank(sa, sc) for sa, sc in stages), key=lambda m: m.peak)
    if max(a_pp, c_pp) % min(a_pp, c_pp) == 0:
        return max((on_rank(sa, sc) for sa, sc in local_stages(a_pp, c_pp)), key=lambda m: m.peak)
    busiest_a = max(range(a_pp), key=lambda s: on_rank(s, 0).peak)
    busiest_c = max(range(c_pp), key=lambda s: on_rank(0, s).peak)
    return on_rank(busiest_a, busiest_c)
