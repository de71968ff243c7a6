"""File-level I/O of checkpoints: durable writes with sha256, verification, safetensors parts,
and the atomic replacement of a checkpoint directory.

Every file is written once (never over an existing one) and fsynced; a directory is fsynced
after its entries are complete. Shard files are written by ``safetensors.torch.save_file``
straight from the tensors' memory; a helper thread (:class:`Hasher`) then fsyncs each one and
hashes it by reading it back from the page cache, while the main thread exports and writes the
next part (the device flushes one file while the CPU prepares the next; hashlib, reads and
fsync release the GIL). Readers check size and sha256 before they trust a file.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dynemb.errors import CheckpointError

logger = logging.getLogger(__name__)

WRITE_BLOCK = 64 << 20
"""Bytes per ``write`` call."""
READ_BLOCK = 8 << 20
"""Bytes per ``read`` call when hashing a file."""


@dataclass(frozen=True)
class FileEntry:
    """What the manifest records of one file: its size and sha256 (hex)."""

    bytes: int
    sha256: str

    def as_json(self) -> dict:
        return {"bytes": self.bytes, "sha256": self.sha256}


def write_bytes(path: Path, data: bytes | memoryview) -> FileEntry:
    """Writes ``data`` to a new file (refusing to overwrite), hashing it meanwhile; fsyncs it.

    Returns:
        The file's size and sha256.
    """
    view = memoryview(data).cast("B")
    digest = hashlib.sha256()
    hasher = threading.Thread(target=digest.update, args=(view,), daemon=True)
    hasher.start()
    try:
        with open(path, "xb", buffering=0) as f:
            done = 0
            while done < len(view):
                done += f.write(view[done:done + WRITE_BLOCK])
            os.fsync(f.fileno())
    finally:
        hasher.join()
    return FileEntry(bytes=len(view), sha256=digest.hexdigest())


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replaces ``path`` with a file holding ``text`` (UTF-8) in one step: a reader, or a
    process killed at any moment, sees the old file or the new one, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def fsync_file(path: Path) -> None:
    """Makes a written file's data durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor],
                  metadata: dict[str, str] | None = None) -> int:
    """Writes ``tensors`` (copied to CPU, contiguous) as a new safetensors file, not yet
    fsynced: :meth:`Hasher.add` fsyncs and hashes it in the background.

    Returns:
        The file's size in bytes.
    """
    if path.exists():
        raise FileExistsError(f"{path} exists; checkpoint files are written once")
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(cpu, str(path), metadata=metadata)
    return path.stat().st_size


def _sync_and_hash(path: Path) -> str:
    fsync_file(path)
    return sha256_file(path)


class Hasher:
    """fsync and sha256 of written files in one helper thread, while the next part is exported
    and written (the device flushes one file while the CPU prepares the next)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynemb-sha256")
        self._jobs: dict[str, tuple[int, Future]] = {}
        self._known: dict[str, FileEntry] = {}

    def add(self, root: Path, rel: str, size: int) -> None:
        """Starts syncing and hashing ``root / rel`` (``size`` bytes, as written)."""
        self._jobs[rel] = (size, self._pool.submit(_sync_and_hash, root / rel))

    def known(self, rel: str, entry: FileEntry) -> None:
        """Records a file hashed while it was written (:func:`write_bytes`)."""
        self._known[rel] = entry

    def entries(self) -> dict[str, dict]:
        """``{rel: {bytes, sha256}}`` of every file added, once each is durable and hashed."""
        try:
            out = {rel: FileEntry(size, job.result()).as_json()
                   for rel, (size, job) in self._jobs.items()}
            return {**out, **{rel: e.as_json() for rel, e in self._known.items()}}
        finally:
            self._pool.shutdown(wait=True)


def fsync_dir(path: Path) -> None:
    """Makes the entries of directory ``path`` durable (a no-op where directories cannot be
    opened, e.g. on Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover  (platforms without directory fds)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """sha256 (hex) of a file, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(READ_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def inside(root: Path, rel: str) -> Path:
    """``root / rel``, refused unless it resolves (symbolic links followed) to a path inside
    ``root``.

    Raises:
        CheckpointError: ``rel`` is absolute, or leads (through ``..`` or a symbolic link)
            outside the checkpoint directory.
    """
    path = root / rel
    base = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.isabs(rel) or os.path.commonpath([base, real]) != base or real == base:
        raise CheckpointError(f"checkpoint {root}: file {rel!r} resolves to {real}, outside the "
                              "checkpoint directory; expected a plain name inside it (the "
                              "checkpoint was edited, or holds a symbolic link).")
    return path


def verify(root: Path, rel: str, entry: dict) -> None:
    """Checks that ``root / rel`` is inside ``root`` and exists with the size and sha256 the
    manifest recorded.

    Raises:
        CheckpointError: outside the checkpoint, missing, truncated (or grown), or a checksum
            mismatch.
    """
    path = inside(root, rel)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {root}: file {rel} is missing (the manifest lists it "
                              f"with {entry['bytes']} bytes); the checkpoint is incomplete: load "
                              "an older one or save again.")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"checkpoint {root}: file {rel} has {size} bytes, expected "
                              f"{entry['bytes']} (truncated or overwritten); the checkpoint is "
                              "damaged: load an older one or save again.")
    found = sha256_file(path)
    if found != entry["sha256"]:
        raise CheckpointError(f"checkpoint {root}: file {rel} fails its checksum: sha256 "
                              f"expected {entry['sha256']}, found {found}; the file is corrupted: "
                              "load an older checkpoint or save again.")


class TensorFile:
    """Reads row windows of one safetensors file without loading the whole file.

    Args:
        path: the file (already verified).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._file = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"checkpoint file {path} is not a readable safetensors file "
                                  f"({e}); the checkpoint is damaged.") from None
        self._slices = {name: self._file.get_slice(name) for name in self._file.keys()}

    def names(self) -> set[str]:
        return set(self._slices)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slices[name].get_shape())

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype (``"I64"``, ``"F32"``, ...)."""
        return str(self._slices[name].get_dtype())

    def rows(self, name: str) -> int:
        return self.shape(name)[0]

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of tensor ``name`` (a copy; the whole tensor without bounds)."""
        stop = self.rows(name) if stop is None else stop
        return self._slices[name][start:stop]

    def metadata(self) -> dict[str, str]:
        return self._file.metadata() or {}


# ---------------------------------------------------------------- atomic directory replacement

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two existing paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where
    the platform or file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def replace_dir(tmp: Path, dest: Path, old: Path) -> Path | None:
    """Puts the complete directory ``tmp`` at ``dest`` in one atomic step.

    With no ``dest`` yet this is one ``rename``. Over an existing checkpoint the two are swapped
    atomically where the platform can (Linux ``renameat2``); elsewhere ``dest`` is first renamed
    to ``old`` and ``tmp`` to ``dest`` (a crash between the two leaves the previous checkpoint
    complete at ``old``; ``load`` says so). The parent directory is fsynced.

    Returns:
        Where the previous checkpoint now is (to be deleted by the caller), or None.
    """
    parent = dest.parent
    if not dest.exists():
        os.rename(tmp, dest)
        fsync_dir(parent)
        return None
    if _exchange(tmp, dest):
        fsync_dir(parent)
        return tmp
    os.rename(dest, old)
    os.rename(tmp, dest)
    fsync_dir(parent)
    return old
