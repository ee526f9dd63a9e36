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
    """Vectorised masked GAE (eq. 1–3 of this module's docstring): A = δ·Cᵀ chunk by chunk; the PyTorch path.

    1. Compact each row: a stable sort on "is masked" moves the valid tokens to the front in their original order,
       so in compacted coordinates the next valid token is simply the next column (j < N_b are valid).
    2. δ_j = r_j + γ·V_{j+1}·[j + 1 < N_b] − V_j, and δ_j = 0 for j ≥ N_b.
    3. Over chunks [s, e) from the last to the first, A[s:e] = δ[s:e]·Cᵀ + (γλ)^(e − t)·A_e, where C is the C×C
       discount matrix and A_e the advantage carried from the chunk after (0 past the end). Memory is bounded by
       chunk_size² rather than T²; accumulation is fp32 (fp64 for fp64 inputs).
    4. Scatter back to the original positions (masked positions receive the zeros of step 2), R = A + V there.
    """
    _check_gae_inputs(rewards_BT, values_BT, mask_BT, gamma, lam)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    valid_BT = _valid(mask_BT, values_BT)
    compute_dtype = torch.promote_types(values_BT.dtype, torch.float32)
    B, T = values_BT.shape
    device = values_BT.device

    # 1. Compaction: argsort of the "masked" flag, stable, puts valid tokens first in time order.
    order_BT = torch.argsort((~valid_BT).to(torch.int8), dim=1, stable=True)
    num_valid_B = valid_BT.sum(dim=1)
    rewards_BN = rewards_BT.to(compute_dtype).gather(1, order_BT)
    values_BN = values_BT.to(compute_dtype).gather(1, order_BT)
    positions_N = torch.arange(T, device=device)
    valid_BN = positions_N[None, :] < num_valid_B[:, None]
    has_next_BN = (positions_N[None, :] + 1) < num_valid_B[:, None]

    # 2. TD residuals in compacted coordinates; rewards at masked positions are dropped here.
    zero = torch.zeros((), dtype=compute_dtype, device=device)
    next_values_BN = torch.cat([values_BN[:, 1:], values_BN.new_zeros(B, 1)], dim=1)
    next_values_BN = torch.where(has_next_BN, next_values_BN, zero)
    deltas_BN = torch.where(valid_BN, rewards_BN + gamma * next_values_BN - values_BN, zero)

    # 3. Discounted reverse sums, one matrix product per chunk of the time axis.
    decay = gamma * lam
    advantages_BN = torch.zeros_like(deltas_BN)
    carry_B = values_BN.new_zeros(B)
    full_discount_CC = _discount_matrix_CC(decay, min(chunk_size, max(T, 1)), compute_dtype, device)
    for end in range(T, 0, -chunk_size):
        start = max(0, end - chunk_size)
        length = end - start
        discount_CC = full_discount_CC[:length, :length]
        # (γλ)^(e − t) for t in [s, e): how much of the carried A_e reaches each position of this chunk.
        carry_decay_C = torch.pow(
            torch.tensor(decay, dtype=compute_dtype, device=device),
            torch.arange(length, 0, -1, device=device, dtype=compute_dtype),
        )
        chunk_BC = deltas_BN[:, start:end] @ discount_CC.T + carry_B[:, None] * carry_decay_C[None, :]
        advantages_BN[:, start:end] = chunk_BC
        carry_B = chunk_BC[:, 0]

    # 4. Back to the original token positions.
    advantages_BT = torch.zeros_like(advantages_BN).scatter_(1, order_BT, advantages_BN)
    returns_BT = torch.where(valid_BT, advantages_BT + values_BT.to(compute_dtype), zero)
    return advantages_BT.to(values_BT.dtype), returns_BT.to(values_BT.dtype)


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
