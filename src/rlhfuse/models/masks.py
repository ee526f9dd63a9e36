"""What a batch's attention mask implies for a forward, worked out once on the host: `MaskLayout`.

A forward given only the mask must look at its values to choose its path (no mask at all, right padding alone
that causal attention already hides, or left / inner padding that needs a [B, 1, T, T] mask; for packing, where
every real token goes), and reading device values is a host sync per forward and per stage. A pipeline step
knows its micro-batches on the host before it moves them to the device, so it computes each one's layout there
(`mask_layout` on the CPU mask: no sync) and hands it to every stage's forward.

Legend: B batch rows, T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rlhfuse.models.packing import PackedSequences, pack_rows

Padding = Literal["none", "right", "inner"]
"""none: every token real; right: padding only after a row's real tokens (causal attention needs no mask);
inner: padding before or between real tokens (left-padded prompts): the forward builds a mask."""


@dataclass(frozen=True)
class MaskLayout:
    """A batch's padding kind and, for packed forwards, its packing (on the device the forward runs on)."""

    padding: Padding
    packed: PackedSequences | None = None

    def to(self, device: torch.device | str) -> MaskLayout:
        return MaskLayout(self.padding, None if self.packed is None else self.packed.to(device))


def padding_of(valid_BT: Tensor) -> Padding:
    """The padding kind of a boolean validity mask (reads its values: call it on a host tensor)."""
    if bool(valid_BT.all()):
        return "none"
    return "inner" if bool((~valid_BT[:, :-1] & valid_BT[:, 1:]).any()) else "right"


def mask_layout(attention_mask_BT: Tensor, *, packed: bool) -> MaskLayout:
    """The layout of a host mask (1 = token, 0 = padding); `packed`: also its packing."""
    valid_BT = attention_mask_BT.to(torch.bool)
    return MaskLayout(padding_of(valid_BT), pack_rows(attention_mask_BT) if packed else None)


def band_mask(num_tokens: int, window: int, device: torch.device) -> Tensor:
    """[1, 1, T, T] bool: query t may attend to keys t - window + 1 .. t (a causal sliding window)."""
    t_T = torch.arange(num_tokens, device=device)
    distance_TT = t_T[:, None] - t_T[None, :]
    return ((distance_TT >= 0) & (distance_TT < window))[None, None]
