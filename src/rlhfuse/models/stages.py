"""`split_stages`: cut a `Transformer` into pipeline stages over contiguous layer ranges.

Legend: B batch rows, T tokens, D model width.

Stages hold the original modules (no copies), so a step through the stages trains the original model.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from rlhfuse.models.masks import MaskLayout
from rlhfuse.models.packing import PackedSequences, pack_rows
from rlhfuse.models.transformer import Transformer, build_context, packed_context, run_layers


class Stage(nn.Module):
    """Layers [start, stop) of a model; stage 0 embeds token ids, the last stage applies final norm and head."""

    def __init__(self, model: Transformer, layer_range: tuple[int, int], index: int, num_stages: int) -> None:
        super().__init__()
        self.config = model.config
        self.index = index
        self.num_stages = num_stages
        self.layer_range = layer_range
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.embed_tokens = model.embed_tokens if self.is_first else None
        self.layers = nn.ModuleList(model.layers[layer_range[0] : layer_range[1]])
        self.norm = model.norm if self.is_last else None
        # the model itself is not registered (that would make every stage own every parameter): a plain list
        self._model: list[Transformer] = [model]
        if self.is_last:
            self.head = model.lm_head if model.head == "lm" else model.value_head

    def forward(
        self,
        x: Tensor,
        *,
        attention_mask_BT: Tensor | None = None,
        position_ids_BT: Tensor | None = None,
        layout: MaskLayout | None = None,
    ) -> Tensor:
        """x: input_ids_BT on stage 0, else the previous stage's hidden_BTD. Returns hidden_BTD, or on the
        last stage logits_BTV / values_BT like `Transformer.forward`. layout: the mask's layout worked out on the
        host (`rlhfuse.models.masks`; its packing when the model packs): the forward then reads no mask value."""
        model = self._model[0]
        if model.packing:
            return self._packed(x, attention_mask_BT, None if layout is None else layout.packed)
        x_BTD = model.embed(x) if self.embed_tokens is not None else x
        b, t = x_BTD.shape[:2]
        ctx = build_context(
            self.config, b, t, x_BTD.device, x_BTD.dtype, attention_mask_BT, position_ids_BT,
            padding=None if layout is None else layout.padding,
        )  # fmt: skip
        x_BTD = run_layers(self.layers, x_BTD, ctx, checkpointed=model.activation_checkpointing)
        if self.norm is None:
            return x_BTD
        return model.apply_head(self.norm(x_BTD))

    @property
    def packing(self) -> bool:
        """Whether the stage's forward runs on the packed real tokens (its model's `packing`)."""
        return bool(self._model[0].packing)

    def _packed(self, x: Tensor, attention_mask_BT: Tensor | None, packed: PackedSequences | None) -> Tensor:
        """`forward` computed on the real tokens only (`rlhfuse.models.packing`): the padded [B, T(, D)] input
        is packed, the layers run on the stream, and the output is unpacked to the padded layout (0 at padding),
        so the messages between stages and the last stage's output keep their shapes."""
        model = self._model[0]
        mask_BT = (
            torch.ones(x.shape[:2], dtype=torch.long, device=x.device)
            if attention_mask_BT is None
            else attention_mask_BT
        )
        if packed is None:
            packed = pack_rows(
                mask_BT.to(x.device)
            )  # reads the mask (host syncs): callers pass it when known
        x_N_ = packed.pack(x)
        x_1ND = (model.embed(x_N_) if self.embed_tokens is not None else x_N_)[None]
        ctx = packed_context(self.config, packed, x_1ND.dtype)
        x_1ND = run_layers(self.layers, x_1ND, ctx, checkpointed=model.activation_checkpointing)
        if self.norm is None:
            return packed.unpack(x_1ND[0])
        return packed.unpack(model.apply_head(self.norm(x_1ND))[0])

    def extra_repr(self) -> str:
        return f"stage {self.index}/{self.num_stages}, layers [{self.layer_range[0]}, {self.layer_range[1]})"


