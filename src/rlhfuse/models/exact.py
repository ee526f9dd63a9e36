"""A batch-invariant forward (`attention_backend="exact"`): each row's outputs are the same bits whatever else is
in the call (batch size, padding, the rows beside it, a chunked prefill or a decode step over a KV cache), so
that the sampler's per-token log-probs equal the trainer's recomputation bit for bit.

Legend: N rows (tokens) of a linear, I input features, O output features, X tiles of M = TILE_ROWS rows, Z the
batch of one bmm; for attention B batch, H query heads, K kv heads, G = H // K, T query tokens, S key positions, E head
channels, L compacted key slots (S rounded up to whole blocks), X blocks of C = 64 keys.

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

Not covered: CUDA (no kernel here is written for it, and cuBLAS picks its algorithm by shape and batch count,
so the same ops are not expected to be invariant there); several threads splitting one op (exactness is
measured single-threaded, `OMP_NUM_THREADS=1`); LoRA's unmerged adapters (the trainer adds B A x to W x, the
generator runs the merged W + B A: different arithmetic, whatever the kernels); a tensor-parallel shard's
linears (`rlhfuse.runtime.tensor_parallel` swaps in its own).

The cost: every linear computes whole 64-row tiles (a decode step of one row pays for 64); attention computes
every score of the padded [T, L] square, sorts each query's keys and gathers each query's values ([B, K, T, L, E],
bounded by chunks of `QUERY_CHUNK` queries), where SDPA's fused kernel reads K and V once per block of queries.
docs/models.md ("Exact (batch-invariant) forward") has the timings. A reference for exactness on the CPU, not a
fast path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
"""Queries per pass of `exact_attention` (its gathered values are [B, K, chunk, L, E])."""


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
    when set); a window, a scale and a soft-cap as the layer's spec says (None: plain attention).

    Every gemm is one fixed shape per model, batched by bmm (only the batch count changes with the call): the
    scores as 16-row tiles of queries against a kv head's keys, p . v as [G, C] weights against [C, E] values
    per query and block."""
    b, h, t, e = q_BHTE.shape
    kv_heads, s = k_BKSE.shape[1], k_BKSE.shape[2]
    group = h // kv_heads
    window, scale, softcap = (None, None, None) if spec is None else (spec.window, spec.scale, spec.softcap)
    if allowed_B1TS is None:
        t_T = torch.arange(t, device=q_BHTE.device)
        distance_TT = t_T[:, None] - t_T[None, :]
        allowed_B1TS = ((distance_TT >= 0) & (distance_TT < (window or t)))[None, None]
    if t > QUERY_CHUNK:  # each query's result is its own: chunks give the same bits in less memory
        return torch.cat(
            [
                exact_attention(q_BHTE[:, :, i : i + QUERY_CHUNK], k_BKSE, v_BKSE, mask_B1TS, spec)
                for i, mask_B1TS in zip(
                    range(0, t, QUERY_CHUNK), allowed_B1TS.split(QUERY_CHUNK, dim=2), strict=True
                )
            ],
            dim=2,
        )
    allowed_BTS = allowed_B1TS[:, 0].expand(b, t, s)
    blocks = -(-s // KEY_BLOCK)
    slots = blocks * KEY_BLOCK
    # each query's allowed keys first, in position order (a stable sort of "not allowed"), then the rest
    order_BTS = torch.argsort((~allowed_BTS).to(torch.uint8), dim=-1, stable=True)
    index_BTL = F.pad(order_BTS, (0, slots - s))
    kept_BTL = torch.arange(slots, device=q_BHTE.device) < allowed_BTS.sum(-1, keepdim=True)

    # scores: the G x T queries of each kv head in 16-row tiles, against its keys (zero keys up to L: N >= 2)
    rows = group * t
    tiles = -(-rows // SCORE_TILE_ROWS)
    q_ZME = F.pad(q_BHTE.reshape(b * kv_heads, rows, e), (0, 0, 0, tiles * SCORE_TILE_ROWS - rows))
    k_BKEL = F.pad(k_BKSE, (0, 0, 0, slots - s)).transpose(-1, -2)
    k_ZEL = k_BKEL[:, :, None].expand(b, kv_heads, tiles, e, slots).reshape(-1, e, slots)
    scores_ZML = torch.bmm(q_ZME.reshape(-1, SCORE_TILE_ROWS, e), k_ZEL)
    scores_BKGTL = scores_ZML.view(b, kv_heads, tiles * SCORE_TILE_ROWS, slots)[:, :, :rows]
    scores_BKGTL = scores_BKGTL.reshape(b, kv_heads, group, t, slots)
    scores_BKGTL = scores_BKGTL * (scale if scale is not None else e**-0.5)
    if softcap is not None:
        scores_BKGTL = torch.tanh(scores_BKGTL / softcap) * softcap
    # ... compacted: slot l of query t holds its l-th allowed key, slots past its last one are empty
    scores_BKGTL = scores_BKGTL.gather(-1, index_BTL[:, None, None].expand(b, kv_heads, group, t, slots))
    wide = torch.promote_types(q_BHTE.dtype, torch.float32)
    scores_BKGTL = scores_BKGTL.masked_fill(~kept_BTL[:, None, None], float("-inf")).to(wide)
    weights_BKGTL = torch.exp(scores_BKGTL - scores_BKGTL.amax(-1, keepdim=True))

    # the softmax denominator and p . v in blocks of C keys, the blocks folded left to right
    weights_BKGTXC = weights_BKGTL.view(b, kv_heads, group, t, blocks, KEY_BLOCK)
    denominator_BKGT = _left_fold(weights_BKGTXC.sum(-1), -1)
    base_BK11 = (torch.arange(b * kv_heads, device=q_BHTE.device) * s).view(b, kv_heads, 1, 1)
    rows_N = (base_BK11 + index_BTL[:, None]).flatten()
    v_BKTLE = v_BKSE.reshape(b * kv_heads * s, e).index_select(0, rows_N).to(wide)
    w_ZGC = weights_BKGTXC.permute(0, 1, 3, 4, 2, 5).reshape(-1, group, KEY_BLOCK)
    partial_BKTXGE = torch.bmm(w_ZGC, v_BKTLE.view(-1, KEY_BLOCK, e)).view(b, kv_heads, t, blocks, group, e)
    numerator_BKGTE = _left_fold(partial_BKTXGE, 3).transpose(2, 3)
    out_BKGTE = numerator_BKGTE / denominator_BKGT[..., None]
    return out_BKGTE.to(q_BHTE.dtype).reshape(b, h, t, e)
