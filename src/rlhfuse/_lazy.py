"""Lazy public names of a package: `from rlhfuse.trainer import RLHFTrainer` imports the module that defines the
name on first use, so that importing the package itself stays cheap (`rlhfuse-train --help` loads neither torch
nor Lightning). A package lists its names once more under `if TYPE_CHECKING:`, for type checkers."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Mapping
from typing import Any


def lazy_package(package: str, public: Mapping[str, tuple[str, ...]]) -> None:
    """Make the public names of `package` (its defining module -> names) lazy: each is imported on first access
    and then kept as a plain attribute."""
    home = {name: module for module, names in public.items() for name in names}

    class LazyPackage(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            module = home.get(name)
            if module is None:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            value = getattr(importlib.import_module(module), name)
            setattr(self, name, value)
            return value

        def __dir__(self) -> list[str]:
            return sorted({*vars(self), *home})

        def __setattr__(self, name: str, value: Any) -> None:
            # Importing a submodule binds it on its package, and one may share its name with a public name (the
            # module rlhfuse.trainer.validate and the function validate): the public name keeps its meaning, as
            # it does when the package imports it eagerly.
            if name in home and isinstance(value, types.ModuleType):
                return
            super().__setattr__(name, value)

    sys.modules[package].__class__ = LazyPackage
