"""Every torch.distributed collective and point-to-point call of rlhfuse lives in `rlhfuse.distributed` (read from
the source with `ast`: aliases, `from torch.distributed import ...` and `torch.distributed.<op>` chains)."""

from __future__ import annotations

import ast
import pathlib

import rlhfuse

ROOT = pathlib.Path(rlhfuse.__file__).parent

OPS = frozenset(
    {
        "all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_object",
        "all_gather_into_tensor", "all_gather_coalesced", "gather", "gather_object", "scatter",
        "scatter_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
        "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
        "batch_isend_irecv", "broadcast_object_list", "send_object_list", "recv_object_list", "P2POp",
    }
)  # fmt: skip


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def violations(source: str, name: str = "<snippet>") -> list[str]:
    """`file:line op` for every torch.distributed collective / point-to-point call (or import of one)."""
    tree = ast.parse(source)
    aliases = {"torch.distributed"}  # names bound to the torch.distributed module
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch.distributed") and alias.asname:
                    aliases.add(alias.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full.startswith("torch.distributed") and alias.name not in OPS:
                    aliases.add(alias.asname or alias.name)
                if node.module.startswith("torch.distributed") and alias.name in OPS:
                    found.append(f"{name}:{node.lineno} from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in OPS:
            base = _dotted(node.value)
            if base in aliases or (base or "").startswith("torch.distributed"):
                found.append(f"{name}:{node.lineno} {base}.{node.attr}")
    return found


def test_no_collective_outside_rlhfuse_distributed() -> None:
    found = [
        v
        for path in sorted(ROOT.rglob("*.py"))
        if "distributed" not in path.relative_to(ROOT).parts[:1]
        for v in violations(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    ]
    assert found == [], (
        "torch.distributed calls outside rlhfuse/distributed (use its helpers):\n" + "\n".join(found)
    )


def test_the_boundary_reader_catches_every_spelling() -> None:
    snippet = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch import distributed as d2\n"
        "from torch.distributed import isend\n"
        "def f(x):\n"
        "    dist.all_reduce(x)\n"
        "    d2.broadcast(x, 0)\n"
        "    torch.distributed.barrier()\n"
        "    fn = dist.all_gather_object\n"
        "    isend(x, 1)\n"
        "    from rlhfuse import distributed\n"
        "    distributed.all_reduce(x)\n"  # the helpers are fine
        "    dist.get_rank()\n"  # not a collective
    )
    found = violations(snippet)
    assert sorted(v.split()[-1] for v in found) == sorted(
        ["isend", "dist.all_reduce", "d2.broadcast", "torch.distributed.barrier", "dist.all_gather_object"]
    ), found
