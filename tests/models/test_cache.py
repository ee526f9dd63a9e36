"""KVCache slot operations: prefix sharing, export/import (migration), reset, truncate (speculation), overflow.

Legend: B batch rows, T tokens, V vocabulary, S cache slots.
"""

from __future__ import annotations

import pytest
import torch

from rlhfuse.models import KVCache, ModelConfig, SlotState, Transformer

PROMPT = torch.tensor([[5, 17, 99, 3, 42]])
CONTINUATION = [7, 8, 9]


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.tiny()).eval()


def decode(model: Transformer, cache: KVCache, slot: int, tokens: list[int]) -> torch.Tensor:
    """Feed `tokens` one at a time into `slot`; the stacked last-position logits [len(tokens), V]."""
    out = []
    with torch.no_grad():
        for tok in tokens:
            out.append(model(torch.tensor([[tok]]), cache=cache, cache_slots_B=torch.tensor([slot]))[0, -1])
    return torch.stack(out)


def prefilled(model: Transformer, slot: int = 0, num_slots: int = 4) -> KVCache:
    cache = KVCache.allocate(model.config, num_slots=num_slots, max_len=12)
    with torch.no_grad():
        model(PROMPT, cache=cache, cache_slots_B=torch.tensor([slot]))
    return cache


def test_copy_slot_gives_identical_continuation(model):
    cache = prefilled(model, slot=0)
    reference_TV = decode(model, cache, 0, CONTINUATION)
    cache = prefilled(model, slot=0)
    cache.copy_slot(0, [1, 3])
    assert cache.lengths_S.tolist() == [5, 5, 0, 5]
    torch.testing.assert_close(decode(model, cache, 3, CONTINUATION), reference_TV, atol=0, rtol=0)
    torch.testing.assert_close(decode(model, cache, 1, CONTINUATION), reference_TV, atol=0, rtol=0)
    # the copies are independent: slot 0 still continues from the bare prompt
    torch.testing.assert_close(decode(model, cache, 0, CONTINUATION), reference_TV, atol=0, rtol=0)


def test_copied_samples_decode_together_in_one_batch(model):
    """n samples of one prompt: prefill once, copy, then decode all copies in one batched step."""
    cache = prefilled(model, slot=2)
    cache.copy_slot(2, [0, 1])
    slots_B = torch.tensor([0, 1, 2])
    with torch.no_grad():
        logits_BTV = model(torch.tensor([[7], [8], [9]]), cache=cache, cache_slots_B=slots_B)
        full_7 = model(torch.cat([PROMPT, torch.tensor([[7]])], dim=1))[0, -1]
        full_9 = model(torch.cat([PROMPT, torch.tensor([[9]])], dim=1))[0, -1]
    torch.testing.assert_close(logits_BTV[0, -1], full_7, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits_BTV[2, -1], full_9, atol=1e-5, rtol=0)


def test_export_import_into_another_cache_continues_identically(model):
    source = prefilled(model, slot=1)
    state = source.export_slot(1)
    assert isinstance(state, SlotState) and state.length == 5
    assert state.k_LHTD.shape == (2, 2, 5, 16)
    reference_TV = decode(model, source, 1, CONTINUATION)
    destination = KVCache.allocate(model.config, num_slots=2, max_len=8)
    destination.import_slot(0, state)
    torch.testing.assert_close(decode(model, destination, 0, CONTINUATION), reference_TV, atol=0, rtol=0)


def test_padding_in_cache_is_stored_but_never_attended(model):
    """A left-padded prefill and an unpadded one continue identically (positions count valid tokens only)."""
    padded = KVCache.allocate(model.config, num_slots=1, max_len=12)
    with torch.no_grad():
        model(
            torch.cat([torch.zeros(1, 3, dtype=torch.long), PROMPT], dim=1),
            attention_mask_BT=torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]]),
            cache=padded,
        )
    assert padded.lengths_S.tolist() == [8] and padded.valid_ST[0, :8].tolist() == [False] * 3 + [True] * 5
    plain = prefilled(model, slot=0, num_slots=1)
    torch.testing.assert_close(decode(model, padded, 0, CONTINUATION), decode(model, plain, 0, CONTINUATION))


def test_reset_empties_slots(model):
    cache = prefilled(model, slot=0)
    reference_TV = decode(model, prefilled(model, slot=0), 0, CONTINUATION)
    cache.reset([0])
    assert cache.lengths_S[0] == 0 and not cache.valid_ST[0].any()
    with torch.no_grad():
        model(PROMPT, cache=cache, cache_slots_B=torch.tensor([0]))
    torch.testing.assert_close(decode(model, cache, 0, CONTINUATION), reference_TV, atol=0, rtol=0)


def test_truncate_drops_rejected_positions_and_decoding_continues_as_if_never_written(model):
    reference_TV = decode(model, prefilled(model, slot=1), 1, CONTINUATION)
    cache = prefilled(model, slot=1)
    with torch.no_grad():  # a verify step of 4 positions of which only the first is kept
        model(torch.tensor([[CONTINUATION[0], 30, 31, 32]]), cache=cache, cache_slots_B=torch.tensor([1]))
    cache.truncate(torch.tensor([1]), torch.tensor([6]))
    assert cache.lengths_S[1] == 6 and cache.valid_ST[1].sum() == 6
    torch.testing.assert_close(
        decode(model, cache, 1, CONTINUATION[1:]), reference_TV[1:], atol=1e-6, rtol=1e-5
    )
    with pytest.raises(ValueError, match="truncate only shortens"):
        cache.truncate(torch.tensor([1]), torch.tensor([11]))


def test_overflow_names_slot_length_and_max_len(model):
    cache = prefilled(model, slot=2)  # max_len 12, length 5
    with pytest.raises(ValueError, match=r"slot 2 \(length 5\).*max_len=12"), torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long), cache=cache, cache_slots_B=torch.tensor([2]))
    assert cache.lengths_S[2] == 5, "a refused call must leave the cache unchanged"


def test_import_rejects_foreign_shapes_and_long_states(model):
    state = prefilled(model, slot=0).export_slot(0)
    other = KVCache.allocate(ModelConfig.tiny(num_kv_heads=4), num_slots=1, max_len=12)
    with pytest.raises(ValueError, match=r"state.k_LHTD has shape \(2, 2, 5, 16\)"):
        other.import_slot(0, state)
    short = KVCache.allocate(model.config, num_slots=1, max_len=4)
    with pytest.raises(ValueError, match="holds 5 positions but max_len=4"):
        short.import_slot(0, state)


def test_repeated_slots_are_refused(model):
    cache = KVCache.allocate(model.config, num_slots=2, max_len=4)
    with pytest.raises(ValueError, match="repeated slots"), torch.no_grad():
        model(torch.zeros(2, 1, dtype=torch.long), cache=cache, cache_slots_B=torch.tensor([1, 1]))


def test_cache_works_under_inference_mode_and_refuses_autograd(model):
    reference_TV = decode(model, prefilled(model, slot=0), 0, CONTINUATION)
    cache = KVCache.allocate(model.config, num_slots=1, max_len=12)
    with torch.inference_mode():
        model(PROMPT, cache=cache)
        got_TV = torch.stack([model(torch.tensor([[t]]), cache=cache)[0, -1] for t in CONTINUATION])
    torch.testing.assert_close(got_TV, reference_TV, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match=r"torch\.no_grad\(\)"):
        model(PROMPT, cache=KVCache.allocate(model.config, num_slots=1, max_len=12))
