"""The other process of the ddr-file tests (tests/table/test_ddr_files.py): run as
``python _ddr_child.py <command> <directory>``; it prints what happened and exits with a code the
test checks (it never sees the parent's objects, only the store on disk)."""

from __future__ import annotations

import os
import signal
import sys

import torch

import dynemb
from dynemb import Adam, Storage, StorageMode
from dynemb.errors import ConfigError

EXIT_REFUSED = 3  # the table could not be built: the ConfigError is printed


def config(directory, *, reopen=False, capacity: int = 256,
           threads: int | None = None) -> dynemb.TableConfig:
    """The store every test uses: a CACHING table (a quarter cached) with its files in
    ``directory``."""
    storage = Storage(mode=StorageMode.CACHING, cache_load_factor=0.25, ddr_path=str(directory),
                      reopen=reopen)
    return dynemb.TableConfig(name="t", dim=4, features=("f",), capacity=capacity,
                              optimizer=Adam(lr=0.01), storage=storage, threads=threads)


THREADED = {"capacity": 16384, "threads": 2}
"""A table whose flush of 5,000 rows splits over two threads."""


def rows(keys: torch.Tensor) -> torch.Tensor:
    """The values the tests assign to ``keys``: row k is [k, k + 0.25, k + 0.5, k + 0.75]."""
    return keys.float()[:, None] + torch.arange(4) / 4


def _crash(directory: str) -> None:
    """Reopens a cleanly closed store, writes (a flush, then more rows), and is killed."""
    t = dynemb.DynamicTable(config(directory))
    t.insert_or_assign(torch.arange(100), rows(torch.arange(100)))
    t.close()
    t = dynemb.DynamicTable(config(directory, reopen=True))
    t.insert_or_assign(torch.arange(100, 150), rows(torch.arange(100, 150)))
    t.flush()  # the header on disk now describes these rows ...
    t.insert_or_assign(torch.arange(150, 250), rows(torch.arange(150, 250)))  # ... not these
    print("writing", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _exit(directory: str) -> None:
    """Writes rows (they stay dirty in the cache) and exits without close()."""
    t = dynemb.DynamicTable(config(directory))
    t.insert_or_assign(torch.arange(200), rows(torch.arange(200)))
    assert bool(t.cache.dirty.any())
    print("exiting", flush=True)


def _exit_threaded(directory: str) -> None:
    """:func:`_exit` with 5,000 dirty rows and two threads: the flush at exit runs after
    Python has stopped its thread pools."""
    t = dynemb.DynamicTable(config(directory, **THREADED))
    t.insert_or_assign(torch.arange(5000), rows(torch.arange(5000)))
    assert int(t.cache.dirty.sum()) > 2048
    print("exiting", flush=True)


def _open(directory: str) -> None:
    """Tries to reopen the store (another process holds it)."""
    try:
        dynemb.DynamicTable(config(directory, reopen=True))
    except ConfigError as e:
        print(e, flush=True)
        sys.exit(EXIT_REFUSED)
    print("opened", flush=True)


def _small(directory: str) -> None:
    """Builds a table of about 4.8 MB on a 1 MiB filesystem and fills it; lists what is left
    there if it is refused."""
    try:
        t = dynemb.DynamicTable(config(directory, capacity=65536))
    except ConfigError as e:
        print(e)
        print("left:", sorted(os.listdir(directory)), flush=True)
        sys.exit(EXIT_REFUSED)
    print("built", flush=True)
    t.find_or_insert(torch.arange(60000))  # rows written to the (sparse) files
    t.close()
    print("filled", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"crash": _crash, "exit": _exit, "exit_threaded": _exit_threaded, "open": _open,
     "small": _small}[sys.argv[1]](sys.argv[2])
