"""Split backward: a stage's backward as I (input gradient, now) then W (weight gradients, later).

I runs autograd from the stage's output to its input only, keeping the graph, and captures the gradient arriving
at each node where a parameter's branch joins the path from output to input (the join nodes). W later runs
autograd from those nodes, with the captured gradients, to the parameters only: the weight-gradient kernels that
B would have run, and nothing of the input-gradient path again. This is the zero-bubble split (Qi et al., "Zero
Bubble Pipeline Parallelism", ICLR'24; torch.distributed.pipelining does the same), written on autograd's public
graph API (`Node.register_prehook`, `GradientEdge`) so that W accumulates through each parameter's
AccumulateGrad like B: `.grad` sums, post-accumulate hooks (the bucketed gradient reduction) fire as in B.

A parameter whose branch never joins that path (a first stage: its input is token ids, no gradient; or a
parameter feeding only a side output) gets its gradient in W from the stage output, over the kept graph: right,
at the cost of that part of the backward run in W.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class _JoinGroup:
    """Parameters whose branches join the input path at `joins`, and the gradients captured there in I."""

    params: list[Tensor]
    joins: list[Node]
    grads: dict[int, tuple[Tensor | None, ...]] = field(default_factory=dict)  # index in joins -> captured


@dataclass
class PendingWeights:
    """What W needs after I: the join groups with their captured gradients, and (only when some parameter never
    joins the input path) the stage output and its gradient, over the kept graph."""

    groups: list[_JoinGroup]
    rest: list[Tensor]
    output: Tensor | None
    grad_output: Tensor | None


def _node(t: Tensor) -> Node | None:
    return get_gradient_edge(t).node if t.requires_grad else None


def _parents(root: Node) -> dict[Node, list[Node]]:
    """Every node reachable from `root` (towards the leaves) -> the nodes that feed it a gradient."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen, todo = {root}, deque([root])
    while todo:
        node = todo.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            parents[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return parents


def _ancestors(start: Node, parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes on a gradient path from the root to `start` (walking up), not entering `stop`; and the `stop` nodes
    met on the way."""
    seen, met, todo = {start}, set(), deque([start])
    while todo:
        for up in parents.get(todo.popleft(), ()):
            if up in stop:
                met.add(up)
            elif up not in seen:
                seen.add(up)
                todo.append(up)
    return seen, met


def _join_groups(
    root: Node, x: Tensor | None, params: Sequence[Tensor]
) -> tuple[list[_JoinGroup], list[Tensor]]:
    """The parameters grouped by the nodes where their branches join the output-to-input path, and the
    parameters whose branches never join it."""
    parents = _parents(root)
    x_node = _node(x) if x is not None else None
    path: set[Node] = set()
    if x_node is not None and (x_node in parents or x_node is root):
        path, _ = _ancestors(x_node, parents, set())
        path.discard(x_node)
    by_join: dict[Node, _JoinGroup] = {}
    rest: list[Tensor] = []
    for p in params:
        node = _node(p)
        if node is None or node not in parents:
            continue  # frozen, or not used by this stage: no gradient, as in B
        _, joins = _ancestors(node, parents, path)
        if not joins:
            rest.append(p)
            continue
        groups = {id(by_join[j]): by_join[j] for j in joins if j in by_join}
        merged = _JoinGroup([p], [j for j in joins if j not in by_join])
        for g in groups.values():  # branches meeting at a shared join node: one group
            merged.params += g.params
            merged.joins += g.joins
        for j in merged.joins:
            by_join[j] = merged
    unique = {id(g): g for g in by_join.values()}
    return list(unique.values()), rest


def backward_input(
    output: Tensor, grad_output: Tensor | None, x: Tensor | None, params: Sequence[Tensor]
) -> tuple[Tensor | None, PendingWeights]:
    """I: the gradient of `output` (times `grad_output`; None for a scalar loss) with respect to the stage input
    `x` (None, or not requiring grad, on a first stage), and what W needs to finish the weight gradients."""
    root = output.grad_fn
    if root is None:
        raise ValueError("backward_input: the stage output has no autograd graph (run the forward with grad)")
    needs_x = x is not None and x.requires_grad
    groups, rest = _join_groups(root, x if needs_x else None, params)
    handles = []
    for group in groups:
        for i, join in enumerate(group.joins):

            def capture(
                grad_outputs: tuple[Tensor | None, ...], group: _JoinGroup = group, i: int = i
            ) -> None:
                group.grads[i] = grad_outputs

            handles.append(join.register_prehook(capture))
    grad_x = None
    try:
        if needs_x:
            assert x is not None
            (grad_x,) = torch.autograd.grad(output, (x,), grad_output, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    keep = bool(rest)
    return grad_x, PendingWeights(groups, rest, output if keep else None, grad_output if keep else None)


def backward_weight(pending: PendingWeights) -> None:
    """W: accumulate the weight gradients left by `backward_input` into `.grad` (through each parameter's
    AccumulateGrad, as B does), then release the graph."""
    if pending.rest:  # first: it runs over the join nodes, whose buffers the groups' passes free
        assert pending.output is not None
        torch.autograd.backward(pending.output, pending.grad_output, retain_graph=True, inputs=pending.rest)
    for group in pending.groups:
        edges, grads = [], []
        for i, join in enumerate(group.joins):
            for k, g in enumerate(group.grads.get(i, ())):
                if g is not None:
                    edges.append(GradientEdge(join, k))
                    grads.append(g)
        if not edges:
            continue
        handles = []
        if len(group.joins) > 1:  # a join downstream of another receives its captured gradient, not the sum
            for i, join in enumerate(group.joins):
                captured = group.grads.get(i)
                handles.append(join.register_prehook(lambda _g, captured=captured: captured))
        try:
            torch.autograd.backward(edges, grads, inputs=group.params)
        finally:
            for handle in handles:
                handle.remove()
    pending.groups.clear()
    pending.output = pending.grad_output = None
