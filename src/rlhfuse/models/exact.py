"""A batch-invariant forward (`attention_backend="exact"`): each row's outputs are the same bits whatever else is
in the call (batch size, padding, the rows beside it, a chunked prefill or a decode step over a KV cache), so
that the sampler's per-token log-probs equal the trainer's recomputation bit for bit.

Legend: N rows (tokens) of a linear, I input features, O output features, X tiles of M = TILE_ROWS rows; for
attention B batch, H query heads, K kv heads, T query tokens, S key positions, E head channels.

Where a float result depends on the call and not on the row alone, and what this module does instead (torch
2.13, CPU build, MKL, one thread):

- Linear layers. `F.linear(x[:M], W)[0]` changes in its last bits with M where the BLAS picks kernels by shape: a
  matrix-vector path for M = 1, other kernels for a few rows; from some row count on, one kernel gives a row
  the same bits for any M (measured: from M = 4 on an AMD EPYC with AVX2 for every shape tried, up to 2000 rows;
  an Intel AVX512 machine differed at M = 2 and M >= 16). That count is probed, not assumed: the first call of
  each weight shape, dtype, device and autocast state runs `probed_least`, which puts a row at the first, middle
  and last place of calls of 1 to 4096 rows among random rows and finds the least count of LEAST_ROWS from
  which every call gives it the bits of the largest. `invariant_linear` then runs F.linear itself, rows padded
  up to that count (a decode step of one row computes 4 rows here). Where the probe finds none, or cannot reach
  MIN_PROBED_ROWS rows within PROBE_MACS multiply-adds (a large vocabulary head), the rows run as [TILE_ROWS, I]
  tiles in one bmm with the weight expanded (a fixed shape: a tile's bits are a lone tile's for any number of
  tiles). A probe is evidence, not proof: `rollout/logprob_abs_diff` (logged every iteration) is the check that
  the mode held over a run.
- Pointwise functions. `torch.exp`, `tanh`, `sin`, `cos`, `log`, `rsqrt` give an element the same bits wherever
  it sits in a tensor; `F.silu`, `torch.sigmoid` and `F.gelu(approximate="tanh")` do not (a tail shorter than a
  vector takes a scalar path with other rounding). `silu` and `gelu_tanh` here are written from exp / tanh and
  the correctly rounded + - x /.
- Row reductions. RMSNorm (`F.rms_norm`), softmax / log-softmax over the last dim (the LM head's log-probs, on
  contiguous or sliced logits) and sum / amax over a contiguous last dim give each row the same bits whatever
  the number of rows: they stay as they are.
- Attention. The sum over keys is where the call shows: the KV cache holds padding slots and the trainer's batch
  holds left padding, so one query's keys sit at different indices in the two calls, among different numbers of
  masked keys. On the CPU, `cpu_exact_attention` runs one compiled pass (numba, `_attend_rows`) that reads each
  query's allowed keys alone, in position order: dot products in order over E, the exact max, exp per key, the
  denominator and p . v summed key after key, nothing reassociated. No other key is read, so a query's result is a function of its own keys' values: exact by
  construction, whatever the BLAS, at SDPA's cost on a decode step (no gemm of one row, no copy of the keys:
  the cache's keys and values are read where they lie, and the result is written in the layout the output
  projection reads).
  On CUDA `cuda_exact_attention` runs the Triton kernel of `kernels/exact.py`: one program per query, its
  allowed keys compacted in position order and read in fixed blocks (one reduction tree per block, the blocks
  added first to last), and the linears run that module's fixed-tile matmul (no split over I), so neither
  depends on cuBLAS's choice of algorithm. Tested under the Triton interpreter; no GPU has run it yet.
  The two devices round differently; a run computes on one. The backward is plain attention's (SDPA's own).

Not covered: a GPU run (the CUDA kernels are tested in the interpreter only); other devices (exact attention
refuses them); several threads splitting one op (exactness is measured single-threaded,
`OMP_NUM_THREADS=1`); LoRA's unmerged adapters (the trainer adds B A x to W x, the generator runs the merged
W + B A: different arithmetic, whatever the kernels); a tensor-parallel shard's linears
(`rlhfuse.runtime.tensor_parallel` swaps in its own).

The cost: docs/models.md ("Exact (batch-invariant) forward") has the timings.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlhfuse._resources import load_kernel_module
from rlhfuse.models.masks import band_mask

if TYPE_CHECKING:  # attention.py registers this module's kernels: no import back at run time
    from rlhfuse.models.attention import AttentionSpec

TILE_ROWS = 64
"""Rows of one linear's gemm tile where the linear runs in fixed tiles (`invariant_linear`, no least row count)."""
QUERY_CHUNK = 256
"""Queries per pass of a masked call on CUDA (the kernel's key lists are [B, chunk, S])."""
LEAST_ROWS = (1, 2, 4, 8, 16, 32, 64)
"""The least row counts a probe may find (`least_rows`): a call with fewer rows is padded up to it."""
PROBE_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 255, 256, 257,
              511, 512, 513, 1000, 1024, 2047, 2048, 4096)  # fmt: skip
