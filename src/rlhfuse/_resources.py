"""Locate the resources that live at the repository root (`conf/`, `kernels/`); read the JSON files a user
hands in (`read_json`: one error naming the file, never a bare decoder message).

In a source checkout (editable install) they sit beside `src/`; in a wheel they are shipped inside the
package as `rlhfuse/conf` and `rlhfuse/kernels` (see `[tool.hatch.build.targets.wheel.force-include]`).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

_PACKAGE_DIR = Path(__file__).resolve().parent


def _find(name: str) -> Path:
    candidates = [_PACKAGE_DIR / name, _PACKAGE_DIR.parent.parent / name]
    for path in candidates:
        if path.is_dir():
            return path
    tried = ", ".join(str(p) for p in candidates)
    raise FileNotFoundError(
        f"rlhfuse resource folder {name!r} not found (looked in {tried}); reinstall rlhfuse "
        "(`pip install rlhfuse` ships it inside the wheel, a source checkout keeps it at the repository root)"
    )


@cache
def conf_dir() -> Path:
    """The Hydra configuration folder (`conf/`)."""
    return _find("conf")


@cache
def kernels_dir() -> Path:
    """The Triton kernels folder (`kernels/`)."""
    return _find("kernels")


@cache
def load_kernel_module(name: str) -> ModuleType:
    """Import `kernels/<name>.py` as module `rlhfuse.kernels.<name>`, wherever `kernels/` lives."""
    path = kernels_dir() / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"kernel module {name!r} not found at {path}")
    module_name = f"rlhfuse.kernels.{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def read_json(path: Path, error: type[Exception]) -> Any:
    """`path` parsed as UTF-8 JSON; `error` naming the file and the position otherwise."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise error(f"{path} is not UTF-8 text (byte {err.start}): re-save it as UTF-8 JSON") from None
    except json.JSONDecodeError as err:
        raise error(
            f"{path} is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}): fix or replace the file"
        ) from None
