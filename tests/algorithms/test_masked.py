"""Masked statistics and whitening on hand-derived examples.

Legend: B batch rows, T time (tokens).
"""

from __future__ import annotations

import pytest
import torch

from rlhfuse.algorithms import masked_mean, masked_var, whiten


def test_masked_mean_and_var_by_hand():
    # Valid values [2, 4, 6]; the masked 100 and the masked NaN must not count.
    # mean = 4; unbiased var = (4 + 0 + 4)/2 = 4; biased var = 8/3
    x_BT = torch.tensor([[2.0, 4.0, 100.0], [6.0, float("nan"), 1.0]])
    mask_BT = torch.tensor([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(masked_mean(x_BT, mask_BT), torch.tensor(4.0))
    torch.testing.assert_close(masked_var(x_BT, mask_BT), torch.tensor(4.0))
    torch.testing.assert_close(masked_var(x_BT, mask_BT, unbiased=False), torch.tensor(8.0 / 3.0))
    # Per row: [3, 6]; an all-masked row gives 0, not NaN.
    torch.testing.assert_close(masked_mean(x_BT, mask_BT, dim=1), torch.tensor([3.0, 6.0]))
    torch.testing.assert_close(masked_mean(x_BT, torch.zeros(2, 3), dim=1), torch.tensor([0.0, 0.0]))


def test_masked_var_needs_two_values():
    with pytest.raises(ValueError, match="at least 2 valid"):
        masked_var(torch.tensor([1.0, 2.0]), torch.tensor([1, 0]))


def test_whiten_by_hand():
    # Valid [2, 4, 6]: μ = 4, σ = 2 → (x − μ)/σ = [−1, 0, 1]; masked → 0.
    # shift_mean=False adds μ back: [3, 4, 5].
    x_BT = torch.tensor([[2.0, 4.0, 100.0], [6.0, -7.0, 1.0]], dtype=torch.float64)
    mask_BT = torch.tensor([[1, 1, 0], [1, 0, 0]])
    expected_BT = torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(whiten(x_BT, mask_BT, eps=0.0), expected_BT)
    shifted_BT = torch.tensor([[3.0, 4.0, 0.0], [5.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(whiten(x_BT, mask_BT, shift_mean=False, eps=0.0), shifted_BT)


def test_whitened_valid_tokens_have_zero_mean_unit_variance():
    generator = torch.Generator().manual_seed(0)
    x_BT = 3.0 + 5.0 * torch.randn(4, 50, generator=generator, dtype=torch.float64)
    mask_BT = torch.rand(4, 50, generator=generator) < 0.6
    whitened_BT = whiten(x_BT, mask_BT)
    torch.testing.assert_close(masked_mean(whitened_BT, mask_BT), torch.tensor(0.0, dtype=torch.float64))
    torch.testing.assert_close(masked_var(whitened_BT, mask_BT), torch.tensor(1.0, dtype=torch.float64))
