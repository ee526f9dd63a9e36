"""Hydra glue: the structured-config schema, `compose_config` for scripts, DictConfig -> dataclasses once."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import keyword
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from rlhfuse._resources import conf_dir
from rlhfuse.core.algorithm_config import RENAMED_KEYS
from rlhfuse.core.config_checks import config_key, is_flat
from rlhfuse.trainer.run_config import RLHFConfig

SCHEMA_NAME = "rlhfuse_schema"


def _schema_type(annotation: Any) -> Any:
    """`annotation` as OmegaConf can check it: `Literal[...]` becomes str (its choices are checked by each
    config's `problems()`), nested config dataclasses become their schema twins, and a union OmegaConf cannot
    hold (of several types besides None: a name or a list of them, a number or `auto`) becomes Any, its values
    checked by the config's `problems()` instead."""
    origin = get_origin(annotation)
    if origin is Literal:  # a closed choice of names, or of names and booleans (auto | true | false)
        return str if all(isinstance(a, str) for a in get_args(annotation)) else Any
    if origin in (Union, types.UnionType):
        members = [_schema_type(a) for a in get_args(annotation)]
        if len([m for m in members if m is not type(None)]) > 1:
            return Any
        return functools.reduce(lambda a, b: a | b, members)
    if origin is list:
        return list[_schema_type(get_args(annotation)[0])]  # type: ignore[misc]
    if dataclasses.is_dataclass(annotation):
        return schema(annotation)  # type: ignore[arg-type]
    return annotation


@functools.cache
def schema(cls: type) -> type:
    """The OmegaConf structured-config twin of the config dataclass `cls`: the same keys and defaults, with
    the fields of flat-composed parts (`rlhfuse.core.config_checks.flat_field`) at the parent's level."""
    fields: list[tuple[str, Any, Any]] = []
    for f, kind in _leaf_fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            make = functools.partial(_to_schema, f.default_factory)
            fields.append((config_key(f), kind, dataclasses.field(default_factory=make)))
        else:
            fields.append((config_key(f), kind, dataclasses.field(default=f.default)))
    if not any(keyword.iskeyword(name) for name, _, _ in fields):
        return dataclasses.make_dataclass(cls.__name__, fields)
    # a key that is a Python keyword (`async`): a class body OmegaConf reads, without the generated methods
    # whose source would name it
    namespace: dict[str, Any] = {"__annotations__": {name: kind for name, kind, _ in fields}}
    namespace.update({name: value for name, _, value in fields})
    return dataclasses.dataclass(init=False, repr=False, eq=False)(type(cls.__name__, (), namespace))


def _leaf_fields(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(cls)
    out: list[tuple[dataclasses.Field[Any], Any]] = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if is_flat(f):
            out += _leaf_fields(hints[f.name])
        else:
            out.append((f, _schema_type(hints[f.name])))
    return out


def _to_schema(make: Any) -> Any:
    return _as_schema(make())


def _as_schema(value: Any) -> Any:
    """A default value as the schema holds it (config dataclass instances become their twins)."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return value
    return schema(type(value))(**_flat_values(value))


def _flat_values(value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(value):
        if is_flat(f):
            out.update(_flat_values(getattr(value, f.name)))
        else:
            out[config_key(f)] = _as_schema(getattr(value, f.name))
    return out


def _from_container(cls: type, data: dict[str, Any]) -> Any:
    """The config dataclass `cls` from its schema twin's container (flat parts regrouped)."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = hints[f.name]
        if is_flat(f):
            kwargs[f.name] = _from_container(kind, data)
        elif config_key(f) in data:
            value = data[config_key(f)]
            kwargs[f.name] = _from_container(kind, value) if dataclasses.is_dataclass(kind) else value  # type: ignore[arg-type]
    return cls(**kwargs)


def register_schema() -> None:
    """Register `RLHFConfig`'s schema as the one `conf/config.yaml` builds on: YAML keys and types are checked."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=schema(RLHFConfig))


@functools.cache
def schema_keys(cls: type = RLHFConfig) -> dict[str, Any]:
    """The key tree of `cls`'s schema: key -> subtree (a config dataclass) or None (a leaf)."""
    out: dict[str, Any] = {}
    for f, kind in _leaf_fields(cls):
        nested = isinstance(kind, type) and dataclasses.is_dataclass(kind)
        out[config_key(f)] = schema_keys(kind) if nested else None
    return out


def closest(word: str, choices: Sequence[str]) -> list[str]:
    """The choice `word` most likely misspells (a list of at most one, as `difflib.get_close_matches` gives):
    among difflib's close matches, one spelled with the same letters first (a transposition, `gpro` for `grpo`,
    over a substitution, `gspo`), then the closest."""
    close = difflib.get_close_matches(word, list(choices), n=5)
    close.sort(key=lambda c: sorted(c) != sorted(word))  # stable: difflib's order among equals
    return close[:1]


def unknown_keys(keys: Sequence[str]) -> list[str]:
    """One problem per dotted key that the schema does not have, with the closest known key."""
    problems = []
    for key in keys:
        section, _, leaf = key.partition(".")
        if section == "algorithm" and leaf in RENAMED_KEYS:
            new, values = RENAMED_KEYS[leaf]
            mapping = f" ({', '.join(f'{a} -> {b}' for a, b in values.items())})" if values else ""
            problems.append(f"{key} was renamed algorithm.{new}{mapping}: set algorithm.{new} instead")
            continue
        tree: dict[str, Any] | None = schema_keys()
        parts = key.split(".")
        for depth, part in enumerate(parts):
            if tree is None:  # below a leaf (a list index, a dict value): the leaf's type checks it
                break
            if part not in tree:
                known = ".".join(parts[:depth])
                close = closest(part, list(tree))
                hint = f"did you mean {'.'.join([*parts[:depth], close[0]])}?" if close else ""
                where = f"{known}.*" if known else "the top level"
                problems.append(
                    f"{key} is not a configuration key ({hint + ' ' if hint else ''}known at {where}: "
                    f"{', '.join(sorted(tree))})"
                )
                break
            tree = tree[part]
    return problems


def _paths(node: Any, prefix: str = "") -> list[str]:
    if not isinstance(node, dict):
        return [prefix] if prefix else []
    out = []
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        out += _paths(value, path) if isinstance(value, dict) else [path]
    return out


def override_keys(overrides: Sequence[str]) -> list[str]:
    """The configuration keys command-line overrides set (Hydra's own keys and group choices aside)."""
    keys = []
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if "=" not in item or key.startswith("hydra") or "/" in key or key.startswith("-"):
            continue
        keys.append(key)
    return keys


def check_keys(keys: Sequence[str]) -> None:
    """ValueError listing every key the schema does not have (Hydra would report only the first); one key is
    one line."""
    problems = unknown_keys(keys)
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        raise ValueError(
            f"invalid configuration ({len(problems)} problem(s)):\n  - " + "\n  - ".join(problems)
        )


def to_config(cfg: DictConfig) -> RLHFConfig:
    """Convert a composed DictConfig into the typed `RLHFConfig` (library code never sees a DictConfig).
    Keys the schema does not have (a `+key=value` override, a misspelt key in an experiment YAML) are errors."""
    raw = OmegaConf.to_container(cfg, resolve=False)
    check_keys([k for k in _paths(raw) if not k.startswith("hydra")])
    merged = OmegaConf.merge(OmegaConf.structured(schema(RLHFConfig)), cfg)
    OmegaConf.resolve(merged)
    container = OmegaConf.to_container(merged, resolve=True)
    assert isinstance(container, dict)
    config = _from_container(RLHFConfig, {str(k): v for k, v in container.items()})
    assert isinstance(config, RLHFConfig)
    return config


def compose_config(
    overrides: Sequence[str] = (), config_name: str = "config", config_dir: str | Path | None = None
) -> RLHFConfig:
    """Compose rlhfuse's shipped configuration with command-line style overrides, from a script or a test.

    `config_dir`: a folder of the user's own configs searched beside the shipped ones (as `rlhfuse-train
    --config-dir` does), e.g. `my_conf/experiment/mine.yaml` for `experiment=mine`. A bad override or config file
    is one ValueError naming the key (and the file), never Hydra's multi-line report."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    user_dirs: list[Path] = []
    search: list[str] = []
    if config_dir is not None:
        folder = Path(config_dir).resolve()
        if not folder.is_dir():
            raise FileNotFoundError(f"config_dir={str(config_dir)!r} is not a folder (resolved to {folder})")
        user_dirs.append(folder)
        search.append(f"hydra.searchpath=[{_quoted(f'file://{folder}')}]")
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=[*overrides, *search])
    except COMPOSITION_ERRORS as err:
        raise ValueError(composition_problem(err, user_dirs)) from None
    return to_config(cfg)


def _quoted(text: str) -> str:
    """`text` as a quoted string of Hydra's override grammar (a path with spaces or `=` stays one value)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


# What Hydra raises while composing (before any job runs): a bad override, a missing option, a bad config file.
COMPOSITION_ERRORS = (ConfigCompositionException, OverrideParseException, OmegaConfBaseException)


def composition_problem(err: BaseException, config_dirs: Sequence[str | Path] = ()) -> str:
    """One line for a composition error: the override or config file, the key, what was expected and, where
    one is close, the intended key or option. `config_dirs`: the user's config folders, to name the file."""
    # Hydra raises some of these `from` OmegaConf's error and others inside its handler (the file's case)
    cause = err if isinstance(err, OmegaConfBaseException) else err.__cause__ or err.__context__
    text = str(err).strip()
    merging = re.match(r"In '([^']+)':", text)  # a config file of the defaults list (not the primary one)
    source = merging.group(1) if merging and merging.group(1) != "config" else None
    where = f"{_config_file(source, config_dirs)}: " if source else ""
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and err.options:
        group, _, name = err.missing_cfg_file.rpartition("/")
        choice = f"{group}={name}" if group else name
        close = closest(name, list(err.options))
        hint = f"; did you mean {group}={close[0]}?" if close and group else ""
        return f"{where}{choice} is not an option of {group or 'the configs'} (choices: {', '.join(sorted(err.options))}){hint}"
    if isinstance(err, OverrideParseException):
        reason = err.message.strip().splitlines()[0]
        return (
            f"{err.override}: cannot parse this override ({reason}); see "
            "https://hydra.cc/docs/advanced/override_grammar/basic/ (quote values with spaces or brackets)"
        )
    if (
        isinstance(cause, ConfigKeyError | ConfigAttributeError)
        and cause.full_key
        and not _hydras(cause.full_key)
    ):
        problems = unknown_keys([cause.full_key])
        return where + (problems[0] if problems else _first_line(cause.msg or str(cause)))
    if isinstance(cause, ValidationError) and cause.full_key:
        override = re.match(r"Error merging override (\S+)", text)
        value = override.group(1).split("=", 1)[-1] if override else _quoted_value(cause.msg or "")
        setting = f"{cause.full_key}={value}" if value is not None else cause.full_key
        expected = expected_type(cause.full_key)
        return f"{where}{setting}: " + (
            f"expected {expected}" if expected else _first_line(cause.msg or str(cause))
        )
    reason = _first_line(cause.msg if isinstance(cause, OmegaConfBaseException) and cause.msg else "")
    return where + _first_line(text) + (f": {reason}" if reason else "")


def _hydras(key: str) -> bool:
    """Whether `key` is one of Hydra's own settings (not in rlhfuse's schema)."""
    return key == "hydra" or key.startswith("hydra.")


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0].strip()


def _quoted_value(message: str) -> str | None:
    """The value in OmegaConf's "Value 'three' of type 'str' could not be converted ..."."""
    found = re.match(r"Value '(.*)' of type", message)
    return found.group(1) if found else None


def _config_file(name: str, config_dirs: Sequence[str | Path]) -> str:
    """The file behind config `name` (`experiment/mine`): the first of the user's folders, then the shipped
    `conf/`, that holds it."""
    for folder in [*config_dirs, conf_dir()]:
        path = Path(folder) / f"{name}.yaml"
        if path.is_file():
            return str(path)
    return f"{name}.yaml"


def expected_type(key: str) -> str | None:
    """What the schema accepts at the dotted `key` ("an int", "a number", ...), None when it is not known."""
    tree: Any = schema(RLHFConfig)
    kind: Any = None
    for part in key.split("."):
        if not (isinstance(tree, type) and dataclasses.is_dataclass(tree)):
            return None
        kinds = {f.name: f.type for f in dataclasses.fields(tree)}
        if part not in kinds:
            return None
        tree = kind = kinds[part]
    return _describe(kind)


def _describe(kind: Any) -> str | None:
    names = {int: "an int", float: "a number", bool: "true or false", str: "a string"}
    if kind in names:
        return names[kind]
    origin = get_origin(kind)
    if origin is list:
        item = _describe(get_args(kind)[0])
        return f"a list of {item.split(' ', 1)[1]}s" if item and item.startswith(("a ", "an ")) else "a list"
    if origin in (Union, types.UnionType):
        members = [_describe(a) for a in get_args(kind) if a is not type(None)]
        if len(members) == 1 and members[0]:
            return f"{members[0]} or null"
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return f"a mapping of {kind.__name__}'s keys"
    return None
