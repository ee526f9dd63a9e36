"""Packed sequences: the real tokens of B padded rows laid end to end as one stream of N tokens, no padding.

Legend: B sequences (rows), T padded width, N real tokens of all rows, W columns of a window, L longest
sequence, D model width, V vocabulary.

`pack_rows(attention_mask_BT)` reads any padding (left-padded prompts + right-padded responses, or inner gaps)
and gives `PackedSequences`: `cu_seqlens_B1` (flash-attn's varlen offsets), position ids restarting at 0 for
every sequence (the rotary positions the padded path gives: the count of real tokens before), and the indices
that move tensors between the padded layout and the stream. The transformer runs on the stream
(`Transformer.packed_hidden_states`); `packed_forward` and `packed_last_token` give back, at the edges, the
padded-layout outputs the typed stage data (`Experience`, `TrainBatch` losses) are read from, running the head
on real tokens only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from rlhfuse.models.transformer import Transformer


@dataclass(frozen=True)
class PackedSequences:
    """Where each of the N packed tokens came from and where it goes: row b's real tokens, in order, occupy
    stream positions cu_seqlens_B1[b] .. cu_seqlens_B1[b + 1]."""

    cu_seqlens_B1: Tensor
    """int32 [B + 1]: offsets of each sequence in the stream (flash-attn's cu_seqlens)."""
    position_ids_N: Tensor
    """long [N]: the token's position in its own sequence (0 at each sequence's first real token)."""
    source_N: Tensor
    """long [N]: the token's flat index b * T + t in the padded [B, T] layout."""
    dense_N: Tensor
    """long [N]: the token's flat index b * L + position in the right-padded [B, L] layout (per-sequence SDPA)."""
    batch: int
    width: int
    max_seqlen: int
    _windows: dict[tuple[int, int, bool], tuple[Tensor, Tensor, int]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    """`window`'s answers, per (start, stop, inference mode): the Actor's and the Critic's forwards of one
    micro-batch ask for the same window, which costs a dozen ops and, off the full window, a host sync."""

    @property
    def num_tokens(self) -> int:
        return int(self.source_N.shape[0])

    @property
    def lengths_B(self) -> Tensor:
        return (self.cu_seqlens_B1[1:] - self.cu_seqlens_B1[:-1]).long()

    def to(self, device: torch.device | str) -> PackedSequences:
        """The packing on `device`; itself (with the windows it has answered) when it is there already."""
        tensors = (self.cu_seqlens_B1, self.position_ids_N, self.source_N, self.dense_N)
        cu_seqlens_B1, position_ids_N, source_N, dense_N = moved = [x.to(device) for x in tensors]
        if all(new is old for new, old in zip(moved, tensors, strict=True)):
            return self
        return PackedSequences(
            cu_seqlens_B1, position_ids_N, source_N, dense_N, self.batch, self.width, self.max_seqlen
        )

    def pack(self, x_BT_: Tensor) -> Tensor:
        """x_N_: the real tokens' entries of a padded [B, T, ...] tensor, in stream order."""
        if tuple(x_BT_.shape[:2]) != (self.batch, self.width):
            raise ValueError(
                f"pack needs a [{self.batch}, {self.width}, ...] tensor (the packed rows), got {tuple(x_BT_.shape)}"
            )
        return x_BT_.reshape(self.batch * self.width, *x_BT_.shape[2:]).index_select(0, self.source_N)

    def window(self, start: int = 0, stop: int | None = None) -> tuple[Tensor, Tensor, int]:
        """(stream indices of the real tokens in padded columns [start, stop), their flat index b * W + (t -
        start) in the [B, W] window, W)."""
        stop = self.width if stop is None else stop
        if not 0 <= start <= stop <= self.width:
            raise ValueError(f"window [{start}, {stop}) must lie within the {self.width} padded columns")
        # index tensors made under inference mode serve inference mode alone (autograd cannot save them)
        key = (start, stop, torch.is_inference_mode_enabled())
        found = self._windows.get(key)
        if found is None:
            found = self._windows[key] = self._window(start, stop)
        return found

    def _window(self, start: int, stop: int) -> tuple[Tensor, Tensor, int]:
        if start == 0 and stop == self.width:  # every real token: no data-dependent selection (no host sync)
            return torch.arange(self.num_tokens, device=self.source_N.device), self.source_N, self.width
        cols_N = self.source_N % self.width
        rows_N = self.source_N // self.width
        inside_N = (cols_N >= start) & (cols_N < stop)
        picked_M = inside_N.nonzero().squeeze(1)
        span = stop - start
        return picked_M, rows_N[picked_M] * span + (cols_N[picked_M] - start), span

    def unpack(self, x_N_: Tensor, start: int = 0, stop: int | None = None) -> Tensor:
        """The padded [B, W, ...] layout of columns [start, stop) from stream values x_N_ (0 at padding)."""
        picked_M, dest_M, span = self.window(start, stop)
        return scatter_rows(x_N_[picked_M], dest_M, self.batch, span)


def scatter_rows(x_M_: Tensor, dest_M: Tensor, batch: int, span: int) -> Tensor:
    """A zero [batch, span, ...] tensor with x_M_[m] at flat position dest_M[m] (differentiable)."""
    # in place into the fresh zeros (the out-of-place index_copy would clone them first)
    flat = x_M_.new_zeros(batch * span, *x_M_.shape[1:]).index_copy_(0, dest_M, x_M_)
    return flat.view(batch, span, *x_M_.shape[1:])


def pack_rows(attention_mask_BT: Tensor) -> PackedSequences:
    """The packing of the real tokens (mask 1) of each row; padding may sit anywhere (left, right, inside)."""
    if attention_mask_BT.dim() != 2:
        raise ValueError(f"attention_mask_BT must be [B, T], got shape {tuple(attention_mask_BT.shape)}")
    valid_BT = attention_mask_BT.to(torch.bool)
    batch, width = valid_BT.shape
    lengths_B = valid_BT.sum(dim=1)
    if batch == 0 or int(lengths_B.min()) < 1:
        raise ValueError(
            "every packed row needs at least one real token (attention_mask_BT has an empty row)"
        )
    max_seqlen = int(lengths_B.max())
    source_N = valid_BT.reshape(-1).nonzero().squeeze(1)
    position_ids_N = (valid_BT.long().cumsum(dim=1) - 1).reshape(-1)[source_N]
    cu_seqlens_B1 = torch.zeros(batch + 1, dtype=torch.int32, device=valid_BT.device)
    cu_seqlens_B1[1:] = lengths_B.cumsum(dim=0)
    dense_N = (source_N // width) * max_seqlen + position_ids_N
    return PackedSequences(cu_seqlens_B1, position_ids_N, source_N, dense_N, batch, width, max_seqlen)


def packed_forward(
    model: Transformer,
    input_ids_BT: Tensor,
    attention_mask_BT: Tensor,
    *,
    start: int = 0,
    stop: int | None = None,
    packed: PackedSequences | None = None,
) -> Tensor:
    """`model(input_ids_BT, attention_mask_BT=...)[:, start:stop]` (logits [B, W, V] or values [B, W]) computed
    on the packed real tokens: no layer, and not the head, runs on padding; padded entries of the result are 0
    (the padded path's values there are meaningless too). packed: the mask's packing, made on the host and moved
    to the device (`rlhfuse.models.masks.MaskLayout`); None: packed here (host reads of the mask)."""
    if packed is None:
        packed = pack_rows(attention_mask_BT.to(input_ids_BT.device))
    picked_M, dest_M, span = packed.window(start, stop)
    out_M_ = model.packed_outputs(packed.pack(input_ids_BT), packed, picked_M)
    return scatter_rows(out_M_, dest_M, packed.batch, span)


def packed_last_token(
    model: Transformer, input_ids_BT: Tensor, attention_mask_BT: Tensor, packed: PackedSequences | None = None
) -> Tensor:
    """The model's output at each row's last real token ([B] values, or [B, V] logits), packed (`packed`: the
    mask's packing, made once for several models; None: packed here)."""
    if packed is None:
        packed = pack_rows(attention_mask_BT.to(input_ids_BT.device))
    last_B = packed.cu_seqlens_B1[1:].long() - 1
    return model.packed_outputs(packed.pack(input_ids_BT), packed, last_B)


def check_packing(models: Iterable[Transformer | None]) -> None:
    """Raise the fix (data.packing=false, or a packing attention backend) when a model cannot run packed."""
    from rlhfuse.models.attention import packing_problem

    for model in models:
        if model is not None and (problem := packing_problem(model.config.attention_backend)) is not None:
            raise ValueError(problem)
