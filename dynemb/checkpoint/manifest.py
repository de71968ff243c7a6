"""The manifest of a checkpoint (``manifest.json``): what was saved, by how many ranks, with which
configuration, the size and sha256 of every file, and its own checksum (see
docs/checkpoint-format.md).

:func:`read_manifest` is the one way in: it parses the JSON strictly, checks the format, the
version and the manifest's checksum, and validates the whole document against the schema
(:mod:`dynemb.checkpoint.schema`) before anything uses a field of it.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import hashlib
import json
import logging
import os
import re
import stat
from pathlib import Path

from dynemb.config import TableConfig
from dynemb.errors import CheckpointError

logger = logging.getLogger(__name__)

FORMAT = "dynemb-checkpoint"
FORMAT_VERSION = 2
"""2: the manifest carries ``manifest_sha256`` and every shard file's metadata names its table,
rank, part, rows, kind and content."""
LEGACY_VERSIONS = (1,)
"""Versions still read: without the manifest checksum and the newer file metadata (a warning is
logged; everything else is checked as for the current version)."""
MANIFEST = "manifest.json"
CHECKSUM = "manifest_sha256"
MAX_MANIFEST_BYTES = 256 << 20
FULL, DELTA = "full", "delta"


def to_json(value: object) -> object:
    """A config value as plain JSON: dataclasses as ``{"type": class name, field: ...}``, enums
    by value, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict = {"type": type(value).__name__}
        for f in dataclasses.fields(value):
            out[f.name] = to_json(getattr(value, f.name))
        return out
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def storage_mode(config: TableConfig) -> str:
    """The table's storage mode in force (HBM_ONLY before tiers existed)."""
    storage = getattr(config, "storage", None)
    mode = getattr(storage, "effective_mode", None) or getattr(storage, "mode", None)
    return "hbm_only" if mode is None else str(getattr(mode, "value", mode))


def table_entry(config: TableConfig, state_width: int) -> dict:
    """The manifest's description of one table (ranks are added by the writer)."""
    return {
        "name": config.name,
        "config": to_json(config),
        "dim": config.dim,
        "state_width": state_width,
        "optimizer": to_json(config.optimizer),
        "routing": config.routing.value,
        "id_range": config.id_range,
        "storage_mode": storage_mode(config),
        "score": config.score.value,
        "admission": config.admission is not None,
        "ranks": [],
    }


