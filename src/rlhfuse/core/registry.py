"""Components chosen by name.

An import path `package.module:attribute` is resolved only when the user's own config (or command line) names
it; rlhfuse never resolves names read from checkpoints or datasets, so no file can make rlhfuse import code.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar, cast

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, config_key: str, entries: Mapping[str, T] | None = None) -> None:
        self.kind = kind
        self.config_key = config_key
        self._entries: dict[str, T] = dict(entries or {})

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            return obj

        return add

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries or _is_import_path(name)

    def get(self, name: str) -> T:
        if name in self._entries:
            return self._entries[name]
        if _is_import_path(name):
            return cast(T, _import(name, self.config_key))
        raise KeyError(self.unknown_message(name))

    def unknown_message(self, name: str) -> str:
        return (
            f"unknown {self.kind} {self.config_key}={name!r}: known {self.kind} names are {self.names()} "
            f"(or name your own as 'package.module:function')"
        )


def _is_import_path(name: str) -> bool:
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr and all(part.isidentifier() for part in [*module.split("."), attr]))


def _import(path: str, config_key: str) -> object:
    """The attribute a `package.module:attribute` path names, the current directory searched first (as
    `python -m` does: a console script's own folder is what Python puts first on sys.path)."""
    module_name, _, attr = path.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        top = module_name.split(".")[0]
        if isinstance(err, ModuleNotFoundError) and (
            module_name == err.name or module_name.startswith(f"{err.name}.")
        ):
            raise KeyError(
                f"{config_key}={path!r}: cannot import module {module_name!r}: no {err.name!r} in the current "
                f"directory ({cwd}) nor on sys.path: run from the folder holding {top}.py (or the package "
                f"{top}/), or add that folder to PYTHONPATH"
            ) from err
        raise KeyError(
            f"{config_key}={path!r}: importing module {module_name!r} failed: {type(err).__name__}: {err}"
        ) from err
    if not hasattr(module, attr):
        raise KeyError(f"{config_key}={path!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)
