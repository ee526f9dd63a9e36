"""Vocabulary-parallel temperature / top-k / top-p filtering and inverse-CDF sampling: the same tokens as
`rlhfuse.core.sampling.filter_logits` + `sample_from` on the same uniforms (ties aside; sums are taken in a
different order, so a uniform within rounding of a boundary may differ), from each rank's slice of the logits
(`VocabShard`), never gathering the full logits.

- top-k: each rank's k largest logits are all-gathered (k * tp values per row) and the k-th largest of those
  is the global k-th;
- softmax: one max and one sum over the group;
- top-p: the nucleus threshold t (the smallest kept probability: a token is dropped when the tokens more likely
  than it already reach top_p) is bracketed by all-reduces of the probability mass and count above a few
  candidate thresholds per round (`SPLITS` of them, from each rank's sorted probabilities, so a round costs
  one all-reduce of [B, 2 * SPLITS]), until at most `CANDIDATES` tokens per rank lie in the bracket; those are
  all-gathered and the threshold is read off them exactly as the single-process cumulative sum would;
- sampling: the slices' kept masses are all-gathered (rank order = vocabulary order) and each rank searches
  its own slice for the row's target; the lowest hit wins.

Everything is computed in `dtype`, by default `sampling_dtype` of the logits' device (float32 on CUDA, float64
elsewhere), as the single-process `filter_logits` does: these [B, Vl] passes run every decode step.

Legend: B rows, Vl this rank's vocabulary slice (padded rows carry no probability), K candidates, M splits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlhfuse import distributed
from rlhfuse.core.sampling import sampling_dtype
from rlhfuse.generation.engine import SamplingParams
from rlhfuse.models import Transformer
from rlhfuse.runtime.tensor_parallel import (
    VocabShard,
    mask_padded_vocab,
    vocab_parallel_argmax,
    vocab_parallel_logprobs,
)

SPLITS = 16
CANDIDATES = 64
MAX_ROUNDS = 16


def _sum(x: Tensor, group: Any) -> Tensor:
    x = x.contiguous().clone()
    distributed.all_reduce(x, group=group)
    return x


def vocab_parallel_filter(
    logits_BV: Tensor,
    shard: VocabShard,
    group: Any = None,
    *,
    vocab_size: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """This rank's slice of `filter_logits(full logits, ...)` in `dtype` (default: `sampling_dtype` of the
    logits' device), rows summing to 1 over the group."""
    dtype = sampling_dtype(logits_BV.device) if dtype is None else dtype
    logits_BV = mask_padded_vocab(logits_BV.detach().to(dtype) / temperature, shard)
    if 0 < top_k < vocab_size:
        local_BK = torch.topk(logits_BV, min(top_k, shard.size), dim=-1).values
        candidates_BK = torch.cat(distributed.all_gather(local_BK.contiguous(), group=group), dim=-1)
        kth_B1 = torch.topk(candidates_BK, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    m_B = distributed.max_over_group(logits_BV.max(dim=-1).values, group)
    e_BV = (logits_BV - m_B.unsqueeze(-1)).exp()
    probs_BV = e_BV / _sum(e_BV.sum(dim=-1), group).unsqueeze(-1)
    if top_p < 1.0:
        t_B1 = nucleus_threshold(probs_BV, top_p, group)
        probs_BV = probs_BV.masked_fill(probs_BV < t_B1, 0.0)
        probs_BV = probs_BV / _sum(probs_BV.sum(dim=-1), group).unsqueeze(-1)
    return probs_BV


def nucleus_threshold(probs_BV: Tensor, top_p: float, group: Any = None) -> Tensor:
    """Per row, the smallest probability top-p keeps, p_(J) with J the first sorted position whose inclusive
    cumulative probability reaches top_p (the tokens kept are those with p >= it, ties aside). [B, 1], in the
    probabilities' dtype (their counts too: exact in float32 up to 2**24 tokens)."""
    batch, device, dtype = probs_BV.shape[0], probs_BV.device, probs_BV.dtype
    if batch == 0:
        return probs_BV.new_zeros(0, 1)
    asc_BV = torch.sort(probs_BV, dim=-1).values
    prefix_BV1 = torch.cat([asc_BV.new_zeros(batch, 1), torch.cumsum(asc_BV, dim=-1)], dim=-1)
    local_total_B1 = prefix_BV1[:, -1:]
    width = asc_BV.shape[-1]

    def above(t_BM: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's mass and count of probabilities >= each threshold."""
        below_BM = torch.searchsorted(asc_BV, t_BM.contiguous(), right=False)
        return local_total_B1 - prefix_BV1.gather(-1, below_BM), (width - below_BM).to(dtype)

    # the bracket [lo, hi): mass(>= lo) >= top_p > mass(>= hi); counts of tokens >= each end
    lo_B = torch.zeros(batch, dtype=dtype, device=device)
    top_B = distributed.max_over_group(asc_BV[:, -1], group)
    hi_B = torch.nextafter(top_B, torch.full_like(top_B, float("inf")))
    lo_count_B = _sum(torch.full((batch,), float(width), dtype=dtype, device=device), group)
    hi_count_B = torch.zeros_like(lo_count_B)
    hi_mass_B = torch.zeros_like(lo_count_B)
    steps = torch.arange(1, SPLITS, dtype=dtype, device=device) / SPLITS
    for _ in range(MAX_ROUNDS):
        if float((lo_count_B - hi_count_B).max()) <= CANDIDATES:
            break
        t_BM = lo_B.unsqueeze(1) + (hi_B - lo_B).unsqueeze(1) * steps  # M = SPLITS - 1 inner thresholds
        mass_BM, count_BM = above(t_BM)
        reduced = _sum(torch.cat([mass_BM, count_BM], dim=-1), group)
        mass_BM, count_BM = reduced[:, : SPLITS - 1], reduced[:, SPLITS - 1 :]
        inside_B = (mass_BM >= top_p).sum(dim=-1)  # thresholds still keeping top_p: a prefix (mass decreases)
        last = SPLITS - 2
        lo_i, hi_i = (inside_B - 1).clamp(min=0), inside_B.clamp(max=last)
        moved_lo, moved_hi = inside_B > 0, inside_B <= last
        lo_B = torch.where(moved_lo, t_BM.gather(-1, lo_i[:, None]).squeeze(1), lo_B)
        lo_count_B = torch.where(moved_lo, count_BM.gather(-1, lo_i[:, None]).squeeze(1), lo_count_B)
        hi_B = torch.where(moved_hi, t_BM.gather(-1, hi_i[:, None]).squeeze(1), hi_B)
        hi_count_B = torch.where(moved_hi, count_BM.gather(-1, hi_i[:, None]).squeeze(1), hi_count_B)
        hi_mass_B = torch.where(moved_hi, mass_BM.gather(-1, hi_i[:, None]).squeeze(1), hi_mass_B)
    # the tokens in the bracket, all-gathered (each rank's padded with -1 to the largest count)
    in_BV = (probs_BV >= lo_B.unsqueeze(1)) & (probs_BV < hi_B.unsqueeze(1))
    most = torch.tensor([float(in_BV.sum(dim=-1).max()) if batch else 0.0], dtype=dtype, device=device)
    distributed.all_reduce(most, op="max", group=group)
    k = max(int(most.item()), 1)
    local_BK = torch.topk(torch.where(in_BV, probs_BV, torch.full_like(probs_BV, -1.0)), min(k, width)).values
    cands_BK = torch.sort(
        torch.cat(distributed.all_gather(local_BK, group=group), dim=-1), descending=True
    ).values
    cum_BK = hi_mass_B.unsqueeze(1) + torch.cumsum(cands_BK.clamp(min=0.0), dim=-1)
    j_B = (cum_BK < top_p).sum(dim=-1).clamp(max=cands_BK.shape[-1] - 1)
    t_B = cands_BK.gather(-1, j_B[:, None]).squeeze(1)
    return torch.where(t_B >= 0, t_B, lo_B).unsqueeze(1)


def vocab_parallel_sample_from(
    probs_BV: Tensor, uniforms_B: Tensor, shard: VocabShard, group: Any = None
) -> Tensor:
    """Inverse-CDF sampling over the group's slices in the probabilities' dtype (as `sample_from`: the first token
    whose cumulative probability exceeds the row's uniform times the total; past the end: the vocabulary's last
    real token)."""
    local_cdf_BV = torch.cumsum(probs_BV, dim=-1)
    # each slice's mass as its own cumulative sum ends, summed in rank order: slice r's last cdf value is then
    # bit for bit the next slice's offset, and the last slice's the total, so no target falls between slices
    ends = distributed.all_gather(local_cdf_BV[:, -1].contiguous(), group=group)  # [B] per rank, rank order
    rank = distributed.rank(group)
    offset_B = sum((ends[r] for r in range(rank)), torch.zeros_like(ends[0]))
    total_B = sum((ends[r] for r in range(len(ends))), torch.zeros_like(ends[0]))
    # kept below the total, as in `sample_from`: a uniform that rounds up to 1 (in float32 every u > 1 - 2**-25)
    # would land past the last kept token
    below_B = torch.nextafter(total_B, torch.zeros_like(total_B))
    target_B1 = torch.minimum(uniforms_B.to(probs_BV.device, probs_BV.dtype) * total_B, below_B).unsqueeze(1)
    cdf_BV = offset_B.unsqueeze(1) + local_cdf_BV
    local_B = torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(1)
    here_B = (target_B1.squeeze(1) >= offset_B) & (local_B < shard.valid)
    big = torch.iinfo(torch.int64).max
    pick_B = torch.where(here_B, local_B + shard.start, torch.full_like(local_B, big))
    distributed.all_reduce(pick_B, op="min", group=group)
    last = shard.start + shard.valid - 1 if shard.valid else -1
    last_B = torch.full_like(pick_B, last)
    distributed.all_reduce(last_B, op="max", group=group)
    return torch.where(pick_B == big, last_B, pick_B)


def vocab_parallel_filtered_sample(
    logits_BV: Tensor,
    uniforms_B: Tensor,
    shard: VocabShard,
    group: Any = None,
    *,
    vocab_size: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """`sample_from(filter_logits(full logits, ...), uniforms)` from this rank's slice (global token ids), in
    `dtype` (default: `sampling_dtype` of the logits' device)."""
    probs_BV = vocab_parallel_filter(
        logits_BV, shard, group, vocab_size=vocab_size, temperature=temperature, top_k=top_k, top_p=top_p,
        dtype=dtype,
    )  # fmt: skip
    return vocab_parallel_sample_from(probs_BV, uniforms_B, shard, group)


class VocabularyShards:
    """`TokenChoice` (`rlhfuse.generation.engine`) of a tensor-parallel instance: each rank holds a
    `shard_transformer` shard of the Actor whose logits are its vocabulary slice; greedy tokens by
    `vocab_parallel_argmax`, sampled ones by `vocab_parallel_filtered_sample`, their log-probs by
    `vocab_parallel_logprobs`, the same on every rank of `group`
    (so the instance's ranks step in lockstep). Sampling computes in `dtype`; None: `sampling_dtype` of the
    logits' device at each call (the shard may move after the choice is made), as the whole-vocabulary engine."""

    lockstep = True

    def __init__(self, shard: Transformer, group: Any, dtype: torch.dtype | None = None) -> None:
        self.vocab: VocabShard = shard.vocab_shard  # type: ignore[assignment]
        self.vocab_size = shard.config.vocab_size
        self.group = group
        self.dtype = dtype

    def greedy(self, logits_NV: Tensor) -> Tensor:
        return vocab_parallel_argmax(logits_NV, self.vocab, self.group)

    def sample(self, logits_NV: Tensor, uniforms_N: Tensor, params: SamplingParams) -> Tensor:
        return vocab_parallel_filtered_sample(
            logits_NV, uniforms_N, self.vocab, self.group, vocab_size=self.vocab_size,
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, dtype=self.dtype,
        )  # fmt: skip

    def logprobs(self, logits_NV: Tensor, tokens_N: Tensor, temperature: float) -> Tensor:
        return vocab_parallel_logprobs(logits_NV.float(), tokens_N, self.vocab, self.group, temperature)
