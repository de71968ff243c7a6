"""Safe ddr files: a full filesystem is a ConfigError up front (never a SIGBUS), a store torn by
a crash is never reopened, one store has one user (an exclusive lock, across processes), the
reopen modes True / False / "auto", and the flush at close and at interpreter exit.

The crash, lock and exit cases run a second process (``_ddr_child.py``), which sees only the
store on disk."""

from __future__ import annotations

import copy
import dataclasses
import errno
import pickle
import gc
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

import dynemb
from dynemb import Storage, StorageMode
from dynemb.errors import ConfigError
from dynemb.optim.rules import state_width
from dynemb.table.memory import storage_layout

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _ddr_child as C  # noqa: E402


def _child(command: str, directory: Path, *, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*prefix, sys.executable, str(HERE / "_ddr_child.py"), command,
                           str(directory)], capture_output=True, text=True, timeout=300, env=env)


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _closed_store(directory: Path) -> None:
    """A store in ``directory`` holding rows 0..19, closed cleanly."""
    t = dynemb.DynamicTable(C.config(directory))
    t.insert_or_assign(torch.arange(20), C.rows(torch.arange(20)))
    t.close()


def _need(cfg: dynemb.TableConfig) -> int:
    """Bytes of the table's ddr files: its ddr rows (float32) and, for CACHING, the backing
    index (key, score, write step int64 and digest uint8 per slot)."""
    lay = storage_layout(cfg.capacity, cfg.bucket_capacity, cfg.storage.mode,
                         cfg.storage.cache_load_factor)
    width = cfg.dim + state_width(cfg.optimizer, cfg.dim)
    index = lay.slots * (8 + 8 + 8 + 1) if lay.mode == StorageMode.CACHING else 0
    return lay.ddr_rows * width * 4 + index


# ---------------------------------------------------------------- a full filesystem


@pytest.mark.parametrize("mode", [StorageMode.HYBRID, StorageMode.CACHING])
def test_no_space_is_a_config_error_and_leaves_no_file(tmp_path, monkeypatch, mode):
    storage = Storage(mode=mode, cache_load_factor=0.25, ddr_path=str(tmp_path))
    cfg = dataclasses.replace(C.config(tmp_path), storage=storage)
    calls, real = [], os.posix_fallocate
    last = 1 if mode == StorageMode.HYBRID else 2  # CACHING: the first file gets its space

    def full(fd, offset, length):
        calls.append(length)
        if len(calls) == last:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ConfigError) as info:
        dynemb.DynamicTable(cfg)
    msg = str(info.value)
    assert str(tmp_path) in msg and f"need {_need(cfg)} bytes" in msg and "bytes free" in msg
    assert len(calls) == last
    assert _files(tmp_path) == []  # neither the allocated file nor the lock is left
    monkeypatch.undo()
    t = dynemb.DynamicTable(cfg)  # and the store is free: it builds once there is space
    t.find_or_insert(torch.arange(10))
    t.close()


