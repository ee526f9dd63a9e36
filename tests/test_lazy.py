"""The packages whose public names load on first use (`rlhfuse._lazy`): each name is listed once under
`TYPE_CHECKING` (for type checkers), in the lazy table (for the interpreter) and in `__all__`, the three agree, and
each resolves to the object its module defines."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

import rlhfuse

ROOT = pathlib.Path(rlhfuse.__file__).parent
LAZY = sorted(
    ".".join(["rlhfuse", *p.parent.relative_to(ROOT).parts])
    for p in ROOT.rglob("__init__.py")
    if "lazy_package(" in p.read_text()
)


def declared(package: str) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """From the package's source: name -> module under TYPE_CHECKING, name -> module in its table, `__all__`."""
    tree = ast.parse((ROOT.joinpath(*package.split(".")[1:]) / "__init__.py").read_text())
    checked: dict[str, str] = {}
    table: dict[str, str] = {}
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module
                checked.update({a.name: imp.module for a in imp.names})
        elif isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "_PUBLIC":
            for module, group in ast.literal_eval(node.value).items():
                table.update(dict.fromkeys(group, module))
        elif isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__":
            names = ast.literal_eval(node.value)
    return checked, table, names


def test_the_lazy_packages_are_found():
    assert {"rlhfuse.trainer", "rlhfuse.core", "rlhfuse.models", "rlhfuse.runtime"} <= set(LAZY), LAZY


@pytest.mark.parametrize("package", LAZY)
def test_names_are_declared_alike_and_resolve(package):
    checked, table, names = declared(package)
    assert checked == table, set(checked.items()) ^ set(table.items())
    assert sorted(names) == sorted(table)
    module = importlib.import_module(package)
    for name, home in table.items():
        assert getattr(module, name) is getattr(importlib.import_module(home), name), name
    assert set(names) <= set(dir(module))


def test_a_submodule_does_not_replace_the_public_name_it_shares():
    """`rlhfuse.runtime.lower` is a function (the package's name) and a module: importing the module keeps the
    function, as the eager import did."""
    import rlhfuse.runtime
    import rlhfuse.runtime.lower
    from rlhfuse.runtime import lower

    assert callable(lower) and rlhfuse.runtime.lower is lower
    assert lower is importlib.import_module("rlhfuse.runtime.lower").lower
