"""The files of a memory-mapped ddr store (``<ddr_path>/<table>.ddr.*``): created preallocated,
owned by one table at a time, and reopened only after a clean shutdown.

A store is owned by one table at a time (an exclusive ``flock`` on ``.lock``), preallocated
when created (so a full filesystem is a ``ConfigError`` up front, never a SIGBUS while
training), and carries a clean-shutdown marker (``.clean``) written by ``close()`` (or at
interpreter exit) and removed as soon as a table opens it for writing: a store without it may
be torn and is never reopened.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import itertools
import json
import logging
import os
import re
import weakref
from pathlib import Path

import numpy as np
import torch

from dynemb.config import StorageMode
from dynemb.errors import ConfigError
from dynemb.table.memory import VALUE_BYTES, Layout

logger = logging.getLogger(__name__)

_NP_DTYPES = {torch.float32: np.float32, torch.int64: np.int64, torch.uint8: np.uint8}
_ZEROS = 1 << 24  # bytes written per call where the filesystem cannot preallocate
_STORE_FILES = ("rows", "keys", "scores", "digests", "written", "json", "clean", "json.tmp",
                "clean.tmp")
"""The files of a store (but its lock): :func:`ddr_file_bytes`'s, the header, the marker."""


def ddr_file_bytes(layout: Layout, row_width: int) -> dict[str, int]:
    """Bytes of each file of a table's ddr store: its ddr rows (float32, ``row_width`` = dim +
    optimizer state per row) and, for CACHING, the backing store's index arrays (``HashIndex``:
    keys, scores and write steps int64, digests uint8, one per slot)."""
    sizes = {"rows": layout.ddr_rows * row_width * VALUE_BYTES}
    if layout.mode == StorageMode.CACHING:
        n = layout.slots
        sizes.update(keys=8 * n, scores=8 * n, digests=n, written=8 * n)
    return sizes


# ---------------------------------------------------------------- the lock and the exit hooks


class _Hold:
    """What must be undone if a store's owner is dropped: the lock's file descriptor and the
    files a store being created has made so far (kept apart from :class:`DdrFiles`, so a
    ``weakref.finalize`` can run it after the owner is garbage collected)."""

    def __init__(self, lock_path: Path, fd: int) -> None:
        self.lock_path, self.fd, self.pid = lock_path, fd, os.getpid()
        self.created: list[Path] = []
        self.committed = False
        self.token = next(_TOKENS)

    def release(self) -> None:
        """Removes the files of a store whose creation never finished, then the lock."""
        _TABLES.pop(self.token, None)
        _HOLDS.pop(self.token, None)
        if self.fd < 0:
            return
        if not self.committed and self.created:
            for path in self.created:
                path.unlink(missing_ok=True)
            self.lock_path.unlink(missing_ok=True)  # still locked: nobody else holds it
        os.close(self.fd)
        self.fd = -1


_TOKENS = itertools.count()
_HOLDS: dict[int, _Hold] = {}
"""Every lock this process holds (a forked child closes its copies)."""
_TABLES: dict[int, weakref.ReferenceType] = {}
"""The open tables with ddr files, by their hold's token: closed at interpreter exit."""
_hooks_installed = False


def _install_hooks() -> None:
    """At the first lock (never at import): close the open tables at interpreter exit, and let
    a forked child (e.g. a data-loader worker) drop its inherited copies of the locks."""
    global _hooks_installed
    if not _hooks_installed:
        atexit.register(_close_at_exit)
        os.register_at_fork(after_in_child=_forget_in_child)
        _hooks_installed = True


def _close_at_exit() -> None:
    for token, ref in list(_TABLES.items()):
        table, hold = ref(), _HOLDS.get(token)
        if table is None or hold is None or hold.pid != os.getpid():
            continue
        try:
            table.close()
        except Exception:  # noqa: BLE001  (one table failing must not keep the others open)
            logger.exception("table %r: closing its ddr files at interpreter exit failed; "
                             "its store was not marked cleanly closed", table.name)


