"""The package graph, read from the source: dependencies flow one way (no cycle between rlhfuse's subpackages,
imports inside functions included), `rlhfuse.trainer` is the composition root that no other package imports,
and the bottom package `rlhfuse.core` imports none of the execution packages."""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import rlhfuse

ROOT = pathlib.Path(rlhfuse.__file__).parent


def _package_of(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported(node: ast.AST, module_parts: list[str]) -> list[str]:
    """Absolute module names an import statement names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = module_parts[: len(module_parts) - node.level]
            name = ".".join([*base, *([node.module] if node.module else [])])
        else:
            name = node.module or ""
        if name == "rlhfuse":  # `from rlhfuse import ops`
            return [f"rlhfuse.{alias.name}" for alias in node.names]
        return [name]
    return []


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        parts = ["rlhfuse", *path.relative_to(ROOT).with_suffix("").parts]
        source = _package_of(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):  # every import, nested ones too
            for name in _imported(node, parts):
                if name.startswith("rlhfuse.") and (target := name.split(".")[1]) != source:
                    graph[source].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_cycle_between_subpackages() -> None:
    cycle = _cycle(package_graph())
    assert cycle is None, f"import cycle between rlhfuse subpackages: {' -> '.join(cycle or [])}"


def test_trainer_is_the_composition_root() -> None:
    importers = sorted(src for src, targets in package_graph().items() if "trainer" in targets)
    assert importers == [], f"only rlhfuse.trainer composes the components; imported by {importers}"


def test_core_sits_at_the_bottom() -> None:
    allowed = {"algorithms", "models", "_lazy", "_optional", "_resources"}
    assert package_graph()["core"] <= allowed, package_graph()["core"] - allowed


def test_the_graph_reader_sees_nested_and_relative_imports(tmp_path: pathlib.Path) -> None:
    tree = ast.parse("def f():\n    from rlhfuse.trainer import build\n    from .. import ops\n")
    names = [n for node in ast.walk(tree) for n in _imported(node, ["rlhfuse", "runtime", "strategy"])]
    assert names == ["rlhfuse.trainer", "rlhfuse.ops"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_distributed_sits_just_above_core() -> None:
    """rlhfuse.distributed (the only caller of torch.distributed collectives) may use core, nothing above it;
    core does not import it back."""
    graph = package_graph()
    assert graph["distributed"] <= {"core"}, graph["distributed"] - {"core"}
    assert "distributed" not in graph["core"]


def _untyped_config_parameters(tree: ast.AST) -> list[str]:
    """Functions of `tree` taking the run's root config below the trainer: a parameter named `cfg` (its name
    throughout the trainer), or one named `config` annotated `Any`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                untyped = isinstance(arg.annotation, ast.Name) and arg.annotation.id == "Any"
                if arg.arg == "cfg" or (arg.arg == "config" and untyped):
                    found.append(f"{node.name}({arg.arg})")
    return found


def test_no_layer_below_the_trainer_reads_the_root_config() -> None:
    """Below the composition root each component takes its own typed part of the configuration (a runtime
    check takes `PipelineRun`, a model helper its `ModelConfig`), never the whole config typed `Any`."""
    offenders = {
        str(path.relative_to(ROOT)): found
        for path in sorted(ROOT.rglob("*.py"))
        if path.relative_to(ROOT).parts[0] != "trainer"
        and (found := _untyped_config_parameters(ast.parse(path.read_text())))
    }
    # the planner reads any ModelConfig-shaped object by attribute, so that it needs no torch import
    assert offenders == {"planner/specs.py": ["from_config(config)"]}, offenders
    assert _untyped_config_parameters(ast.parse("def f(cfg): ...\ndef g(config: Any): ...")) == [
        "f(cfg)",
        "g(config)",
    ]


def _name_tests(tree: ast.AST) -> list[str]:
    """Comparisons of a component's name (`x.name`, or a recorded `...get("<group>.name")`) with string literals:
    asking which component was chosen rather than what it can do."""

    def is_name(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr == "name" and not (isinstance(node.value, ast.Name) and node.value.id == "os")
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and any(isinstance(a, ast.Constant) and str(a.value).endswith(".name") for a in node.args)
        )

    def is_literal(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str)
        return isinstance(node, ast.Tuple | ast.List | ast.Set) and all(is_literal(e) for e in node.elts)

    return [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        and any(is_name(s) for s in [node.left, *node.comparators])
        and any(is_literal(s) for s in [node.left, *node.comparators])
    ]


def test_capabilities_are_asked_of_registry_entries_not_of_names() -> None:
    """No module tests a component's name against a string ("is this vllm / fsdp / the pipeline inferencer"):
    what a strategy, generator, inferencer or migration policy is and what rules it brings are fields of its
    registry entry (`rlhfuse.trainer.topology`, the table in `rlhfuse.trainer.components`)."""
    offenders = {
        str(path.relative_to(ROOT)): found
        for path in sorted(ROOT.rglob("*.py"))
        if (found := _name_tests(ast.parse(path.read_text())))
    }
    assert offenders == {}, offenders
    probe = 'a = g.name == "vllm"\nb = p.name in ("fixed", "auto")\nc = r.get("pipeline.name") != "fsdp"\nd = os.name == "nt"'
    assert _name_tests(ast.parse(probe)) == [
        "g.name == 'vllm'",
        "p.name in ('fixed', 'auto')",
        "r.get('pipeline.name') != 'fsdp'",
    ]
