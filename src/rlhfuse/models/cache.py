"""`KVCache`: key/value buffers owned by the generation engine, addressed by slot.

Legend: L layers, S cache slots, H kv heads, T cached positions (max_len), D head channels, B batch rows.

A slot holds one sequence. Position t of slot s is *valid* when it holds a real token (attention may use it)
and invalid when it holds padding (stored, so that slot positions stay aligned with the batch, but never
attended to). `lengths[s]` counts stored positions (valid or not); new tokens go after them.

The bookkeeping (lengths, which slots a call addresses, overflow checks) is kept on the host as Python ints, in
step with the device buffers, so that addressing a cached call never waits for the device: a call's slots and
write positions are uploaded once (`CacheCall`), without a sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhfuse.models.config import ModelConfig


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
    row; num_keys: positions read back (max over rows of length + T); slots_B / write_pos_BT: the same on the
    device (write_pos_BT[b, t] = lengths[b] + t); first_slot: set when slots are first_slot, first_slot + 1, ...
    (the cache is then read as a view, not gathered)."""

    slots: tuple[int, ...]
    lengths: tuple[int, ...]
    num_tokens: int
    num_keys: int
    slots_B: Tensor
    write_pos_BT: Tensor
    first_slot: int | None


def _host_ints(values: int | Sequence[int] | Tensor) -> list[int]:
    """Slots or lengths as Python ints (a tensor is read once: callers that decode pass lists)."""
    if isinstance(values, Tensor):
        return [int(v) for v in values.reshape(-1).tolist()]
    if isinstance(values, int):
        return [values]
    return [int(v) for v in values]


