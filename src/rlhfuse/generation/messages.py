"""The messages generation instances exchange, each one dataclass with `pack()` / `unpack()` over the one
tensor codec of `rlhfuse.core.wire` (no pickling, no `all_gather_object`):

- `SampleBatch`: migrating samples (request + tokens so far, and the slot's KV cache for a KV transfer); also a
  finished tail sample streamed to a freed instance (one sample, no KV), the end of that stream (no sample) and
  the finished samples all-gathered after generation;
- `InferredBatch`: finished samples with what inference computed for them (`InferredSample`, a typed record
  instead of positional rows), all-gathered so every rank assembles the same `Experience`.

Per sample the header carries its `SampleRequest` integers (row, prompt_index, sample_index, group, seed,
prompt length, token count, stopped, KV length or -1, sampler log-prob count); the payload the prompt + token
ids of every sample (int64, concatenated), their sampler log-probs (float64, concatenated), then per message
type its tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhfuse.core.wire import Packed, pack_tensors, unpack_tensors
from rlhfuse.generation.engine import MigratingSample, SampleRequest
from rlhfuse.models import SlotState

# per sample: row, prompt_index, sample_index, group, seed, prompt len, tokens, stopped, kv length, log-probs
_INTS = 10


def _request_ints(r: SampleRequest, kv: SlotState | None = None) -> list[int]:
    kv_len = kv.length if kv is not None else -1
    return [r.row, r.prompt_index, r.sample_index, r.group, r.seed, r.prompt_len, len(r.tokens), int(r.stopped),
            kv_len, len(r.logprobs)]  # fmt: skip


def _ids(requests: Sequence[SampleRequest]) -> list[Tensor]:
    """Prompt + tokens of every request, concatenated (int64, on the CPU where requests keep them), and their
    sampler log-probs (float64: a host float exactly)."""
    parts = [t for r in requests for t in (r.prompt_P.cpu(), torch.tensor(r.tokens, dtype=torch.int64))]
    ids = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    return [ids, torch.tensor([x for r in requests for x in r.logprobs], dtype=torch.float64)]


def _requests(ints: Sequence[int], ids: Tensor, logprobs: Tensor) -> tuple[list[SampleRequest], list[int]]:
    """The requests of a message (prompts on the CPU) and each one's KV length (-1 = no KV)."""
    count = ints[0]
    ids, logprobs_host = ids.cpu(), logprobs.tolist()
    out, kv_lengths, offset, at = [], [], 0, 0
    for k in range(count):
        row, prompt_index, sample_index, group, seed, p, n, stopped, kv_len, m = ints[
            1 + _INTS * k : 1 + _INTS * (k + 1)
        ]
        out.append(SampleRequest(row, prompt_index, sample_index, group, ids[offset : offset + p].clone(), seed,
                                 ids[offset + p : offset + p + n].tolist(), bool(stopped),
                                 logprobs_host[at : at + m]))  # fmt: skip
        kv_lengths.append(kv_len)
        offset += p + n
        at += m
    return out, kv_lengths


@dataclass
class SampleBatch:
    """Samples moving between instances. Payload: ids, log-probs, then k_LHTD, v_LHTD, valid_T of each sample
    with KV."""

    samples: list[MigratingSample]

    def pack(self, device: torch.device | str | None = None) -> Packed:
        ints = [len(self.samples)]
        kv: list[Tensor] = []
        for s in self.samples:
            ints += _request_ints(s.request, s.kv)
            if s.kv is not None:
                kv += [s.kv.k_LHTD, s.kv.v_LHTD, s.kv.valid_T]
        return pack_tensors(ints, [*_ids([s.request for s in self.samples]), *kv], device=device)

    @staticmethod
    def unpack(packed: Packed) -> SampleBatch:
        ints, (ids, logprobs, *kv) = unpack_tensors(packed)
        requests, kv_lengths = _requests(ints, ids, logprobs)
        samples, k = [], 0
        for request, kv_len in zip(requests, kv_lengths, strict=True):
            state = None
            if kv_len >= 0:
                state = SlotState(kv[k], kv[k + 1], kv[k + 2])
                k += 3
            samples.append(MigratingSample(request, state))
        return SampleBatch(samples)

    @property
    def requests(self) -> list[SampleRequest]:
        return [s.request for s in self.samples]

    @staticmethod
    def of(requests: Sequence[SampleRequest]) -> SampleBatch:
        """Finished (or not started) samples: requests only, no KV."""
        return SampleBatch([MigratingSample(r, None) for r in requests])


@dataclass
class InferredSample:
    """One finished sample and its inference results over its n generated tokens: logprobs_N / ref_logprobs_N
    (Actor / Ref log-probs), values_N (Critic values), float32 [n]; score: the sequence-level reward;
    rule_scores: each rule-based reward function's own score (`Experience.rule_scores_BK`'s row)."""

    request: SampleRequest
    logprobs_N: Tensor
    ref_logprobs_N: Tensor
    values_N: Tensor
    score: float
    rule_scores: tuple[float, ...] = ()


@dataclass
class InferredBatch:
    """Inference results of several samples. Payload: ids and sampler log-probs, then the log-probs, Ref
    log-probs and values of every sample (each concatenated), then the scores (float64 [B]) and the rule scores
    (float64 [B, K])."""

    rows: list[InferredSample]

    def pack(self, device: torch.device | str | None = None) -> Packed:
        ints = [len(self.rows)]
        for r in self.rows:
            ints += _request_ints(r.request)

        def cat(name: str) -> Tensor:
            parts = [getattr(r, name).reshape(-1) for r in self.rows]
            return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)

        scores = torch.tensor([r.score for r in self.rows], dtype=torch.float64)
        width = len(self.rows[0].rule_scores) if self.rows else 0
        rules = torch.tensor([r.rule_scores for r in self.rows], dtype=torch.float64).reshape(
            len(self.rows), width
        )
        tensors = [
            *_ids([r.request for r in self.rows]),
            cat("logprobs_N"),
            cat("ref_logprobs_N"),
            cat("values_N"),
        ]
        return pack_tensors(ints, [*tensors, scores, rules], device=device)

    @staticmethod
    def unpack(packed: Packed) -> InferredBatch:
        ints, (ids, sampled, logprobs, ref_logprobs, values, scores, rules) = unpack_tensors(packed)
        requests, _ = _requests(ints, ids, sampled)
        sizes = [len(r.tokens) for r in requests]
        return InferredBatch(
            [
                InferredSample(r, lp.cpu(), ref.cpu(), v.cpu(), score, tuple(rule))
                for r, lp, ref, v, score, rule in zip(
                    requests, logprobs.split(sizes), ref_logprobs.split(sizes), values.split(sizes),
                    scores.tolist(), rules.tolist(), strict=True,
                )
            ]
        )  # fmt: skip
