"""Property: any chunking of sequences into cached calls, with padding inside any call, over blocks of any size
(from a pool of one block that grows), gives the logits of one uncached forward over each full sequence.

Legend: B batch rows, T tokens, V vocabulary.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfuse.models import KVCache, ModelConfig, Transformer

torch.manual_seed(0)
MODEL = Transformer(ModelConfig.tiny(architecture="qwen2")).eval()
NUM_SLOTS = 4


@st.composite
def chunked_batches(draw):
    num_rows = draw(st.integers(1, 3))
    num_calls = draw(st.integers(1, 3))
    # chunk_lengths[c][b]: real tokens row b appends in call c (0 = the row is all padding in that call)
    chunk_lengths = [[draw(st.integers(0, 4)) for _ in range(num_rows)] for _ in range(num_calls)]
    for b in range(num_rows):
        if sum(c[b] for c in chunk_lengths) == 0:
            chunk_lengths[0][b] = 1
    slots = draw(st.permutations(range(NUM_SLOTS)))[:num_rows]
    side = draw(st.sampled_from(["left", "right"]))
    block_size = draw(st.sampled_from([1, 2, 3, 16]))  # positions spanning blocks, and one block per slot
    return chunk_lengths, slots, side, block_size


@settings(max_examples=25, deadline=None)
@given(chunked_batches())
def test_chunked_cached_calls_equal_full_forward(case):
    chunk_lengths, slots, side, block_size = case
    num_rows = len(slots)
    gen = torch.Generator().manual_seed(sum(map(sum, chunk_lengths)))
    cache = KVCache.allocate(
        MODEL.config, num_slots=NUM_SLOTS, max_len=4 * len(chunk_lengths), block_size=block_size, num_blocks=1
    )
    sequences: list[list[int]] = [[] for _ in range(num_rows)]
    got: list[list[torch.Tensor]] = [[] for _ in range(num_rows)]
    with torch.no_grad():
        for lengths in chunk_lengths:
            width = max(max(lengths), 1)
            ids_BT = torch.zeros(num_rows, width, dtype=torch.long)
            mask_BT = torch.zeros(num_rows, width, dtype=torch.long)
            for b, n in enumerate(lengths):
                tokens = torch.randint(1, 128, (n,), generator=gen)
                cols = slice(width - n, width) if side == "left" else slice(0, n)
                ids_BT[b, cols], mask_BT[b, cols] = tokens, 1
                sequences[b].extend(tokens.tolist())
            logits_BTV = MODEL(
                ids_BT, attention_mask_BT=mask_BT, cache=cache, cache_slots_B=torch.tensor(slots)
            )
            for b in range(num_rows):
                got[b].extend(logits_BTV[b][mask_BT[b].bool()])
        for b, seq in enumerate(sequences):
            expected_TV = MODEL(torch.tensor([seq]))[0]
            torch.testing.assert_close(torch.stack(got[b]), expected_TV, atol=1e-5, rtol=0)
