"""`KVCache`: key/value buffers owned by the generation engine, addressed by slot.

Legend: L layers, S cache slots, H kv heads, T cached positions (max_len), D head channels, B batch rows.

A slot holds one sequence. Position t of slot s is *valid* when it holds a real token (attention may use it)
and invalid when it holds padding (stored, so that slot positions stay aligned with the batch, but never
attended to). `lengths_S[s]` counts stored positions (valid or not); new tokens go after them.
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


class KVCache:
    """Per-layer key/value buffers for `num_slots` sequences of up to `max_len` positions each."""

    def __init__(self, k_LSHTD: Tensor, v_LSHTD: Tensor, lengths_S: Tensor, valid_ST: Tensor) -> None:
        self.k_LSHTD = k_LSHTD
        self.v_LSHTD = v_LSHTD
        self.lengths_S = lengths_S
        self.valid_ST = valid_ST

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
            lengths_S=torch.zeros(num_slots, dtype=torch.int64, device=device),
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

    def nbytes_per_slot(self) -> int:
        """Bytes of k + v one slot holds at max_len (M_kv in the migration rule of the paper)."""
        return 2 * self.k_LSHTD[:, 0].numel() * self.k_LSHTD.element_size()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"cache slot {slot} is out of range: the cache has {self.num_slots} slots")

    def reset(self, slots: int | Sequence[int] | Tensor) -> None:
        """Empty the given slots (the stale k/v stay in memory but are unreachable: length 0, nothing valid)."""
        index = torch.as_tensor(slots, dtype=torch.int64, device=self.device).reshape(-1)
        for slot in index.tolist():
            self._check_slot(slot)
        self.lengths_S[index] = 0
        self.valid_ST[index] = False

    def copy_slot(self, src: int, dst: int | Sequence[int]) -> None:
        """Copy slot `src` into each `dst` (prefix sharing: n samples of one prompt reuse its prefill)."""
        self._check_slot(src)
        length = int(self.lengths_S[src])
        for d in [dst] if isinstance(dst, int) else list(dst):
            self._check_slot(d)
            if d == src:
                continue
            self.k_LSHTD[:, d, :, :length] = self.k_LSHTD[:, src, :, :length]
            self.v_LSHTD[:, d, :, :length] = self.v_LSHTD[:, src, :, :length]
            self.valid_ST[d] = False
            self.valid_ST[d, :length] = self.valid_ST[src, :length]
            self.lengths_S[d] = length

    def export_slot(self, slot: int) -> SlotState:
        """A copy of the slot's stored positions, independent of this cache's buffers."""
        self._check_slot(slot)
        length = int(self.lengths_S[slot])
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
        self.lengths_S[slot] = length

    def truncate(self, slots_B: Tensor, lengths_B: Tensor) -> None:
        """Cut each slot back to `lengths_B` stored positions (speculative decoding drops the positions of
        rejected draft tokens; the k/v stay in memory, unreachable, and are overwritten by the next append)."""
        slots_B = torch.as_tensor(slots_B, dtype=torch.int64, device=self.device)
        lengths_B = torch.as_tensor(lengths_B, dtype=torch.int64, device=self.device)
        if bool((lengths_B > self.lengths_S[slots_B]).any()) or bool((lengths_B < 0).any()):
            raise ValueError(
                f"truncate: lengths {lengths_B.tolist()} must be within 0..the stored "
                f"{self.lengths_S[slots_B].tolist()} of slots {slots_B.tolist()} (truncate only shortens)"
            )
        keep_BT = torch.arange(self.max_len, device=self.device)[None, :] < lengths_B[:, None]
        self.valid_ST[slots_B] = self.valid_ST[slots_B] & keep_BT
        self.lengths_S[slots_B] = lengths_B

    def check_room(self, slots_B: Tensor, num_new: int) -> None:
        """Raise if appending `num_new` positions to any of `slots_B` would pass max_len."""
        new_lengths_B = self.lengths_S[slots_B] + num_new
        over = (new_lengths_B > self.max_len).nonzero().flatten().tolist()
        if over:
            details = ", ".join(
                f"slot {int(slots_B[b])} (length {int(self.lengths_S[slots_B[b]])})" for b in over
            )
            raise ValueError(
                f"KV cache overflow: appending {num_new} tokens to {details} would pass max_len={self.max_len}; "
                "allocate a larger cache or stop generation earlier"
            )
