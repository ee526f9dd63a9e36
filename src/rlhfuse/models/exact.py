"""A batch-invariant forward (`attention_backend="exact"`): each row's outputs are the same bits whatever else is
in the call (batch size, padding, the rows beside it, a chunked prefill or a decode step over a KV cache), so
that the sampler's per-token log-probs equal the trainer's recomputation bit for bit.

Legend: N rows (tokens) of a linear, I input features, O output features, X tiles of M = TILE_ROWS rows, Z the
batch of one bmm; for attention B batch, H query heads, K kv heads, G = H // K, T query tokens, S key positions, E head
channels, L compacted key slots (S rounded up to whole blocks), X blocks of C = 64 keys, N picked (row, query) pairs.

Where a float result depends on the call and not on the row alone, and what this module does instead (measured
with torch 2.13, CPU build, MKL, AVX512, one thread):

- Linear layers. `F.linear(x[:M], W)[0]` changes in its last bits with M: MKL takes a matrix-vector path for M = 1,
  and other blockings for M = 2 and M >= 16 (K=576, N=1536 and every tiny shape tried). A gemm of a fixed row-tile
  shape is invariant to the row's place in the tile and to the other rows' values, and `torch.bmm` over
  [X, M, I] tiles with the weight expanded along X gives each tile the bits of a lone tile, for any X (measured
  for M = 16, 32 and 64, I x O from 64 x 128 to 512 x 8192 and 1408 x 512). So `invariant_linear` pads the
  flattened rows to whole tiles and runs them through bmm. One output feature (the value head, O = 1) is the
  matrix-vector case again (bmm's result then changes with X): the weight gets a zero second column. Computing
  the transpose instead (W @ x^T, rows as the gemm's columns) is not invariant: 512 x 1408 changes past 300
  rows. M = 64: MKL packs the weight once per tile, so fewer, larger tiles cost less wherever a call has many
  rows (training, prefill, batched decode), and more where it has few (a lone decode step computes 64 rows).
- Pointwise functions. `torch.exp`, `tanh`, `sin`, `cos`, `log`, `rsqrt` give an element the same bits wherever
  it sits in a tensor; `F.silu`, `torch.sigmoid` and `F.gelu(approximate="tanh")` do not (a tail shorter than a
  vector takes a scalar path with other rounding). `silu` and `gelu_tanh` here are written from exp / tanh and
  the correctly rounded + - x /.
- Row reductions. RMSNorm (`F.rms_norm`), softmax / log-softmax over the last dim (the LM head's log-probs, on
  contiguous or sliced logits) and sum / amax over a contiguous last dim give each row the same bits whatever
  the number of rows: they stay as they are.
- Attention. The sum over keys is where the call shows: the KV cache holds padding slots and the trainer's batch
  holds left padding, so one query's keys sit at different indices in the two calls, among different numbers of
  masked keys. `exact_attention` works on each query's allowed keys only, in position order, compacted to the
  left (the same list in both calls). The scores are 16-row tiles of queries against a kv head's keys in bmm
  (measured: a score's bits change neither with the number of key columns, 2 to 600, nor with the batch count,
  E = 16 to 256); the softmax max is exact in any order; the sums over keys, the softmax denominator (a
  contiguous sum of 64) and p . v (bmm of [G, 64] weights against [64, E] values per query and block, one shape
  per model: measured invariant to the batch count for G = 1 to 16, E = 8 to 256), run in blocks of C = 64
  compacted keys, folded left to right. The blocks a longer call adds past the query's keys are all zeros, and
  x + 0.0 == x. Queries are independent, so long calls run in chunks of `QUERY_CHUNK` queries.
  The compaction is done once per row, not per query (`exact_attention`): a query whose keys are the first of
  its row's list has exactly its own compaction there, so the row's queries share its value blocks, and bmm
  over a stride-0 batch of one block gives each query the bits of its own copy (measured, and tested against the
  per-query form on random masks). The backward is plain attention's, as the linears' is plain.

Not covered: CUDA (no kernel here is written for it, and cuBLAS picks its algorithm by shape and batch count,
so the same ops are not expected to be invariant there); several threads splitting one op (exactness is
measured single-threaded, `OMP_NUM_THREADS=1`); LoRA's unmerged adapters (the trainer adds B A x to W x, the
generator runs the merged W + B A: different arithmetic, whatever the kernels); a tensor-parallel shard's
linears (`rlhfuse.runtime.tensor_parallel` swaps in its own).

The cost: every linear computes whole 64-row tiles (a decode step of one row pays for 64); attention computes
every score of the padded [T, L] square, one bmm per row, kv head and block for p . v (a [G, C] gemm per query),
a block copy per trailing pad query, and reads where its kinds of queries are on the host once per masked call,
where SDPA's fused kernel reads K and V once per block of queries. docs/models.md ("Exact (batch-invariant)
forward") has the timings. A reference for exactness on the CPU, not a fast path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:  # attention.py registers this module's kernels: no import back at run time
    from rlhfuse.models.attention import AttentionSpec

TILE_ROWS = 64
"""Rows of one linear's gemm tile: every linear computes its rows as rows of [TILE_ROWS, I] tiles."""
SCORE_TILE_ROWS = 16
"""Rows (queries of one kv head) of one tile of attention scores."""
KEY_BLOCK = 64
"""Keys summed in one contiguous reduction before the left fold over blocks."""
QUERY_CHUNK = 256
"""Queries per pass of `exact_attention` (its scores are [B, H, chunk, L])."""
SHARED_BLOCK_QUERIES = 4
"""Up to this many queries per row, p . v copies each query its value blocks and runs one bmm; past it, one bmm
per row, kv head and block whose queries share the block's values (fewer calls against fewer copies)."""


