"""Where a save writes, and what it may replace or remove.

* :class:`SaveLock`: saves to one path are serialised by an exclusive ``flock`` on
  ``.<name>.lock`` beside it, held by the saving process (rank 0 of a collective save) from
  before it looks at the path until the new checkpoint is in place. The lock file is removed by
  its holder; a waiter that finds it replaced takes the new one. A load holds the same file
  shared (:func:`load_lock`), so no save replaces a checkpoint while it is being read.
* Temporary and replaced directories are named after their owner,
  ``.<name>.tmp-<host>-<pid>-<token>`` and ``.<name>.old-<host>-<pid>-<token>``: a save (holding
  the lock) removes those of owners that are gone, never one whose process is alive on this host.
* :func:`check_replaceable`: a save replaces only an empty directory or a dynemb checkpoint whose
  manifest is valid and names every file in it.
* :func:`check_complete`: the new checkpoint, before it is put in place: its manifest reads back
  valid, and every file it names is there with its size, and nothing else is.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path

from dynemb.checkpoint.manifest import MANIFEST, read_manifest
from dynemb.checkpoint.schema import file_specs
from dynemb.errors import CheckpointError

logger = logging.getLogger(__name__)

LOCK_WAIT_S = 3600.0
"""How long a save waits for another save to the same path before it raises."""
_POLL_S = 0.02
_DIRS = re.compile(r"(tables|dense|tables/[0-9]{3,9}-[A-Za-z0-9_.-]{0,64})")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"


class SaveLock:
    """An exclusive lock on saves to ``dest`` (a context manager; ``flock`` on
    ``.<name>.lock`` in the same directory); ``shared``: the lock of a load, held by any number
    of readers at once and by no save meanwhile.

    Args:
        dest: the checkpoint path.
        wait_s: how long to wait for another save (None: ``LOCK_WAIT_S``).
        shared: a reader's lock.
    """

    def __init__(self, dest: Path, wait_s: float | None = None, shared: bool = False) -> None:
        self.path = dest.parent / f".{dest.name}.lock"
        self.wait_s = LOCK_WAIT_S if wait_s is None else wait_s
        self.shared = shared
        self._fd: int | None = None

    def _try(self) -> int | None:
        fd = os.open(self.path, (os.O_RDONLY if self.shared else os.O_RDWR) | os.O_CREAT
                     | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(self.path))
        except FileNotFoundError:
            same = False
        if not same:  # its holder removed it after we opened it: take the new one
            os.close(fd)
            return None
        return fd

    def __enter__(self) -> SaveLock:
        deadline = time.monotonic() + self.wait_s
        told = False
        while (fd := self._try()) is None:
            if time.monotonic() > deadline:
                raise CheckpointError(f"checkpoint: another save to {self.path.parent} holds "
                                      f"{self.path} for more than {self.wait_s:.0f} s; wait for "
                                      "it to finish, or save elsewhere.")
            if not told:
                logger.info("waiting for a %s to finish (%s is locked)",
                            "save" if self.shared else "load or another save", self.path)
                told = True
            time.sleep(_POLL_S)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is None:
            return
        try:
            if self.shared:  # the last reader removes the file, once it holds it exclusively
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if not os.path.samestat(os.fstat(self._fd), os.stat(self.path)):
                    raise FileNotFoundError(self.path)
            os.unlink(self.path)  # while holding it: a waiter notices and takes a fresh file
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def load_lock(path: Path) -> SaveLock | None:
    """Takes the shared lock of a load of the checkpoint at ``path`` (through symbolic links:
    the lock of the directory saves write); None where its lock file cannot be created or
    opened (a read-only location, another user's directory) or locked (a file system without
    ``flock``): the load goes on unlocked.

    Raises:
        CheckpointError: a save held the path for more than ``LOCK_WAIT_S``.
    """
    lock = SaveLock(Path(os.path.realpath(path)), shared=True)
    try:
        return lock.__enter__()
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR,
                       errno.ENAMETOOLONG, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            logger.debug("loading %s without its lock (%s)", path, e)
            return None
        raise


# ---------------------------------------------------------------- owned temporary directories


def owned_name(dest: Path, role: str) -> Path:
    """A new ``.<name>.<role>-<host>-<pid>-<token>`` beside ``dest`` (role ``tmp`` or ``old``)."""
    token = uuid.uuid4().hex[:12]
    return dest.parent / f".{dest.name}.{role}-{_host()}-{os.getpid()}-{token}"


def _owner(path: Path, prefix: str) -> tuple[str, int] | None:
    host, sep, rest = path.name[len(prefix):].rpartition("-")
    host, sep2, pid = host.rpartition("-")
    if not (sep and sep2 and pid.isdigit() and rest):
        return None
    return host, int(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_abandoned(dest: Path, role: str, keep: Path | None = None) -> None:
    """Removes ``.<name>.<role>-*`` beside ``dest`` whose owner process is gone (call it holding
    the :class:`SaveLock`). Kept: ``keep``, and directories of a live process of this host (or
    of this process's current save); directories of other hosts are removed (their owner held
    the lock when it made them, so it is no longer saving) unless their name cannot be parsed."""
    prefix = f".{dest.name}.{role}-"
    host = _host()
    for path in sorted(p for p in dest.parent.iterdir() if p.name.startswith(prefix)):
        owner = _owner(path, prefix)
        if path == keep:
            continue
        if owner is None:
            logger.info("leaving %s: its owner is unknown (not named <host>-<pid>-<token>)", path)
            continue
        same_host = owner[0] == host
        if same_host and owner[1] != os.getpid() and _alive(owner[1]):
            logger.info("keeping %s: its owner (pid %d) is alive", path, owner[1])
            continue
        logger.info("removing %s, left by an interrupted save", path)
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- what a directory holds


def _tree(root: Path) -> tuple[set[str], set[str], list[str]]:
    """(files, directories, other entries: links, devices...) under ``root``, relative."""
    files: set[str] = set()
    dirs: set[str] = set()
    other: list[str] = []
    for d, subdirs, names in os.walk(root):  # does not follow symbolic links
        base = Path(d).relative_to(root)
        for n in subdirs:
            rel = (base / n).as_posix()
            if (Path(d) / n).is_symlink():
                other.append(rel)
            else:
                dirs.add(rel)
        for n in names:
            p, rel = Path(d) / n, (base / n).as_posix()
            if p.is_symlink() or not p.is_file():
                other.append(rel)
            else:
                files.add(rel)
    return files, dirs, other


def _unexpected(root: Path, manifest: dict) -> list[str]:
    """Entries under ``root`` that the manifest does not name: files it does not list, links,
    and directories other than ``tables``, ``dense`` and ``tables/<NNN>-<slug>``."""
    files, dirs, other = _tree(root)
    named = set(manifest["files"]) | {MANIFEST}
    odd = sorted(files - named) + sorted(other)
    return odd + sorted(d + "/" for d in dirs if not _DIRS.fullmatch(d))


def check_replaceable(dest: Path) -> None:
    """Refuses to let a save replace ``dest`` unless it is absent, an empty directory, or a
    dynemb checkpoint: a valid manifest that names every file in the directory.

    Raises:
        CheckpointError: naming what is there.
    """
    if not os.path.lexists(dest):
        return
    if dest.is_symlink() or not dest.is_dir():
        raise CheckpointError(f"checkpoint: {dest} exists and is not a directory (a file or a "
                              "symbolic link); refusing to replace it. Choose another path or "
                              "remove it.")
    if not any(dest.iterdir()):
        return
    try:
        manifest = read_manifest(dest)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint: {dest} exists and is not a dynemb checkpoint "
                              f"({e}); refusing to replace it. Choose another path or remove "
                              "it.") from None
    odd = _unexpected(dest, manifest)
    if odd:
        raise CheckpointError(f"checkpoint: {dest} is not a dynemb checkpoint: it holds "
                              f"entries its manifest does not name ({odd[:5]}, {len(odd)} in "
                              "all); "
                              "refusing to replace it. Move them, choose another path, or "
                              "remove it.")


def check_complete(root: Path) -> None:
    """The new checkpoint in ``root``, before it is put in place: the manifest reads back valid
    (checksum and schema), every file it names is there with its recorded size, and nothing
    else is.

    Raises:
        CheckpointError: what is missing, of another size, or extra.
    """
    manifest = read_manifest(root)
    for spec in file_specs(manifest, f"checkpoint {root}"):
        path, want = root / spec.rel, manifest["files"][spec.rel]["bytes"]
        size = path.stat().st_size if path.is_file() and not path.is_symlink() else None
        if size != want:
            raise CheckpointError(f"checkpoint {root}: {spec.rel} has {size} bytes after "
                                  f"writing, expected {want}; the save is abandoned.")
    odd = _unexpected(root, manifest)
    if odd:
        raise CheckpointError(f"checkpoint {root}: unexpected entries {odd[:5]} after writing; "
                              "the save is abandoned.")
