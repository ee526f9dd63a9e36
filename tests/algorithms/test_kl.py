"""KL estimators and the KL-shaped rewards, by hand and against the exact KL of a small categorical.

Legend: B batch rows, T time (tokens), V vocabulary.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhfuse.algorithms import kl_estimate, kl_penalty_rewards


def test_each_estimator_by_hand():
    # log r = logp − logp_ref = [ln 2, −ln 2]
    # k1 = log r                = [0.693147, −0.693147]
    # k2 = ½ (log r)²           = [0.240227, 0.240227]
    # k3 = (1/r − 1) + log r    = [(0.5 − 1) + 0.693147, (2 − 1) − 0.693147] = [0.193147, 0.306853]
    ln2 = math.log(2.0)
    logprobs_BT = torch.tensor([[ln2, 0.0]], dtype=torch.float64)
    ref_logprobs_BT = torch.tensor([[0.0, ln2]], dtype=torch.float64)
    expected = {
        "k1": [ln2, -ln2],
        "k2": [0.5 * ln2**2, 0.5 * ln2**2],
        "k3": [-0.5 + ln2, 1.0 - ln2],
    }
    for kind, values in expected.items():
        torch.testing.assert_close(
            kl_estimate(logprobs_BT, ref_logprobs_BT, kind), torch.tensor([values], dtype=torch.float64)
        )
    with pytest.raises(ValueError, match="kind must be one of"):
        kl_estimate(logprobs_BT, ref_logprobs_BT, "k4")


def test_k1_and_k3_are_unbiased_for_kl_policy_to_reference():
    # E_{y~π}[k] = Σ_y π(y)·k(y) must equal KL(π ‖ π_ref) = Σ_y π(y)(log π(y) − log π_ref(y)) for k1 and k3.
    generator = torch.Generator().manual_seed(0)
    logp_V = torch.log_softmax(torch.randn(7, generator=generator, dtype=torch.float64), dim=0)
    ref_logp_V = torch.log_softmax(torch.randn(7, generator=generator, dtype=torch.float64), dim=0)
    exact = (logp_V.exp() * (logp_V - ref_logp_V)).sum()
    for kind in ("k1", "k3"):
        expectation = (logp_V.exp() * kl_estimate(logp_V[None], ref_logp_V[None], kind)[0]).sum()
        torch.testing.assert_close(expectation, exact)
    assert bool((kl_estimate(logp_V, ref_logp_V, "k3") >= 0).all())


def test_kl_penalty_rewards_by_hand():
    # β = 0.5. Row 0: mask [1, 1, 0], last valid t = 1: [−0.05, −0.1 + 2, 0] = [−0.05, 1.9, 0]
    #          Row 1: mask [1, 0, 1] (interior hole), last valid t = 2: [−0.25, 0, −4.5 + (−1)] = [−0.25, 0, −5.5]
    scores_B = torch.tensor([2.0, -1.0])
    kl_BT = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.4, 9.0]])
    mask_BT = torch.tensor([[1, 1, 0], [1, 0, 1]])
    rewards_BT = kl_penalty_rewards(scores_B, kl_BT, mask_BT, kl_coef=0.5)
    torch.testing.assert_close(rewards_BT, torch.tensor([[-0.05, 1.9, 0.0], [-0.25, 0.0, -5.5]]))


def test_kl_penalty_rewards_rejects_rows_without_valid_tokens():
    with pytest.raises(ValueError, match=r"rows \[1\] have no valid token"):
        kl_penalty_rewards(torch.ones(2), torch.zeros(2, 3), torch.tensor([[1, 0, 0], [0, 0, 0]]), 0.1)
