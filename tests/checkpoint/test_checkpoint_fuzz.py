"""Fuzzing the manifest: every single-bit flip of a small checkpoint's manifest.json either makes
``load`` raise CheckpointError before the model changed, or loads exactly what was saved; and
``inspect --verify`` (``verify_all``) agrees with ``load`` on every flip. A second pass flips
bits and re-seals the manifest (recomputes its checksum, as an editor or a bug would): every
failure is still a CheckpointError raised before anything changed."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import dynemb
from dynemb import checkpoint
from dynemb.checkpoint import CheckpointError, inspect, manifest

import _models as M


def _model():
    """One Adam table with admission (dim 2, three features) and the MLP: a small manifest
    that still has every kind of field (steps, parts, admission, dense optimizer)."""
    table = dynemb.TableConfig(name="t", dim=2, features=list(M.FEATURES), capacity=64,
                               optimizer=dynemb.Adam(lr=0.05),
                               admission=dynemb.Admission(threshold=2, counter_capacity=64))
    model = M.Tiny(dynemb.EmbeddingBagCollection([table]), width=6)
    return model, torch.optim.Adam(model.mlp.parameters(), lr=0.01)


def _dense(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Dense parameters and the dense optimizer's state tensors (Adam: step, m, v)."""
    out = [p.data for p in model.mlp.parameters()]
    for p in model.mlp.parameters():
        out += [v for v in opt.state[p].values()] if p in opt.state else []
    return out


def _raw(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor a load may change, as stored (slot by slot, free slots included), and the
    step counters: a failed load must leave each bit as it was."""
    out = []
    for t in model.sparse.tables.values():
        ix = t.index
        out += [ix.keys, ix.scores, ix.written, ix.digests, t.store.hbm,
                torch.tensor([t.step, t.optimizer.step])]
        if t.admission is not None:
            a = t.admission.index
            out += [a.keys, a.scores, a.digests]
    return out + _dense(model, opt)


def _clone(state: list[torch.Tensor]) -> list[torch.Tensor]:
    return [v.detach().clone() for v in state]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A saved checkpoint and what it holds; a model holding another state, and the checkpoint
    of that state (to go back to it after a flip loaded)."""
    root = tmp_path_factory.mktemp("fuzz")
    model, opt = _model()
    M.train(model, opt, range(3))
    checkpoint.save(root / "ck", model=model, dense_optimizer=opt, step=3)
    saved = (M.snapshot(model), _clone(_dense(model, opt)))
    target, target_opt = _model()
    M.train(target, target_opt, range(2), seed=7)
    checkpoint.save(root / "other", model=target, dense_optimizer=target_opt, step=2)
    return root, saved, target, target_opt


def _load(path, target, opt) -> str | None:
    """None if ``path`` loaded into ``target``, else the CheckpointError's message."""
    try:
        checkpoint.load(path, model=target, dense_optimizer=opt)
    except CheckpointError as e:
        return str(e)
    return None


def _verifies(path) -> bool:
    try:
        inspect.verify_all(path)
    except CheckpointError:
        return False
    return True


def _flips(raw: bytes, positions, reseal: bool):
    """(byte, bit, manifest bytes) per flip; re-sealed flips that are no JSON are skipped."""
    for byte, bit in positions:
        data = bytearray(raw)
        data[byte] ^= 1 << bit
        if reseal:
            try:
                data = bytearray(manifest.write_json(json.loads(bytes(data))))
            except (ValueError, UnicodeDecodeError, RecursionError):
                continue
        yield byte, bit, bytes(data)


def _run(setup, positions, reseal: bool) -> dict[str, int]:
    root, saved, target, opt = setup
    work = root / ("resealed" if reseal else "flipped")
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(root / "ck", work)
    raw = (root / "ck" / "manifest.json").read_bytes()
    before = _clone(_raw(target, opt))
    seen = {"refused": 0, "loaded": 0}
    last = 0
    fd = os.open(work / "manifest.json", os.O_RDWR)
    try:
        for byte, bit, data in _flips(raw, positions, reseal):
            if not reseal:  # rewrite one byte in place (fast), the previous one restored
                os.pwrite(fd, raw[last:last + 1], last)
                os.pwrite(fd, data[byte:byte + 1], byte)
                last = byte
            else:
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)
            assert (work / "manifest.json").read_bytes() == data  # exactly one flip
            error = _load(work, target, opt)
            if not reseal:  # inspect --verify agrees with load
                assert _verifies(work) == (error is None), (byte, bit, error)
            if error is not None:
                seen["refused"] += 1
                assert _same(_raw(target, opt), before), (byte, bit, error)
                continue
            seen["loaded"] += 1
            if not reseal:  # exactly what was saved: rows, steps, counters, dense, optimizer
                M.assert_same_tables(M.snapshot(target), saved[0])
                assert _same(_dense(target, opt), saved[1]), (byte, bit)
            checkpoint.load(root / "other", model=target, dense_optimizer=opt)
            before = _clone(_raw(target, opt))
        os.ftruncate(fd, 0)
        os.pwrite(fd, raw, 0)
    finally:
        os.close(fd)
    return seen


def test_every_bit_flip_of_the_manifest_is_refused_or_harmless(setup):
    root = setup[0]
    n = (root / "ck" / "manifest.json").stat().st_size
    assert n < 4000
    seen = _run(setup, [(i, b) for i in range(n) for b in range(8)], reseal=False)
    assert seen == {"refused": 8 * n, "loaded": 0}  # the checksum covers every byte


def test_resealed_bit_flips_fail_only_with_checkpoint_error_before_any_change(setup):
    """Flips the checksum cannot catch (the manifest re-sealed after the flip) meet the schema,
    the model's configuration and each file's own metadata: each load raises CheckpointError
    with the model untouched, or completes."""
    root = setup[0]
    n = (root / "ck" / "manifest.json").stat().st_size
    seen = _run(setup, [(i, (i * 5) % 8) for i in range(0, n, 4)], reseal=True)
    assert seen["refused"] > 0 and seen["loaded"] > 0
