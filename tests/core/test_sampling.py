"""The precision of sampling (`rlhfuse.core.sampling`): float64 on the CPU (the reference tokens), float32 on
CUDA, where a decode step's [B, V] passes in float64 cost twice the bytes and, on most GPUs, many times the time;
inverse-CDF sampling never lands on a filtered token, in either precision.

Legend: B rows, V vocabulary."""

from __future__ import annotations

import torch

from rlhfuse.core.sampling import filter_logits, sample_from, sampling_dtype


def test_cuda_samples_in_float32_and_every_other_device_in_float64():
    assert sampling_dtype(torch.device("cuda", 0)) is torch.float32
    assert sampling_dtype(torch.device("cpu")) is torch.float64
    assert filter_logits(torch.randn(2, 5), temperature=1.0, top_k=0, top_p=1.0).dtype is torch.float64


def test_float32_sampling_draws_the_float64_tokens_away_from_the_cdf_steps():
    """Random logits of a real vocabulary's size, temperature / top-k / top-p: float32 gives the float64 tokens
    for every uniform farther than float32's rounding from a step of the cumulative distribution."""
    g = torch.Generator().manual_seed(0)
    logits_BV = 3 * torch.randn(64, 32000, generator=g)
    uniforms_B = torch.rand(64, generator=g, dtype=torch.float64)
    for top_k, top_p in ((0, 1.0), (50, 1.0), (0, 0.9), (40, 0.95)):
        probs = {
            dtype: filter_logits(logits_BV, temperature=0.7, top_k=top_k, top_p=top_p, dtype=dtype)
            for dtype in (torch.float32, torch.float64)
        }
        assert probs[torch.float32].dtype is torch.float32
        tokens = {dtype: sample_from(p_BV, uniforms_B) for dtype, p_BV in probs.items()}
        cdf_BV = probs[torch.float64].cumsum(-1)
        gap_B = (cdf_BV - uniforms_B[:, None] * cdf_BV[:, -1:]).abs().min(-1).values
        clear_B = gap_B > 1e-5
        assert clear_B.sum() > 50
        assert torch.equal(tokens[torch.float32][clear_B], tokens[torch.float64][clear_B]), (top_k, top_p)


def test_a_uniform_rounding_up_to_one_draws_the_last_kept_token_not_a_filtered_one():
    """In float32 every uniform above 1 - 2**-25 rounds to 1: the target is then the row's total, which only
    the tokens past the last kept one reach (filtered, probability 0)."""
    probs_BV = torch.tensor([[0.25, 0.5, 0.25, 0.0, 0.0]])
    for dtype in (torch.float32, torch.float64):
        u_B = torch.tensor([1 - 2.0**-30 if dtype is torch.float32 else 1 - 2.0**-53], dtype=torch.float64)
        assert sample_from(probs_BV.to(dtype), u_B).tolist() == [2], dtype
        assert sample_from(probs_BV.to(dtype), torch.zeros(1, dtype=torch.float64)).tolist() == [0]
