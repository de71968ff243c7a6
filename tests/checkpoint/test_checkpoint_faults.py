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
