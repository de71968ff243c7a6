"""The manifest's schema: every field's type and range, and the consistency between fields,
checked before any field is used (:func:`validate`); and the list of files the manifest
describes with what each must hold (:func:`file_specs`).

File names are not free: every file's name is determined by its role (``dense/rank<r>.pt``,
``tables/<NNN>-<slug of the table name>/rank<r>.part<p>.safetensors``, ``...admission...``,
``...evicted...``), so a manifest cannot point outside its directory, at another table's files,
or at one file twice, and every file under ``files`` is named by exactly one role.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dynemb.checkpoint.manifest import (
    CHECKSUM, DELTA, FULL, LEGACY_VERSIONS, MANIFEST, table_slug,
)
from dynemb.config import Routing, ScorePolicy, StorageMode
from dynemb.errors import CheckpointError

INT64_MAX = (1 << 63) - 1
MAX_WORLD = 1 << 20
MAX_WIDTH = 1 << 31
_SHA256 = re.compile(r"[0-9a-f]{64}")
_TABLE_DIR = re.compile(r"tables/[0-9]{3,9}-([A-Za-z0-9_.-]{0,64})")
_TOP = {"format", "format_version", "kind", "step", "since_step", "library_version",
        "torch_version", "created_unix", "world_size", "tables", "dense", "files"}
_TABLE = {"name", "config", "dim", "state_width", "optimizer", "routing", "id_range",
          "storage_mode", "score", "admission", "ranks"}
_RANK = {"rows", "table_step", "optimizer_step", "since_table_step", "parts", "admission",
         "evicted"}


@dataclass(frozen=True)
class FileSpec:
    """One file the manifest names, and what it must hold."""

    rel: str
    """Its name inside the checkpoint (a plain relative path)."""
    content: str
    """``"dense"``, ``"rows"``, ``"admission"`` or ``"evicted"``."""
    rank: int
    """The rank that wrote it."""
    table: str | None = None
    """The table's name in the checkpoint (None for dense files)."""
    part: int | None = None
    """The part's index (rows files)."""
    rows: int = 0
    """Rows (rows files) or keys (admission, evicted)."""