def upload(values: Tensor | Sequence[int] | Sequence[Sequence[int]], device: torch.device) -> Tensor:
    """Host values (a CPU tensor, or ints as int64) on `device` without a sync: on CUDA through pinned memory
    with non_blocking=True (a pageable copy would make torch synchronise the stream); `rlhfuse.core.syncs`
    exports it for the packages above models."""
    host = values if isinstance(values, Tensor) else torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda" and host.device.type == "cpu":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class KVCache:
    """Per-layer key/value buffers for `num_slots` sequences of up to `max_len` positions each."""

    def __init__(self, k_LSHTD: Tensor, v_LSHTD: Tensor, valid_ST: Tensor) -> None:
        self.k_LSHTD = k_LSHTD
        self.v_LSHTD = v_LSHTD
        self.valid_ST = valid_ST
        self.lengths: list[int] = [0] * int(k_LSHTD.shape[1])
        """Stored positions per slot, on the host (the device never needs them but as `CacheCall` indices)."""

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_slots: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        if num_slots <= 0 or max_len <= 0:
            raise ValueError(f"KVCache needs num_slots > 0 and max_len > 0 (got {num_slots}, {max_len})")
        shape = (config.num_layers, num_slots, config.num_kv_heads, max_len, config.resolved_head_dim)
        return cls(
            k_LSHTD=torch.zeros(shape, dtype=dtype, device=device),
            v_LSHTD=torch.zeros(shape, dtype=dtype, device=device),
            valid_ST=torch.zeros(num_slots, max_len, dtype=torch.bool, device=device),
        )

    @property
    def num_slots(self) -> int:
        return int(self.k_LSHTD.shape[1])

    @property
    def max_len(self) -> int:
        return int(self.k_LSHTD.shape[3])

    @property
    def device(self) -> torch.device:
        return self.k_LSHTD.device

    @property
    def lengths_S(self) -> Tensor:
        """`lengths` as a CPU tensor (a host copy: changing it changes nothing)."""
        return torch.tensor(self.lengths, dtype=torch.int64)

    def nbytes_per_slot(self) -> int:
        """Bytes of k + v one slot holds at max_len (M_kv in the migration rule of the paper)."""
        return 2 * self.k_LSHTD[:, 0].numel() * self.k_LSHTD.element_size()

    def nbytes(self) -> int:
        """Bytes of the k and v buffers."""
        return 2 * self.k_LSHTD.numel() * self.k_LSHTD.element_size()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"cache slot {slot} is out of range: the cache has {self.num_slots} slots")

    # ------------------------------------------------------------------ one forward call
    def begin(self, slots: int | Sequence[int] | Tensor, num_tokens: int) -> CacheCall:
        """Check and address a call appending `num_tokens` positions to each of `slots` (nothing changes
        here: a refused call leaves the cache as it was; `commit` records the new positions)."""
        slot_list = _host_ints(slots)
        if len(set(slot_list)) != len(slot_list):
            raise ValueError(f"cache_slots_B has repeated slots {slot_list}: each row needs its own slot")
        if slot_list and (min(slot_list) < 0 or max(slot_list) >= self.num_slots):
            raise IndexError(f"cache_slots_B {slot_list} out of range: the cache has {self.num_slots} slots")
        self.check_room(slot_list, num_tokens)
        lengths = [self.lengths[s] for s in slot_list]
        both_2B = upload([slot_list, lengths], self.device)
        slots_B, lengths_B = both_2B[0], both_2B[1]
        write_pos_BT = lengths_B[:, None] + torch.arange(num_tokens, device=self.device)[None, :]
        first = slot_list[0] if slot_list else 0
        is_range = slot_list == list(range(first, first + len(slot_list)))
        return CacheCall(
            slots=tuple(slot_list),
            lengths=tuple(lengths),
            num_tokens=num_tokens,
            num_keys=max(lengths, default=0) + num_tokens,
            slots_B=slots_B,
            write_pos_BT=write_pos_BT,
            first_slot=first if is_range else None,
        )

    def store(self, layer: int, call: CacheCall, k_BTHD: Tensor, v_BTHD: Tensor) -> None:
        """Write one layer's keys/values of the call's new positions."""
        layer_k_SHTD, layer_v_SHTD = self.k_LSHTD[layer], self.v_LSHTD[layer]
        # advanced indices (slots, positions) around a slice put B, T first: the [B, T, H, D] layout we hold
        layer_k_SHTD[call.slots_B[:, None], :, call.write_pos_BT] = k_BTHD.to(layer_k_SHTD.dtype)
        layer_v_SHTD[call.slots_B[:, None], :, call.write_pos_BT] = v_BTHD.to(layer_v_SHTD.dtype)

    def keys_values(self, layer: int, call: CacheCall) -> tuple[Tensor, Tensor]:
        """One layer's keys and values of the call's slots, positions 0..num_keys-1: k_BHSD, v_BHSD."""
        layer_k_SHTD, layer_v_SHTD = self.k_LSHTD[layer], self.v_LSHTD[layer]
        if call.first_slot is not None:
            rows = slice(call.first_slot, call.first_slot + len(call.slots))
            return layer_k_SHTD[rows, :, : call.num_keys], layer_v_SHTD[rows, :, : call.num_keys]
        return layer_k_SHTD[call.slots_B, :, : call.num_keys], layer_v_SHTD[call.slots_B, :, : call.num_keys]

    def commit(self, call: CacheCall, valid_BT: Tensor) -> None:
        """Once every layer's k/v is stored: the new positions become part of their slots."""
        self.valid_ST[call.slots_B[:, None], call.write_pos_BT] = valid_BT
        for s, length in zip(call.slots, call.lengths, strict=True):
            self.lengths[s] = length + call.num_tokens

    # ------------------------------------------------------------------ slot operations
    def reset(self, slots: int | Sequence[int] | Tensor) -> None:
        """Empty the given slots (the stale k/v stay in memory but are unreachable: length 0, nothing valid)."""
        slot_list = _host_ints(slots)
        for slot in slot_list:
            self._check_slot(slot)
        for slot in slot_list:
            self.lengths[slot] = 0
        if len(slot_list) == 1:
            self.valid_ST[slot_list[0]] = False
        elif slot_list:
            self.valid_ST[upload(slot_list, self.device)] = False

    def copy_slot(self, src: int, dst: int | Sequence[int]) -> None:
        """Copy slot `src` into each `dst` (prefix sharing: n samples of one prompt reuse its prefill)."""
        self._check_slot(src)
        length = self.lengths[src]
        for d in [dst] if isinstance(dst, int) else list(dst):
            self._check_slot(d)
            if d == src:
                continue
            self.k_LSHTD[:, d, :, :length] = self.k_LSHTD[:, src, :, :length]
            self.v_LSHTD[:, d, :, :length] = self.v_LSHTD[:, src, :, :length]
            self.valid_ST[d] = False
            self.valid_ST[d, :length] = self.valid_ST[src, :length]
            self.lengths[d] = length

    def export_slot(self, slot: int) -> SlotState:
        """A copy of the slot's stored positions, independent of this cache's buffers."""
        self._check_slot(slot)
        length = self.lengths[slot]
        return SlotState(
            k_LHTD=self.k_LSHTD[:, slot, :, :length].clone(),
            v_LHTD=self.v_LSHTD[:, slot, :, :length].clone(),
            valid_T=self.valid_ST[slot, :length].clone(),
        )

    def import_slot(self, slot: int, state: SlotState) -> None:
        """Overwrite `slot` with an exported state (from this or another cache of the same model shape)."""
        self._check_slot(slot)
        length = state.length
        expected = (self.k_LSHTD.shape[0], self.k_LSHTD.shape[2], length, self.k_LSHTD.shape[4])
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
        self.k_LSHTD[:, slot, :, :length] = state.k_LHTD.to(self.k_LSHTD)
        self.v_LSHTD[:, slot, :, :length] = state.v_LHTD.to(self.v_LSHTD)
        self.valid_ST[slot] = False
        self.valid_ST[slot, :length] = state.valid_T.to(self.device)
        self.lengths[slot] = length

    def truncate(self, slots: Sequence[int] | Tensor, lengths: Sequence[int] | Tensor) -> None:
        """Cut each slot back to `lengths` stored positions (speculative decoding drops the positions of
        rejected draft tokens; the k/v stay in memory, unreachable, and are overwritten by the next append)."""
        slot_list, new_lengths = _host_ints(slots), _host_ints(lengths)
        stored = [self.lengths[s] for s in slot_list]
        if any(not 0 <= n <= old for n, old in zip(new_lengths, stored, strict=True)):
            raise ValueError(
                f"truncate: lengths {new_lengths} must be within 0..the stored {stored} of slots {slot_list} "
                "(truncate only shortens)"
            )
        both_2B = upload([slot_list, new_lengths], self.device)
        keep_BT = torch.arange(self.max_len, device=self.device)[None, :] < both_2B[1][:, None]
        self.valid_ST[both_2B[0]] = self.valid_ST[both_2B[0]] & keep_BT
        for s, n in zip(slot_list, new_lengths, strict=True):
            self.lengths[s] = n

    def check_room(self, slots: Sequence[int] | Tensor, num_new: int) -> None:
        """Raise if appending `num_new` positions to any of `slots` would pass max_len."""
        over = [s for s in _host_ints(slots) if self.lengths[s] + num_new > self.max_len]
        if over:
            details = ", ".join(f"slot {s} (length {self.lengths[s]})" for s in over)
            raise ValueError(
                f"KV cache overflow: appending {num_new} tokens to {details} would pass max_len={self.max_len}; "
                "allocate a larger cache or stop generation earlier"
            )
