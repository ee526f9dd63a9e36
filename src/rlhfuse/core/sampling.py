"""Sampling helpers shared by every generator: per-sample seeds, logit filtering (temperature, top-k, top-p)
and inverse-CDF sampling from a per-sample stream of uniforms (the sampling fields of a generator's config are
`rlhfuse.core.sampling_config`).

Legend: B rows, V vocabulary.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhfuse.core.sampling_config import SamplingConfig as SamplingConfig  # importable from here too


@dataclass(frozen=True)
class Sampling:
    """How one `generate` call samples when it differs from the generator's own settings (held-out evaluation:
    greedy, or another number of samples per prompt): the sampling settings and the samples per prompt."""

    config: SamplingConfig
    samples_per_prompt: int


def sample_seed(run_seed: int, iteration: int, prompt_id: int, sample_index: int) -> int:
    """A well-mixed 63-bit seed for one sample's random stream."""
    digest = hashlib.blake2b(f"{run_seed}/{iteration}/{prompt_id}/{sample_index}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def sampling_dtype(device: torch.device) -> torch.dtype:
    """The precision of a decode step's filtering and inverse-CDF sampling on `device`: float32 on CUDA, float64
    elsewhere. Their [B, V] passes (softmax, top-p's sort, the cumulative sum) run every decode step: float64
    doubles their bytes and runs at 1/2 (H100) to 1/64 (most other GPUs) of float32's rate. The CPU keeps
    float64: its tokens are the ones every test and the default job's metrics are pinned to (the stand-in device,
    which computes on the CPU, too); a GPU's differ from them anyway (bf16 logits, other matmul rounding)."""
    return torch.float32 if device.type == "cuda" else torch.float64


def filter_logits(
    logits_BV: Tensor, *, temperature: float, top_k: int, top_p: float, dtype: torch.dtype | None = None
) -> Tensor:
    """Probabilities after temperature, top-k and top-p filtering (rows sum to 1), in `dtype` (default:
    `sampling_dtype` of the logits' device)."""
    dtype = sampling_dtype(logits_BV.device) if dtype is None else dtype
    logits_BV = logits_BV.to(dtype) / temperature
    if 0 < top_k < logits_BV.shape[-1]:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    probs_BV = torch.softmax(logits_BV, dim=-1)
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(probs_BV, dim=-1, descending=True)
        # Drop a token when the tokens strictly more likely than it already reach top_p.
        drop_sorted_BV = (torch.cumsum(sorted_BV, dim=-1) - sorted_BV) >= top_p
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
        probs_BV = probs_BV.masked_fill(drop_BV, 0.0)
        probs_BV = probs_BV / probs_BV.sum(dim=-1, keepdim=True)
    return probs_BV


def sample_from(probs_BV: Tensor, uniforms_B: Tensor) -> Tensor:
    """Inverse-CDF sampling in the probabilities' dtype: the first token whose cumulative probability exceeds the
    row's uniform times the row's total."""
    cdf_BV = torch.cumsum(probs_BV, dim=-1)
    total_B1 = cdf_BV[:, -1:]
    # kept below the total: a uniform that rounds up to 1 (in float32 every u > 1 - 2**-25) would otherwise
    # land past the last token with any probability, on a filtered one
    below_B1 = torch.nextafter(total_B1, torch.zeros_like(total_B1))
    u_B1 = torch.minimum(uniforms_B.to(cdf_BV.dtype)[:, None] * total_B1, below_B1)
    index_B = torch.searchsorted(cdf_BV, u_B1, right=True).squeeze(1)
    return index_B.clamp_(max=probs_BV.shape[-1] - 1)
