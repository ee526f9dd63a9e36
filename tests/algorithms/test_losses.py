"""PPO policy and value losses on hand-derived examples.

Legend: B batch rows, T time (tokens).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhfuse.algorithms import PolicyLossStats, ValueLossStats, ppo_policy_loss, value_loss


def _logprobs_for_ratios(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_BT, old_logprobs_BT) whose ratio exp(logp − old) is `ratios`."""
    ratios_BT = torch.tensor(ratios, dtype=torch.float64)
    return torch.log(ratios_BT), torch.zeros_like(ratios_BT)


def test_clipped_policy_loss_by_hand():
    # ε = 0.2; per token L = max(−A·r, −A·clip(r, 0.8, 1.2)):
    # r = 1.5, A = +1: max(−1.5, −1.2) = −1.2   clipped
    # r = 0.5, A = +1: max(−0.5, −0.8) = −0.5   not clipped
    # r = 1.5, A = −1: max( 1.5,  1.2) =  1.5   not clipped
    # r = 0.5, A = −1: max( 0.5,  0.8) =  0.8   clipped
    # 5th token masked (r = 100, A = 5) must not count.
    # loss = (−1.2 − 0.5 + 1.5 + 0.8)/4 = 0.15; clip_fraction = 2/4; ratio_mean = (1.5+0.5+1.5+0.5)/4 = 1
    # approx_kl = mean((r − 1) − log r) = ((0.5 − ln 1.5)·2 + (−0.5 + ln 2)·2)/4
    logprobs_BT, old_logprobs_BT = _logprobs_for_ratios([[1.5, 0.5, 1.5, 0.5, 100.0]])
    advantages_BT = torch.tensor([[1.0, 1.0, -1.0, -1.0, 5.0]], dtype=torch.float64)
    mask_BT = torch.tensor([[1, 1, 1, 1, 0]])
    loss, stats = ppo_policy_loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, clip_eps=0.2)
    assert isinstance(stats, PolicyLossStats)
    torch.testing.assert_close(loss, torch.tensor(0.15, dtype=torch.float64))
    torch.testing.assert_close(stats.clip_fraction, torch.tensor(0.5, dtype=torch.float64))
    torch.testing.assert_close(stats.ratio_mean, torch.tensor(1.0, dtype=torch.float64))
    expected_kl = ((0.5 - math.log(1.5)) * 2 + (-0.5 + math.log(2.0)) * 2) / 4
    torch.testing.assert_close(stats.approx_kl, torch.tensor(expected_kl, dtype=torch.float64))
    assert all(s.dim() == 0 and not s.requires_grad for s in stats)


def test_policy_loss_gradient_flows_only_through_unclipped_tokens():
    # d/d logp of −A·r = −A·r (r = exp(logp − old)); clipped tokens have zero gradient.
    # Tokens as above: grads per token (÷4 for the mean) = [0, −0.5, 1.5, 0]/4.
    logprobs_BT, old_logprobs_BT = _logprobs_for_ratios([[1.5, 0.5, 1.5, 0.5]])
    logprobs_BT.requires_grad_(True)
    advantages_BT = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    loss, _ = ppo_policy_loss(logprobs_BT, old_logprobs_BT, advantages_BT, torch.ones(1, 4))
    (grad_BT,) = torch.autograd.grad(loss, logprobs_BT)
    torch.testing.assert_close(grad_BT, torch.tensor([[0.0, -0.5, 1.5, 0.0]], dtype=torch.float64) / 4)


def test_clip_eps_high_is_asymmetric():
    # r = 1.5, A = +1, ε_high = 0.3: max(−1.5, −1.3) = −1.3;  r = 0.5, A = −1, ε = 0.2: max(0.5, 0.8) = 0.8
    logprobs_BT, old_logprobs_BT = _logprobs_for_ratios([[1.5, 0.5]])
    advantages_BT = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, _ = ppo_policy_loss(
        logprobs_BT, old_logprobs_BT, advantages_BT, torch.ones(1, 2), clip_eps=0.2, clip_eps_high=0.3
    )
    torch.testing.assert_close(loss, torch.tensor((-1.3 + 0.8) / 2, dtype=torch.float64))


