"""Triton kernel for masked Generalized Advantage Estimation (GAE): one program per row, tiles of BLOCK_T tokens.

Each program walks its row from the last tile to the first. Inside a tile both recurrences are parallel scans
(`tl.associative_scan`, log-depth) over the tile read backwards in time: V_next by "latest valid token wins",
and A as a composition of affine maps x ↦ a·x + b (a = γλ, b = δ on valid tokens; a = 1, b = 0 on masked ones,
which pass the carried A through). Between tiles two scalars are carried: V and A at the nearest valid token.

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
def _compose_affine(a_first, b_first, a_then, b_then):
    # x ↦ a_then·(a_first·x + b_first) + b_then: the map of the earlier scan elements, then the later one.
    return a_first * a_then, a_then * b_first + b_then


@triton.jit
def _latest_valid(value_left, key_left, value_right, key_right):
    # Keep the candidate with the larger key (scan index of a valid token, −1 for none); commutative.
    take_right = key_right > key_left
    return tl.where(take_right, value_right, value_left), tl.where(take_right, key_right, key_left)


@triton.jit
def _gae_tile_scan_kernel(
    rewards_ptr,
    values_ptr,
    mask_ptr,
    advantages_ptr,
    returns_ptr,
    T,
    stride_row,
    gamma,
    gamma_lam,
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0)
    row_offset = row.to(tl.int64) * stride_row
    scan_index = tl.arange(0, BLOCK_T)
    # State carried from the tile after (later times): V and A at the nearest valid token ≥ tile end (0 if none).
    carried_value = tl.zeros((), dtype=tl.float32)
    carried_advantage = tl.zeros((), dtype=tl.float32)
    for tile in range(0, tl.cdiv(T, BLOCK_T)):
        end = T - tile * BLOCK_T
        # Scan element i is time end − 1 − i: a forward scan then runs backwards in time.
        times = end - 1 - scan_index
        in_row = times >= 0
        reward = tl.load(rewards_ptr + row_offset + times, mask=in_row, other=0.0).to(tl.float32)
        value = tl.load(values_ptr + row_offset + times, mask=in_row, other=0.0).to(tl.float32)
        valid = (tl.load(mask_ptr + row_offset + times, mask=in_row, other=0) != 0) & in_row

        # V_next(t): the nearest valid token at a time > t inside this tile (scan elements < i), else the carry.
        # Read as an inclusive scan over the sequence shifted by one (element i looks at time t + 1).
        next_times = times + 1
        next_in_tile = (scan_index > 0) & (next_times >= 0)
        next_value = tl.load(values_ptr + row_offset + next_times, mask=next_in_tile, other=0.0).to(
            tl.float32
        )
        next_valid = (
            tl.load(mask_ptr + row_offset + next_times, mask=next_in_tile, other=0) != 0
        ) & next_in_tile
        next_key = tl.where(next_valid, scan_index, -1)
        bootstrap_value, bootstrap_key = tl.associative_scan((next_value, next_key), 0, _latest_valid)
        bootstrap_value = tl.where(bootstrap_key >= 0, bootstrap_value, carried_value)

        # X_t = A at the nearest valid token ≥ t: X_t = δ_t + γλ·X_next on valid tokens, X_t = X_next on masked
        # ones; as affine maps of the carried A, composed by the scan.
        delta = reward + gamma * bootstrap_value - value
        slope = tl.where(valid, gamma_lam, 1.0)
        offset = tl.where(valid, delta, 0.0)
        scan_slope, scan_offset = tl.associative_scan((slope, offset), 0, _compose_affine)
        advantage = scan_slope * carried_advantage + scan_offset

        tl.store(advantages_ptr + row_offset + times, tl.where(valid, advantage, 0.0), mask=in_row)
        tl.store(returns_ptr + row_offset + times, tl.where(valid, advantage + value, 0.0), mask=in_row)

        # Carry to the tile before: A at the tile's first time, and V at its earliest valid token.
        carried_advantage = tl.sum(tl.where(scan_index == BLOCK_T - 1, advantage, 0.0), axis=0)
        valid_key = tl.where(valid, scan_index, -1)
        earliest_key = tl.max(valid_key, axis=0)
        earliest_value = tl.sum(tl.where(scan_index == earliest_key, value, 0.0), axis=0)
        carried_value = tl.where(earliest_key >= 0, earliest_value, carried_value)


def gae(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    block_t: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked GAE by tiled reverse scans per row (GAE, Schulman et al. 2016, eq. 16); returns (advantages_BT, returns_BT).

    Same signature and outputs as `rlhfuse.algorithms.compute_gae`; accumulates in fp32 and returns the dtype of
    `values_BT`. `block_t` (a power of two) is the tile length. Inputs are validated by the caller
    (`rlhfuse.ops.gae`).
    """
    B, T = values_BT.shape
    block_t = min(block_t, triton.next_power_of_2(max(T, 1)))
    rewards_f_BT = rewards_BT.to(torch.float32).contiguous()
    values_f_BT = values_BT.to(torch.float32).contiguous()
    mask_u8_BT = mask_BT.to(torch.uint8).contiguous()
    advantages_BT = torch.empty_like(values_f_BT)
    returns_BT = torch.empty_like(values_f_BT)
    if B > 0 and T > 0:
        _gae_tile_scan_kernel[(B,)](
            rewards_f_BT,
            values_f_BT,
            mask_u8_BT,
            advantages_BT,
            returns_BT,
            T,
            T,
            float(gamma),
            float(gamma * lam),
            BLOCK_T=block_t,
        )
    return advantages_BT.to(values_BT.dtype), returns_BT.to(values_BT.dtype)
