"""Two processes save to one path at the same time, round after round; in each round one of
them is SIGKILLed at a random moment and a new one takes its place. The path always holds a
complete checkpoint that loads (checked while they run, by loads that take turns with the
saves, and after each kill); every save of the processes not killed succeeds; at the end the
path holds the last save exactly; what killed saves left beside it is removed by later saves.

The writers are forked from the test process (no interpreter start-up per writer)."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import signal
import time
import traceback
from pathlib import Path

import pytest
import torch

import dynemb
from dynemb import checkpoint
from dynemb.checkpoint import inspect
from dynemb.checkpoint.paths import SaveLock

import _models as M

ROUNDS = 6
MAX_SAVES = 500


def _writer(path: Path, seed: int, work: Path) -> None:
    """Trains and saves to ``path`` until ``work/stop`` exists; then writes the step and snapshot
    of its last save (``result-<seed>.pt``), or its traceback (``error-<seed>``)."""
    try:
        torch.set_num_threads(1)
        model = M.Tiny(dynemb.EmbeddingBagCollection(M.tables()), seed=seed)
        opt = torch.optim.Adam(model.mlp.parameters(), lr=0.01)
        step = 0
        while step < MAX_SAVES and (step == 0 or not (work / "stop").exists()):
            M.train(model, opt, range(step, step + 1), seed=seed)
            checkpoint.save(path, model=model, dense_optimizer=opt, step=1000 * seed + step)
            if step == 0:
                (work / f"ready-{seed}").write_text("saved once")
            step += 1
        torch.save({"step": 1000 * seed + step - 1, "tables": M.snapshot(model)},
                   work / f"result-{seed}.pt")
    except BaseException:  # noqa: BLE001  (reported to the parent)
        (work / f"error-{seed}").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


class Writer:
    """A forked process saving to ``path`` until ``work/stop`` exists."""

    def __init__(self, path: Path, seed: int, work: Path) -> None:
        self.seed, self.work = seed, work
        self.proc = mp.get_context("fork").Process(target=_writer, args=(path, seed, work))
        self.proc.start()

    def error(self) -> str:
        f = self.work / f"error-{self.seed}"
        return f.read_text() if f.exists() else f"exit code {self.proc.exitcode}"

    def assert_alive(self) -> None:
        assert self.proc.is_alive(), self.error()

    def ready(self) -> bool:
        return (self.work / f"ready-{self.seed}").exists()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join()  # reaped: its pid is gone

    def finish(self) -> dict:
        self.proc.join(120)
        assert self.proc.exitcode == 0, self.error()
        return torch.load(self.work / f"result-{self.seed}.pt", weights_only=False)


def _check(path: Path, model: torch.nn.Module) -> int:
    """While the writers save: the checkpoint at ``path`` verifies and loads (each holds the
    path's lock shared, so no save replaces the files under it); returns its step."""
    inspect.verify_all(path)
    return checkpoint.load(path, model=model)


def _wait_ready(writers: list[Writer]) -> None:
    deadline = time.monotonic() + 120
    while not all(w.ready() for w in writers):
        for w in writers:
            w.assert_alive()
        assert time.monotonic() < deadline, "a writer never saved"
        time.sleep(0.01)


def _run_until(t_end: float, path: Path, writers: list[Writer], model, rng) -> int:
    """Checks the path at random moments until ``t_end``; returns how many checks."""
    checks = 0
    while time.monotonic() < t_end:
        for w in writers:
            w.assert_alive()
        _check(path, model)
        checks += 1
        time.sleep(rng.uniform(0.0, 0.03))
    return checks


def test_concurrent_saves_with_one_killed_leave_a_complete_checkpoint(tmp_path):
    path, work = tmp_path / "ck", tmp_path / "work"
    work.mkdir()
    rng = random.Random(10)
    model = M.Tiny(dynemb.EmbeddingBagCollection(M.tables()))
    M.train(model, torch.optim.Adam(model.mlp.parameters()), range(1))  # compiled kernels,
    checkpoint.save(tmp_path / "warm", model=model, step=0)  # inherited by every fork
    checkpoint.load(tmp_path / "warm", model=model)
    shutil.rmtree(tmp_path / "warm")
    writers = [Writer(path, 1, work), Writer(path, 2, work)]
    checks = 0
    try:
        for rnd in range(ROUNDS):
            _wait_ready(writers)
            checks += _run_until(time.monotonic() + rng.uniform(0.05, 0.4), path, writers,
                                 model, rng)
            victim = writers.pop(rng.randrange(2))
            victim.kill()  # at a random moment of its loop: writing, committing, training
            _check(path, model)
            writers.append(Writer(path, 3 + rnd, work))
        _wait_ready(writers)
        (work / "stop").write_text("stop")
        results = {w.seed: w.finish() for w in writers}
    finally:
        for w in writers:
            if w.proc.is_alive():
                w.kill()
    step = _check(path, model)
    last = results[step // 1000]  # the path holds the last save of the writer that saved last
    assert last["step"] == step
    M.assert_same_tables(M.snapshot(model), last["tables"])
    assert checks >= ROUNDS
    checkpoint.save(path, model=model, step=0)  # removes what the killed saves left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "work"]


def test_leftovers_of_live_owners_are_kept_and_the_lock_waits(tmp_path):
    """A save removes the temporary directories of dead owners only (a live process of this
    host keeps its own); a second save to a locked path waits, then raises naming the lock."""
    from dynemb.checkpoint import paths  # noqa: PLC0415

    model = M.Tiny(dynemb.EmbeddingBagCollection(M.tables()))
    path = tmp_path / "deep" / "er" / "ck"  # parents are created
    checkpoint.save(path, model=model, step=1)
    dead = mp.get_context("fork").Process(target=os._exit, args=(0,))
    dead.start()
    dead.join()
    host = paths._host()
    live_dir = path.parent / f".ck.tmp-{host}-{os.getppid()}-aaaaaaaaaaaa"
    dead_dir = path.parent / f".ck.tmp-{host}-{dead.pid}-bbbbbbbbbbbb"
    for d in (live_dir, dead_dir):
        d.mkdir()
        (d / "x").write_text("partial")
    checkpoint.save(path, model=model, step=2)
    assert live_dir.exists() and not dead_dir.exists()
    with SaveLock(path):
        with pytest.raises(checkpoint.CheckpointError, match=r"another save to .* holds "
                                                             r".*\.ck\.lock"):
            with SaveLock(path, wait_s=0.2):
                pass
    assert not (path.parent / ".ck.lock").exists()  # its holder removes it
    assert checkpoint.load(path, model=model) == 2


def test_a_save_cannot_replace_a_checkpoint_while_it_is_loaded(tmp_path, monkeypatch):
    """A save that replaced the checkpoint between a load's checks and its reading of the rows
    used to give the model the new files' rows with the old manifest's steps and dense state,
    silently. Now the load holds the path's lock shared: the save waits (here: gives up)."""
    from dynemb.checkpoint import paths, reader  # noqa: PLC0415

    path = tmp_path / "ck"
    saved = M.Tiny(dynemb.EmbeddingBagCollection(M.tables()))
    M.train(saved, torch.optim.Adam(saved.mlp.parameters()), range(2))
    checkpoint.save(path, model=saved, step=2)
    other = M.Tiny(dynemb.EmbeddingBagCollection(M.tables()), seed=3)
    M.train(other, torch.optim.Adam(other.mlp.parameters()), range(5), seed=3)
    monkeypatch.setattr(paths, "LOCK_WAIT_S", 0.2)
    real_apply, refused = reader._apply, []

    def save_meanwhile(*args, **kwargs):  # what another process may do at this moment
        try:
            checkpoint.save(path, model=other, step=5)
        except checkpoint.CheckpointError as error:
            refused.append(str(error))
        return real_apply(*args, **kwargs)
    monkeypatch.setattr(reader, "_apply", save_meanwhile)
    model = M.Tiny(dynemb.EmbeddingBagCollection(M.tables()))
    assert checkpoint.load(path, model=model) == 2
    M.assert_same_tables(M.snapshot(model), M.snapshot(saved))
    assert len(refused) == 1 and ".ck.lock for more than" in refused[0], refused
    monkeypatch.setattr(reader, "_apply", real_apply)
    checkpoint.save(path, model=other, step=5)  # once the load is done
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no lock file left


def test_a_load_goes_on_unlocked_where_no_lock_can_be_taken(tmp_path, monkeypatch):
    """A file system without flock (ENOLCK) or a read-only location (EROFS): loads, which
    worked there before they took the lock, still do."""
    import errno  # noqa: PLC0415

    from dynemb.checkpoint import paths  # noqa: PLC0415

    model = M.Tiny(dynemb.EmbeddingBagCollection(M.tables()))
    checkpoint.save(tmp_path / "ck", model=model, step=1)
    for code in (errno.ENOLCK, errno.EROFS):
        def refuse(*_, code=code):
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(paths.fcntl, "flock", refuse)
        assert checkpoint.load(tmp_path / "ck", model=model) == 1
        assert inspect.verify_all(tmp_path / "ck") > 0