def _forget_in_child() -> None:
    for hold in list(_HOLDS.values()):
        if hold.fd >= 0:
            os.close(hold.fd)  # the parent's lock stays: it holds its own descriptor
            hold.fd = -1
    _HOLDS.clear()
    _TABLES.clear()


def _lock(path: Path, what: str) -> _Hold:
    """An exclusive, non-blocking ``flock`` on ``path`` (created if missing); ConfigError
    naming the path (and the holder's pid) if another table holds it."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"{what}: cannot create the lock file {str(path)!r}: {e}. "
                              "Choose a writable ddr_path.") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            this = " (this process)" if holder == str(os.getpid()) else ""
            raise ConfigError(
                f"{what}: the store is in use by another table: the lock {str(path)!r} is held "
                f"by process {holder}{this}. A ddr store has one user at a time: close() that "
                "table (or end that process) first, or choose another ddr_path.") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else the file was removed (and maybe replaced) while we locked it: retry
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            _install_hooks()
            hold = _Hold(path, fd)
            _HOLDS[hold.token] = hold
            return hold
        os.close(fd)


def _preallocate(fd: int, nbytes: int) -> None:
    """Reserves ``nbytes`` of disk for the file ``fd`` (its size becomes ``nbytes``)."""
    if nbytes == 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return
    except AttributeError:  # a platform without it
        pass
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
    zeros = bytes(min(_ZEROS, nbytes))  # no fallocate here: write the zeros themselves
    for start in range(0, nbytes, _ZEROS):
        n = min(_ZEROS, nbytes - start)
        if os.pwrite(fd, zeros[:n], start) != n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the files of one store


class DdrFiles:
    """The memory-mapped files of one table's ddr tier: ``<dir>/<table>.ddr.<array>``, a
    ``.json`` header written by :meth:`flush`, the ``.lock`` held while this object is open and
    the ``.clean`` marker of a store closed cleanly.

    Building it takes the store's lock, then creates the files (preallocated; refusing existing
    ones) or checks that the store to reopen was closed cleanly. The table then maps its arrays
    (:meth:`alloc`) and calls :meth:`opened`, which removes the marker before anything is
    written. :meth:`close` syncs the files, writes the header and the marker and releases the
    lock. If the owner is garbage collected instead, the lock is released (and the files of a
    store whose creation did not finish are removed).

    Args:
        directory: ``Storage.ddr_path`` (created if missing).
        table: the table name (characters other than letters, digits, ``._-`` become ``_``).
        reopen: ``Storage.reopen``: True opens a store closed cleanly (refusing a missing or
            torn one), False creates one (refusing existing files), "auto" reopens a cleanly
            closed store and otherwise creates one, replacing a torn store's files (logged).
        sizes: bytes of each file (:func:`ddr_file_bytes`).
    """

    def __init__(self, directory: str, table: str, *, reopen: bool | str,
                 sizes: dict[str, int]) -> None:
        self.dir = Path(directory)
        self.table = table
        self.prefix = re.sub(r"[^A-Za-z0-9_.-]", "_", table) + ".ddr"
        self.sizes = dict(sizes)
        self.closed = False
        self._maps: list[np.memmap] = []
        self._what = f"table {table!r}: ddr store {str(self.dir / self.prefix)!r}"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"table {table!r}: cannot create Storage.ddr_path "
                              f"{str(self.dir)!r}: {e}. Choose a writable directory.") from e
        self._hold = _lock(self.path("lock"), self._what)
        self._finalizer = weakref.finalize(self, self._hold.release)
        self._finalizer.atexit = False  # at exit the table is closed properly, not dropped
        try:
            self.reopened = self._choose(reopen)
            if not self.reopened:
                self._create()
        except BaseException:
            self.abandon()
            raise

    def path(self, name: str) -> Path:
        return self.dir / f"{self.prefix}.{name}"

    def __reduce_ex__(self, protocol):
        """Refuses ``copy.deepcopy`` and pickling: a copy would share this store's lock and
        files (two owners writing, one closing the other's lock)."""
        raise ConfigError(f"{self._what}: a table with ddr files cannot be copied or pickled "
                          "(its store has one owner); save its rows with dynemb.checkpoint, "
                          "or copy a table without Storage.ddr_path.")

    # ------------------------------------------------------------------ opening

    def _store_files(self) -> list[Path]:
        """The files of the store that exist, but the lock (only its own names: another
        table's prefix may start with this one's, e.g. tables "user" and "user.ddr")."""
        return [p for p in map(self.path, _STORE_FILES) if p.exists()]

    def _choose(self, reopen: bool | str) -> bool:
        """Whether to reopen the store there (True) or create one (False)."""
        existing = self._store_files()
        if reopen is False:
            if existing:
                raise ConfigError(
                    f"{self._what} already holds {[p.name for p in existing]}; remove them, "
                    "choose another directory, or pass Storage(reopen=True) to continue from a "
                    "cleanly closed store (reopen='auto': reopen it if it was closed cleanly, "
                    "else start a new one).")
            return False
        if self._is_clean():
            return True
        if reopen is True:
            if self.header() is None:
                raise ConfigError(f"{self._what}: Storage(reopen=True) found no backing store "
                                  f"(no {self.prefix}.json) in {str(self.dir)!r} to reopen.")
            raise ConfigError(
                f"{self._what} was not closed cleanly (no {self.prefix}.clean marker: the "
                "process that last opened it crashed, was killed, or dropped the table without "
                "close()), so its rows may be torn; it is not reopened. Restore the table from "
                "your last checkpoint (dynemb.checkpoint.load) into a new store: remove these "
                "files or pass Storage(reopen='auto'), which replaces a torn store with an "
                "empty one.")
        if existing:
            logger.warning("%s was not closed cleanly (a crash after it was opened): its files "
                           "%s are replaced by a new, empty store; restore the rows from your "
                           "last checkpoint.", self._what, [p.name for p in existing])
            for p in existing:
                p.unlink(missing_ok=True)
        return False

    def _is_clean(self) -> bool:
        """Whether the marker is there and names the header on disk (by its hash)."""
        try:
            marker = json.loads(self.path("clean").read_text())
            header = self.path("json").read_bytes()
        except (OSError, ValueError):
            return False
        return (isinstance(marker, dict)
                and marker.get("header_sha256") == hashlib.sha256(header).hexdigest())

    def _create(self) -> None:
        """Creates every file at its full size (preallocated), or nothing."""
        need = sum(self.sizes.values())
        free = _free_bytes(self.dir)
        if need > free:
            raise self._no_space(need, free)
        for name, nbytes in self.sizes.items():
            path = self.path(name)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                self._hold.created.append(path)
                try:
                    _preallocate(fd, nbytes)
                finally:
                    os.close(fd)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise self._no_space(need, _free_bytes(self.dir)) from e
                raise ConfigError(f"{self._what}: cannot create {str(path)!r}: {e}.") from e

    def _no_space(self, need: int, free: int) -> ConfigError:
        return ConfigError(
            f"{self._what}: its files need {need} bytes ({need / 2**20:.1f} MiB) in "
            f"Storage.ddr_path {str(self.dir)!r}, whose filesystem has {free} bytes free "
            f"({free / 2**20:.1f} MiB); nothing was created. Free space there, choose a "
            "ddr_path on a larger filesystem, or lower the table's capacity.")

    def alloc(self, name: str, n: int, dtype: torch.dtype, fill: int | float) -> torch.Tensor:
        """A tensor of ``n`` elements backed by the file ``<prefix>.<name>`` (zero-copy)."""
        path, np_dtype = self.path(name), _NP_DTYPES[dtype]
        want = n * np.dtype(np_dtype).itemsize
        try:
            found = path.stat().st_size
        except FileNotFoundError:
            found = "no file"
        if self.sizes.get(name) != want or found != want:
            self.abandon()
            raise ConfigError(f"{self._what}: {str(path)!r}: expected {want} bytes for this "
                              f"table's configuration, found {found}; reopen a store with the "
                              "configuration that wrote it.")
        mm = np.memmap(path, dtype=np_dtype, mode="r+", shape=(n,))
        if fill and not self.reopened:
            mm[:] = fill  # preallocated: the pages exist, writing them cannot fault
        self._maps.append(mm)
        return torch.from_numpy(mm)

    def opened(self, table: object, check=None) -> None:
        """The table finished building on these files: ``check(header)`` (a reopened store's
        header against the table; abandons the store if it raises), then the clean marker is
        removed (before anything is written) and the table is closed at interpreter exit."""
        if self.reopened and check is not None:
            try:
                check(self.header())
            except BaseException:
                self.abandon()
                raise
        clean = self.path("clean")
        if clean.exists():
            clean.unlink()
            _fsync_dir(self.dir)
        self._hold.committed = True
        _TABLES[self._hold.token] = weakref.ref(table)

    # ------------------------------------------------------------------ writing and closing

    def header(self) -> dict | None:
        path = self.path("json")
        if not path.exists():
            return None
        try:
            header = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{self._what}: the header {str(path)!r} cannot be read: {e}.") from e
        if not isinstance(header, dict):
            raise ConfigError(f"{self._what}: the header {str(path)!r} is not a JSON object.")
        return header

    def replaced(self) -> bool:
        """Whether the store's files were removed (or replaced) under this open table: its lock
        file is no longer the one it locked."""
        try:
            return os.stat(self.path("lock")).st_ino != os.fstat(self._hold.fd).st_ino
        except OSError:
            return True

    def flush(self, header: dict) -> None:
        """Writes every mapped page to disk, then the header (atomically, via a rename)."""
        if self.closed:
            raise ConfigError(f"{self._what} is closed; a closed table cannot write to it.")
        if self.replaced():
            raise ConfigError(f"{self._what}: its files were removed or replaced while this "
                              "table had them open; nothing was written there.")
        for mm in self._maps:
            mm.flush()
        self._write("json", json.dumps(header, indent=1))

    def _write(self, name: str, text: str) -> None:
        tmp = self.path(name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path(name))
        _fsync_dir(self.dir)

    def close(self, header: dict | None, *, clean: bool = True) -> None:
        """Syncs the files, writes ``header`` (if given) and the clean-shutdown marker naming
        it, and releases the lock; with ``clean`` False (rows that may be half written) only
        releases the lock, leaving the store torn. Idempotent."""
        if self.closed:
            return
        if not clean:
            logger.warning("%s: a call that changes the table was interrupted part way (or still "
                           "runs), so the store is closed without the clean-shutdown marker and "
                           "will not be reopened; restore the table from your last checkpoint.",
                           self._what)
            self._release()
            return
        if self.replaced():  # never write this table's header into another store
            logger.warning("%s: its files were removed or replaced while this table had them "
                           "open; closing it without writing there.", self._what)
            self._release()
            return
        if header is not None:
            self.flush(header)
        else:
            for mm in self._maps:
                mm.flush()
        text = self.path("json").read_bytes() if self.path("json").exists() else None
        if text is not None:
            self._write("clean", json.dumps({"header_sha256": hashlib.sha256(text).hexdigest(),
                                             "pid": os.getpid()}))
        self._release()

    def delete(self) -> None:
        """Removes the files and releases the lock (mapped tensors stay valid until dropped)."""
        self._maps.clear()
        for path in self._store_files():
            path.unlink(missing_ok=True)
        if not self.closed:
            self.path("lock").unlink(missing_ok=True)  # while still holding it
        self._release()

    def abandon(self) -> None:
        """Gives the store up after a failed build: the files this object created are removed
        (a store being reopened is left as it was) and the lock released."""
        self._maps.clear()
        if not self.closed:
            for path in self._hold.created:
                path.unlink(missing_ok=True)
            self._hold.created.clear()
            if not self._store_files():  # no store here: no lock file either (still held)
                self.path("lock").unlink(missing_ok=True)
        self._release()

    def _release(self) -> None:
        self.closed = True
        self._finalizer()  # runs _Hold.release once
