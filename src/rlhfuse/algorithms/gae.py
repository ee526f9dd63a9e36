"""Generalized Advantage Estimation (GAE) with token masks: the reference loop and the chunked matrix form.

Legend: B batch rows, T time (tokens), N valid tokens of a row after compaction (N ≤ T), C chunk length.

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


def compute_gae(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    chunk_size: int = 512,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked GAE (eq. 1–3 of this module's docstring); returns (advantages_BT, returns_BT), 0 at masked tokens.

    Dispatches through `rlhfuse.ops.gae`: the Triton reverse-scan kernel on CUDA, `compute_gae_matrix` (chunked
    matrix form, memory ∝ chunk_size²) elsewhere. `backend` is "auto" (default), "torch" or "triton".
    """
    from rlhfuse import ops  # deferred: ops imports this module for the reference

    return ops.gae(rewards_BT, values_BT, mask_BT, gamma, lam, chunk_size=chunk_size, backend=backend)
