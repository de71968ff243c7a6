"""Reading and writing configuration dataclasses: from dicts, YAML and JSON files, with dotted
overrides (``data.split=time``), and back to plain dicts for ``config.yaml``.

Unknown keys raise :class:`~dynemb.errors.ConfigError` listing the valid ones; values are
checked by each dataclass's own validation.
"""

from __future__ import annotations

import copy
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


def _entries_of(hint: object) -> type | None:
    """The dataclass X of a ``tuple[X, ...]`` field, or None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis \
            and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
        return args[0]
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
        entries = _entries_of(hints[name])
        nested = None if entries is not None else _dataclass_of(hints[name])
        path = f"{prefix[:-2]}.{name}" if prefix else name
        if nested is not None and not isinstance(value, nested):
            value = from_dict(nested, value, path)
        elif entries is not None and isinstance(value, (list, tuple)):
            value = tuple(v if isinstance(v, entries) else from_dict(entries, v, f"{path}[{i}]")
                          for i, v in enumerate(value))
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
        return to_dict_value(value)

    result = plain(config)
    assert isinstance(result, dict)
    return result


MAX_CONFIG_BYTES = 1 << 20
"""Largest config file read (1 MiB): a config is a page of settings."""
MAX_CONFIG_VALUES = 100_000
"""Most values a config may expand to through YAML aliases (``*name``): a "billion laughs"
file of nested aliases is refused before it is expanded."""


def _yaml_error(where: str, error: yaml.YAMLError) -> ConfigError:
    """A parser error as ``<where>, line L, column C: not valid YAML (...)``."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    what = " ".join(str(x) for x in (getattr(error, "context", None),
                                     getattr(error, "problem", None)) if x) or str(error)
    return ConfigError(f"{where}{at}: not valid YAML ({what}).")


def _check_unique(node: yaml.MappingNode, where: str) -> None:
    """Raises ConfigError, naming the line, if a key appears twice in one mapping (YAML would
    keep the last value silently)."""
    seen: set[tuple[str, str]] = set()
    for key, _ in node.value:
        if isinstance(key, yaml.ScalarNode):
            if (key.tag, key.value) in seen:
                raise ConfigError(f"{where}, line {key.start_mark.line + 1}: key {key.value!r} "
                                  "appears twice in one mapping; expected each setting once.")
            seen.add((key.tag, key.value))


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object, refusing a key that appears twice in it."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"key {key!r} appears twice in one object; expected each setting "
                              "once.")
        out[key] = value
    return out


def _check_graph(root: yaml.Node, where: str) -> None:
    """Raises ConfigError, naming the line, if the composed YAML contains itself (an anchor
    cycle) or expands through its aliases to more than MAX_CONFIG_VALUES values."""
    visited = 0
    ancestors: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, leaving = stack.pop()
        if leaving:
            ancestors.discard(id(node))
            continue
        line = node.start_mark.line + 1
        if id(node) in ancestors:
            raise ConfigError(f"{where}, line {line}: the value anchored there contains itself "
                              "through an alias (a YAML anchor cycle); expected plain nested "
                              "settings.")
        visited += 1
        if visited > MAX_CONFIG_VALUES:
            raise ConfigError(f"{where}, line {line}: expands to more than {MAX_CONFIG_VALUES:,} "
                              "values through its YAML aliases (*name); expected a config of "
                              "plain settings: write values out instead of nesting aliases.")
        if isinstance(node, yaml.ScalarNode):
            continue
        if isinstance(node, yaml.MappingNode):
            _check_unique(node, where)
        children = (node.value if isinstance(node, yaml.SequenceNode)
                    else [part for pair in node.value for part in pair])
        ancestors.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in reversed(children))