def balanced_ranges(layer_costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Contiguous, non-empty ranges minimising the largest stage cost (dynamic programme, O(stages·layers²))."""
    n = len(layer_costs)
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest max-stage-cost splitting the first i layers into k stages; cut[k][i]: last cut
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                # ties go to the later cut: the last stage, which also runs the LM head over the vocabulary, stays lighter
                if cost <= best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    ranges: list[tuple[int, int]] = []
    stop = n
    for k in range(num_stages, 0, -1):
        start = cut[k][stop]
        ranges.append((start, stop))
        stop = start
    return ranges[::-1]


def split_stages(
    model: Transformer, num_stages: int, *, layer_costs: Sequence[float] | None = None
) -> list[Stage]:
    """`num_stages` modules whose chained forward equals `model.forward` (no cache), sharing its parameters."""
    num_layers = model.config.num_layers
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"num_stages={num_stages} must be between 1 and the model's num_layers={num_layers} "
            "(every stage holds at least one layer)"
        )
    costs = [1.0] * num_layers if layer_costs is None else list(layer_costs)
    if len(costs) != num_layers or any(c < 0 for c in costs):
        raise ValueError(
            f"layer_costs needs {num_layers} non-negative numbers, one per layer (got {len(costs)}: {costs[:8]})"
        )
    ranges = balanced_ranges(costs, num_stages)
    return [Stage(model, r, i, num_stages) for i, r in enumerate(ranges)]


# --- which tensors a stage holds (sharded construction: a rank materialises only its stages) -----------------
def stage_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """The layer ranges `split_stages` gives equal-cost layers (the runtime's split)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"num_stages={num_stages} must be between 1 and the model's num_layers={num_layers} "
            "(every stage holds at least one layer)"
        )
    return balanced_ranges([1.0] * num_layers, num_stages)


def stage_of(name: str, num_layers: int, num_stages: int) -> int:
    """The stage holding parameter `name` of a `Transformer` split into `num_stages` equal-cost stages: the
    embedding on the first, decoder layer i on the stage whose range holds i, final norm and head on the last."""
    if name.startswith("embed_tokens."):
        return 0
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        for s, (start, stop) in enumerate(stage_ranges(num_layers, num_stages)):
            if start <= layer < stop:
                return s
    if name.startswith(("norm.", "lm_head.", "value_head.")):
        return num_stages - 1
    raise ValueError(f"parameter {name!r} belongs to no pipeline stage")


def to_device(model: nn.Module, device: torch.device | str) -> nn.Module:
    """`model.to(device)` for a model whose unmaterialised (meta) tensors stay meta (another rank holds them)."""
    return model._apply(lambda t: t if t.is_meta else t.to(device))


def _storages(tensors: Iterable[Tensor]) -> dict[tuple[str, int], int]:
    """(device, storage address) -> bytes of each storage behind `tensors`, once (of a sharded DTensor: this
    rank's shard; meta tensors hold none)."""
    from torch.distributed.tensor import DTensor  # a second to import: not with the models

    out: dict[tuple[str, int], int] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if not t.is_meta:
            out[(str(t.device), t.untyped_storage().data_ptr())] = t.untyped_storage().nbytes()
    return out


def _module_tensors(modules: Iterable[nn.Module | None]) -> Iterator[Tensor]:
    for module in modules:
        if module is not None:
            yield from module.parameters()
            yield from module.buffers()


def resident_bytes(*modules: nn.Module | None) -> int:
    """Bytes of the parameters and buffers materialised on this rank (meta tensors hold none; of a sharded one,
    its shard), each storage counted once over all `modules` (tied weights, a stage and its model, shared
    copies)."""
    return sum(_storages(_module_tensors(modules)).values())


def unshared_bytes(tensors: Iterable[Tensor], *modules: nn.Module) -> int:
    """Bytes of the storages behind `tensors` that no parameter or buffer of `modules` uses, each storage once:
    what producing them allocated (received buffers, gathered or merged tensors), as opposed to the models' own
    tensors handed on as they are."""
    own = _storages(_module_tensors(modules))
    return sum(n for key, n in _storages(tensors).items() if key not in own)


def joined(buckets: Iterable[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """A streamed weight sync's buckets as one mapping (every bucket consumed, so a stream's collectives run)."""
    return {name: t for bucket in buckets for name, t in bucket.items()}


def metered(
    buckets: Iterable[Mapping[str, Tensor]], *modules: nn.Module
) -> Iterator[tuple[Mapping[str, Tensor], int]]:
    """Each bucket of a streamed weight sync with the most `unshared_bytes` any bucket so far allocated beside
    `modules` (a stream frees a bucket before producing the next: its peak is its largest bucket's)."""
    peak = 0
    for bucket in buckets:
        peak = max(peak, unshared_bytes(bucket.values(), *modules))
        yield bucket, peak


def cast_copy(model: Transformer, dtype: torch.dtype) -> Transformer:
    """A frozen copy of `model` with its floating-point weights in `dtype`, made without a full-precision copy
    first (deepcopy would double the fp32 weights for a moment): each parameter is cast as it is copied, tied
    ones once."""
    memo: dict[int, object] = {
        id(p): torch.nn.Parameter(
            p.detach().to(dtype) if p.is_floating_point() else p.detach().clone(), False
        )
        for p in model.parameters()
    }
    return copy.deepcopy(model, memo).eval().requires_grad_(False)
