"""Generalized Advantage Estimation (GAE) with token masks: the reference loop, the same loop compiled by numba
and run in fp64 step by step (numba's bits without numba), a cumulative-sum form (pure PyTorch) and the chunked
matrix form; `compute_gae` picks one.

Legend: B batch rows, T time (tokens), N valid tokens of a row after compaction (N ≤ T), C chunk length,
K chunks, W compacted width (T + 1 or more: a dummy column for masked tokens).

Mask convention: `mask_BT` = 1 on tokens produced by the policy (response tokens) and 0 on padding and on tokens
inside a response that the policy did not produce (e.g. tool output). Masked positions neither receive nor
propagate advantage: the recursion skips them. For a valid token t, V_next(t) is V at the next *valid* token of
the same row (0 after the last valid token). Rewards at masked positions are ignored (the trainer puts all rewards
on valid tokens); advantages and returns at masked positions are 0.

    δ_t = r_t + γ·V_next(t)·[t not last valid] − V_t                                     (GAE, eq. 1)
    A_t = Σ_{k ≥ t, k valid} (γλ)^(#valid steps from t to k) · δ_k                        (GAE, eq. 2)
    R_t = A_t + V_t                                                                       (GAE, eq. 3)

(Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage Estimation", 2016, eq. 16;
RLHFuse §6 computes A as one matrix product instead of one kernel launch per token.)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import torch

from rlhfuse.algorithms.masked import _valid


def _check_gae_inputs(
    rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float, lam: float
) -> None:
    problems = []
    if values_BT.dim() != 2:
        problems.append(f"values_BT must be 2-D (B, T), got shape {tuple(values_BT.shape)}")
    for name, tensor in (("rewards_BT", rewards_BT), ("mask_BT", mask_BT)):
        if tensor.shape != values_BT.shape:
            problems.append(f"{name} shape {tuple(tensor.shape)} != values_BT shape {tuple(values_BT.shape)}")
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= value <= 1.0:
            problems.append(f"{name} must lie in [0, 1], got {value}")
    if problems:
        raise ValueError("invalid GAE inputs: " + "; ".join(problems))


def compute_gae_loop(
    rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference masked GAE, the backward recursion one token at a time (eq. 1–3 of this module's docstring).

    A_t = δ_t + γλ·A_next(t), where the carried V_next and A_next are only updated on valid tokens.
    Returns (advantages_BT, returns_BT) in the dtype of `values_BT`, zero at masked positions.
    """
    _check_gae_inputs(rewards_BT, values_BT, mask_BT, gamma, lam)
    valid_BT = _valid(mask_BT, values_BT)
    compute_dtype = torch.promote_types(values_BT.dtype, torch.float32)
    rewards_f_BT = rewards_BT.to(compute_dtype)
    values_f_BT = values_BT.to(compute_dtype)
    B, T = values_BT.shape
    next_value_B = values_f_BT.new_zeros(B)
    next_advantage_B = values_f_BT.new_zeros(B)
    advantages_BT = values_f_BT.new_zeros(B, T)
    for t in reversed(range(T)):
        valid_B = valid_BT[:, t]
        delta_B = rewards_f_BT[:, t] + gamma * next_value_B - values_f_BT[:, t]
        advantage_B = delta_B + gamma * lam * next_advantage_B
        next_value_B = torch.where(valid_B, values_f_BT[:, t], next_value_B)
        next_advantage_B = torch.where(valid_B, advantage_B, next_advantage_B)
        advantages_BT[:, t] = torch.where(valid_B, advantage_B, 0.0)
    returns_BT = torch.where(valid_BT, advantages_BT + values_f_BT, 0.0)
    return advantages_BT.to(values_BT.dtype), returns_BT.to(values_BT.dtype)


