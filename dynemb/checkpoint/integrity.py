"""What each file of a checkpoint must be, checked against the manifest before anything is
loaded: its size and sha256 (:func:`dynemb.checkpoint.files.verify`), and for safetensors files
their own metadata (table, rank, part, rows, kind, content) and their tensors' names, dtypes and
shapes. ``load`` checks the files it reads, ``inspect --verify`` all of them, with the same code.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dynemb.checkpoint.files import TensorFile, inside, verify
from dynemb.checkpoint.manifest import FORMAT, LEGACY_VERSIONS
from dynemb.checkpoint.schema import FileSpec
from dynemb.errors import CheckpointError

HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads that check file checksums (hashlib and file reads release the GIL)."""
_LEGACY_META = {"rows": ("table", "rank", "part")}
"""Metadata that format-1 files carry (admission and evicted files carried none)."""


def file_metadata(spec: FileSpec, kind: str) -> dict[str, str]:
    """The safetensors metadata a file of role ``spec`` in a checkpoint of ``kind`` carries."""
    meta = {"format": FORMAT, "table": str(spec.table), "rank": str(spec.rank), "kind": kind,
            "content": spec.content, "rows": str(spec.rows)}
    if spec.part is not None:
        meta["part"] = str(spec.part)
    return meta


def _tensors(spec: FileSpec, table: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    n = spec.rows
    if spec.content == "rows":
        return {"keys": ("I64", (n,)), "embeddings": ("F32", (n, table["dim"])),
                "optimizer_state": ("F32", (n, table["state_width"])), "scores": ("I64", (n,))}
    if spec.content == "admission":
        return {"keys": ("I64", (n,)), "counts": ("I64", (n,))}
    return {"keys": ("I64", (n,))}


def check_tensor_file(root: Path, spec: FileSpec, manifest: dict) -> None:
    """The safetensors file of ``spec`` (already verified) against the manifest: its metadata
    names the same table, rank, part, rows, kind and content, and it holds exactly the tensors
    of its role with their dtypes and shapes.

    Raises:
        CheckpointError: naming the file, the field, what the manifest says and what was found.
    """
    f = TensorFile(inside(root, spec.rel))
    where = f"checkpoint {root}: {spec.rel}"
    found = f.metadata()
    want = file_metadata(spec, manifest["kind"])
    if manifest["format_version"] in LEGACY_VERSIONS:
        keep = _LEGACY_META.get(spec.content, ())
        want = {k: v for k, v in want.items() if k in keep}
    for k, v in want.items():
        if found.get(k) != v:
            raise CheckpointError(f"{where}: its metadata has {k}={found.get(k)!r}, the manifest "
                                  f"says {v!r} (a file of another table, rank or checkpoint, or "
                                  "an edited manifest); load another checkpoint or save again.")
    shapes = _tensors(spec, manifest["tables"][spec.table])
    if f.names() != set(shapes):
        raise CheckpointError(f"{where}: holds tensors {sorted(f.names())}, expected "
                              f"{sorted(shapes)}.")
    for name, (dtype, shape) in shapes.items():
        got = (f.dtype(name), f.shape(name))
        if got != (dtype, shape):
            raise CheckpointError(f"{where}: tensor {name!r} is {got[0]} of shape {got[1]}, "
                                  f"expected {dtype} of shape {shape}.")


def check_files(root: Path, manifest: dict, specs: list[FileSpec]) -> None:
    """Size and sha256 of every file of ``specs`` (hashed on ``HASH_THREADS`` threads), then each
    safetensors file's metadata and tensors; the first failure in ``specs`` order is raised."""
    files = manifest["files"]
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        jobs = [pool.submit(verify, root, s.rel, files[s.rel]) for s in specs]
        for job in jobs:
            job.result()
    for s in specs:
        if s.content != "dense":
            check_tensor_file(root, s, manifest)