def test_a_real_full_filesystem_raises_instead_of_sigbus(tmp_path):
    """A 1 MiB tmpfs (mounted in a user namespace, no root needed) and a table of 4.8 MB: the
    process used to die of SIGBUS filling its sparse files."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -rm (a user and mount namespace) is not available here")
    mnt = tmp_path / "small"
    mnt.mkdir()
    q = shlex.quote
    cmd = (f"mount -t tmpfs -o size=1m tmpfs {q(str(mnt))} && exec {q(sys.executable)} "
           f"{q(str(HERE / '_ddr_child.py'))} small {q(str(mnt))}")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode != C.EXIT_REFUSED and "mount" in r.stderr and "dynemb" not in r.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    assert r.returncode == C.EXIT_REFUSED, (r.returncode, r.stdout, r.stderr)
    need = _need(C.config(mnt, capacity=65536))
    assert f"need {need} bytes" in r.stdout and "bytes free" in r.stdout
    assert "left: []" in r.stdout


# ---------------------------------------------------------------- a crash, and reopen modes


def test_a_store_torn_by_a_crash_is_refused_and_auto_replaces_it(tmp_path, caplog):
    r = _child("crash", tmp_path)
    assert r.returncode == -signal.SIGKILL and "writing" in r.stdout, r.stderr
    with pytest.raises(ConfigError, match="not closed cleanly") as info:
        dynemb.DynamicTable(C.config(tmp_path, reopen=True))
    assert "checkpoint" in str(info.value)
    with caplog.at_level(logging.WARNING, logger="dynemb.table.ddr_files"):
        t = dynemb.DynamicTable(C.config(tmp_path, reopen="auto"))
    assert "not closed cleanly" in caplog.text
    assert t.size() == 0 and t.step == 0  # a new, empty store: nothing of the torn one
    t.insert_or_assign(torch.arange(5), C.rows(torch.arange(5)))
    t.close()
    again = dynemb.DynamicTable(C.config(tmp_path, reopen=True))  # the new store closed cleanly
    assert again.size() == 5 and torch.equal(again.find(torch.arange(5)).values,
                                             C.rows(torch.arange(5)))
    again.close()


def test_reopen_auto_creates_then_reopens(tmp_path):
    t = dynemb.DynamicTable(C.config(tmp_path, reopen="auto"))  # nothing there: creates
    assert t.size() == 0
    t.insert_or_assign(torch.arange(60), C.rows(torch.arange(60)))
    t.close()
    assert (tmp_path / "t.ddr.clean").exists()
    t = dynemb.DynamicTable(C.config(tmp_path, reopen="auto"))  # closed cleanly: reopens
    assert not (tmp_path / "t.ddr.clean").exists()  # open for writing: no longer clean
    found = t.find(torch.arange(60))
    assert found.found.all() and torch.equal(found.values, C.rows(torch.arange(60)))
    t.close()
    t.close()  # idempotent
    with pytest.raises(ConfigError, match="after close"):
        t.find_or_insert(torch.arange(3))


def test_a_marker_that_does_not_name_the_header_on_disk_is_not_clean(tmp_path):
    """The marker names its header by hash: a header written after it (or put there by hand)
    does not pass for a clean store."""
    _closed_store(tmp_path)
    header = tmp_path / "t.ddr.json"
    header.write_text(header.read_text().replace('"step": ', '"step": 1'))
    with pytest.raises(ConfigError, match="not closed cleanly"):
        dynemb.DynamicTable(C.config(tmp_path, reopen=True))


@pytest.mark.parametrize("change", [{"optimizer": dynemb.SGD(lr=0.1)},
                                    {"score": dynemb.ScorePolicy.LFU}])
def test_a_failed_reopen_leaves_the_store_clean_and_free(tmp_path, change):
    """Another optimizer, or another score policy (its scores are steps, counts or the
    user's: they mean nothing under another), is refused on reopen."""
    _closed_store(tmp_path)
    other = dataclasses.replace(C.config(tmp_path, reopen=True), **change)
    with pytest.raises(ConfigError, match="expected"):
        dynemb.DynamicTable(other)
    assert (tmp_path / "t.ddr.clean").exists()
    t = dynemb.DynamicTable(C.config(tmp_path, reopen=True))  # not locked, still clean
    assert torch.equal(t.find(torch.arange(20)).values, C.rows(torch.arange(20)))
    t.close()


def test_a_call_interrupted_part_way_leaves_the_store_torn(tmp_path, monkeypatch):
    """A KeyboardInterrupt (or out-of-memory error) inside a call leaves rows half written
    (here: keys placed in the backing index, their rows never initialised): close(), as the
    exit hook after Ctrl-C, must not mark such a store clean. dynemb's own errors are raised
    before a change, so after one the store still closes cleanly."""
    t = dynemb.DynamicTable(C.config(tmp_path))
    t.insert_or_assign(torch.arange(20), C.rows(torch.arange(20)))
    with pytest.raises(dynemb.errors.InputError):
        t.insert_or_assign(torch.arange(2), torch.full((2, 4), float("nan")))
    assert not t.interrupted
    t.close()
    t = dynemb.DynamicTable(C.config(tmp_path, reopen=True))

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(t.store, "init", interrupt)
    with pytest.raises(KeyboardInterrupt):
        t.find_or_insert(torch.arange(100, 120))
    assert t.interrupted
    t.close()
    assert not (tmp_path / "t.ddr.clean").exists()
    with pytest.raises(ConfigError, match="not closed cleanly"):
        dynemb.DynamicTable(C.config(tmp_path, reopen=True))


# ---------------------------------------------------------------- one user at a time


def test_a_second_process_cannot_open_a_store_in_use(tmp_path):
    _closed_store(tmp_path)
    t = dynemb.DynamicTable(C.config(tmp_path, reopen=True))  # this process holds it
    r = _child("open", tmp_path)
    assert r.returncode == C.EXIT_REFUSED, (r.stdout, r.stderr)
    assert "in use" in r.stdout and str(tmp_path / "t.ddr.lock") in r.stdout
    assert f"process {os.getpid()}" in r.stdout
    t.close()


def test_a_second_table_in_this_process_is_refused_until_the_first_is_gone(tmp_path):
    _closed_store(tmp_path)
    t = dynemb.DynamicTable(C.config(tmp_path, reopen=True))
    with pytest.raises(ConfigError, match="in use"):
        dynemb.DynamicTable(C.config(tmp_path, reopen=True))
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None  # the exit hook holds tables weakly: they can be garbage collected
    with pytest.raises(ConfigError, match="not closed cleanly"):  # dropped, never closed
        dynemb.DynamicTable(C.config(tmp_path, reopen=True))
    t = dynemb.DynamicTable(C.config(tmp_path, reopen="auto"))  # the lock was released
    t.close()


def test_a_table_whose_name_extends_another_s_keeps_its_own_store(tmp_path):
    """Table "user" (files user.ddr.*) and table "user.ddr" (files user.ddr.ddr.*) in one
    directory: each store is only its own files, so "user" neither refuses nor (with
    reopen="auto") deletes the files of "user.ddr" as if they were its torn store."""
    other = dynemb.DynamicTable(dataclasses.replace(C.config(tmp_path), name="user.ddr"))
    other.insert_or_assign(torch.arange(20), C.rows(torch.arange(20)))
    other.flush()
    theirs = _files(tmp_path)
    for reopen in (False, "auto"):
        t = dynemb.DynamicTable(dataclasses.replace(C.config(tmp_path, reopen=reopen), name="user"))
        t.close(delete_files=True)
        assert _files(tmp_path) == theirs
    assert torch.equal(other.find(torch.arange(20)).values, C.rows(torch.arange(20)))
    other.close()


def test_a_forked_child_does_not_keep_the_store_locked(tmp_path):
    """A child forked while a table is open (a data-loader worker, say) inherits the lock's
    descriptor; it must drop it, or the store stays locked after the parent closes it."""
    t = dynemb.DynamicTable(C.config(tmp_path))
    t.insert_or_assign(torch.arange(20), C.rows(torch.arange(20)))
    go, wait = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: lives until the parent has reopened the store
        os.close(wait)
        os.read(go, 1)
        os._exit(0)
    os.close(go)
    try:
        t.close()
        t = dynemb.DynamicTable(C.config(tmp_path, reopen=True))  # the child is still alive
        assert torch.equal(t.find(torch.arange(20)).values, C.rows(torch.arange(20)))
        t.close()
    finally:
        os.close(wait)  # the child reads EOF and exits
        os.waitpid(pid, 0)


def test_a_table_with_ddr_files_cannot_be_copied_or_pickled(tmp_path):
    """A deep copy (e.g. of a model, for an EMA or eval copy) shared the store's lock
    descriptor and files: closing the copy released the original's lock and marked the store
    clean under the copy's header. Copying and pickling are refused; the original is intact."""
    ebc = dynemb.EmbeddingBagCollection([C.config(tmp_path)])
    copy.deepcopy(ebc)  # not built yet: configs only, nothing to share
    t = ebc.tables["t"]
    t.insert_or_assign(torch.arange(20), C.rows(torch.arange(20)))
    for attempt in (lambda: copy.deepcopy(ebc), lambda: copy.deepcopy(t), lambda: pickle.dumps(t)):
        with pytest.raises(ConfigError, match="cannot be copied or pickled"):
            attempt()
    with pytest.raises(ConfigError, match="in use"):  # still locked by the original
        dynemb.DynamicTable(C.config(tmp_path, reopen="auto"))
    ebc.close()
    t = dynemb.DynamicTable(C.config(tmp_path, reopen=True))
    assert torch.equal(t.find(torch.arange(20)).values, C.rows(torch.arange(20)))
    t.close()


# ---------------------------------------------------------------- flush at interpreter exit


@pytest.mark.parametrize("command, n, kw", [("exit", 200, {}),
                                             ("exit_threaded", 5000, C.THREADED)])
def test_an_open_table_is_flushed_and_closed_at_interpreter_exit(command, n, kw, tmp_path):
    r = _child(command, tmp_path)
    assert r.returncode == 0 and "exiting" in r.stdout and not r.stderr, r.stderr
    t = dynemb.DynamicTable(C.config(tmp_path, reopen=True, **kw))
    found = t.find(torch.arange(n))
    assert found.found.all() and torch.equal(found.values, C.rows(torch.arange(n)))
    t.close()


def test_a_table_whose_files_were_replaced_never_writes_into_the_new_store(tmp_path, caplog):
    old = dynemb.DynamicTable(C.config(tmp_path))
    old.insert_or_assign(torch.arange(30), C.rows(torch.arange(30)))
    shutil.rmtree(tmp_path)  # removed under the open table, then a new store made there
    new = dynemb.DynamicTable(C.config(tmp_path))
    new.insert_or_assign(torch.arange(3), C.rows(torch.arange(3)))
    new.close()
    with pytest.raises(ConfigError, match="removed or replaced"):
        old.flush()
    with caplog.at_level(logging.WARNING, logger="dynemb.table.ddr_files"):
        old.close()  # e.g. at interpreter exit
    assert "removed or replaced" in caplog.text
    t = dynemb.DynamicTable(C.config(tmp_path, reopen=True))  # the new store, intact and clean
    assert t.size() == 3 and t.step == new.step
    t.close()