def _discount_matrix_CC(decay: float, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """C[t, k] = decay^(k − t) for k ≥ t, else 0 (the upper-triangular discount matrix of eq. 2)."""
    steps = torch.arange(length, device=device)
    exponent_CC = (steps[None, :] - steps[:, None]).to(dtype)
    upper_CC = exponent_CC >= 0
    # pow(0, 0) = 1 keeps the diagonal right for γλ = 0; the lower triangle is masked before pow sees it.
    powers_CC = torch.pow(torch.tensor(decay, dtype=dtype, device=device), exponent_CC.clamp_min(0))
    return torch.where(upper_CC, powers_CC, torch.zeros((), dtype=dtype, device=device))


def compute_gae_matrix(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    chunk_size: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised masked GAE (eq. 1–3 of this module's docstring): A = δ·Cᵀ per chunk; the PyTorch path.

    1. Compact each row: valid token t moves to column (number of valid tokens before t), masked tokens to the
       columns after the row's N_b valid ones, so in compacted coordinates the next valid token is simply the next
       column. Masked rewards and values are zeroed first, so the tail j ≥ N_b holds zeros and
       δ_j = r_j + γ·V_{j+1} − V_j is automatically 0 there and has no bootstrap term at j = N_b − 1.
    2. Split the (zero-padded) time axis into K chunks of C = chunk_size columns. Within chunk k,
       a_k = δ_k·Cᵀ with C[t, u] = (γλ)^(u − t) for u ≥ t: one batched matrix product for all chunks.
    3. Join chunks: the advantage at the start of chunk k is S_k = a_k[0] + (γλ)^C·S_{k+1}, i.e. S = a[:, :, 0]·Eᵀ
       with E[k, j] = (γλ)^(C·(j − k)) for j ≥ k; then A_k[t] = a_k[t] + (γλ)^(C − t)·S_{k+1}.
       Memory is O(B·T + C² + K²) instead of O(T²); accumulation in fp32 (fp64 for fp64 inputs).
    4. Gather back to the original positions; R = A + V on valid tokens, 0 elsewhere.
    """
    _check_gae_inputs(rewards_BT, values_BT, mask_BT, gamma, lam)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    valid_BT = _valid(mask_BT, values_BT)
    compute_dtype = torch.promote_types(values_BT.dtype, torch.float32)
    B, T = values_BT.shape
    device = values_BT.device
    zero = torch.zeros((), dtype=compute_dtype, device=device)
    # torch.where, not a product with the mask: padding may hold inf/NaN.
    rewards_BT = torch.where(valid_BT, rewards_BT.to(compute_dtype), zero)
    values_BT_f = torch.where(valid_BT, values_BT.to(compute_dtype), zero)

    # 1. Compaction by a permutation built from prefix counts (O(B·T), no sort).
    valid_count_BT = torch.cumsum(valid_BT, dim=1)
    masked_count_BT = torch.arange(1, T + 1, device=device) - valid_count_BT
    num_valid_B1 = valid_count_BT[:, -1:] if T > 0 else valid_count_BT
    destination_BT = torch.where(valid_BT, valid_count_BT - 1, num_valid_B1 + masked_count_BT - 1)
    # A chunk longer than the sequence would only multiply padding.
    chunk_size = min(chunk_size, max(T, 1))
    num_chunks = -(-T // chunk_size)
    padded = num_chunks * chunk_size
    rewards_BN = rewards_BT.new_zeros(B, padded).scatter_(1, destination_BT, rewards_BT)
    values_BN = values_BT_f.new_zeros(B, padded + 1).scatter_(1, destination_BT, values_BT_f)
    deltas_BN = rewards_BN + gamma * values_BN[:, 1:] - values_BN[:, :-1]

    # 2. Within-chunk discounted reverse sums, all chunks in one batched product.
    decay = gamma * lam
    discount_CC = _discount_matrix_CC(decay, chunk_size, compute_dtype, device)
    inner_BKC = deltas_BN.view(B, num_chunks, chunk_size) @ discount_CC.T

    # 3. Chain the chunks: S_k, the advantage at each chunk's first column, then add the carried S_{k+1}.
    chunk_decay = decay**chunk_size
    chunk_discount_KK = _discount_matrix_CC(chunk_decay, num_chunks, compute_dtype, device)
    starts_BK = inner_BKC[:, :, 0] @ chunk_discount_KK.T
    carried_BK = torch.cat([starts_BK[:, 1:], starts_BK.new_zeros(B, 1)], dim=1)
    # (γλ)^(C − t) for t in [0, C): how much of S_{k+1} reaches column t of chunk k.
    carry_decay_C = torch.pow(
        torch.tensor(decay, dtype=compute_dtype, device=device),
        torch.arange(chunk_size, 0, -1, device=device, dtype=compute_dtype),
    )
    advantages_BN = (inner_BKC + carried_BK[:, :, None] * carry_decay_C).view(B, padded)

    # 4. Back to the original token positions. Masked tokens read a tail column j ≥ N_b, where every δ is 0 and
    # hence A is 0, so no further masking is needed (values_BT_f is already 0 there).
    advantages_out_BT = advantages_BN.gather(1, destination_BT)
    returns_out_BT = advantages_out_BT + values_BT_f
    return advantages_out_BT.to(values_BT.dtype), returns_out_BT.to(values_BT.dtype)


# Scan weights (γλ)^(−i) stay below 10^_LOG10_SCAN_RANGE (fp64 overflows at ~1.8·10^308).
_LOG10_SCAN_RANGE = 250.0
# compute_gae_scan works on blocks of rows of about this many columns in all (0.5 MB per fp64 buffer).
_SCAN_BLOCK_ELEMENTS = 1 << 16


def _scan_chunk_length(decay: float, length: int, chunk_size: int | None) -> int:
    """Longest chunk whose weights (γλ)^(−i), i < chunk, stay below 10^_LOG10_SCAN_RANGE; capped by chunk_size."""
    limit = length
    if 0.0 < decay < 1.0:
        limit = min(limit, int(_LOG10_SCAN_RANGE / -math.log10(decay)))
    if chunk_size is not None:
        limit = min(limit, chunk_size)
    return max(1, limit)


def _discounted_cumsum_(x_BN: torch.Tensor, decay: float, chunk: int) -> None:
    """x_j ← Σ_{i ≤ j} decay^(j − i)·x_i along dim 1, in place (fp64; 0 < decay ≤ 1; N a multiple of chunk).

    Per chunk: decay^(i) · cumsum(decay^(−i)·x_i), i the offset in the chunk (weights ≤ 10^250 by the choice of
    chunk). Chunks are chained through their last elements e_k: S_k = e_k + decay^C·S_(k−1) is the same
    problem on K elements with decay^C, solved recursively, then x_k[i] += decay^(i+1)·S_(k−1). When even one
    element per chunk would overflow the weights (decay < 10^−125), decay², decay³ underflow: S is two or three
    shifted additions.
    """
    B, N = x_BN.shape
    if decay == 0.0 or N <= 1:
        return
    num_chunks = N // chunk
    if chunk == 1:
        if _scan_chunk_length(decay, N, None) == 1:  # tiny decay: powers vanish after a few terms
            original_BN = x_BN.clone()
            power, shift = decay, 1
            while power > 0.0 and shift < N:
                x_BN[:, shift:].add_(original_BN[:, :-shift], alpha=power)
                power *= decay
                shift += 1
            return
    x_BKC = x_BN.view(B, num_chunks, chunk)
    steps_C = torch.arange(chunk, device=x_BN.device, dtype=x_BN.dtype)
    # pow of the exact integer steps, not exp(i·log decay): the weights are then correctly rounded.
    decay_0 = torch.tensor(decay, device=x_BN.device, dtype=x_BN.dtype)
    if decay != 1.0 and chunk > 1:
        x_BKC.mul_(torch.pow(decay_0, -steps_C))
    if chunk > 1:
        x_BKC.cumsum_(dim=2)
    if decay != 1.0 and chunk > 1:
        x_BKC.mul_(torch.pow(decay_0, steps_C))
    if num_chunks > 1:
        chunk_decay = decay**chunk
        ends_BK = x_BKC[:, :, -1].clone()  # becomes S_k, the chained value at the end of chunk k
        next_chunk = _scan_chunk_length(chunk_decay, num_chunks, None)
        padded = -(-num_chunks // next_chunk) * next_chunk
        if padded != num_chunks:
            ends_BK = torch.nn.functional.pad(ends_BK, (0, padded - num_chunks))
        _discounted_cumsum_(ends_BK, chunk_decay, next_chunk)
        x_BKC[:, 1:].addcmul_(ends_BK[:, : num_chunks - 1, None], torch.pow(decay_0, steps_C + 1))


def compute_gae_scan(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked GAE (eq. 1–3 of this module's docstring) as a cumulative sum: O(B·T) work, any device, pure PyTorch.

    1. Compact each row *in reverse*: the valid token t goes to column N_b − (number of valid tokens up to and
       including t), so the row's last valid token lands in column 0 and its first in column N_b − 1; every masked
       token goes to one dummy column (the last, W − 1), whose results are overwritten with 0. One scatter per input,
       no sort. In these coordinates the next valid token of column j is column j − 1, the recursion runs forward,
       A'_j = δ'_j + γλ·A'_(j−1), with δ'_j = r'_j + γ·V'_(j−1) − V'_j (V'_(−1) = 0).
    2. Within a chunk of C columns starting at j0: A'_j = (γλ)^(j−j0) · Σ_{i=j0..j} (γλ)^(−(i−j0))·δ'_i, one
       `cumsum` in fp64 between two multiplications by fixed weight vectors. A prefix sum whose terms grow is
       dominated by its last terms, so its rounding error relative to A'_j is that of the loop. C is the longest
       chunk with (γλ)^(−C) ≤ 10^250 (the whole row for γλ ≥ 0.94 and T ≤ 9000), or `chunk_size` if smaller;
       γλ = 1 needs no weights and γλ = 0 no sum (A' = δ').
    3. Chain chunks: S_k = a_k[C−1] + (γλ)^C·S_(k−1), the advantage at the end of chunk k, is the same prefix sum
       over the K chunk ends with decay (γλ)^C, solved recursively (`_discounted_cumsum_`); then
       A'_k[i] = a_k[i] + (γλ)^(i+1)·S_(k−1).
    4. Gather back with the same index: valid tokens read their column, masked ones the zeroed dummy.

    Memory is O(B·T) (fp64 scan buffer); no T×T or C×C tensor. Returns (advantages_BT, returns_BT) in the dtype of
    `values_BT`; δ and the outputs are computed in fp32 (fp64 for fp64 inputs), like `compute_gae_loop`. Range:
    weights up to 10^250 times |δ| must stay finite in fp64, always true for fp32 inputs (|δ| < 10^39); fp64
    inputs need |δ| < 10^55.
    """
    _check_gae_inputs(rewards_BT, values_BT, mask_BT, gamma, lam)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    compute_dtype = torch.promote_types(values_BT.dtype, torch.float32)
    B, T = values_BT.shape
    device = values_BT.device
    if B == 0 or T == 0:
        empty_BT = values_BT.new_zeros(B, T)
        return empty_BT, empty_BT.clone()
    valid_BT = mask_BT if mask_BT.dtype == torch.bool else mask_BT != 0
    decay = gamma * lam
    chunk = _scan_chunk_length(decay, T + 1, chunk_size)  # T + 1: room for the dummy column
    width = -(-(T + 1) // chunk) * chunk
    # Row blocks of ~_SCAN_BLOCK_ELEMENTS keep the ~10 passes over a block's buffers in cache. Under autograd the
    # blocks are concatenated (gather(out=...) is not differentiable).
    num_blocks = -(-B * width // _SCAN_BLOCK_ELEMENTS) if device.type == "cpu" else 1
    block_rows = -(-B // num_blocks)
    if block_rows >= B:
        advantages_out_BT, returns_out_BT = _scan_block(
            rewards_BT, values_BT, valid_BT, gamma, decay, chunk, width
        )
    elif torch.is_grad_enabled() and (rewards_BT.requires_grad or values_BT.requires_grad):
        blocks = [
            _scan_block(
                rewards_BT[i : i + block_rows],
                values_BT[i : i + block_rows],
                valid_BT[i : i + block_rows],
                gamma,
                decay,
                chunk,
                width,
            )
            for i in range(0, B, block_rows)
        ]
        advantages_out_BT = torch.cat([advantages for advantages, _ in blocks])
        returns_out_BT = torch.cat([returns for _, returns in blocks])
    else:
        advantages_out_BT = torch.empty(B, T, dtype=compute_dtype, device=device)
        returns_out_BT = torch.empty(B, T, dtype=compute_dtype, device=device)
        for i in range(0, B, block_rows):
            rows = slice(i, i + block_rows)
            out = (advantages_out_BT[rows], returns_out_BT[rows])
            _scan_block(rewards_BT[rows], values_BT[rows], valid_BT[rows], gamma, decay, chunk, width, out)
    return advantages_out_BT.to(values_BT.dtype), returns_out_BT.to(values_BT.dtype)


def _scan_block(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    valid_BT: torch.Tensor,
    gamma: float,
    decay: float,
    chunk: int,
    width: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1–4 of `compute_gae_scan` on a block of rows: (advantages, returns), written into `out` if given."""
    compute_dtype = torch.promote_types(values_BT.dtype, torch.float32)
    B = values_BT.shape[0]
    device = values_BT.device
    dummy = width - 1

    # 1. Reverse compaction. Garbage (inf/NaN) at masked positions only ever reaches the dummy column: it is the
    # last column, the forward sums never read it, and it is zeroed before the gather.
    counts_BT = torch.cumsum(valid_BT, dim=1, dtype=torch.int32)
    column_BT = torch.sub(counts_BT[:, -1:] - dummy, counts_BT).mul_(valid_BT).add_(dummy).long()
    rewards_BW = torch.zeros(B, width, dtype=compute_dtype, device=device)
    rewards_BW.scatter_(1, column_BT, rewards_BT.to(compute_dtype))
    values_BW = torch.zeros(B, width, dtype=compute_dtype, device=device)
    values_BW.scatter_(1, column_BT, values_BT.to(compute_dtype))
    deltas_BW = rewards_BW.sub_(values_BW)  # reuse the rewards buffer
    deltas_BW[:, 1:].add_(values_BW[:, :-1], alpha=gamma)

    # 2.–3. Discounted prefix sums per chunk, then chained.
    if decay == 0.0:
        advantages_BW = deltas_BW
    else:
        # A plain cast then in-place products: a mixed fp32 × fp64 product is several times slower on CPU.
        scan_BW = deltas_BW.to(torch.float64)  # no copy for fp64 input (deltas_BW is our own buffer)
        _discounted_cumsum_(scan_BW, decay, chunk)
        advantages_BW = scan_BW.to(compute_dtype)

    # 4. Back to token positions; the dummy column (all masked tokens) reads 0.
    advantages_BW[:, dummy] = 0.0
    returns_BW = values_BW.add_(advantages_BW)
    returns_BW[:, dummy] = 0.0
    if out is None:
        return advantages_BW.gather(1, column_BT), returns_BW.gather(1, column_BT)
    torch.gather(advantages_BW, 1, column_BT, out=out[0])
    torch.gather(returns_BW, 1, column_BT, out=out[1])
    return out


def _gae_rows(  # pragma: no cover - compiled by numba; the tests run the compiled version
    rewards_BT: np.ndarray,
    values_BT: np.ndarray,
    valid_BT: np.ndarray,
    gamma: float,
    decay: float,
    advantages_BT: np.ndarray,
    returns_BT: np.ndarray,
) -> None:
    """The recursion of `compute_gae_loop` (same operations, same order), in fp64, for numba.

    Branch-free: selects, not branches, skip masked tokens (a random mask would mispredict), and garbage read at
    masked positions is never selected. Rows go four at a time with scalar carries, so four independent
    dependency chains (A_t needs A_next) overlap in the pipeline; the rest one at a time.
    """
    B, T = values_BT.shape
    b = 0
    while b + 4 <= B:
        v0 = v1 = v2 = v3 = 0.0  # V_next of rows b..b+3
        a0 = a1 = a2 = a3 = 0.0  # A_next
        for t in range(T - 1, -1, -1):
            m0, m1, m2, m3 = valid_BT[b, t], valid_BT[b + 1, t], valid_BT[b + 2, t], valid_BT[b + 3, t]
            x0, x1 = float(values_BT[b, t]), float(values_BT[b + 1, t])
            x2, x3 = float(values_BT[b + 2, t]), float(values_BT[b + 3, t])
            c0 = (float(rewards_BT[b, t]) + gamma * v0 - x0) + decay * a0
            c1 = (float(rewards_BT[b + 1, t]) + gamma * v1 - x1) + decay * a1
            c2 = (float(rewards_BT[b + 2, t]) + gamma * v2 - x2) + decay * a2
            c3 = (float(rewards_BT[b + 3, t]) + gamma * v3 - x3) + decay * a3
            a0, v0 = (c0, x0) if m0 else (a0, v0)
            a1, v1 = (c1, x1) if m1 else (a1, v1)
            a2, v2 = (c2, x2) if m2 else (a2, v2)
            a3, v3 = (c3, x3) if m3 else (a3, v3)
            advantages_BT[b, t], returns_BT[b, t] = (a0, a0 + x0) if m0 else (0.0, 0.0)
            advantages_BT[b + 1, t], returns_BT[b + 1, t] = (a1, a1 + x1) if m1 else (0.0, 0.0)
            advantages_BT[b + 2, t], returns_BT[b + 2, t] = (a2, a2 + x2) if m2 else (0.0, 0.0)
            advantages_BT[b + 3, t], returns_BT[b + 3, t] = (a3, a3 + x3) if m3 else (0.0, 0.0)
        b += 4
    for row in range(b, B):
        next_value = 0.0
        next_advantage = 0.0
        for t in range(T - 1, -1, -1):
            valid = valid_BT[row, t]
            value = float(values_BT[row, t])
            candidate = (float(rewards_BT[row, t]) + gamma * next_value - value) + decay * next_advantage
            next_advantage = candidate if valid else next_advantage
            next_value = value if valid else next_value
            advantages_BT[row, t] = next_advantage if valid else 0.0
            returns_BT[row, t] = next_advantage + value if valid else 0.0


def compute_gae_steps(
    rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked GAE as `compute_gae_numba` computes it, bit for bit, without numba: `compute_gae_loop` (one batched
    step per token, the same operations in the same order) accumulated in fp64 and rounded once to fp32 (fp64
    for fp64 inputs), then to the inputs' dtype. About 30 us a token on one thread, against numba's import and
    kernel load of about 0.6 s once per process: `compute_gae`'s choice for short rows. No autograd."""
    compute_dtype = torch.promote_types(values_BT.dtype, torch.float32)
    advantages_BT, returns_BT = compute_gae_loop(
        rewards_BT.detach().to(torch.float64),
        values_BT.detach().to(torch.float64),
        mask_BT.detach(),
        gamma,
        lam,
    )
    return (
        advantages_BT.to(compute_dtype).to(values_BT.dtype),
        returns_BT.to(compute_dtype).to(values_BT.dtype),
    )


@functools.cache
def _compiled_gae_rows() -> Callable[..., None] | None:
    """`_gae_rows` compiled by numba (cached on disk), or None without numba; compiled at the first call."""
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a dependency; the scan path covers its absence
        return None
    return numba.njit(cache=True, nogil=True)(_gae_rows)  # type: ignore[no-any-return]


def numba_available() -> bool:
    """Whether `compute_gae_numba` can run (numba importable)."""
    return _compiled_gae_rows() is not None


def compute_gae_numba(
    rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked GAE (eq. 1–3 of this module's docstring): the reference recursion compiled by numba, CPU only.

    One pass over the tokens, accumulated in fp64 and rounded once to fp32 (fp64 for fp64 inputs); no autograd
    (inputs are detached). The first call per dtype compiles (about a second, then cached on disk).
    """
    _check_gae_inputs(rewards_BT, values_BT, mask_BT, gamma, lam)
    kernel = _compiled_gae_rows()
    if kernel is None:
        raise RuntimeError("compute_gae_numba needs numba: pip install numba (or use compute_gae_scan)")
    tensors = (rewards_BT, values_BT, mask_BT)
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(
            "compute_gae_numba runs on CPU tensors only (use compute_gae_scan or the Triton kernel)"
        )
    compute_dtype = torch.promote_types(values_BT.dtype, torch.float32)
    B, T = values_BT.shape
    rewards_c_BT = rewards_BT.detach().to(compute_dtype).contiguous()
    values_c_BT = values_BT.detach().to(compute_dtype).contiguous()
    valid_BT = (mask_BT if mask_BT.dtype == torch.bool else mask_BT != 0).detach().contiguous()
    advantages_BT = torch.empty(B, T, dtype=compute_dtype)
    returns_BT = torch.empty(B, T, dtype=compute_dtype)
    if B and T:
        kernel(
            rewards_c_BT.numpy(),
            values_c_BT.numpy(),
            valid_BT.numpy(),
            float(gamma),
            float(gamma * lam),
            advantages_BT.numpy(),
            returns_BT.numpy(),
        )
    return advantages_BT.to(values_BT.dtype), returns_BT.to(values_BT.dtype)


_METHODS = ("auto", "numba", "steps", "scan", "matrix")
STEPS_MAX_TOKENS = 64
"""Rows of up to this many tokens go to `compute_gae_steps` under method="auto" on the CPU (numba's bits; its
per-call cost, about 2 ms at 64 tokens here, stays below numba's one-time 0.6 s for any run of a few hundred
iterations, and a negligible share of an iteration beyond)."""


def compute_gae(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    chunk_size: int = 512,
    backend: str | None = None,
    method: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked GAE (eq. 1–3 of this module's docstring); returns (advantages_BT, returns_BT), 0 at masked tokens.

    `backend` ("auto", "torch", "triton"; see `rlhfuse.algorithms.ops`) picks the Triton reverse-scan kernel on CUDA. Off
    that path, `method` picks the implementation: "auto" (default) = on CPU tensors no input of which requires
    grad, `compute_gae_steps` for rows of up to STEPS_MAX_TOKENS tokens and `compute_gae_numba` beyond (the same
    bits; numba is imported only there; the scan without numba), `compute_gae_scan` otherwise; "numba",
    "steps", "scan" or "matrix" (`compute_gae_matrix`, the one-product-per-chunk form, with `chunk_size`) force
    one.
    """
    from rlhfuse.algorithms import ops  # deferred: ops imports this module for the reference

    method = method or "auto"
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if ops._use_triton(backend, rewards_BT, values_BT, mask_BT):
        return ops.gae(rewards_BT, values_BT, mask_BT, gamma, lam, backend=backend)
    tensors = (rewards_BT, values_BT, mask_BT)
    if method == "auto":
        on_cpu = all(t.device.type == "cpu" for t in tensors)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        if not on_cpu or needs_grad:
            method = "scan"
        elif (
            values_BT.dim() == 2 and values_BT.shape[1] <= STEPS_MAX_TOKENS
        ):  # other shapes: refused by the one chosen
            method = "steps"
        else:
            method = "numba" if numba_available() else "scan"
    if method == "numba":
        return compute_gae_numba(rewards_BT, values_BT, mask_BT, gamma, lam)
    if method == "steps":
        return compute_gae_steps(rewards_BT, values_BT, mask_BT, gamma, lam)
    if method == "matrix":
        return compute_gae_matrix(rewards_BT, values_BT, mask_BT, gamma, lam, chunk_size=chunk_size)
    return compute_gae_scan(rewards_BT, values_BT, mask_BT, gamma, lam)
