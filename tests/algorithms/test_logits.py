"""Entropy and chosen-token log-probabilities from logits: values and gradients against the plain formulas.

Legend: B batch rows, T time (tokens), V vocabulary.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhfuse.algorithms import entropy_from_logits, logprobs_from_logits


def test_entropy_of_uniform_distribution_is_log_vocab():
    # Equal logits: p = 1/V for every token, H = −Σ (1/V) log(1/V) = log V.
    logits_BTV = torch.full((2, 3, 50), 1.7)
    torch.testing.assert_close(
        entropy_from_logits(logits_BTV, chunk_size=4), torch.full((2, 3), math.log(50))
    )


def test_entropy_of_nearly_deterministic_distribution_is_zero():
    logits_BTV = torch.zeros(1, 1, 10)
    logits_BTV[..., 3] = 1000.0
    torch.testing.assert_close(entropy_from_logits(logits_BTV), torch.zeros(1, 1))


def test_entropy_matches_direct_formula_with_gradients():
    generator = torch.Generator().manual_seed(0)
    logits_BTV = (3 * torch.randn(3, 5, 17, generator=generator)).requires_grad_(True)
    log_probs_BTV = torch.log_softmax(logits_BTV, dim=-1)
    expected_BT = -(log_probs_BTV.exp() * log_probs_BTV).sum(-1)
    entropy_BT = entropy_from_logits(logits_BTV, chunk_size=4)  # 15 rows: 4 chunks, the last partial
    torch.testing.assert_close(entropy_BT, expected_BT)
    weights_BT = torch.randn(3, 5, generator=generator)
    (grad,) = torch.autograd.grad((entropy_BT * weights_BT).sum(), logits_BTV)
    (expected_grad,) = torch.autograd.grad((expected_BT * weights_BT).sum(), logits_BTV)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 4, 4096])
def test_logprobs_and_gradient_match_log_softmax_gather(temperature, chunk_size):
    generator = torch.Generator().manual_seed(1)
    logits_BTV = (2 * torch.randn(2, 7, 33, generator=generator)).requires_grad_(True)
    labels_BT = torch.randint(0, 33, (2, 7), generator=generator)
    expected_BT = torch.log_softmax(logits_BTV / temperature, -1).gather(-1, labels_BT[..., None]).squeeze(-1)
    logprobs_BT = logprobs_from_logits(logits_BTV, labels_BT, temperature=temperature, chunk_size=chunk_size)
    torch.testing.assert_close(logprobs_BT, expected_BT, rtol=0, atol=1e-6)
    upstream_BT = torch.randn(2, 7, generator=generator)
    (grad,) = torch.autograd.grad(logprobs_BT, logits_BTV, upstream_BT)
    (expected_grad,) = torch.autograd.grad(expected_BT, logits_BTV, upstream_BT)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-6)


def test_logprobs_of_bf16_logits_are_fp32_and_accurate():
    generator = torch.Generator().manual_seed(2)
    logits_BTV = torch.randn(2, 3, 40, generator=generator).to(torch.bfloat16)
    labels_BT = torch.randint(0, 40, (2, 3), generator=generator)
    expected_BT = torch.log_softmax(logits_BTV.float(), -1).gather(-1, labels_BT[..., None]).squeeze(-1)
    logprobs_BT = logprobs_from_logits(logits_BTV, labels_BT)
    assert logprobs_BT.dtype == torch.float32
    torch.testing.assert_close(logprobs_BT, expected_BT, rtol=0, atol=1e-6)


def test_logprobs_label_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_sliced_logits_are_not_copied_and_still_correct(monkeypatch):
    # The response slice of a full forward pass is not viewable as (B·T, V); it must be processed per row
    # (views) rather than flattened by a copy, with the same values and gradients.
    generator = torch.Generator().manual_seed(3)
    full_logits_BTV = torch.randn(2, 9, 13, generator=generator, requires_grad=True)
    logits_BTV = full_logits_BTV[:, 3:-1]
    labels_BT = torch.randint(0, 13, (2, 5), generator=generator)
    seen_storage = []
    import rlhfuse.algorithms.ops as ops

    real = ops.chosen_logprobs

    def spy(logits_NV, *args, **kwargs):
        seen_storage.append(logits_NV.untyped_storage().data_ptr())
        return real(logits_NV, *args, **kwargs)

    monkeypatch.setattr(ops, "chosen_logprobs", spy)
    logprobs_BT = logprobs_from_logits(logits_BTV, labels_BT, chunk_size=2)
    assert seen_storage == [full_logits_BTV.untyped_storage().data_ptr()] * 2
    expected_BT = torch.log_softmax(logits_BTV, -1).gather(-1, labels_BT[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs_BT, expected_BT, rtol=0, atol=1e-6)
    (grad,) = torch.autograd.grad(logprobs_BT.sum(), full_logits_BTV)
    (expected_grad,) = torch.autograd.grad(expected_BT.sum(), full_logits_BTV)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        entropy_from_logits(logits_BTV, chunk_size=2),
        -(torch.softmax(logits_BTV, -1) * torch.log_softmax(logits_BTV, -1)).sum(-1),
    )
