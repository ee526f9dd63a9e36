"""Weight resharding, training layout -> generation layout (RLHFuse's all-to-all after every update).

Training holds the Actor as pipeline stages, each split `T` ways tensor-parallel (pipeline.actor_tp; the ranks of
one stage's tp position are `ParallelLayout.tp_grad_groups`). Generation runs world / g instances of g
consecutive ranks (generator.tp = g): rank r is position r % g of instance r // g and needs, of every Actor
tensor, exactly the slice `shard_transformer(actor, r % g, g)` holds (vocabulary padded to a multiple of g, the
padded rows zero; a kv head replicated when g exceeds the kv heads; a mixture's experts whole on the position
that holds them, `ExpertParallelMoEBlock`, or split over their width). Any T and any g dividing the world.

Planning is pure (`plan_reshard`): every tensor is cut along its split dimension into the intervals where one
training shard's range meets one generation shard's range; each piece a rank lacks comes point to point from a
holder of that training shard (among the holders of a piece, i.e. the data-parallel and replica copies, one on the receiver's node first,
then the one that has sent the fewest bytes so far, so that traffic stays inside nodes and spreads), and a piece the rank itself holds is copied locally. Nobody
receives a whole tensor it does not need and no rank gathers the whole model: g = 1 receives the whole Actor
(its generation copy is whole), g = T over the training tp groups receives only the shards of the stages it
lacks. `Resharder.run` executes the plan: per (sender, receiver, dtype) one flat buffer on the layout's device,
all sends and receives posted at once.

Legend: T training tp degree, g generation tp degree; a range [lo, hi) is in the full tensor's coordinates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlhfuse import distributed
from rlhfuse.core.buckets import split_consecutive
from rlhfuse.core.optim import cast_to
from rlhfuse.models import Transformer, stage_of
from rlhfuse.runtime.layout import ParallelLayout
from rlhfuse.runtime.tensor_parallel import _split, _twins, full_shapes, shard_transformer

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Split:
    """How one tensor is split over a tp group: along `dim`, position p holds the full tensor's [lo, hi) =
    `bounds[p]` in its first hi - lo rows (then zero padding up to `local` rows along `dim`; an empty range: none
    of it, a whole expert another position holds, `local` 0 here)."""

    dim: int
    bounds: Ranges
    local: int


@dataclass(frozen=True)
class Entry:
    """One distinct tensor of the Actor: its state-dict names (tied weights share one tensor), stage, full
    shape, and its training and generation splits (None: replicated, every position holds it whole). Every rank
    plans over the same entries, the ones it holds or not (`full_shapes`)."""

    names: tuple[str, ...]
    stage: int
    shape: tuple[int, ...]
    train: Split | None
    gen: Split | None


@dataclass(frozen=True)
class Piece:
    """Rows [lo, hi) along `dim` of entry `entry` (an index into the plan's entries), sent by `src` from its
    training shard (which holds [src_start, src_stop); the piece at offset lo - `src_start`) to `dst`'s
    generation shard (at offset lo - `dst_start`)."""

    entry: int
    src: int
    dst: int
    dim: int
    lo: int
    hi: int
    src_start: int
    src_stop: int
    dst_start: int


@dataclass(frozen=True)
class ReshardRoutes:
    entries: tuple[Entry, ...]
    pieces: tuple[Piece, ...]
    gen_tp: int

    def received_bytes(self, rank: int, element_size: Mapping[int, int]) -> int:
        """Bytes `rank` receives from other ranks (`element_size`: entry index -> bytes per element)."""
        return sum(
            self.piece_numel(p) * element_size[p.entry]
            for p in self.pieces
            if p.dst == rank and p.src != rank
        )

    def piece_numel(self, piece: Piece) -> int:
        shape = list(self.entries[piece.entry].shape)
        shape[piece.dim] = piece.hi - piece.lo
        return int(torch.Size(shape).numel())


def plan_reshard(
    entries: Sequence[Entry],
    train_tp: int,
    gen_tp: int,
    world: int,
    holders: Callable[[int, int], Sequence[int]],
    element_size: Callable[[int], int] = lambda _: 1,
    ranks_per_node: int = 0,
) -> ReshardRoutes:
    """Pure: every piece every rank of `world` needs for its generation shard (position r % gen_tp), and who
    sends it. `holders(stage, t)`: the ranks holding training shard t of `stage` (a receiver that is one of them
    copies locally); among several holders, one on the receiver's node (`ranks_per_node` consecutive ranks per
    node; 0 = one node) first, then the one that has sent the fewest bytes so far, then the lowest rank."""
    per_node = ranks_per_node if ranks_per_node > 0 else world
    sent: dict[int, int] = {}
    pieces: list[Piece] = []
    for i, e in enumerate(entries):
        for dst in range(world):
            j = dst % gen_tp
            if e.gen is not None:
                dim, (a, b), dst_start = e.gen.dim, e.gen.bounds[j], e.gen.bounds[j][0]
            else:
                dim = e.train.dim if e.train is not None else 0
                a, b, dst_start = 0, e.shape[dim], 0
            if e.train is not None:
                if e.train.dim != dim:
                    raise ValueError(
                        f"{e.names[0]}: split along dim {e.train.dim} in training, {dim} in generation"
                    )
                train_bounds = e.train.bounds
            else:
                train_bounds = ((0, e.shape[dim]),) * train_tp
            cursor = a
            while cursor < b:
                options = [t for t, (lo, hi) in enumerate(train_bounds) if lo <= cursor < hi]
                if not options:
                    raise ValueError(f"{e.names[0]}: no training shard holds index {cursor} along dim {dim}")
                end = min(b, max(train_bounds[t][1] for t in options))
                options = [t for t in options if train_bounds[t][1] >= end]
                local = [t for t in options if dst in holders(e.stage, t)]
                if local:
                    t, src = local[0], dst
                else:
                    candidates = sorted({(r, t) for t in options for r in holders(e.stage, t)})
                    src, t = min(
                        candidates,
                        key=lambda rt: (rt[0] // per_node != dst // per_node, sent.get(rt[0], 0), rt[0]),
                    )
                piece = Piece(i, src, dst, dim, cursor, end, *train_bounds[t], dst_start)
                pieces.append(piece)
                if src != dst:
                    shape = list(e.shape)
                    shape[dim] = end - cursor
                    sent[src] = sent.get(src, 0) + int(torch.Size(shape).numel()) * element_size(i)
                cursor = end
    return ReshardRoutes(tuple(entries), tuple(pieces), gen_tp)


def _splits(module: nn.Module) -> dict[str, Split]:
    """state-dict name -> Split of a `shard_transformer` shard's split tensors (whole experts held elsewhere
    included)."""
    local = module.state_dict(keep_vars=True)
    return {
        name: Split(
            dim,
            tuple(tuple(b) for b in bounds),  # type: ignore[misc]
            int(local[name].shape[dim]) if name in local else 0,
        )
        for name, (dim, bounds, _) in _split(module).items()
    }


def generation_spec(
    actor: Transformer, gen_tp: int, position: int
) -> tuple[dict[str, Split], dict[str, torch.Size]]:
    """The generation shard's splits and this position's local shapes, from a meta-device copy of the whole
    Actor split `gen_tp` ways (the layout `shard_transformer` gives the generator; nothing is allocated)."""
    with torch.device("meta"):
        whole = Transformer(actor.config, head=actor.head)
    if gen_tp == 1:
        return {}, {k: v.shape for k, v in whole.state_dict().items()}
    shard = shard_transformer(whole, position, gen_tp)
    return _splits(shard), {k: v.shape for k, v in shard.state_dict().items()}


class Resharder:
    """This rank's side of the resharding of one model (the Actor) from the training layout to generation
    instances of `gen_tp` ranks; the plan is made once (shapes and placement do not change between updates).

    `model`: this rank's trained model (its stages materialised, the others meta; a tp shard when T > 1).
    `everywhere`: every rank holds every stage (full copies brought in sync by `RankStages.gather`), so every
    piece is local. `ranks_per_node`: consecutive ranks per node, to prefer a sender on the receiver's node
    (default: torchrun's LOCAL_WORLD_SIZE, else one node)."""

    def __init__(
        self,
        layout: ParallelLayout,
        rank: int,
        model: Transformer,
        gen_tp: int,
        *,
        everywhere: bool = False,
        ranks_per_node: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        world = layout.world_size
        if gen_tp < 1 or world % gen_tp:
            raise ValueError(
                f"generator.tp={gen_tp} does not divide the world size {world}: set generator.tp to a divisor"
            )
        self.layout, self.rank, self.model, self.gen_tp = layout, rank, model, gen_tp
        self.device = torch.device(layout.device)
        train_tp = layout.model_tp("actor")
        state = model.state_dict(keep_vars=True)
        train_splits = _splits(model) if train_tp > 1 else {}
        shapes = full_shapes(model) if train_tp > 1 else {k: v.shape for k, v in state.items()}
        # a whole expert another position holds has no tensor here: this rank's expert of the same slot stands for
        # it (the same shape and dtype)
        like = {each: k for k, names in _twins(model).items() for each in names} if train_tp > 1 else {}
        gen_splits, self.local_shapes = generation_spec(model, gen_tp, rank % gen_tp)
        n, layers = layout.stages("actor"), model.config.num_layers
        by_tensor: dict[object, list[str]] = {}
        for k in shapes:  # the same names in the same order on every rank
            by_tensor.setdefault(id(state[k]) if k in state else k, []).append(k)
        entries = [
            Entry(tuple(names), stage_of(names[0], layers, n), tuple(shapes[names[0]]),
                  train_splits.get(names[0]), gen_splits.get(names[0]))
            for names in by_tensor.values()
        ]  # fmt: skip
        trained_dtypes = [state[like.get(e.names[0], e.names[0])].dtype for e in entries]
        # what each tensor is sent and held in: the generator's dtype for floating point (None: as trained)
        self.dtypes = [cast_to(d, dtype) for d in trained_dtypes]
        sizes = [torch.empty((), dtype=d).element_size() for d in self.dtypes]

        def holders(stage: int, t: int) -> Sequence[int]:
            if everywhere:
                return range(world)
            return layout.tp_grad_groups[("actor", stage, t)]

        if ranks_per_node is None:  # torchrun's (vLLM sets a LOCAL_WORLD_SIZE of its own without WORLD_SIZE)
            ranks_per_node = distributed.launched_local_world() or 0
        self.plan = plan_reshard(
            entries, train_tp, gen_tp, world, holders, lambda i: sizes[i], ranks_per_node
        )
        self.element_size = dict(enumerate(sizes))
        # this rank's side of the plan, fixed: its local copies, and its messages per (sender, receiver, dtype)
        mine = [p for p in self.plan.pieces if p.dst == rank]
        self.local = [p for p in mine if p.src == rank]
        self.aliased = set[int]()
        """Entries whose generation shard is exactly this rank's own trained tensor (handed over, no copy)."""
        for i, e in enumerate(entries):
            own = [p for p in mine if p.entry == i]
            if len(own) != 1 or own[0].src != rank:  # (src == rank: the entry is held here)
                continue
            p = own[0]
            same_shape = state[e.names[0]].shape == self.local_shapes[e.names[0]]
            same = same_shape and trained_dtypes[i] == self.dtypes[i]
            if same and p.src_start == p.lo == p.dst_start and p.src_stop == p.hi:
                self.aliased.add(i)
        messages: dict[tuple[int, int, str], list[Piece]] = {}
        for p in self.plan.pieces:
            if p.src != p.dst and rank in (p.src, p.dst):
                messages.setdefault((p.src, p.dst, str(self.dtypes[p.entry])), []).append(p)
        self.messages = sorted(messages.items())
        self.received_bytes = 0
        """Bytes this rank received in the last `run` (its generation shard minus what it held)."""

    def run(self) -> dict[str, Tensor]:
        """Collective (every rank): this rank's generation shard of every Actor tensor, keyed like the state dict
        of `shard_transformer(actor, rank % g, g)` (g = 1: the whole Actor's). A tensor whose shard is exactly one
        of this rank's own trained tensors is returned as it (detached, no copy)."""
        return {name: t for bucket in self.buckets(None) for name, t in bucket.items()}

    def buckets(self, cap_bytes: int | None) -> Iterator[dict[str, Tensor]]:
        """Collective (every rank consumes every bucket): `run()`'s tensors in buckets of consecutive entries whose
        whole tensors hold at most `cap_bytes` (one larger entry alone; None: one bucket), each resharded when it
        is asked for, so at most one bucket's received and copied tensors exist at a time (beyond what the
        consumer keeps). Every rank cuts the same buckets (from the full shapes) and sends a pair's pieces in the
        same order, bucket after bucket."""
        entries = self.plan.entries
        whole = [math.prod(e.shape) * self.element_size[i] for i, e in enumerate(entries)]
        runs = [range(len(entries))] if cap_bytes is None else split_consecutive(whole, cap_bytes)
        self.received_bytes = 0
        state = self.model.state_dict(keep_vars=True)
        for run in runs:
            yield self._run_entries(run, state)

    def _run_entries(self, chosen: range, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        entries, rank = self.plan.entries, self.rank
        # None: a whole expert this rank neither holds (training) nor gets (generation); no piece names it here
        trained = {
            i: state[entries[i].names[0]].detach() if entries[i].names[0] in state else None for i in chosen
        }
        out: dict[int, Tensor | None] = {
            i: trained[i]
            if i in self.aliased
            else torch.zeros(self.local_shapes[e.names[0]], dtype=self.dtypes[i], device=self.device)
            if e.names[0] in self.local_shapes
            else None
            for i in chosen
            for e in [entries[i]]
        }

        def piece_of(tensor: Tensor | None, p: Piece, start: int) -> Tensor:
            assert tensor is not None, f"{entries[p.entry].names[0]}: a piece of a tensor rank {rank} lacks"
            return tensor.narrow(p.dim, p.lo - start, p.hi - p.lo)

        works: list[distributed.Work] = []
        keep: list[Tensor] = []  # send buffers stay alive until every send completed
        inbox: list[tuple[Tensor, list[Piece]]] = []
        received = 0
        for (src, dst, _), every in self.messages:
            pieces = [p for p in every if p.entry in chosen]
            if not pieces:
                continue
            if src == rank:
                flat = torch.cat(
                    [
                        piece_of(trained[p.entry], p, p.src_start).reshape(-1).to(self.dtypes[p.entry])
                        for p in pieces
                    ]
                )
                keep.append(flat)
                works.append(distributed.isend(flat, dst))
            else:
                dtype = self.dtypes[pieces[0].entry]
                numel = sum(self.plan.piece_numel(p) for p in pieces)
                flat = torch.empty(numel, dtype=dtype, device=self.device)
                works.append(distributed.irecv(flat, src))
                inbox.append((flat, pieces))
                received += flat.numel() * flat.element_size()
        with torch.no_grad():
            for p in self.local:  # overlapped with the messages in flight
                if p.entry in chosen and p.entry not in self.aliased:
                    piece_of(out[p.entry], p, p.dst_start).copy_(piece_of(trained[p.entry], p, p.src_start))
        distributed.wait_all(works)
        with torch.no_grad():
            for flat, pieces in inbox:
                offset = 0
                for p in pieces:
                    target = piece_of(out[p.entry], p, p.dst_start)
                    target.copy_(flat[offset : offset + target.numel()].view(target.shape))
                    offset += target.numel()
        self.received_bytes += received
        return {name: t for i, t in out.items() if t is not None for name in entries[i].names}
