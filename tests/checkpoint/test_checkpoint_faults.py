"""A save killed part-way leaves the previous checkpoint loadable (and the next save cleans up);
the replacement without ``renameat2`` and its interrupted state are handled."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dynemb
from dynemb import checkpoint
from dynemb.checkpoint import files

import _models as M

HERE = Path(__file__).resolve().parent


def fresh():
    model = M.Tiny(dynemb.EmbeddingBagCollection(M.tables()))
    return model, torch.optim.Adam(model.mlp.parameters(), lr=0.01)


def trained(steps: int):
    model, opt = fresh()
    M.train(model, opt, range(steps))
    return model, opt


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["parts", "commit"])
def test_killed_save_leaves_previous_checkpoint(tmp_path, phase):
    path, signal = tmp_path / "ck", tmp_path / "signal"
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(HERE / "_killed_save.py"), str(path), str(signal),
                             phase], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not signal.exists():
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "the child never reached the kill point"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".ck.tmp-")]
    assert len(leftovers) == 1  # the killed save's temporary directory
    model, opt = fresh()
    assert checkpoint.load(path, model=model, dense_optimizer=opt) == 2
    want, _ = trained(2)
    M.assert_same_tables(M.snapshot(model), M.snapshot(want))
    checkpoint.save(path, model=model, dense_optimizer=opt, step=2)  # cleans up the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "signal"]


def test_replace_without_rename_exchange(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    model, opt = trained(2)
    checkpoint.save(tmp_path / "ck", model=model, step=2)
    M.train(model, opt, range(2, 3))
    checkpoint.save(tmp_path / "ck", model=model, step=3)
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    other, _ = fresh()
    assert checkpoint.load(tmp_path / "ck", model=other) == 3
    M.assert_same_tables(M.snapshot(other), M.snapshot(model))


def test_interrupted_replacement_names_previous_checkpoint(tmp_path):
    model, _ = trained(2)
    checkpoint.save(tmp_path / "ck", model=model, step=2)
    (tmp_path / "ck").rename(tmp_path / ".ck.old-0123")  # a crash between the two renames
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"previous checkpoint is complete at .*\.ck\.old-0123; rename it"):
        checkpoint.load(tmp_path / "ck", model=fresh()[0])


@pytest.mark.parametrize("where", ["part", "dense", "manifest"])
def test_a_full_disk_is_a_checkpoint_error_that_keeps_the_previous_checkpoint(tmp_path,
                                                                               monkeypatch,
                                                                               where):
    """A file system that fills up during a save: the errors that used to escape save (a
    SafetensorError from a part, an OSError from the dense file or the manifest) are raised as
    CheckpointError naming the cause; nothing is left beside the path, and the previous
    checkpoint is unchanged."""
    from safetensors import SafetensorError

    from dynemb.checkpoint import writer

    model, opt = trained(2)
    checkpoint.save(tmp_path / "ck", model=model, dense_optimizer=opt, step=2)
    M.train(model, opt, range(2, 3))
    full = "No space left on device (os error 28)"
    if where == "part":
        def fail(*args, **kwargs):
            raise SafetensorError(f"Error while serializing: I/O error: {full}")
        monkeypatch.setattr(files, "save_file", fail)
    else:
        real = writer.write_bytes

        def fail(path, data):
            if (path.name == "manifest.json") == (where == "manifest"):
                raise OSError(28, "No space left on device", str(path))
            return real(path, data)
        monkeypatch.setattr(writer, "write_bytes", fail)
    with pytest.raises(checkpoint.CheckpointError, match="checkpoint full (save|commit) .* "
                       "failed on rank 0: .*No space left on device"):
        checkpoint.save(tmp_path / "ck", model=model, dense_optimizer=opt, step=3)
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    other, _ = fresh()
    assert checkpoint.load(tmp_path / "ck", model=other) == 2
    want, _ = trained(2)
    M.assert_same_tables(M.snapshot(other), M.snapshot(want))


@pytest.mark.parametrize("damage", ["remove a part", "grow the dense file", "add a file"])
def test_a_new_checkpoint_that_is_not_complete_never_replaces_the_previous(tmp_path,
                                                                             monkeypatch,
                                                                             damage):
    """Files of the new directory that vanish, change size or appear between the writing and
    the commit (another process in the temporary directory, a file system fault): the save
    refuses to put it in place and the previous checkpoint stays (no test guarded this)."""
    from dynemb.checkpoint import writer

    model, opt = trained(2)
    checkpoint.save(tmp_path / "ck", model=model, dense_optimizer=opt, step=2)
    real = writer._manifest

    def manifest_after_damage(view, reports, *args):
        tmp = next(tmp_path.glob(".ck.tmp-*"))
        if damage == "remove a part":
            next(tmp.glob("tables/*/*.part00000.safetensors")).unlink()
        elif damage == "grow the dense file":
            with open(tmp / "dense" / "rank00000.pt", "ab") as f:
                f.write(b"x")
        else:
            (tmp / "dense" / "stray.txt").write_text("x")
        return real(view, reports, *args)
    monkeypatch.setattr(writer, "_manifest", manifest_after_damage)
    with pytest.raises(checkpoint.CheckpointError, match="after writing|unexpected entries"):
        checkpoint.save(tmp_path / "ck", model=model, dense_optimizer=opt, step=3)
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    other, _ = fresh()
    assert checkpoint.load(tmp_path / "ck", model=other) == 2


def test_a_table_interrupted_part_way_is_never_saved(tmp_path, monkeypatch):
    """A KeyboardInterrupt inside a table call may leave rows half written: save refuses the
    table (naming it) and leaves the previous checkpoint as it was."""
    model, opt = trained(2)
    path = tmp_path / "ck"
    checkpoint.save(path, model=model, dense_optimizer=opt, step=2)
    before = files.sha256_file(path / "manifest.json")
    table = model.sparse.tables["a"]

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(table.store, "init", interrupt)
    with pytest.raises(KeyboardInterrupt):
        table.find_or_insert(torch.arange(10_000, 10_010))
    monkeypatch.undo()
    with pytest.raises(dynemb.errors.CheckpointError, match="'sparse/a'.*interrupted part way"):
        checkpoint.save(path, model=model, dense_optimizer=opt, step=3)
    assert files.sha256_file(path / "manifest.json") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
