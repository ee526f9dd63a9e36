"""`KVCache`: a block (paged) key/value cache owned by the generation engine, addressed by slot.

Legend: L layers, S cache slots, N blocks, K positions per block (block_size), H kv heads, D head channels,
T positions, M blocks of one slot, B batch rows.

A slot holds one sequence. Position t of slot s is *valid* when it holds a real token (attention may use it)
and invalid when it holds padding (stored, so that slot positions stay aligned with the batch, but never
attended to). `lengths[s]` counts stored positions (valid or not); new tokens go after them.

Storage is a pool of fixed-size blocks per layer, `k_layers[l]` / `v_layers[l]` of k_NKHD / v_NKHD (flash-attn's
paged layout: one cache tensor per layer), handed out as positions arrive: slot s's position t lives in block
`tables[s][t // K]` at offset t % K of every layer, so a slot holds ceil(length / K) blocks, not max_len
positions. Blocks are reference-counted: `copy_slot` (prefix sharing: the n samples of one prompt) shares the
prompt's blocks instead of copying them, and the first write into a shared block copies that block alone
(copy-on-write). The pool starts with `num_blocks` and grows by a quarter when it runs out, never past
num_slots x ceil(max_len / K) blocks (every slot full), so a call never fails for want of blocks. It grows one
layer's tensor at a time, each old one freed before the next is copied: the copy holds one layer's old pool
beside the grown cache (1 + 1 / (2.5 L) of it), where growing one [L, N, ...] tensor by a copy held the old and
the new whole (2.25x the old per tensor). `peak_nbytes_in_use` is the most the blocks ever held, `nbytes()`
what the pool has allocated.

The bookkeeping (lengths, block tables, reference counts, overflow checks) is kept on the host as Python ints,
in step with the device buffers, so that addressing a cached call never waits for the device: a call's slots,
lengths and new table entries are uploaded without a sync (`CacheCall`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhfuse.models.model_config import ModelConfig


@dataclass
class SlotState:
    """One slot's cache, trimmed to its length: what migration sends between instances.

    k_LHTD / v_LHTD: [num_layers, num_kv_heads, length, head_dim]; valid_T: [length] bool.
    """

    k_LHTD: Tensor
    v_LHTD: Tensor
    valid_T: Tensor

    @property
    def length(self) -> int:
        return int(self.valid_T.shape[0])

    def to(self, device: torch.device | str) -> SlotState:
        return SlotState(self.k_LHTD.to(device), self.v_LHTD.to(device), self.valid_T.to(device))


@dataclass(frozen=True)
class CacheCall:
    """How one cached forward call addresses the cache, made on the host by `KVCache.begin`.

    slots: the rows' slots; lengths: their stored positions before the call; num_tokens: T new positions per
    row; num_keys: positions read back (max over rows of length + T); on the device: slots_B, write_pos_BT
    (lengths[b] + t), write_block_BT / write_offset_BT (where position write_pos_BT[b, t] is stored) and
    read_blocks_BM (each row's first ceil(num_keys / K) table entries: past a row's own blocks they are stale,
    but those positions are in the row's future and masked)."""

    slots: tuple[int, ...]
    lengths: tuple[int, ...]
    num_tokens: int
    num_keys: int
    slots_B: Tensor
    write_pos_BT: Tensor
    write_block_BT: Tensor
    write_offset_BT: Tensor
    read_blocks_BM: Tensor


def _host_ints(values: int | Sequence[int] | Tensor) -> list[int]:
    """Slots or lengths as Python ints (a tensor is read once: callers that decode pass lists)."""
    if isinstance(values, Tensor):
        return [int(v) for v in values.reshape(-1).tolist()]
    if isinstance(values, int):
        return [values]
    return [int(v) for v in values]


def upload(values: Tensor | Sequence[int] | Sequence[Sequence[int]], device: torch.device) -> Tensor:
    """Host values (a CPU tensor, or ints as int64) on `device` without a sync: on CUDA through pinned memory
    with non_blocking=True (a pageable copy would make torch synchronise the stream)."""
    host = values if isinstance(values, Tensor) else torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda" and host.device.type == "cpu":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _blocks_for(length: int, block_size: int) -> int:
    return -(-length // block_size)


def _grown(pool_NKHD: Tensor, blocks: int) -> Tensor:
    """A copy of one layer's pool with `blocks` blocks, the new ones zeros (written in place: no temporary)."""
    out_NKHD = torch.empty((blocks, *pool_NKHD.shape[1:]), dtype=pool_NKHD.dtype, device=pool_NKHD.device)
    old = pool_NKHD.shape[0]
    out_NKHD[:old].copy_(pool_NKHD)
    out_NKHD[old:].zero_()
    return out_NKHD


DEFAULT_BLOCK_SIZE = 16
"""Positions per block (vLLM's default): a slot wastes less than one block; tables stay short."""


class KVCache:
    """Key/value blocks for `num_slots` sequences of up to `max_len` positions each (see the module docstring)."""

    def __init__(
        self,
        k_layers: list[Tensor],
        v_layers: list[Tensor],
        valid_ST: Tensor,
        *,
        num_slots: int,
        max_len: int,
    ) -> None:
        self.k_layers = k_layers
        """Each layer's key blocks, k_NKHD (one tensor per layer: the pool grows a layer at a time)."""
        self.v_layers = v_layers
        """Each layer's value blocks, v_NKHD."""
        self.valid_ST = valid_ST
        self._num_slots, self._max_len = num_slots, max_len
        first_NKHD = k_layers[0]
        self.block_size = int(first_NKHD.shape[1])
        self.max_blocks = num_slots * _blocks_for(max_len, self.block_size)
        """The most blocks the pool can need: every slot at max_len."""
        self.lengths: list[int] = [0] * num_slots
        """Stored positions per slot, on the host."""
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]
        """Each slot's blocks in position order (host); `block_table_SM` is the device copy."""
        self.block_table_SM = torch.zeros(
            num_slots, _blocks_for(max_len, self.block_size), dtype=torch.int64, device=first_NKHD.device
        )
        self.refs: list[int] = [0] * int(first_NKHD.shape[0])
        """Slots holding each block (0 = free)."""
        self.free: list[int] = list(range(int(first_NKHD.shape[0]) - 1, -1, -1))  # a stack: lowest id on top
        self.peak_blocks = 0
        """The most blocks in use at any time since allocation."""

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_slots: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
    ) -> KVCache:
        """An empty cache; `num_blocks`: the pool's first size (default one block per slot; it grows on demand
        up to every slot full)."""
        if num_slots <= 0 or max_len <= 0:
            raise ValueError(f"KVCache needs num_slots > 0 and max_len > 0 (got {num_slots}, {max_len})")
        if block_size <= 0:
            raise ValueError(f"KVCache needs block_size > 0 (got {block_size})")
        blocks = num_slots if num_blocks is None else num_blocks
        blocks = max(1, min(blocks, num_slots * _blocks_for(max_len, block_size)))
        shape = (blocks, block_size, config.num_kv_heads, config.resolved_head_dim)
        return cls(
            k_layers=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)],
            v_layers=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)],
            valid_ST=torch.zeros(num_slots, max_len, dtype=torch.bool, device=device),
            num_slots=num_slots,
            max_len=max_len,
        )

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def max_len(self) -> int:
        return self._max_len

    @property
    def device(self) -> torch.device:
        return self.k_layers[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.k_layers[0].dtype

    @property
    def num_layers(self) -> int:
        return len(self.k_layers)

    @property
    def lengths_S(self) -> Tensor:
        """`lengths` as a CPU tensor (a host copy: changing it changes nothing)."""
        return torch.tensor(self.lengths, dtype=torch.int64)

    # ------------------------------------------------------------------ memory
    def _bytes_per_position(self) -> int:
        """Bytes of k + v of one position over every layer."""
        first_NKHD = self.k_layers[0]
        return 2 * self.num_layers * first_NKHD[0, 0].numel() * first_NKHD.element_size()

    def _bytes_per_block(self) -> int:
        return self._bytes_per_position() * self.block_size

    def nbytes_per_slot(self) -> int:
        """Bytes of k + v one slot holds at max_len (M_kv in the migration rule of the paper)."""
        return self._bytes_per_position() * self.max_len

    def nbytes(self) -> int:
        """Bytes of k + v the pool has allocated."""
        return self._bytes_per_block() * self.num_blocks

    @property
    def num_blocks(self) -> int:
        return int(self.k_layers[0].shape[0])

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - len(self.free)

    def nbytes_in_use(self) -> int:
        """Bytes of k + v in the blocks slots hold now (shared blocks once)."""
        return self._bytes_per_block() * self.blocks_in_use

    @property
    def peak_nbytes_in_use(self) -> int:
        return self._bytes_per_block() * self.peak_blocks

    # ------------------------------------------------------------------ blocks
    def _grow(self) -> None:
        """Grow the pool by a quarter (device copies only; the new blocks are zeros, so stale reads stay finite):
        what it allocates stays within 1.25x the most blocks ever in use, for log-many copies. One layer's
        tensor at a time, the old one dropped before the next is copied (the transient: one old layer)."""
        old = self.num_blocks
        new = min(old + max(old // 4, 1), self.max_blocks)
        if new <= old:
            raise RuntimeError(f"KVCache block pool exhausted at {old} blocks (max {self.max_blocks})")
        for pools in (self.k_layers, self.v_layers):
            for layer in range(len(pools)):
                pools[layer] = _grown(pools[layer], new)
        self.refs.extend([0] * (new - old))
        self.free[:0] = range(new - 1, old - 1, -1)  # below the freed blocks: reuse those first

    def _take(self) -> int:
        if not self.free:
            self._grow()
        block = self.free.pop()
        self.refs[block] = 1
        self.peak_blocks = max(self.peak_blocks, self.blocks_in_use)
        return block

    def _drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)

    def _release_from(self, slot: int, keep: int) -> None:
        """Let go of slot's blocks past the first `keep`."""
        table = self.tables[slot]
        for block in table[keep:]:
            self._drop(block)
        del table[keep:]

    def _set_table(self, entries: list[tuple[int, int, int]]) -> None:
        """(slot, index, block) entries into the device table, in one upload."""
        if entries:
            slot_j_block_3E = upload([list(col) for col in zip(*entries, strict=True)], self.device)
            self.block_table_SM[slot_j_block_3E[0], slot_j_block_3E[1]] = slot_j_block_3E[2]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"cache slot {slot} is out of range: the cache has {self.num_slots} slots")

    # ------------------------------------------------------------------ one forward call
    def begin(self, slots: int | Sequence[int] | Tensor, num_tokens: int) -> CacheCall:
        """Check and address a call appending `num_tokens` positions to each of `slots`: refused calls change
        nothing; blocks for the new positions are taken (shared ones copied first); `commit` records them."""
        slot_list = _host_ints(slots)
        if len(set(slot_list)) != len(slot_list):
            raise ValueError(f"cache_slots_B has repeated slots {slot_list}: each row needs its own slot")
        if slot_list and (min(slot_list) < 0 or max(slot_list) >= self.num_slots):
            raise IndexError(f"cache_slots_B {slot_list} out of range: the cache has {self.num_slots} slots")
        self.check_room(slot_list, num_tokens)
        lengths = [self.lengths[s] for s in slot_list]
        entries: list[tuple[int, int, int]] = []
        copies: list[tuple[int, int]] = []  # (shared block, its private copy)
        for slot, length in zip(slot_list, lengths, strict=True):
            table = self.tables[slot]
            for j in range(length // self.block_size, _blocks_for(length + num_tokens, self.block_size)):
                if j == len(table):
                    table.append(self._take())
                elif self.refs[table[j]] > 1:  # copy-on-write: the other holders keep the original
                    self.refs[table[j]] -= 1
                    copies.append((table[j], self._take()))
                    table[j] = copies[-1][1]
                else:
                    continue
                entries.append((slot, j, table[j]))
        if copies:
            src_dst_2C = upload([[a for a, _ in copies], [b for _, b in copies]], self.device)
            for pool_NKHD in (*self.k_layers, *self.v_layers):
                pool_NKHD[src_dst_2C[1]] = pool_NKHD[src_dst_2C[0]]
        self._set_table(entries)
        slots_lengths_2B = upload([slot_list, lengths], self.device)
        slots_B, lengths_B = slots_lengths_2B[0], slots_lengths_2B[1]
        write_pos_BT = lengths_B[:, None] + torch.arange(num_tokens, device=self.device)[None, :]
        num_keys = max(lengths, default=0) + num_tokens
        return CacheCall(
            slots=tuple(slot_list),
            lengths=tuple(lengths),
            num_tokens=num_tokens,
            num_keys=num_keys,
            slots_B=slots_B,
            write_pos_BT=write_pos_BT,
            write_block_BT=self.block_table_SM[slots_B[:, None], write_pos_BT // self.block_size],
            write_offset_BT=write_pos_BT % self.block_size,
            read_blocks_BM=self.block_table_SM[slots_B, : _blocks_for(num_keys, self.block_size)],
        )

    def store(self, layer: int, call: CacheCall, k_BTHD: Tensor, v_BTHD: Tensor) -> None:
        """Write one layer's keys/values of the call's new positions (into blocks no other slot holds)."""
        self.k_layers[layer][call.write_block_BT, call.write_offset_BT] = k_BTHD.to(self.dtype)
        self.v_layers[layer][call.write_block_BT, call.write_offset_BT] = v_BTHD.to(self.dtype)

    def keys_values(self, layer: int, call: CacheCall) -> tuple[Tensor, Tensor]:
        """One layer's keys and values of the call's slots, positions 0..num_keys-1: k_BHSD, v_BHSD (gathered
        from the rows' blocks)."""
        batch, blocks = call.read_blocks_BM.shape
        blocks_X = call.read_blocks_BM.reshape(-1)
        out = []
        for pool_NKHD in (self.k_layers[layer], self.v_layers[layer]):
            # index_select copies whole blocks (a few times faster than advanced indexing on the CPU); the same
            # contiguous [B, M, K, H, D] copy as pool_NKHD[read_blocks_BM]
            x_BMKHD = pool_NKHD.index_select(0, blocks_X).view(batch, blocks, *pool_NKHD.shape[1:])
            x_BSHD = x_BMKHD.reshape(batch, blocks * self.block_size, *x_BMKHD.shape[3:])[:, : call.num_keys]
            out.append(x_BSHD.transpose(1, 2))
        return out[0], out[1]

    def commit(self, call: CacheCall, valid_BT: Tensor) -> None:
        """Once every layer's k/v is stored: the new positions become part of their slots."""
        self.valid_ST[call.slots_B[:, None], call.write_pos_BT] = valid_BT
        for s, length in zip(call.slots, call.lengths, strict=True):
            self.lengths[s] = length + call.num_tokens

    # ------------------------------------------------------------------ slot operations
    def reset(self, slots: int | Sequence[int] | Tensor) -> None:
        """Empty the given slots: their blocks go back to the pool (shared ones once no slot holds them)."""
        slot_list = _host_ints(slots)
        for slot in slot_list:
            self._check_slot(slot)
        for slot in slot_list:
            self.lengths[slot] = 0
            self._release_from(slot, 0)
        if len(slot_list) == 1:
            self.valid_ST[slot_list[0]] = False
        elif slot_list:
            self.valid_ST[upload(slot_list, self.device)] = False

    def copy_slot(self, src: int, dst: int | Sequence[int]) -> None:
        """Make each `dst` a copy of slot `src` (prefix sharing: n samples of one prompt reuse its prefill) by
        sharing src's blocks; a later write into a shared block copies that block only."""
        self._check_slot(src)
        targets = [d for d in ([dst] if isinstance(dst, int) else list(dst)) if d != src]
        for d in targets:
            self._check_slot(d)
        if not targets:
            return
        for d in targets:
            self._release_from(d, 0)
            self.tables[d] = list(self.tables[src])
            for block in self.tables[d]:
                self.refs[block] += 1
            self.lengths[d] = self.lengths[src]
        targets_D = upload(targets, self.device)
        # positions past a slot's length are never valid, so whole rows copy the validity of src's positions
        self.block_table_SM[targets_D] = self.block_table_SM[src].clone()
        self.valid_ST[targets_D] = self.valid_ST[src].clone()

    def export_slot(self, slot: int) -> SlotState:
        """A copy of the slot's stored positions, independent of this cache's buffers."""
        self._check_slot(slot)
        length = self.lengths[slot]
        blocks_M = upload(self.tables[slot], self.device)
        out = []
        for pools in (self.k_layers, self.v_layers):
            x_LMKHD = torch.stack([pool_NKHD[blocks_M] for pool_NKHD in pools])
            x_LTHD = x_LMKHD.reshape(x_LMKHD.shape[0], -1, *x_LMKHD.shape[3:])[:, :length]
            out.append(x_LTHD.transpose(1, 2).contiguous())
        return SlotState(k_LHTD=out[0], v_LHTD=out[1], valid_T=self.valid_ST[slot, :length].clone())

    def import_slot(self, slot: int, state: SlotState) -> None:
        """Overwrite `slot` with an exported state (from this or another cache of the same model shape)."""
        self._check_slot(slot)
        length = state.length
        _, _, heads, dim = self.k_layers[0].shape
        layers = self.num_layers
        expected = (layers, heads, length, dim)
        for name, tensor in (("k_LHTD", state.k_LHTD), ("v_LHTD", state.v_LHTD)):
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"import_slot({slot}): state.{name} has shape {tuple(tensor.shape)}, this cache needs "
                    f"{expected} [layers, kv heads, length, head_dim]; was it exported from another model?"
                )
        if length > self.max_len:
            raise ValueError(
                f"import_slot({slot}): the state holds {length} positions but max_len={self.max_len}; "
                "allocate the destination cache with a larger max_len"
            )
        self._release_from(slot, 0)
        count = _blocks_for(length, self.block_size)
        self.tables[slot] = [self._take() for _ in range(count)]
        self._set_table([(slot, j, b) for j, b in enumerate(self.tables[slot])])
        blocks_M = upload(self.tables[slot], self.device)
        pad = count * self.block_size - length
        for pools, x_LHTD in ((self.k_layers, state.k_LHTD), (self.v_layers, state.v_LHTD)):
            x_LTHD = (
                upload(x_LHTD, self.device).to(self.dtype).transpose(1, 2)
            )  # a migrated state: host memory
            x_LTHD = torch.cat([x_LTHD, x_LTHD.new_zeros(layers, pad, heads, dim)], dim=1)
            x_LMKHD = x_LTHD.reshape(layers, count, self.block_size, heads, dim)
            for layer, pool_NKHD in enumerate(pools):
                pool_NKHD[blocks_M] = x_LMKHD[layer]
        self.valid_ST[slot] = False
        self.valid_ST[slot, :length] = upload(state.valid_T, self.device)
        self.lengths[slot] = length

    def truncate(self, slots: Sequence[int] | Tensor, lengths: Sequence[int] | Tensor) -> None:
        """Cut each slot back to `lengths` stored positions (speculative decoding drops the positions of
        rejected draft tokens): blocks wholly past the new length go back to the pool, the rest is
        overwritten by the next append."""
        slot_list, new_lengths = _host_ints(slots), _host_ints(lengths)
        stored = [self.lengths[s] for s in slot_list]
        if any(not 0 <= n <= old for n, old in zip(new_lengths, stored, strict=True)):
            raise ValueError(
                f"truncate: lengths {new_lengths} must be within 0..the stored {stored} of slots {slot_list} "
                "(truncate only shortens)"
            )
        slots_lengths_2B = upload([slot_list, new_lengths], self.device)
        keep_BT = torch.arange(self.max_len, device=self.device)[None, :] < slots_lengths_2B[1][:, None]
        self.valid_ST[slots_lengths_2B[0]] = self.valid_ST[slots_lengths_2B[0]] & keep_BT
        for s, n in zip(slot_list, new_lengths, strict=True):
            self.lengths[s] = n
            self._release_from(s, _blocks_for(n, self.block_size))

    def check_room(self, slots: Sequence[int] | Tensor, num_new: int) -> None:
        """Raise if appending `num_new` positions to any of `slots` would pass max_len."""
        over = [s for s in _host_ints(slots) if self.lengths[s] + num_new > self.max_len]
        if over:
            details = ", ".join(f"slot {s} (length {self.lengths[s]})" for s in over)
            raise ValueError(
                f"KV cache overflow: appending {num_new} tokens to {details} would pass max_len={self.max_len}; "
                "allocate a larger cache or stop generation earlier"
            )
