"""The block cache: blocks taken as positions arrive, prefix sharing by shared blocks with copy-on-write, blocks
returned by reset / truncate, the pool growing with its contents kept, export / import across block sizes.

Legend: B batch rows, T tokens, V vocabulary.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rlhfuse.models import KVCache, ModelConfig, Transformer

PROMPT = torch.tensor(
    [[5, 17, 99, 3, 42, 8, 11]]
)  # 7 positions: blocks of 3 hold them in 3 (the last part-full)
CONTINUATION = [7, 8, 9, 10]


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.tiny()).double().eval()


def _cache(model: Transformer, block_size: int = 3, num_slots: int = 4, **kw: int) -> KVCache:
    return KVCache.allocate(
        model.config, num_slots=num_slots, max_len=16, block_size=block_size, dtype=torch.float64, **kw
    )


@torch.no_grad()
def _decode(model: Transformer, cache: KVCache, slot: int, tokens: list[int]) -> torch.Tensor:
    return torch.stack([model(torch.tensor([[t]]), cache=cache, cache_slots_B=[slot])[0, -1] for t in tokens])


@torch.no_grad()
def _full(tokens: list[int], model: Transformer) -> torch.Tensor:
    """Last-position logits of each prefix PROMPT + tokens[:i+1], uncached."""
    seq = torch.cat([PROMPT, torch.tensor([tokens])], dim=1)
    return model(seq)[0, PROMPT.shape[1] :]


def test_blocks_are_taken_as_positions_arrive(model):
    cache = _cache(model, num_blocks=1)
    assert cache.blocks_in_use == 0 and cache.num_blocks == 1
    with torch.no_grad():
        model(PROMPT, cache=cache, cache_slots_B=[2])
    assert cache.tables[2] and len(cache.tables[2]) == 3 and cache.blocks_in_use == 3
    _decode(model, cache, 2, CONTINUATION[:2])  # 9 positions: still 3 blocks
    assert len(cache.tables[2]) == 3
    _decode(model, cache, 2, CONTINUATION[2:3])  # the 10th starts a 4th
    assert len(cache.tables[2]) == 4 and cache.peak_blocks == 4
    assert cache.nbytes_in_use() == 4 * 3 * 2 * 2 * 2 * 16 * 8  # blocks x positions x k,v x L x H x D x fp64
    assert cache.num_blocks >= 4, "the pool grew from one block"


def test_shared_prefix_costs_its_blocks_once_and_samples_diverge_exactly(model):
    cache = _cache(model)
    with torch.no_grad():
        model(PROMPT, cache=cache, cache_slots_B=[0])
    cache.copy_slot(0, [1, 2, 3])
    assert cache.blocks_in_use == 3, "four samples of one prompt hold its three blocks once"
    assert all(cache.tables[s] == cache.tables[0] for s in (1, 2, 3))
    # every sample writes into the shared, part-full last block: each gets its own copy of that block only
    outs = {s: _decode(model, cache, s, [CONTINUATION[s]]) for s in (0, 1, 2, 3)}
    assert cache.blocks_in_use == 3 - 1 + 4
    assert (
        len({cache.tables[s][2] for s in range(4)}) == 4 and len({cache.tables[s][0] for s in range(4)}) == 1
    )
    for s, got in outs.items():
        torch.testing.assert_close(got, _full([CONTINUATION[s]], model), atol=1e-10, rtol=0)
    # and they continue independently, each from its own tokens
    for s in (0, 3):
        torch.testing.assert_close(
            _decode(model, cache, s, CONTINUATION[:2]), _full([CONTINUATION[s], *CONTINUATION[:2]], model)[1:],
            atol=1e-10, rtol=0,
        )  # fmt: skip


def test_reset_and_truncate_return_blocks_and_shared_ones_outlive_one_holder(model):
    cache = _cache(model)
    with torch.no_grad():
        model(PROMPT, cache=cache, cache_slots_B=[0])
    cache.copy_slot(0, 1)
    cache.reset(0)
    assert cache.blocks_in_use == 3 and cache.lengths == [0, 7, 0, 0], (
        "slot 1 still holds the prompt's blocks"
    )
    torch.testing.assert_close(
        _decode(model, cache, 1, CONTINUATION), _full(CONTINUATION, model), atol=1e-10, rtol=0
    )
    assert cache.lengths[1] == 11 and len(cache.tables[1]) == 4
    cache.truncate([1], [6])  # back to 6 positions: 2 blocks
    assert len(cache.tables[1]) == 2 and cache.blocks_in_use == 2
    # decoding again from position 6 rewrites what was cut
    _decode(model, cache, 1, [int(PROMPT[0, 6])])
    torch.testing.assert_close(
        _decode(model, cache, 1, CONTINUATION), _full(CONTINUATION, model), atol=1e-10, rtol=0
    )
    cache.reset([1])
    assert cache.blocks_in_use == 0 and sorted(cache.free) == list(range(cache.num_blocks))


def test_truncate_into_a_shared_block_copies_it_on_the_next_write(model):
    cache = _cache(model)
    with torch.no_grad():
        model(PROMPT, cache=cache, cache_slots_B=[0])
    cache.copy_slot(0, 1)
    cache.truncate([1], [4])  # slot 1 ends inside the shared second block
    got = _decode(model, cache, 1, [77])  # position 4 of slot 1 goes into a copy of block 1
    with torch.no_grad():
        expected = model(torch.cat([PROMPT[:, :4], torch.tensor([[77]])], dim=1))[0, -1]
    torch.testing.assert_close(got[0], expected, atol=1e-10, rtol=0)
    # slot 0's prompt is untouched
    torch.testing.assert_close(
        _decode(model, cache, 0, CONTINUATION), _full(CONTINUATION, model), atol=1e-10, rtol=0
    )


@pytest.mark.parametrize(("src_block", "dst_block"), [(3, 5), (16, 1), (2, 16)])
def test_export_import_across_block_sizes(model, src_block, dst_block):
    source = _cache(model, block_size=src_block)
    with torch.no_grad():
        model(PROMPT, cache=source, cache_slots_B=[1])
    state = source.export_slot(1)
    assert state.k_LHTD.shape == (2, 2, 7, 16)
    destination = _cache(model, block_size=dst_block, num_slots=2, num_blocks=1)
    destination.import_slot(0, state)
    assert len(destination.tables[0]) == -(-7 // dst_block)
    torch.testing.assert_close(
        _decode(model, destination, 0, CONTINUATION), _full(CONTINUATION, model), atol=1e-10, rtol=0
    )


def test_pool_never_grows_past_every_slot_full(model):
    cache = _cache(model, block_size=4, num_slots=2, num_blocks=1)
    with torch.no_grad():
        model(torch.ones(2, 16, dtype=torch.long), cache=cache, cache_slots_B=[0, 1])
    assert cache.num_blocks == cache.max_blocks == 8 and cache.blocks_in_use == 8
    assert cache.nbytes() == 2 * cache.nbytes_per_slot()


class _LiveBytes(TorchDispatchMode):
    """Bytes of live storages while active: `alive` (tensors already there) and every new storage an op makes,
    each counted until its tensor is freed; `peak` is the most at any time."""

    def __init__(self, alive: list[torch.Tensor]) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()
        for tensor in alive:
            self._track(tensor)

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self._seen or storage.nbytes() == 0:
            return  # a view or an in-place result: counted with its storage
        self._seen.add(storage.data_ptr())
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._free, storage.data_ptr(), storage.nbytes())

    def _free(self, ptr: int, nbytes: int) -> None:
        self._seen.discard(ptr)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor)
        return out


def _tensors_of(cache: KVCache) -> list[torch.Tensor]:
    """The tensors a cache holds, as attributes or in lists (no reference to them kept beyond the list)."""
    values = [t for v in vars(cache).values() for t in (v if isinstance(v, list) else [v])]
    return [t for t in values if isinstance(t, torch.Tensor)]


def test_the_pool_grows_a_layer_at_a_time_beside_one_old_layer():
    """Growing the pool copies one layer's blocks at a time, the old tensor freed before the next copy: at any
    time the pool holds at most one old layer beside its grown size (growing one [L, N, ...] tensor by a copy
    held the old and the new whole: 1.5x the grown k and v)."""
    config = ModelConfig.tiny(num_layers=8)
    cache = KVCache.allocate(config, num_slots=4, max_len=64, block_size=4, num_blocks=8)
    with _LiveBytes(_tensors_of(cache)) as live:
        cache.begin([0, 1, 2, 3], 64)  # 64 blocks from 8: grown 11 times
    assert cache.num_blocks == 64
    one_layer = cache.nbytes() // (2 * config.num_layers)  # one layer's k (or v) pool at its grown size
    addressing = 4096  # the slots' validity, the block table and the call's uploads: a few hundred bytes
    assert live.peak <= cache.nbytes() + one_layer + addressing, live.peak / cache.nbytes()  # was 1.5x
    assert live.live <= cache.nbytes() + addressing  # the old pools are gone


def test_cached_calls_address_the_cache_without_reading_the_device(model):
    """Prefill and decode calls with host slots make no sync (CPU standing in for the device), copy-on-write
    and pool growth included; slots given as a tensor are read once."""
    from rlhfuse.core.syncs import SyncCounter

    cache = _cache(model, num_blocks=1)
    with torch.no_grad(), SyncCounter(device="cpu") as counter:
        model(PROMPT.expand(2, -1), cache=cache, cache_slots_B=[0, 2])
        cache.copy_slot(0, [1, 3])
        for token in CONTINUATION:
            model(torch.full((4, 1), token), cache=cache, cache_slots_B=[0, 1, 2, 3])
        cache.truncate([1, 2], [8, 9])
        cache.reset([0, 3])
    assert counter.count == 0, dict(counter.by_kind)
    with torch.no_grad(), SyncCounter(device="cpu") as counter:
        model(torch.tensor([[5]]), cache=cache, cache_slots_B=torch.tensor([1]))
    assert counter.by_kind == {"tolist": 1}
