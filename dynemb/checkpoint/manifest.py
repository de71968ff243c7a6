"""The manifest of a checkpoint (``manifest.json``): what was saved, by how many ranks, with which
configuration, and the size and sha256 of every file (see docs/checkpoint-format.md)."""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from pathlib import Path

from dynemb.errors import CheckpointError
from dynemb.config import TableConfig

FORMAT = "dynemb-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
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


def table_dir(index: int, key: str) -> str:
    """A file-system-safe directory for table ``key`` (its index keeps names distinct)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:64]
    return f"tables/{index:03d}-{slug}"


def read_manifest(path: Path) -> dict:
    """Reads and checks ``path/manifest.json``.

    Raises:
        CheckpointError: no checkpoint there (naming a complete previous one left beside it by
            an interrupted replacement), unreadable JSON, or another format or version.
    """
    manifest = path / MANIFEST
    if not manifest.is_file():
        left = sorted(p for p in path.parent.glob(f".{path.name}.old-*")
                      if (p / MANIFEST).is_file())
        hint = (f" A save that was replacing it was interrupted: the previous checkpoint is "
                f"complete at {left[-1]}; rename it to {path}." if left else "")
        what = "is not a directory" if not path.is_dir() else f"has no {MANIFEST}"
        raise CheckpointError(f"checkpoint {path} {what}: expected a directory written by "
                              f"dynemb.checkpoint.save or export_incremental.{hint}")
    try:
        data = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not readable JSON ({e}); the "
                              "checkpoint is damaged: load an older one.") from None
    found = data.get("format") if isinstance(data, dict) else None
    if found != FORMAT:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not a dynemb checkpoint "
                              f"manifest (format {found!r}, expected {FORMAT!r}).")
    if data.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path}: format version {data.get('format_version')}, "
                              f"expected {FORMAT_VERSION}; load it with the dynemb version that "
                              f"wrote it ({data.get('library_version')}).")
    return data


def write_json(data: dict) -> bytes:
    """The manifest's bytes (sorted keys, indented: diffable and stable)."""
    return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()
