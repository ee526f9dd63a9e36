"""Shared helpers of the component configs: each config dataclass declares its closed choices as `Literal[...]`
types and lists its own problems (`problems()`, messages naming the key, the value and the fix); the trainer's
`validate` gathers them with the rules that span several components into one error."""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args, get_origin

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C")

FLAT = "flatten"


def flat_field(cls: Callable[[], C]) -> C:
    """A config composed into its parent with its keys at the parent's level: `pipeline.actor_lr` is
    `PipelineConfig.optim.actor_lr`. Hydra's YAML stays flat; the code reads the composed parts."""
    return dataclasses.field(default_factory=cls, metadata={FLAT: True})  # type: ignore[no-any-return]


def is_flat(f: dataclasses.Field[Any]) -> bool:
    return bool(f.metadata.get(FLAT))


KEY = "key"


def keyed_field(cls: Callable[[], C], key: str) -> C:
    """A config section whose key differs from its field's name: a Python keyword (`async`, the field
    `asynchronous`) is a YAML and command-line key but no dataclass field name."""
    return dataclasses.field(default_factory=cls, metadata={KEY: key})  # type: ignore[no-any-return]


def config_key(f: dataclasses.Field[Any]) -> str:
    """The field's key in YAML, on the command line and in run.json (its name unless `keyed_field` set one)."""
    return str(f.metadata.get(KEY, f.name))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def literal_choices(annotation: Any) -> tuple[Any, ...] | None:
    """The allowed values of a `Literal[...]` annotation (also inside `X | None` and `list[X]`), else None."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    for arg in get_args(annotation):
        if (choices := literal_choices(arg)) is not None:
            return choices
    return None


def choice_problems(section: DataclassInstance, prefix: str) -> list[str]:
    """One problem per field of the dataclass `section` (a config group) whose value is not among its `Literal`
    choices."""
    problems = []
    for f in dataclasses.fields(section):
        if is_flat(f):
            problems += choice_problems(getattr(section, f.name), prefix)
            continue
        choices = literal_choices(_hints(type(section))[f.name])  # type: ignore[arg-type]
        if choices is None:
            continue
        value = getattr(section, f.name)
        key = f"{prefix}.{config_key(f)}" if prefix else config_key(f)
        values = value if isinstance(value, list) else [value]
        for v in values:
            if v is not None and v not in choices:
                problems.append(f"{key}={v!r} is not one of {list(choices)}: set {key}=<one of them>")
    return problems


def need(problems: list[str], ok: bool, message: str) -> None:
    """Add `message` to `problems` unless `ok`."""
    if not ok:
        problems.append(message)


def positive(problems: list[str], key: str, value: float) -> None:
    need(problems, value > 0, f"{key}={value} must be > 0")


def non_negative(problems: list[str], key: str, value: float, zero: str) -> None:
    """`value >= 0`; `zero` says what 0 means (e.g. "0 = off")."""
    need(problems, value >= 0, f"{key}={value} must be >= 0 ({zero})")