"""The row counts a probe tries (those its multiply-add budget allows)."""
PROBE_MACS = 1 << 30
"""The most multiply-adds of one probe call: a shape too large to be probed past MIN_PROBED_ROWS runs in tiles."""
MIN_PROBED_ROWS = 256
"""A least row count is trusted only when the probe reached calls of at least this many rows."""

_LEAST: dict[tuple[Any, ...], int | None] = {}
"""Probed least row counts per gemm kind, shape, dtypes, device and autocast state (`least_rows`)."""
_UNPROBED = object()


def least_rows(key: tuple[Any, ...], device_type: str, probe: Callable[[], int | None]) -> int | None:
    """The least row count from which this machine's gemm gives a row its bits whatever the row count, the row's
    place and the other rows, for the gemm `key` names on `device_type`: `probe()` the first time (per autocast
    state), remembered for the process."""
    autocast = torch.is_autocast_enabled(device_type)  # (its dtype matters only where it is on)
    full_key = (*key, device_type, autocast and torch.get_autocast_dtype(device_type))
    least = _LEAST.get(full_key, _UNPROBED)
    if least is _UNPROBED:
        with torch.no_grad():
            least = _LEAST[full_key] = probe()
    return least  # type: ignore[return-value]


def probed_least(calls: Callable[[Tensor], list[Tensor]], row: Tensor, macs_per_row: int) -> int | None:
    """The least of LEAST_ROWS from which every probed row count gives `row` the bits the largest call gives it.

    `calls(x_MF)`: the results of the call variants (other batch entries, other key counts) for the rows x, each
    [M, ...]. `row` ([F]) sits at the first, middle and last place among random rows. None when no count
    qualifies, or when the multiply-add budget stops the probe below MIN_PROBED_ROWS rows."""
    counts = [m for m in PROBE_ROWS if m * macs_per_row <= PROBE_MACS]
    if not counts or counts[-1] < MIN_PROBED_ROWS:
        return None
    generator = torch.Generator().manual_seed(0)
    results: dict[int, list[list[Tensor]]] = {}  # per row count: per call variant, the row at each place
    for m in counts:
        places = sorted({0, m // 2, m - 1})
        x_MF = torch.randn(m, row.shape[0], generator=generator).to(row)
        x_MF[places] = row
        results[m] = [[out[place] for place in places] for out in calls(x_MF)]
    references = [variant[0] for variant in results[counts[-1]]]
    least = None
    for m in reversed(counts):
        if not all(
            torch.equal(out, reference)
            for variant, reference in zip(results[m], references, strict=True)
            for out in variant
        ):
            break
        least = m
    return None if least is None else min((c for c in LEAST_ROWS if c >= least), default=None)


def _random_like(shape: tuple[int, ...], like: Tensor, seed: int) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(like)


def linear_least_rows(x_NI: Tensor, weight_OI: Tensor) -> int | None:
    """`least_rows` of F.linear(x, weight) for this weight's shape, strides and dtype (None: fixed tiles)."""
    out_features, features = weight_OI.shape
    key = ("linear", features, out_features, weight_OI.stride(), x_NI.dtype, weight_OI.dtype)

    def probe() -> int | None:
        weight = torch.empty_like(weight_OI).copy_(_random_like(tuple(weight_OI.shape), weight_OI, 1))
        row = _random_like((features,), x_NI, 2)
        return probed_least(lambda x: [F.linear(x, weight)], row, features * out_features)

    return least_rows(key, x_NI.device.type, probe)


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


class _InvariantGemm(torch.autograd.Function):
    """x @ weight.T by `gemm` (fixed tiles: `_tiled_rows`, the CUDA kernel); a plain backward (gradients need no
    batch invariance), which also keeps bmm's backward from materialising one weight gradient per tile
    ([X, I, O]) before summing them."""

    @staticmethod
    def forward(
        ctx: Any, x_NI: Tensor, weight_OI: Tensor, gemm: Callable[[Tensor, Tensor], Tensor]
    ) -> Tensor:
        ctx.save_for_backward(x_NI, weight_OI)
        return gemm(x_NI, weight_OI)

    @staticmethod
    def backward(ctx: Any, grad_NO: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x_NI, weight_OI = ctx.saved_tensors
        grad_NO = grad_NO.to(weight_OI.dtype)  # under autocast the forward's gemm ran in a lower precision
        grad_x = (grad_NO @ weight_OI).to(x_NI.dtype) if ctx.needs_input_grad[0] else None
        grad_w = grad_NO.t() @ x_NI.to(weight_OI.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def invariant_linear(x_NI: Tensor, weight_OI: Tensor, bias_O: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias with a row's result independent of the other rows of the call and of their number
    (any leading shape; the last dim is I). On CUDA the fixed-tile kernel (`kernels/exact.py`); elsewhere F.linear
    over at least the probed least row count (`linear_least_rows`; fewer rows are padded up to it), or
    [TILE_ROWS, I] tiles in bmm where the probe finds none. The bias is added after the gemm."""
    if x_NI.device.type == "cuda":
        *lead, features = x_NI.shape
        x_NI = x_NI.reshape(-1, features)
        if torch.is_autocast_enabled("cuda"):  # what F.linear's autocast would run it in
            x_NI, weight_OI = (t.to(torch.get_autocast_dtype("cuda")) for t in (x_NI, weight_OI))
        y_NO = _InvariantGemm.apply(x_NI, weight_OI, load_kernel_module("exact").invariant_matmul)
        y_NO = y_NO.reshape(*lead, weight_OI.shape[0])
    elif x_NI.dim() == 1:
        y_NO = invariant_linear(x_NI[None], weight_OI)[0]
    else:
        rows = x_NI.shape[:-1].numel()
        least = linear_least_rows(x_NI, weight_OI) if rows else 1
        if rows == 0 or (least is not None and rows >= least):
            y_NO = F.linear(x_NI, weight_OI)  # the hot path: F.linear folds any leading shape into one gemm
        elif least is None:
            *lead, features = x_NI.shape
            y_NO = _InvariantGemm.apply(x_NI.reshape(-1, features), weight_OI, _tiled_rows)
            y_NO = y_NO.reshape(*lead, weight_OI.shape[0])
        else:  # too few rows: zero rows appended along the first dim up to at least `least` in all
            first = x_NI.shape[0]
            extra = -(-least // (rows // first)) - first
            y_NO = F.linear(F.pad(x_NI, (0, 0) * (x_NI.dim() - 1) + (0, extra)), weight_OI)[:first]
    return y_NO if bias_O is None else y_NO + bias_O


class InvariantLinear(nn.Linear):
    """`nn.Linear` (same parameters, same state-dict keys) computed by `invariant_linear`."""

    def forward(self, input: Tensor) -> Tensor:
        return invariant_linear(input, self.weight, self.bias)


def silu(x: Tensor) -> Tensor:
    """x * sigmoid(x) as x / (1 + exp(-x)): the same bits for an element wherever it sits (`F.silu` is not).
    Without a graph to record (sampling) the denominator is built in place: the same ops, one buffer."""
    if torch.is_grad_enabled() and x.requires_grad:
        return x / (1 + torch.exp(-x))
    return x / torch.neg(x).exp_().add_(1)


def gelu_tanh(x: Tensor) -> Tensor:
    """The tanh approximation of gelu, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), from invariant ops
    (`F.gelu(approximate="tanh")` is not)."""
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1 + torch.tanh(inner))


GATE_ACTIVATIONS = {"silu": silu, "gelu_pytorch_tanh": gelu_tanh}
"""ModelConfig.hidden_act -> the gate's activation, batch-invariant."""


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
    if torch.is_grad_enabled() and (q_BHTE.requires_grad or k_BKSE.requires_grad or v_BKSE.requires_grad):
        return _ExactAttention.apply(q_BHTE, k_BKSE, v_BKSE, allowed_B1TS, spec)
    return _exact_forward(q_BHTE, k_BKSE, v_BKSE, allowed_B1TS, spec)  # no graph to record (sampling)


def _attend_rows(  # pragma: no cover - compiled by numba; the tests run the compiled version
    q_XE: np.ndarray,
    q_rows: tuple[int, int, int],
    k_XE: np.ndarray,
    k_rows: tuple[int, int, int],
    v_XE: np.ndarray,
    v_rows: tuple[int, int, int],
    group: int,
    allowed_MTS: np.ndarray,
    scale: float,
    softcap: float,
    out_BTHE: np.ndarray,
) -> None:
    """softmax(q k^T * scale) v of every query over its allowed keys, for numba: the keys a query may see are
    visited in position order and no other key is read, so a query's result depends on its own keys' values
    alone, never on where they sit or on what else is in the call (allowed_MTS: M = 1 or B rows of masks;
    `group` query heads per kv head).

    q, k and v come as the rows of E elements their tensors lie in (`_rows`: a strided view, the KV cache's keys
    included, is read where it lies) and each one's row strides over its first three dims (q's over B, H, T;
    k's and v's over B, K, S); the output is [B, T, H, E], the layout the attention's output projection reads.

    A score is a dot product in order over E, in the arrays' dtype; the j-th key of a query's list always takes
    the same path (in a group of eight chains side by side, or in the tail loop after the last whole group), so
    whatever the compiler makes of each loop, the key's score is computed alike in every call. The max is exact,
    exp(score - max) one key at a time, the denominator and p . v summed in key order, all in the arrays' dtype.
    softcap <= 0: none."""
    b_rows, t_queries, h_heads, e_channels = out_BTHE.shape
    s_keys = allowed_MTS.shape[2]
    qb, qh, qt = q_rows
    kb, kh, ks = k_rows
    vb, vh, vs = v_rows
    zero = out_BTHE.dtype.type(0.0)
    keys = np.empty(s_keys, dtype=np.int64)
    scores = np.empty(s_keys, dtype=out_BTHE.dtype)
    acc = np.empty(e_channels, dtype=out_BTHE.dtype)
    for b in range(b_rows):
        mask = allowed_MTS[b if allowed_MTS.shape[0] > 1 else 0]
        for t in range(t_queries):
            n = 0
            for s in range(s_keys):
                if mask[t, s]:
                    keys[n] = s
                    n += 1
            for h in range(h_heads):
                q_E = q_XE[b * qb + h * qh + t * qt]
                k_row = b * kb + (h // group) * kh
                v_row = b * vb + (h // group) * vh
                j = 0
                while j + 8 <= n:
                    k0_E, k1_E = k_XE[k_row + keys[j] * ks], k_XE[k_row + keys[j + 1] * ks]
                    k2_E, k3_E = k_XE[k_row + keys[j + 2] * ks], k_XE[k_row + keys[j + 3] * ks]
                    k4_E, k5_E = k_XE[k_row + keys[j + 4] * ks], k_XE[k_row + keys[j + 5] * ks]
                    k6_E, k7_E = k_XE[k_row + keys[j + 6] * ks], k_XE[k_row + keys[j + 7] * ks]
                    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zero
                    for e in range(e_channels):
                        x = q_E[e]
                        a0 += x * k0_E[e]
                        a1 += x * k1_E[e]
                        a2 += x * k2_E[e]
                        a3 += x * k3_E[e]
                        a4 += x * k4_E[e]
                        a5 += x * k5_E[e]
                        a6 += x * k6_E[e]
                        a7 += x * k7_E[e]
                    scores[j], scores[j + 1], scores[j + 2], scores[j + 3] = a0, a1, a2, a3
                    scores[j + 4], scores[j + 5], scores[j + 6], scores[j + 7] = a4, a5, a6, a7
                    j += 8
                while j < n:
                    k0_E = k_XE[k_row + keys[j] * ks]
                    a0 = zero
                    for e in range(e_channels):
                        a0 += q_E[e] * k0_E[e]
                    scores[j] = a0
                    j += 1
                # in the arrays' dtype: a bare -inf would make the max and exp float64
                best = out_BTHE.dtype.type(-np.inf)
                for j in range(n):
                    y = scores[j] * scale
                    if softcap > 0:
                        y = np.tanh(y / softcap) * softcap
                    scores[j] = y
                    best = max(best, y)
                for e in range(e_channels):
                    acc[e] = zero
                total = zero
                for j in range(n):
                    w = np.exp(scores[j] - best)
                    total += w
                    v_E = v_XE[v_row + keys[j] * vs]
                    for e in range(e_channels):
                        acc[e] += w * v_E[e]
                out_E = out_BTHE[b, t, h]
                for e in range(e_channels):
                    out_E[e] = acc[e] / total if n > 0 else zero


@functools.cache
def _compiled_attend_rows() -> Callable[..., None]:
    """`_attend_rows` compiled by numba (cached on disk; compiled at the first call per dtype)."""
    import numba

    return numba.njit(cache=True, nogil=True)(_attend_rows)  # type: ignore[no-any-return]


def _rows(x_ABCE: Tensor, dtype: torch.dtype) -> tuple[np.ndarray, tuple[int, int, int]]:
    """x (4 dims) in `dtype` as `_attend_rows` reads it: the rows of E elements its storage holds from its first
    element ([X, E], a view), and its strides over its first three dims in rows. A view whose last dim is not
    contiguous, or whose other strides are not whole rows, is copied first."""
    x_ABCE = x_ABCE.detach().to(dtype)
    n0, n1, n2, e = x_ABCE.shape
    if not x_ABCE.numel():
        return np.empty((0, e), dtype=x_ABCE.numpy().dtype), (0, 0, 0)
    s0, s1, s2, s3 = x_ABCE.stride()
    if (s3 != 1 and e > 1) or s0 % e or s1 % e or s2 % e:
        x_ABCE = x_ABCE.contiguous()
        s0, s1, s2, _ = x_ABCE.stride()
    rows = ((n0 - 1) * s0 + (n1 - 1) * s1 + (n2 - 1) * s2) // e + 1
    return x_ABCE.as_strided((rows, e), (e, 1)).numpy(), (s0 // e, s1 // e, s2 // e)


def cpu_exact_attention(
    q_BHTE: Tensor, k_BKSE: Tensor, v_BKSE: Tensor, allowed_B1TS: Tensor | None, spec: AttentionSpec | None
) -> Tensor:
    """`exact_attention`'s forward on the CPU: one compiled pass (`_attend_rows`) that reads each query's
    allowed keys alone, in position order, in fp32 (fp64 for fp64 inputs). No autograd. The result is a
    [B, H, T, E] view of a [B, T, H, E] tensor (what the output projection reads, without a copy)."""
    b, h, t, e = q_BHTE.shape
    s = k_BKSE.shape[2]
    window, scale, softcap = _spec_parts(spec, e)
    if allowed_B1TS is None:
        allowed_B1TS = band_mask(t, window or t, q_BHTE.device)
    wide = torch.promote_types(q_BHTE.dtype, torch.float32)
    numpy_dtype = np.float64 if wide == torch.float64 else np.float32
    allowed_MTS = allowed_B1TS[:, 0].expand(allowed_B1TS.shape[0], t, s).contiguous().numpy()
    out = np.empty((b, t, h, e), dtype=numpy_dtype)
    _compiled_attend_rows()(
        *_rows(q_BHTE, wide),
        *_rows(k_BKSE, wide),
        *_rows(v_BKSE, wide),
        h // k_BKSE.shape[1],
        allowed_MTS,
        numpy_dtype(scale),
        numpy_dtype(softcap if softcap is not None else 0.0),
        out,
    )
    return torch.from_numpy(out).to(q_BHTE.dtype).transpose(1, 2)


def cuda_exact_attention(
    q_BHTE: Tensor, k_BKSE: Tensor, v_BKSE: Tensor, allowed_B1TS: Tensor | None, spec: AttentionSpec | None
) -> Tensor:
    """`exact_attention`'s forward on CUDA: the Triton kernel of `kernels/exact.py` (each query's allowed keys
    compacted in position order, fixed blocks), masked calls in chunks of QUERY_CHUNK queries. No autograd."""
    window, scale, softcap = _spec_parts(spec, q_BHTE.shape[-1])
    kernel = load_kernel_module("exact").exact_attention
    t = q_BHTE.shape[2]
    if allowed_B1TS is None or t <= QUERY_CHUNK:
        return kernel(q_BHTE, k_BKSE, v_BKSE, allowed_B1TS, scale, softcap, window)  # type: ignore[no-any-return]
    return torch.cat(
        [
            kernel(q_BHTE[:, :, i : i + QUERY_CHUNK], k_BKSE, v_BKSE, mask_B1TS, scale, softcap, window)
            for i, mask_B1TS in zip(
                range(0, t, QUERY_CHUNK), allowed_B1TS.split(QUERY_CHUNK, dim=2), strict=True
            )
        ],
        dim=2,
    )


def _spec_parts(spec: AttentionSpec | None, head_dim: int) -> tuple[int | None, float, float | None]:
    """(window, scale, softcap) of a layer's spec (None: plain attention, the scale head_dim ** -0.5)."""
    if spec is None:
        return None, head_dim**-0.5, None
    return spec.window, spec.scale_for(head_dim), spec.softcap


def _exact_forward(
    q_BHTE: Tensor, k_BKSE: Tensor, v_BKSE: Tensor, allowed_B1TS: Tensor | None, spec: AttentionSpec | None
) -> Tensor:
    """`cpu_exact_attention` or `cuda_exact_attention` by the device (other devices refused)."""
    if q_BHTE.device.type == "cuda":
        return cuda_exact_attention(q_BHTE, k_BKSE, v_BKSE, allowed_B1TS, spec)
    if q_BHTE.device.type != "cpu":
        raise ValueError(
            f"exact attention runs on the CPU and on CUDA, not on {q_BHTE.device.type}: run with exact=false there"
        )
    return cpu_exact_attention(q_BHTE, k_BKSE, v_BKSE, allowed_B1TS, spec)


class _ExactAttention(torch.autograd.Function):
    """`cpu_exact_attention` on the CPU, `cuda_exact_attention` on CUDA; a plain backward (gradients need no
    batch invariance, as the linears'): SDPA's own backward over the same mask (its forward recomputed), or with
    a soft-cap the softmax's probabilities recomputed over the whole [T, S] mask with plain ops, then attention's
    gradients."""

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
        b, h, t, e = q_BHTE.shape
        kv_heads = k_BKSE.shape[1]
        group = h // kv_heads
        window, scale, softcap = _spec_parts(ctx.spec, e)
        if allowed_B1TS is None:
            allowed_B1TS = band_mask(t, window or t, q_BHTE.device)
        wide = torch.promote_types(q_BHTE.dtype, torch.float32)
        if softcap is None:  # SDPA's own backward (no soft-cap there)
            with torch.enable_grad():
                q_, k_, v_ = (x.detach().to(wide).requires_grad_() for x in (q_BHTE, k_BKSE, v_BKSE))
                out_BHTE = F.scaled_dot_product_attention(
                    q_,
                    k_.repeat_interleave(group, 1),
                    v_.repeat_interleave(group, 1),
                    allowed_B1TS,
                    scale=scale,
                )
                grads = torch.autograd.grad(out_BHTE, (q_, k_, v_), grad_BHTE.to(wide))
            return (
                *(g.to(x.dtype) for g, x in zip(grads, (q_BHTE, k_BKSE, v_BKSE), strict=True)),
                None,
                None,
            )
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