def _tiled_rows(x_NI: Tensor, weight_OI: Tensor) -> Tensor:
    """x @ weight.T, its rows padded to whole tiles and run as [TILE_ROWS, I] gemms by one bmm."""
    rows, features = x_NI.shape
    out_features = weight_OI.shape[0]
    tiles = -(-rows // TILE_ROWS)
    x_XMI = F.pad(x_NI, (0, 0, 0, tiles * TILE_ROWS - rows)).contiguous().view(tiles, TILE_ROWS, features)
    w_IO = weight_OI.t()
    if out_features == 1:  # a one-column gemm is MKL's matrix-vector case: give it a zero second column
        w_IO = F.pad(w_IO, (0, 1))
    y_XMO = torch.bmm(x_XMI, w_IO.expand(tiles, *w_IO.shape))
    return y_XMO.reshape(tiles * TILE_ROWS, w_IO.shape[1])[:rows, :out_features]


class _TiledLinear(torch.autograd.Function):
    """`_tiled_rows` forward; a plain backward (gradients need no batch invariance), which also keeps bmm's
    backward from materialising one weight gradient per tile ([X, I, O]) before summing them."""

    @staticmethod
    def forward(ctx: Any, x_NI: Tensor, weight_OI: Tensor) -> Tensor:
        ctx.save_for_backward(x_NI, weight_OI)
        return _tiled_rows(x_NI, weight_OI)

    @staticmethod
    def backward(ctx: Any, grad_NO: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x_NI, weight_OI = ctx.saved_tensors
        grad_NO = grad_NO.to(weight_OI.dtype)  # under autocast the forward's gemm ran in a lower precision
        grad_x = (grad_NO @ weight_OI).to(x_NI.dtype) if ctx.needs_input_grad[0] else None
        grad_w = grad_NO.t() @ x_NI.to(weight_OI.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def invariant_linear(x_NI: Tensor, weight_OI: Tensor, bias_O: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias with each row computed as a row of a [TILE_ROWS, I] tile (any leading shape; the last
    dim is I): a row's result does not depend on the other rows of the call, nor on their number."""
    *lead, features = x_NI.shape
    y_NO = _TiledLinear.apply(x_NI.reshape(-1, features), weight_OI)
    if bias_O is not None:
        y_NO = y_NO + bias_O
    return y_NO.reshape(*lead, weight_OI.shape[0])


class InvariantLinear(nn.Linear):
    """`nn.Linear` (same parameters, same state-dict keys) computed by `invariant_linear`."""

    def forward(self, input: Tensor) -> Tensor:
        return invariant_linear(input, self.weight, self.bias)


def silu(x: Tensor) -> Tensor:
    """x * sigmoid(x) as x / (1 + exp(-x)): the same bits for an element wherever it sits (`F.silu` is not)."""
    return x / (1 + torch.exp(-x))


def gelu_tanh(x: Tensor) -> Tensor:
    """The tanh approximation of gelu, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), from invariant ops
    (`F.gelu(approximate="tanh")` is not)."""
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1 + torch.tanh(inner))


GATE_ACTIVATIONS = {"silu": silu, "gelu_pytorch_tanh": gelu_tanh}
"""ModelConfig.hidden_act -> the gate's activation, batch-invariant."""


def _left_fold(x: Tensor, dim: int) -> Tensor:
    """x's slices along `dim` added first to last (a fold, not a tree: zero blocks past the end change nothing)."""
    total = x.select(dim, 0)
    for block in range(1, x.shape[dim]):
        total = total + x.select(dim, block)
    return total


def _block_values(w_BKXTGC: Tensor, v_BKXCE: Tensor) -> Tensor:
    """p . v of every query and block, [B * K * X * T, G, E]: [G, C] weights against the [C, E] values of its
    row's block, one bmm shape (`exact_attention`)."""
    b, kv_heads, blocks, t, group, _ = w_BKXTGC.shape
    e = v_BKXCE.shape[-1]
    if t <= SHARED_BLOCK_QUERIES:  # a few queries: copy each its blocks, one bmm
        v_ZCE = v_BKXCE[:, :, :, None].expand(b, kv_heads, blocks, t, KEY_BLOCK, e).reshape(-1, KEY_BLOCK, e)
        return torch.bmm(w_BKXTGC.reshape(-1, group, KEY_BLOCK), v_ZCE)
    # one bmm per row, kv head and block, its queries sharing the block's values (stride 0: no copy)
    return torch.cat(
        [
            torch.bmm(w_TGC, v_CE.expand(t, KEY_BLOCK, e))
            for w_XTGC, v_XCE in zip(w_BKXTGC.flatten(0, 1), v_BKXCE.flatten(0, 1), strict=True)
            for w_TGC, v_CE in zip(w_XTGC, v_XCE, strict=True)
        ]
    )


class _Lists(NamedTuple):
    """Where each query's allowed keys sit in its row's list of keys (`exact_attention`)."""

    row_BS: Tensor
    """The row's keys (those of its last query); compacted once per row, in position order."""
    prefix_BT: Tensor
    """Query t's keys start with the row's first prefix_BT[b, t] keys ..."""
    extra_BT: Tensor | None = None
    """... followed by this one key past them, at slot prefix_BT[b, t] (-1: none; None: no query has one)."""
    extended_N: tuple[Tensor, Tensor] | None = None
    """(row, query) of the queries with an extra key (read on the host: they get a block of their own)."""
    single_BT: Tensor | None = None
    """Queries allowed one key alone (a pad query): they take that key's value."""


def exact_attention(
    q_BHTE: Tensor,
    k_BKSE: Tensor,
    v_BKSE: Tensor,
    allowed_B1TS: Tensor | None,
    spec: AttentionSpec | None = None,
) -> Tensor:
    """softmax(q k^T * scale) v over each query's allowed keys, computed on those keys alone, in position order
    (module docstring): the same bits for a query whatever the call's padding, batch or cache layout. Takes what
    every backend takes (`rlhfuse.models.attention`): no mask = plain causal over T == S (within `spec.window`
    when set); a window, a scale and a soft-cap as the layer's spec says (None: plain attention). The backward
    is plain attention's (`_ExactAttention`)."""
    return _ExactAttention.apply(q_BHTE, k_BKSE, v_BKSE, allowed_B1TS, spec)


class _ExactAttention(torch.autograd.Function):
    """`_exact_forward`; a plain backward (gradients need no batch invariance, as the linears'): the softmax's
    probabilities recomputed over the whole [T, S] mask with plain ops, then attention's gradients, instead of
    the backward of every gather, fill and small bmm of the forward."""

    @staticmethod
    def forward(
        ctx: Any, q_BHTE: Tensor, k_BKSE: Tensor, v_BKSE: Tensor, allowed_B1TS: Tensor | None, spec: Any
    ) -> Tensor:
        ctx.save_for_backward(q_BHTE, k_BKSE, v_BKSE, allowed_B1TS)
        ctx.spec = spec
        return _exact_forward(q_BHTE, k_BKSE, v_BKSE, allowed_B1TS, spec)

    @staticmethod
    def backward(ctx: Any, grad_BHTE: Tensor) -> tuple[Tensor | None, ...]:
        q_BHTE, k_BKSE, v_BKSE, allowed_B1TS = ctx.saved_tensors
        spec = ctx.spec
        b, h, t, e = q_BHTE.shape
        kv_heads = k_BKSE.shape[1]
        group = h // kv_heads
        window, scale, softcap = (
            (None, None, None) if spec is None else (spec.window, spec.scale, spec.softcap)
        )
        scale = scale if scale is not None else e**-0.5
        if allowed_B1TS is None:
            t_T = torch.arange(t, device=q_BHTE.device)
            distance_TT = t_T[:, None] - t_T[None, :]
            allowed_B1TS = ((distance_TT >= 0) & (distance_TT < (window or t)))[None, None]
        wide = torch.promote_types(q_BHTE.dtype, torch.float32)
        q_BKGTE = q_BHTE.to(wide).view(b, kv_heads, group, t, e)
        k_BK1SE, v_BK1SE = k_BKSE.to(wide)[:, :, None], v_BKSE.to(wide)[:, :, None]
        grad_BKGTE = grad_BHTE.to(wide).view(b, kv_heads, group, t, e)
        scores_BKGTS = q_BKGTE @ k_BK1SE.transpose(-1, -2) * scale
        if softcap is not None:
            capped_BKGTS = torch.tanh(scores_BKGTS / softcap)
            scores_BKGTS = capped_BKGTS * softcap
        scores_BKGTS = scores_BKGTS.masked_fill(~allowed_B1TS[:, :, None], float("-inf"))
        p_BKGTS = torch.softmax(scores_BKGTS, dim=-1)
        grad_p_BKGTS = grad_BKGTE @ v_BK1SE.transpose(-1, -2)
        grad_scores_BKGTS = p_BKGTS * (grad_p_BKGTS - (p_BKGTS * grad_p_BKGTS).sum(-1, keepdim=True))
        if softcap is not None:
            grad_scores_BKGTS = grad_scores_BKGTS * (1 - capped_BKGTS * capped_BKGTS)
        grad_scores_BKGTS = grad_scores_BKGTS * scale
        grad_q = (grad_scores_BKGTS @ k_BK1SE).reshape(b, h, t, e).to(q_BHTE.dtype)
        grad_k = (grad_scores_BKGTS.transpose(-1, -2) @ q_BKGTE).sum(2).to(k_BKSE.dtype)
        grad_v = (p_BKGTS.transpose(-1, -2) @ grad_BKGTE).sum(2).to(v_BKSE.dtype)
        return grad_q, grad_k, grad_v, None, None


def _exact_forward(
    q_BHTE: Tensor,
    k_BKSE: Tensor,
    v_BKSE: Tensor,
    allowed_B1TS: Tensor | None,
    spec: AttentionSpec | None,
) -> Tensor:
    """`exact_attention`'s forward.

    A row's keys are compacted once per row (its last query's keys), not once per query: a query whose allowed
    keys are the row's first ones has, on them, exactly its own compaction (causal attention over left padding
    or over a cache: every prefill and training call). A query with one key past those (a trailing pad query's
    own key) gets its own copy of the one block holding it; a query allowed one key alone (a pad query) gets
    that key's value, which is what the sums give it. Any other query (a sliding window past its first keys)
    is computed again as a row of its own. Telling them apart reads their places on the host, once per masked
    call of more than one query."""
    b, t, s = q_BHTE.shape[0], q_BHTE.shape[2], k_BKSE.shape[2]
    window = None if spec is None else spec.window
    plain_causal = allowed_B1TS is None and (window or t) >= t
    if plain_causal and t <= QUERY_CHUNK:  # query t's keys: the row's first t + 1
        every_BS = torch.ones(b, s, dtype=torch.bool, device=q_BHTE.device)
        prefix_BT = torch.arange(1, t + 1, device=q_BHTE.device).expand(b, t)
        return _row_compacted(q_BHTE, k_BKSE, v_BKSE, _Lists(every_BS, prefix_BT), spec)
    if allowed_B1TS is None:
        t_T = torch.arange(t, device=q_BHTE.device)
        distance_TT = t_T[:, None] - t_T[None, :]
        allowed_B1TS = ((distance_TT >= 0) & (distance_TT < (window or t)))[None, None]
    if t > QUERY_CHUNK:  # each query's result is its own: chunks give the same bits in less memory
        return torch.cat(
            [
                _exact_forward(q_BHTE[:, :, i : i + QUERY_CHUNK], k_BKSE, v_BKSE, mask_B1TS, spec)
                for i, mask_B1TS in zip(
                    range(0, t, QUERY_CHUNK), allowed_B1TS.split(QUERY_CHUNK, dim=2), strict=True
                )
            ],
            dim=2,
        )
    allowed_BTS = allowed_B1TS[:, 0].expand(b, t, s)
    if t == 1:  # a lone query's keys are its row's
        return _row_compacted(q_BHTE, k_BKSE, v_BKSE, _Lists(allowed_BTS[:, 0], allowed_BTS.sum(-1)), spec)
    lists, other_N = _query_lists(allowed_BTS)
    out_BHTE = _row_compacted(q_BHTE, k_BKSE, v_BKSE, lists, spec)
    if len(other_N[0]) == 0:
        return out_BHTE
    row_N, query_N = other_N
    redone_NH1E = _row_compacted(
        q_BHTE[row_N, :, query_N, None],
        k_BKSE[row_N],
        v_BKSE[row_N],
        _Lists(allowed_BTS[row_N, query_N], allowed_BTS[row_N, query_N].sum(-1, keepdim=True)),
        spec,
    )
    out_BTHE = out_BHTE.transpose(1, 2).index_put((row_N, query_N), redone_NH1E[:, :, 0])
    return out_BTHE.transpose(1, 2)


def _query_lists(allowed_BTS: Tensor) -> tuple[_Lists, tuple[Tensor, Tensor]]:
    """Each query's keys as the row's first ones, maybe one more past them, or one key alone; and (row, query)
    of the others, which need a row of their own. One host read: where the extended and the other queries are."""
    s = allowed_BTS.shape[-1]
    s_S = torch.arange(s, device=allowed_BTS.device, dtype=torch.int32)
    row_BS = allowed_BTS[:, -1]
    rank_BS = row_BS.cumsum(-1) - 1
    in_row_BTS = allowed_BTS & row_BS[:, None]
    prefix_BT = in_row_BTS.sum(-1)
    outside_BT = allowed_BTS.sum(-1) - prefix_BT
    # the in-row keys are the row's first ones when the last of them has rank prefix - 1
    last_in_row_BT = torch.where(in_row_BTS, s_S, -1).amax(-1)
    is_prefix_BT = rank_BS.gather(1, last_in_row_BT.clamp(min=0).long()) == prefix_BT - 1
    is_prefix_BT |= prefix_BT == 0
    first_outside_BT = torch.where(allowed_BTS & ~row_BS[:, None], s_S, s).amin(-1)
    past_row_BT = first_outside_BT > last_in_row_BT
    first_outside_BT = first_outside_BT.long()
    single_BT = prefix_BT + outside_BT == 1
    extended_BT = ~single_BT & is_prefix_BT & (outside_BT == 1) & past_row_BT
    other_BT = ~single_BT & ~extended_BT & ~(is_prefix_BT & (outside_BT == 0))
    extra_BT = torch.where(extended_BT | (single_BT & (outside_BT == 1)), first_outside_BT, -1)
    found_N3 = torch.stack([extended_BT, other_BT]).nonzero().cpu()  # the host read
    extended_N3, other_N3 = (found_N3[found_N3[:, 0] == kind].to(allowed_BTS.device) for kind in (0, 1))
    extended_N = (extended_N3[:, 1], extended_N3[:, 2])
    lists = _Lists(row_BS, prefix_BT, extra_BT, extended_N, single_BT)
    return lists, (other_N3[:, 1], other_N3[:, 2])


def _row_compacted(
    q_BHTE: Tensor, k_BKSE: Tensor, v_BKSE: Tensor, lists: _Lists, spec: AttentionSpec | None
) -> Tensor:
    """Attention of each query over its keys as `lists` places them in its row's list, compacted to the left in
    position order: the sums of `exact_attention`, the row's keys gathered once per row.

    Every gemm is one fixed shape per model, batched by bmm (only the batch count changes with the call): the
    scores as 16-row tiles of queries against a kv head's keys, p . v as [G, C] weights against [C, E] values
    per query and block (the row's queries share a block's values: a stride-0 batch, no copy)."""
    b, h, t, e = q_BHTE.shape
    kv_heads, s = k_BKSE.shape[1], k_BKSE.shape[2]
    group = h // kv_heads
    scale, softcap = (None, None) if spec is None else (spec.scale, spec.softcap)
    blocks = -(-s // KEY_BLOCK)
    slots = blocks * KEY_BLOCK
    # the row's keys first, in position order (a stable sort of "not in the row"), then the rest
    order_BS = torch.argsort((~lists.row_BS).to(torch.uint8), dim=-1, stable=True)
    index_BL = F.pad(order_BS, (0, slots - s))
    slot_L = torch.arange(slots, device=q_BHTE.device)
    index_BTL = index_BL[:, None].expand(b, t, slots)
    count_BT = lists.prefix_BT
    if lists.extra_BT is not None:  # a key past the row's first ones: in the slot after them
        has_extra_BT = lists.extra_BT >= 0
        count_BT = count_BT + has_extra_BT
        is_extra_BTL = (slot_L == lists.prefix_BT[..., None]) & has_extra_BT[..., None]
        index_BTL = torch.where(is_extra_BTL, lists.extra_BT[..., None], index_BTL)
    kept_BTL = slot_L < count_BT[..., None]

    # scores: the G x T queries of each kv head in 16-row tiles, against its keys (zero keys up to L: N >= 2)
    rows = group * t
    tiles = -(-rows // SCORE_TILE_ROWS)
    q_ZME = F.pad(q_BHTE.reshape(b * kv_heads, rows, e), (0, 0, 0, tiles * SCORE_TILE_ROWS - rows))
    k_BKEL = F.pad(k_BKSE, (0, 0, 0, slots - s)).transpose(-1, -2)
    k_ZEL = k_BKEL[:, :, None].expand(b, kv_heads, tiles, e, slots).reshape(-1, e, slots)
    scores_ZML = torch.bmm(q_ZME.reshape(-1, SCORE_TILE_ROWS, e), k_ZEL)
    # in place from here on: the forward runs without autograd (`_ExactAttention`)
    scores_ZML.mul_(scale if scale is not None else e**-0.5)
    if softcap is not None:
        scores_ZML.div_(softcap).tanh_().mul_(softcap)
    scores_BKGTL = scores_ZML.view(b, kv_heads, tiles * SCORE_TILE_ROWS, slots)[:, :, :rows]
    scores_BKGTL = scores_BKGTL.reshape(b, kv_heads, group, t, slots)
    # ... compacted: slot l of query t holds its l-th key, slots past its last one are empty
    index_BKGTL = index_BTL[:, None, None].expand(b, kv_heads, group, t, slots)
    empty_B11TL = ~kept_BTL[:, None, None]
    wide = torch.promote_types(q_BHTE.dtype, torch.float32)
    scores_BKGTL = scores_BKGTL.gather(-1, index_BKGTL).masked_fill_(empty_B11TL, float("-inf")).to(wide)
    # exp(-inf) = 0 written as 0: exp takes a slow path on -inf (and the empty slots are most of a short call)
    scores_BKGTL.sub_(scores_BKGTL.amax(-1, keepdim=True)).masked_fill_(empty_B11TL, 0.0)
    weights_BKGTL = scores_BKGTL.exp_().masked_fill_(empty_B11TL, 0.0)

    # the softmax denominator and p . v in blocks of C keys, the blocks folded left to right
    weights_BKGTXC = weights_BKGTL.view(b, kv_heads, group, t, blocks, KEY_BLOCK)
    denominator_BKGT = _left_fold(weights_BKGTXC.sum(-1), -1)
    first_BK1 = (torch.arange(b * kv_heads, device=q_BHTE.device) * s).view(b, kv_heads, 1)
    # index_select copies whole rows of E (a gather on E would read an index per element)
    rows_N = (first_BK1 + index_BL[:, None]).flatten()
    v_BKLE = v_BKSE.reshape(-1, e).index_select(0, rows_N).to(wide).view(b, kv_heads, slots, e)
    v_BKXCE = v_BKLE.view(b, kv_heads, blocks, KEY_BLOCK, e)
    w_BKXTGC = weights_BKGTXC.permute(0, 1, 4, 3, 2, 5)  # a view: bmm reads each [G, C] matrix in place
    partial_ZGE = _block_values(w_BKXTGC, v_BKXCE)
    partial_BKXTGE = partial_ZGE.view(b, kv_heads, blocks, t, group, e)
    if lists.extended_N is not None and len(lists.extended_N[0]) > 0:
        partial_BKXTGE = _extended_blocks(partial_BKXTGE, w_BKXTGC, v_BKLE, v_BKSE, lists)
    numerator_BKTGE = _left_fold(partial_BKXTGE, 2)
    out_BKGTE = numerator_BKTGE.transpose(2, 3) / denominator_BKGT[..., None]
    out_BHTE = out_BKGTE.to(q_BHTE.dtype).reshape(b, h, t, e)
    if lists.single_BT is not None:
        # one key alone: weight exp(0) = 1 on it, 0 on every other slot, a denominator of 1: its value, exactly
        rows_N = (first_BK1 + index_BTL[:, None, :, 0]).flatten()
        value_BKTE = v_BKSE.reshape(-1, e).index_select(0, rows_N).to(wide).to(q_BHTE.dtype)
        value_BHTE = value_BKTE.view(b, kv_heads, t, e).repeat_interleave(group, dim=1)
        out_BHTE = torch.where(lists.single_BT[:, None, :, None], value_BHTE, out_BHTE)
    return out_BHTE


def _extended_blocks(
    partial_BKXTGE: Tensor, w_BKXTGC: Tensor, v_BKLE: Tensor, v_BKSE: Tensor, lists: _Lists
) -> Tensor:
    """p . v of the block holding each extended query's extra key, again, with that key's value in its slot
    (the row's blocks hold the row's next key there): a copy of one block per such query."""
    assert lists.extra_BT is not None and lists.extended_N is not None
    kv_heads, slots, e = v_BKLE.shape[1:]
    row_N, query_N = lists.extended_N
    n = len(row_N)
    slot_N = lists.prefix_BT[row_N, query_N]
    block_N, within_N = slot_N // KEY_BLOCK, slot_N % KEY_BLOCK
    k_K = torch.arange(kv_heads, device=row_N.device)
    blocks_NK = (row_N[:, None] * kv_heads + k_K) * (slots // KEY_BLOCK) + block_N[:, None]
    values_NKCE = v_BKLE.reshape(-1, KEY_BLOCK * e).index_select(0, blocks_NK.flatten())
    values_NKCE = values_NKCE.view(n, kv_heads, KEY_BLOCK, e)
    extra_NKE = v_BKSE[row_N, :, lists.extra_BT[row_N, query_N]].to(v_BKLE.dtype)
    values_NKCE[torch.arange(n, device=row_N.device), :, within_N] = extra_NKE
    weights_NKGC = w_BKXTGC[row_N, :, block_N, query_N]
    group = weights_NKGC.shape[2]
    redone_ZGE = torch.bmm(weights_NKGC.reshape(-1, group, KEY_BLOCK), values_NKCE.view(-1, KEY_BLOCK, e))
    partial_BXTKGE = partial_BKXTGE.permute(0, 2, 3, 1, 4, 5)
    partial_BXTKGE = partial_BXTKGE.index_put(
        (row_N, block_N, query_N), redone_ZGE.view(n, kv_heads, group, e)
    )
    return partial_BXTKGE.permute(0, 3, 1, 2, 4, 5)