def table_slug(key: str) -> str:
    """The file-system-safe form of table name ``key`` in its directory name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:64]


def table_dir(index: int, key: str) -> str:
    """A file-system-safe directory for table ``key`` (its index keeps names distinct)."""
    return f"tables/{index:03d}-{table_slug(key)}"


_ZEROS = "0" * 64
_CHECKSUM_LINE = re.compile(rb'\n "manifest_sha256": "([0-9a-f]{64})",?\n')
"""The top-level checksum field (one space of indent: nested fields have more)."""


def write_json(data: dict) -> bytes:
    """The manifest's bytes: sorted keys, indented (diffable and stable), sealed with
    ``manifest_sha256``: the sha256 of these very bytes with its own 64 hex digits read as
    zeros."""
    try:
        body = json.dumps({**data, CHECKSUM: _ZEROS}, indent=1, sort_keys=True,
                          allow_nan=False) + "\n"
    except ValueError as e:  # NaN or infinity in a config value
        raise CheckpointError(f"checkpoint: the manifest cannot be written as JSON ({e}); "
                              "expected finite numbers in every table config.") from None
    raw = body.encode()
    digest = hashlib.sha256(raw).hexdigest()
    m = _CHECKSUM_LINE.search(raw)
    return raw[:m.start(1)] + digest.encode() + raw[m.end(1):]


def _checksum(raw: bytes, where: str) -> str | None:
    """Checks the seal of a manifest's bytes; returns its value (None: the manifest has none).

    Raises:
        CheckpointError: more than one checksum field, or a mismatch (any changed byte).
    """
    found = list(_CHECKSUM_LINE.finditer(raw))
    if not found:
        return None
    if len(found) > 1:
        raise CheckpointError(f"{where}: {MANIFEST} has {len(found)} {CHECKSUM} fields, "
                              "expected one; the manifest is damaged or was edited.")
    m = found[0]
    want = m.group(1).decode()
    computed = hashlib.sha256(raw[:m.start(1)] + _ZEROS.encode() + raw[m.end(1):]).hexdigest()
    if computed != want:
        raise CheckpointError(f"{where}: {MANIFEST} fails its checksum ({CHECKSUM} {want}, "
                              f"computed {computed}); the manifest is damaged or was edited: "
                              "load an older checkpoint or save again.")
    return want


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {dup!r} appears twice in one object")
    return out


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def parse(raw: bytes, where: str) -> dict:
    """Strict JSON: UTF-8, no duplicate keys, no NaN or Infinity, an object at the top."""
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates,
                          parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}: {MANIFEST} is not readable JSON ({e}); the checkpoint "
                              "is damaged: load an older one.") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: {MANIFEST} holds a JSON {type(data).__name__}, expected "
                              "an object; the checkpoint is damaged: load an older one.")
    return data


def _check_version(data: dict, where: str) -> int:
    found = data.get("format")
    if found != FORMAT:
        raise CheckpointError(f"{where}: {MANIFEST} is not a dynemb checkpoint manifest (format "
                              f"{found!r}, expected {FORMAT!r}).")
    version = data.get("format_version")
    if type(version) is not int or (version != FORMAT_VERSION and version not in LEGACY_VERSIONS):
        raise CheckpointError(f"{where}: format version {version!r:.40}, expected "
                              f"{FORMAT_VERSION} (or {', '.join(map(str, LEGACY_VERSIONS))}, read "
                              "for compatibility); "
                              f"load it with the dynemb version that wrote it "
                              f"({str(data.get('library_version'))[:40]}).")
    return version


def _check_sealed(data: dict, version: int, sealed: str | None, where: str) -> None:
    """A current manifest must carry the checksum that was verified; a legacy one has none."""
    found = data.get(CHECKSUM)
    if version in LEGACY_VERSIONS:
        if found is not None:
            raise CheckpointError(f"{where}: a format {version} manifest with a {CHECKSUM}; "
                                  "the manifest is damaged or was edited.")
        logger.warning("%s: format version %d has no manifest checksum and fewer file metadata; "
                       "it is validated and its files checked, but an edited manifest cannot "
                       "be told from the saved one. Save it again to upgrade it.", where, version)
        return
    if sealed is None or found != sealed:
        raise CheckpointError(f"{where}: {MANIFEST} has no valid {CHECKSUM} (format version "
                              f"{version} requires one); the manifest is damaged or was edited.")


def _missing(path: Path) -> CheckpointError:
    prefix = f".{path.name}.old-"
    try:
        left = sorted(p for p in path.parent.iterdir()
                      if p.name.startswith(prefix) and (p / MANIFEST).is_file())
    except OSError:
        left = []
    hint = (f" A save that was replacing it was interrupted: the previous checkpoint is "
            f"complete at {left[-1]}; rename it to {path}." if left else "")
    what = "is not a directory" if not path.is_dir() else f"has no {MANIFEST}"
    return CheckpointError(f"checkpoint {path} {what}: expected a directory written by "
                           f"dynemb.checkpoint.save or export_incremental.{hint}")


def _read(path: Path, where: str) -> bytes:
    """The manifest's bytes (not through a symbolic link, at most ``MAX_MANIFEST_BYTES``; a
    FIFO or device in its place is refused without blocking on it)."""
    try:
        fd = os.open(os.path.join(path, MANIFEST),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise _missing(path) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{where}: {MANIFEST} is a symbolic link; expected a file "
                                  "written by dynemb.checkpoint.") from None
        if e.errno == errno.ENOTDIR:
            raise _missing(path) from None
        raise CheckpointError(f"{where}: {MANIFEST} cannot be read ({e}).") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _missing(path)
        raw = b""
        if info.st_size <= MAX_MANIFEST_BYTES:  # else refused below without reading it
            with os.fdopen(fd, "rb", closefd=False) as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"{where}: {MANIFEST} cannot be read ({e}).") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_MANIFEST_BYTES or info.st_size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{where}: {MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes; "
                              "expected a dynemb manifest.")
    return raw


def read_manifest(path: str | os.PathLike) -> dict:
    """Reads, checks and validates ``path/manifest.json``.

    Returns:
        The manifest, valid against the schema (every field present, typed and in range, every
        file name plain and listed once), its bytes matching its checksum.

    Raises:
        CheckpointError: no checkpoint there (naming a complete previous one left beside it by
            an interrupted replacement), unreadable JSON, another format or version, a wrong
            checksum, or anything the schema refuses.
    """
    from dynemb.checkpoint.schema import validate  # noqa: PLC0415  (schema imports this module)

    path = Path(path)
    where = f"checkpoint {path}"
    raw = _read(path, where)
    sealed = _checksum(raw, where)  # before parsing: any changed byte fails here
    data = parse(raw, where)
    version = _check_version(data, where)
    _check_sealed(data, version, sealed, where)
    validate(data, where)
    return data