def test_dual_clip_bounds_negative_advantages_only():
    # c = 3. r = 5, A = −1: standard max(5, 1.2) = 5, dual min(5, 3) = 3.
    #        r = 5, A = +1: standard max(−5, −1.2) = −1.2, dual clip does not apply to A > 0.
    # dual: (3 − 1.2)/2 = 0.9;  without: (5 − 1.2)/2 = 1.9
    logprobs_BT, old_logprobs_BT = _logprobs_for_ratios([[5.0, 5.0]])
    advantages_BT = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)
    mask_BT = torch.ones(1, 2)
    dual, _ = ppo_policy_loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, dual_clip=3.0)
    plain, _ = ppo_policy_loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    torch.testing.assert_close(dual, torch.tensor(0.9, dtype=torch.float64))
    torch.testing.assert_close(plain, torch.tensor(1.9, dtype=torch.float64))
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_policy_loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, dual_clip=0.5)


def test_token_versus_sequence_reduction():
    # r = 1 everywhere, so L_t = −A_t. Row 0 losses [1, 2, 3] (mean 2), row 1 [10] (mean 10), row 2 empty.
    # token: (1 + 2 + 3 + 10)/4 = 4;  sequence: (2 + 10)/2 = 6 (the empty row is not a sequence).
    advantages_BT = -torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0], [7.0, 7.0, 7.0]])
    mask_BT = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    logprobs_BT = torch.zeros(3, 3)
    token, _ = ppo_policy_loss(logprobs_BT, logprobs_BT, advantages_BT, mask_BT, reduction="token")
    sequence, _ = ppo_policy_loss(logprobs_BT, logprobs_BT, advantages_BT, mask_BT, reduction="sequence")
    torch.testing.assert_close(token, torch.tensor(4.0))
    torch.testing.assert_close(sequence, torch.tensor(6.0))
    with pytest.raises(ValueError, match="reduction must be one of"):
        ppo_policy_loss(logprobs_BT, logprobs_BT, advantages_BT, mask_BT, reduction="batch")


def test_clipped_value_loss_by_hand():
    # ε = 0.2, V_old = 0.
    # t0: V = 0.5 → V_clip = 0.2, R = 1: (0.5 − 1)² = 0.25, (0.2 − 1)² = 0.64 → ½·0.64 = 0.32 (clipped larger)
    # t1: V = 0.1 → V_clip = 0.1, R = −1: both (1.1)² = 1.21 → ½·1.21 = 0.605
    # loss = (0.32 + 0.605)/2 = 0.4625; clip_fraction = 1/2; unclipped loss = ½·(0.25 + 1.21)/2 = 0.365
    # explained variance: R − V = [0.5, −1.1], Var = 0.73 − 0.09 = 0.64; Var R = 1 → 1 − 0.64 = 0.36
    values_BT = torch.tensor([[0.5, 0.1, 3.0]], dtype=torch.float64)
    old_values_BT = torch.zeros(1, 3, dtype=torch.float64)
    returns_BT = torch.tensor([[1.0, -1.0, -3.0]], dtype=torch.float64)
    mask_BT = torch.tensor([[1, 1, 0]])
    loss, stats = value_loss(values_BT, old_values_BT, returns_BT, mask_BT, clip_eps=0.2)
    assert isinstance(stats, ValueLossStats)
    torch.testing.assert_close(loss, torch.tensor(0.4625, dtype=torch.float64))
    torch.testing.assert_close(stats.clip_fraction, torch.tensor(0.5, dtype=torch.float64))
    torch.testing.assert_close(stats.explained_variance, torch.tensor(0.36, dtype=torch.float64))
    unclipped, unclipped_stats = value_loss(values_BT, old_values_BT, returns_BT, mask_BT, clip_eps=None)
    torch.testing.assert_close(unclipped, torch.tensor(0.365, dtype=torch.float64))
    torch.testing.assert_close(unclipped_stats.clip_fraction, torch.tensor(0.0, dtype=torch.float64))


def test_value_loss_sequence_reduction():
    # No clipping, ½(V − R)²: row 0 [½·1, ½·9] mean 2.5, row 1 [½·4] = 2. token: 7/3; sequence: 2.25.
    values_BT = torch.tensor([[1.0, 3.0], [2.0, 0.0]])
    returns_BT = torch.zeros(2, 2)
    mask_BT = torch.tensor([[1, 1], [1, 0]])
    token, _ = value_loss(values_BT, values_BT, returns_BT, mask_BT, clip_eps=None)
    sequence, _ = value_loss(values_BT, values_BT, returns_BT, mask_BT, clip_eps=None, reduction="sequence")
    torch.testing.assert_close(token, torch.tensor(7.0 / 3.0))
    torch.testing.assert_close(sequence, torch.tensor(2.25))