def _load_yaml(text: str, where: str) -> object:
    """:func:`parse_yaml`, except that a syntax error is raised as the parser's YAMLError."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_graph(node, where)
        return loader.construct_document(node)
    except ConfigError:
        raise
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to read; expected plain nested "
                          "settings.") from None
    except (ValueError, TypeError, OverflowError) as error:  # e.g. a date like 2020-13-45
        raise ConfigError(f"{where}: a value cannot be read ({error}).") from None
    finally:
        loader.dispose()


def parse_yaml(text: str, where: str) -> object:
    """The value of a YAML document, checked for anchor cycles and alias bombs before it is
    built (see :data:`MAX_CONFIG_VALUES`).

    Args:
        text: the YAML text.
        where: what to name in errors (``config file run.yaml``).
    Raises:
        ConfigError: not valid YAML (naming the parser's line and column), an anchor cycle, an
            alias expansion past the limit, or nesting too deep to parse.
    """
    try:
        return _load_yaml(text, where)
    except yaml.YAMLError as error:
        raise _yaml_error(where, error) from None


def read_text(path: str | Path, where: str | None = None) -> str:
    """The file's text (UTF-8, a leading BOM dropped), at most MAX_CONFIG_BYTES; errors name
    ``where`` (default ``config file PATH``)."""
    where = where or f"config file {path}"
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"{where}: cannot read it ({error.strerror or error}).") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{where}: expected at most {MAX_CONFIG_BYTES:,} bytes of "
                          "settings, found a larger file; is it the right file?")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = raw[:error.start].count(b"\n") + 1
        raise ConfigError(f"{where}, line {line}: expected UTF-8 text, found byte "
                          f"{raw[error.start]:#04x} that is not UTF-8; save the file as "
                          "UTF-8.") from None


def read_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML (or JSON: ``.json``) file.

    Raises:
        ConfigError: the file cannot be read, is larger than MAX_CONFIG_BYTES, is not UTF-8, is
            not valid YAML/JSON (naming the line), has an anchor cycle or an alias bomb, or does
            not hold a mapping.
    """
    path = Path(path)
    text = read_text(path)
    where = f"config file {path}"
    if path.suffix == ".json":
        try:
            data = json.loads(text, object_pairs_hook=_unique_pairs)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{where}, line {error.lineno}, column {error.colno}: not valid "
                              f"JSON ({error.msg}).") from None
        except ConfigError as error:
            raise ConfigError(f"{where}: {error}") from None
        except RecursionError:
            raise ConfigError(f"{where}: nested too deeply to read; expected plain nested "
                              "settings.") from None
        except ValueError as error:  # e.g. an integer of more than 4300 digits
            raise ConfigError(f"{where}: a value cannot be read ({error}).") from None
    else:
        data = parse_yaml(text, where)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping at the top, found "
                          f"{type(data).__name__}.")
    return data


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``data`` with ``KEY=VALUE`` overrides applied; dotted keys reach nested sections and
    values are parsed as YAML (``steps=100``, ``data.split=time``, ``model.top_mlp=[32]``); a
    value that is not valid YAML is taken as the string it is."""
    result = copy.deepcopy(data)
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
            node[leaf] = _load_yaml(text, f"override {item!r}")
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


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (the string literal after it)."""
    import ast  # noqa: PLC0415
    import inspect  # noqa: PLC0415
    import textwrap  # noqa: PLC0415

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (e.g. a frozen build)
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and \
                isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def describe_yaml(config: object, width: int = 96) -> str:
    """The config as YAML (every field, resolved) with each field's meaning as a comment above
    it, section by section: what ``dynemb train --print-config`` prints. It loads back as the
    same config."""
    import textwrap  # noqa: PLC0415

    lines: list[str] = []

    def walk(obj: object, indent: str) -> None:
        docs = field_docs(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if docs.get(f.name):
                lines.extend(textwrap.wrap(docs[f.name], width - len(indent) - 2,
                                           initial_indent=f"{indent}# ",
                                           subsequent_indent=f"{indent}# "))
            if dataclasses.is_dataclass(value):
                doc = (type(value).__doc__ or "").strip().splitlines()
                lines.append(f"{indent}{f.name}:" + (f"  # {doc[0]}" if doc else ""))
                walk(value, indent + "  ")
            else:
                text = yaml.safe_dump({f.name: to_dict_value(value)}, default_flow_style=True,
                                      width=10**6).strip()[1:-1]
                lines.append(f"{indent}{text}")

    walk(config, "")
    return "\n".join(lines) + "\n"


def to_dict_value(value: object) -> object:
    """One field's value as plain data (see :func:`to_dict`)."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a list's entry
        return {f.name: to_dict_value(getattr(value, f.name)) for f in dataclasses.fields(value)
                if getattr(value, f.name) is not None}  # null: not set, so left out
    if isinstance(value, (list, tuple)):
        return [to_dict_value(v) for v in value]
    return value
