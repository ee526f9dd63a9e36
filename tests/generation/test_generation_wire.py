"""The wire messages round-trip through the one tensor codec: every integer, token, dtype and shape."""

import pytest
import torch

from rlhfuse.core.wire import Packed, pack_tensors, unpack_tensors
from rlhfuse.generation.engine import MigratingSample, SampleRequest
from rlhfuse.generation.messages import InferredBatch, InferredSample, SampleBatch
from rlhfuse.models import SlotState


def _request(row: int, tokens: list[int]) -> SampleRequest:
    return SampleRequest(
        row, 10 + row, row % 2, row // 2, torch.arange(3 + row), 1234567 + row, tokens, row == 1
    )


def test_codec_keeps_dtypes_shapes_and_values() -> None:
    tensors = [torch.arange(5), torch.randn(2, 3).bfloat16(), torch.tensor([True, False]), torch.empty(0, 4)]
    packed = pack_tensors([7, -1], tensors)
    assert packed.header_H.dtype == torch.int64 and packed.payload_N.dtype == torch.uint8
    ints, out = unpack_tensors(Packed(packed.header_H.clone(), packed.payload_N.clone()))
    assert ints == [7, -1]
    for a, b in zip(tensors, out, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    with pytest.raises(ValueError, match="malformed"):
        unpack_tensors(Packed(packed.header_H, packed.payload_N[:-8]))


def test_sample_batch_round_trip_with_and_without_kv() -> None:
    kv = SlotState(
        torch.randn(2, 1, 6, 4).bfloat16(), torch.randn(2, 1, 6, 4).bfloat16(), torch.rand(6) > 0.3
    )
    samples = [MigratingSample(_request(0, [5, 6, 7]), kv), MigratingSample(_request(1, []), None)]
    (a, b) = SampleBatch.unpack(SampleBatch(samples).pack()).samples
    for got, want in ((a, samples[0]), (b, samples[1])):
        for name in ("row", "prompt_index", "sample_index", "group", "seed", "tokens", "stopped"):
            assert getattr(got.request, name) == getattr(want.request, name)
        assert torch.equal(got.request.prompt_P, want.request.prompt_P)
    assert b.kv is None and a.kv is not None
    assert torch.equal(a.kv.k_LHTD, kv.k_LHTD) and torch.equal(a.kv.v_LHTD, kv.v_LHTD)
    assert torch.equal(a.kv.valid_T, kv.valid_T)
    assert SampleBatch.unpack(SampleBatch([]).pack()).samples == []


def test_inferred_batch_round_trip() -> None:
    rows = [
        InferredSample(
            _request(r, list(range(n))),
            torch.randn(n),
            torch.randn(n),
            torch.randn(n),
            0.5 * r,
            (r, 0.25 * r),
        )
        for r, n in ((0, 3), (1, 0), (2, 5))
    ]
    got = InferredBatch.unpack(InferredBatch(rows).pack()).rows
    for g, w in zip(got, rows, strict=True):
        assert g.request.row == w.request.row and g.request.tokens == w.request.tokens and g.score == w.score
        assert g.rule_scores == w.rule_scores  # each reward function's own score travels with the sample
        for name in ("logprobs_N", "ref_logprobs_N", "values_N"):
            assert torch.equal(getattr(g, name), getattr(w, name))
    assert InferredBatch.unpack(InferredBatch([]).pack()).rows == []
