"""Triton kernel for masked Generalized Advantage Estimation (GAE), one program per row.

Loaded at runtime with `rlhfuse._resources.load_kernel_module("gae")`; the PyTorch reference with the same
signature and outputs is `rlhfuse.algorithms.compute_gae_matrix` (parity test: tests/kernels/test_gae_kernel.py).

Legend: B batch rows, T time (tokens).

Mask convention (identical to the reference): mask_BT = 1 on tokens produced by the policy, 0 elsewhere. The
reverse scan skips masked positions: they neither receive nor propagate advantage, and for a valid token the
"next value" is V at the next valid token of the row (0 after the last valid one). Rewards at masked positions
are ignored; advantages and returns there are 0.

    δ_t = r_t + γ·V_next(t) − V_t,        A_t = δ_t + γλ·A_next(t)        (GAE, Schulman et al. 2016, eq. 16)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gae_reverse_scan_kernel(
    rewards_ptr,
    values_ptr,
    mask_ptr,
    advantages_ptr,
    returns_ptr,
    T,
    stride_row,
    gamma,
    gamma_lam,
):
    row = tl.program_id(0)
    row_offset = row.to(tl.int64) * stride_row
    # Carried state of the reverse scan: V and A at the next valid token (0 past the last valid one).
    next_value = tl.zeros((), dtype=tl.float32)
    next_advantage = tl.zeros((), dtype=tl.float32)
    for step in range(0, T):
        t = T - 1 - step
        reward = tl.load(rewards_ptr + row_offset + t).to(tl.float32)
        value = tl.load(values_ptr + row_offset + t).to(tl.float32)
        valid = tl.load(mask_ptr + row_offset + t) != 0
        delta = reward + gamma * next_value - value
        advantage = delta + gamma_lam * next_advantage
        # A masked token keeps the carried state untouched, so the scan jumps over it.
        next_value = tl.where(valid, value, next_value)
        next_advantage = tl.where(valid, advantage, next_advantage)
        advantage_out = tl.where(valid, advantage, 0.0)
        tl.store(advantages_ptr + row_offset + t, advantage_out)
        tl.store(returns_ptr + row_offset + t, tl.where(valid, advantage + value, 0.0))


def gae(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked GAE by a reverse scan per row (GAE, Schulman et al. 2016, eq. 16); returns (advantages_BT, returns_BT).

    Same signature and outputs as `rlhfuse.algorithms.compute_gae`; accumulates in fp32 and returns the dtype of
    `values_BT`. Inputs are validated by the caller (`rlhfuse.ops.gae`).
    """
    B, T = values_BT.shape
    rewards_f_BT = rewards_BT.to(torch.float32).contiguous()
    values_f_BT = values_BT.to(torch.float32).contiguous()
    mask_u8_BT = mask_BT.to(torch.uint8).contiguous()
    advantages_BT = torch.empty_like(values_f_BT)
    returns_BT = torch.empty_like(values_f_BT)
    if B > 0 and T > 0:
        _gae_reverse_scan_kernel[(B,)](
            rewards_f_BT,
            values_f_BT,
            mask_u8_BT,
            advantages_BT,
            returns_BT,
            T,
            T,
            float(gamma),
            float(gamma * lam),
        )
    return advantages_BT.to(values_BT.dtype), returns_BT.to(values_BT.dtype)