class _Checker:
    """Raises CheckpointError naming the field, what was expected and what was found."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, at: str, expected: str, found: object) -> None:
        text = repr(found)
        text = text if len(text) <= 80 else text[:77] + "..."
        raise CheckpointError(f"{self.where}: {MANIFEST} field {at}: expected {expected}, found "
                              f"{text}; the manifest is damaged or was edited: load another "
                              "checkpoint or save again.")

    def obj(self, v: object, at: str, keys: set[str]) -> dict:
        if not isinstance(v, dict):
            self.fail(at, "an object", v)
        if set(v) != keys:
            missing, extra = sorted(keys - set(v)), sorted(set(v) - keys)
            self.fail(at, f"an object with the fields {sorted(keys)}",
                      f"missing {missing}, unknown {extra}")
        return v

    def int(self, v: object, at: str, lo: int = 0, hi: int = INT64_MAX) -> int:
        if type(v) is not int or not lo <= v <= hi:
            self.fail(at, f"an integer in [{lo}, {hi}]", v)
        return v

    def str(self, v: object, at: str, choices: set[str] | None = None) -> str:
        if not isinstance(v, str) or (choices is not None and v not in choices):
            self.fail(at, "a string" + (f" in {sorted(choices)}" if choices else ""), v)
        return v

    def list(self, v: object, at: str, length: int | None = None) -> list:
        if not isinstance(v, list) or (length is not None and len(v) != length):
            self.fail(at, "a list" + (f" of {length}" if length is not None else ""), v)
        return v

    def const(self, v: object, at: str, want: object) -> None:
        if type(v) is not type(want) or v != want:
            self.fail(at, repr(want), v)


def _files_entry(c: _Checker, rel: str, entry: object) -> None:
    c.obj(entry, f"files[{rel!r}]", {"bytes", "sha256"})
    c.int(entry["bytes"], f"files[{rel!r}].bytes", 0, 1 << 62)
    if not isinstance(entry["sha256"], str) or not _SHA256.fullmatch(entry["sha256"]):
        c.fail(f"files[{rel!r}].sha256", "64 lowercase hex digits", entry["sha256"])


def _small_file(c: _Checker, v: object, at: str, want: str) -> int:
    c.obj(v, at, {"file", "keys"})
    c.const(v["file"], f"{at}.file", want)
    return c.int(v["keys"], f"{at}.keys", 0, 1 << 62)


def _rank(c: _Checker, r: object, at: str, kind: str, folder: str, key: str, rank: int,
          admission: bool, specs: list[FileSpec]) -> None:
    c.obj(r, at, _RANK)
    rows = c.int(r["rows"], f"{at}.rows", 0, 1 << 62)
    step = c.int(r["table_step"], f"{at}.table_step")
    c.int(r["optimizer_step"], f"{at}.optimizer_step")
    base = f"{folder}/rank{rank:05d}"
    total = 0
    for p, part in enumerate(c.list(r["parts"], f"{at}.parts")):
        c.obj(part, f"{at}.parts[{p}]", {"file", "rows"})
        c.const(part["file"], f"{at}.parts[{p}].file", f"{base}.part{p:05d}.safetensors")
        n = c.int(part["rows"], f"{at}.parts[{p}].rows", 1, 1 << 62)
        total += n
        specs.append(FileSpec(part["file"], "rows", rank, key, p, n))
    if total != rows:
        c.fail(f"{at}.rows", f"the sum of its parts' rows ({total})", rows)
    if (r["admission"] is not None) != admission:
        c.fail(f"{at}.admission", "an admission file" if admission else "null (the table has "
               "no admission)", r["admission"])
    if r["admission"] is not None:
        rel = f"{base}.admission.safetensors"
        specs.append(FileSpec(rel, "admission", rank, key,
                              rows=_small_file(c, r["admission"], f"{at}.admission", rel)))
    if kind == FULL:
        c.const(r["since_table_step"], f"{at}.since_table_step", None)
        c.const(r["evicted"], f"{at}.evicted", None)
    else:
        c.int(r["since_table_step"], f"{at}.since_table_step", 0, step)
        rel = f"{base}.evicted.safetensors"
        specs.append(FileSpec(rel, "evicted", rank, key,
                              rows=_small_file(c, r["evicted"], f"{at}.evicted", rel)))


def _table(c: _Checker, key: str, t: object, data: dict, specs: list[FileSpec]) -> str:
    at = f"tables[{key!r}]"
    c.obj(t, at, _TABLE)
    name = c.str(t["name"], f"{at}.name")
    if not name or (key != name and not key.endswith("/" + name)):
        c.fail(f"{at}.name", f"the last part of the table's key {key!r}", name)
    config = t["config"]
    if not isinstance(config, dict) or config.get("type") != "TableConfig" \
            or config.get("name") != name or config.get("dim") != t["dim"]:
        c.fail(f"{at}.config", "a TableConfig object of the same name and dim", config)
    c.int(config.get("capacity"), f"{at}.config.capacity", 1)
    c.int(t["dim"], f"{at}.dim", 1, MAX_WIDTH)
    c.int(t["state_width"], f"{at}.state_width", 0, MAX_WIDTH)
    if not isinstance(t["optimizer"], dict) or not isinstance(t["optimizer"].get("type"), str):
        c.fail(f"{at}.optimizer", "an object with a string type", t["optimizer"])
    c.str(t["routing"], f"{at}.routing", {m.value for m in Routing})
    if t["id_range"] is not None:
        c.int(t["id_range"], f"{at}.id_range", 1, 1 << 63)
    c.str(t["storage_mode"], f"{at}.storage_mode", {m.value for m in StorageMode})
    c.str(t["score"], f"{at}.score", {m.value for m in ScorePolicy})
    if not isinstance(t["admission"], bool):
        c.fail(f"{at}.admission", "true or false", t["admission"])
    ranks = c.list(t["ranks"], f"{at}.ranks", data["world_size"])
    folder = _folder(c, key, ranks, at)
    for rank, r in enumerate(ranks):
        _rank(c, r, f"{at}.ranks[{rank}]", data["kind"], folder, key, rank, t["admission"],
              specs)
    return folder


def _folder(c: _Checker, key: str, ranks: list, at: str) -> str:
    """The table's directory, taken from its first file; it must carry the table's slug."""
    for r in ranks:
        for field in ("parts", "admission", "evicted"):
            v = r.get(field) if isinstance(r, dict) else None
            v = v[0] if field == "parts" and isinstance(v, list) and v else v
            rel = v.get("file") if isinstance(v, dict) else None
            if isinstance(rel, str):
                folder = rel.rpartition("/")[0]
                m = _TABLE_DIR.fullmatch(folder)
                if not m or m.group(1) != table_slug(key):
                    c.fail(f"{at} file {rel!r}", f"a file under tables/<NNN>-{table_slug(key)}/",
                           rel)
                return folder
    return f"tables/000-{table_slug(key)}"  # no files: the name is never used


def _dense(c: _Checker, d: object, world: int, specs: list[FileSpec]) -> None:
    c.obj(d, "dense", {"files", "optimizer", "replicated"})
    for r, rel in enumerate(c.list(d["files"], "dense.files", world)):
        c.const(rel, f"dense.files[{r}]", f"dense/rank{r:05d}.pt")
        specs.append(FileSpec(rel, "dense", r))
    if d["optimizer"] is not None:
        c.str(d["optimizer"], "dense.optimizer")
    if not isinstance(d["replicated"], bool):
        c.fail("dense.replicated", "true or false", d["replicated"])


def _header(c: _Checker, data: dict) -> None:
    keys = _TOP if data.get("format_version") in LEGACY_VERSIONS else _TOP | {CHECKSUM}
    c.obj(data, "(top level)", keys)
    kind = c.str(data["kind"], "kind", {FULL, DELTA})
    step = c.int(data["step"], "step")
    if kind == FULL:
        c.const(data["since_step"], "since_step", None)
    else:
        c.int(data["since_step"], "since_step", 0, step)
    c.str(data["library_version"], "library_version")
    c.str(data["torch_version"], "torch_version")
    created = data["created_unix"]
    if type(created) not in (int, float) or not 0 <= created < 1e11:
        c.fail("created_unix", "seconds since 1970", created)
    c.int(data["world_size"], "world_size", 1, MAX_WORLD)
    if not isinstance(data["tables"], dict):
        c.fail("tables", "an object", data["tables"])
    if not isinstance(data["files"], dict):
        c.fail("files", "an object", data["files"])


def file_specs(data: dict, where: str) -> list[FileSpec]:
    """Validates the manifest ``data`` and lists its files (dense files first, then each
    table's, in the manifest's order).

    Raises:
        CheckpointError: a field is missing, unknown, of the wrong type or out of range, a file
            name is not the one its role gives, a folder is shared by two tables, or ``files``
            does not list exactly the files named elsewhere.
    """
    c = _Checker(where)
    _header(c, data)
    specs: list[FileSpec] = []
    _dense(c, data["dense"], data["world_size"], specs)
    folders: dict[str, str] = {}
    for key, t in data["tables"].items():
        folder = _table(c, key, t, data, specs)
        if folder in folders:
            c.fail(f"tables[{key!r}]", "a folder of its own",
                   f"{folder}, also used by {folders[folder]!r}")
        folders[folder] = key
    named = {s.rel for s in specs}
    listed = set(data["files"])
    if named != listed:
        c.fail("files", "exactly the files named by dense and tables",
               f"unnamed {sorted(listed - named)[:5]}, unlisted {sorted(named - listed)[:5]}")
    for rel, entry in data["files"].items():
        _files_entry(c, rel, entry)
    return specs


def validate(data: dict, where: str) -> None:
    """Validates the manifest ``data`` (see :func:`file_specs`)."""
    file_specs(data, where)
