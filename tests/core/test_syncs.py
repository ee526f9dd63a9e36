"""`SyncCounter`: each kind of device-to-host read counted once, device-only work counted zero (on the CPU, which
stands in for the device)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rlhfuse.core.syncs import SyncCounter
from rlhfuse.models import upload

X = torch.arange(6)
MASK = X > 2

SYNCING: list[tuple[str, str, Callable[[], object]]] = [
    ("item", "item", lambda: X[0].item()),
    ("bool", "item", lambda: bool(MASK[0])),
    ("int", "item", lambda: int(X[1])),
    ("float", "item", lambda: float(X[1])),
    ("any() as a condition", "item", lambda: 1 if MASK.any() else 0),
    ("a tensor as a slice bound", "item", lambda: X[: X[2]]),
    ("a tensor as a list index", "item", lambda: [1, 2, 3][X[1]]),
    ("tolist", "tolist", lambda: X.tolist()),
    ("numpy", "numpy", lambda: X.numpy()),
    ("cpu", "cpu", lambda: X.cpu()),
    ("nonzero", "nonzero", lambda: X.nonzero()),
    ("where(mask)", "nonzero", lambda: torch.where(MASK)),
    ("boolean mask index", "bool_index", lambda: X[MASK]),
    ("masked_select", "masked_select", lambda: X.masked_select(MASK)),
    ("unique", "unique", lambda: X.unique()),
    ("repeat_interleave by a tensor", "repeat_interleave", lambda: X.repeat_interleave(X)),
]

DEVICE_ONLY: list[tuple[str, Callable[[], object]]] = [
    ("arithmetic and reductions", lambda: (X * 2 + 1).sum().max()),
    ("comparison to a Python int", lambda: X[0] == 1),
    ("integer-tensor index", lambda: X[torch.tensor([1, 2])]),
    ("index_put with a tensor index", lambda: X.clone().index_put_((torch.tensor([0]),), torch.tensor(9))),
    ("torch.where(mask, a, b)", lambda: torch.where(MASK, X, -X)),
    ("isin", lambda: torch.isin(X, torch.tensor([1, 2]))),
    ("repeat_interleave with output_size", lambda: X.repeat_interleave(X, output_size=15)),
    ("repeat_interleave by an int", lambda: X.repeat_interleave(2)),
    ("argmax / cumsum / searchsorted", lambda: torch.searchsorted(X.cumsum(0), X[None, :2]).argmax()),
    ("shape and len", lambda: (X.shape[0], len(X), X.numel())),
    ("upload of host ints", lambda: upload([[1, 2], [3, 4]], torch.device("cpu"))),
]


@pytest.mark.parametrize(("name", "kind", "fn"), SYNCING, ids=[c[0] for c in SYNCING])
def test_each_kind_is_counted_once(name, kind, fn):
    with SyncCounter(device="cpu") as counter:
        fn()
    assert counter.count == 1 and counter.by_kind == {kind: 1}, (name, dict(counter.by_kind))


@pytest.mark.parametrize(("name", "fn"), DEVICE_ONLY, ids=[c[0] for c in DEVICE_ONLY])
def test_device_only_work_counts_zero(name, fn):
    with SyncCounter(device="cpu") as counter:
        fn()
    assert counter.count == 0, (name, dict(counter.by_kind))


def test_counts_add_up_and_methods_are_restored():
    original = torch.Tensor.tolist
    defined_on_tensor = {name: name in torch.Tensor.__dict__ for name in ("tolist", "numpy", "cpu")}
    with SyncCounter(device="cpu") as counter:
        for _ in range(3):
            X.tolist()
        int(X[0])
        X.cpu()
    assert counter.by_kind == {"tolist": 3, "item": 1, "cpu": 1} and counter.count == 5
    assert torch.Tensor.tolist is original
    assert {name: name in torch.Tensor.__dict__ for name in defined_on_tensor} == defined_on_tensor
    X.tolist()  # outside: not counted
    assert counter.count == 5


def test_nested_counters_count_alone():
    with SyncCounter(device="cpu") as outer:
        X.tolist()
        with SyncCounter(device="cpu") as inner:
            int(X[0])
            X.tolist()
        bool(MASK[1])
    assert inner.by_kind == {"item": 1, "tolist": 1}
    assert outer.by_kind == {"tolist": 1, "item": 1}


def test_tensors_off_the_counted_device_do_not_count():
    """Counting CUDA syncs, a read of a CPU tensor is host work, not a sync."""
    with SyncCounter(device="cuda") as counter:
        X.tolist()
        int(X[0])
        X[MASK]
    assert counter.count == 0
