"""Reading and writing configuration dataclasses: from dicts, YAML and JSON files, with dotted
overrides (``data.split=time``), and back to plain dicts for ``config.yaml``.

Unknown keys raise :class:`~dynemb.errors.ConfigError` listing the valid ones; values are
checked by each dataclass's own validation.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from dynemb.errors import ConfigError

T = TypeVar("T")


def _dataclass_of(hint: object) -> type | None:
    """The dataclass a field's type names (also inside ``X | None``), or None."""
    for candidate in (hint, *typing.get_args(hint)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def from_dict(cls: type[T], data: object, where: str | None = None) -> T:
    """Builds dataclass ``cls`` from a mapping; nested dataclass fields take nested mappings.

    Args:
        cls: a dataclass type.
        data: ``{field: value}``; missing fields keep their defaults; lists become tuples.
        where: the key path of this section, shown in errors (None: the top level).
    Raises:
        ConfigError: ``data`` is not a mapping, has unknown keys, or a value fails validation.
    """
    prefix = f"{where}: " if where else ""
    where = where or cls.__name__
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of settings, found {type(data).__name__} "
                          f"{data!r}.")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys are {sorted(fields)}.")
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        nested = _dataclass_of(hints[name])
        if nested is not None and not isinstance(value, nested):
            value = from_dict(nested, value, f"{prefix[:-2]}.{name}" if prefix else name)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError as error:
        if not prefix or str(error).startswith(prefix):
            raise
        raise ConfigError(f"{prefix}{error}") from None
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{prefix}{cls.__name__}: {error}") from None


def to_dict(config: object) -> dict[str, Any]:
    """A dataclass as plain data: nested dicts, enum values, lists (YAML/JSON-ready)."""

    def plain(value: object) -> object:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    result = plain(config)
    assert isinstance(result, dict)
    return result


def read_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML (or JSON: ``.json``) file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"config file {path}: cannot read it ({error.strerror}).") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        raise ConfigError(f"config file {path}: not valid "
                          f"{'JSON' if path.suffix == '.json' else 'YAML'}: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping at the top, found "
                          f"{type(data).__name__}.")
    return data


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``data`` with ``KEY=VALUE`` overrides applied; dotted keys reach nested sections and
    values are parsed as YAML (``steps=100``, ``data.split=time``, ``model.top_mlp=[32]``)."""
    result = json.loads(json.dumps(data))  # a deep copy of plain data
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. data.split=time.")
        node = result
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section.")
        try:
            node[leaf] = yaml.safe_load(text)
        except yaml.YAMLError:
            node[leaf] = text
    return result


def load(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """A config of type ``cls`` from an optional file plus overrides."""
    data = read_file(path) if path is not None else {}
    return from_dict(cls, apply_overrides(data, overrides))


def dump_yaml(config: object) -> str:
    """The config as YAML (every field, resolved)."""
    return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=None)
