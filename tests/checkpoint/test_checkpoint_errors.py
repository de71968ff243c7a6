"""Mismatches and damage are reported with what was expected and what was found, before the
model changes: table names, dims, optimizer types, score policy, routing, capacity, dense state,
checksums, truncated and missing files, bad manifests."""

from __future__ import annotations

import json

import pytest
import torch

import dynemb
from dynemb import checkpoint
from dynemb.checkpoint import CheckpointError

import _models as M
from _models import expect_untouched, fresh, trained_other


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of a model trained 3 steps (tables a: Adam dim 4, b: Adagrad dim 3)."""
    path = tmp_path_factory.mktemp("ck") / "ck"
    model, opt = fresh()
    M.train(model, opt, range(3))
    checkpoint.save(path, model=model, dense_optimizer=opt, step=3)
    return path


def test_table_names_differ(saved):
    tables = M.tables()
    tables[1] = dynemb.TableConfig(**{**tables[1].__dict__, "name": "c"})
    model, _ = fresh(tables)
    msg = expect_untouched(saved, model, match="holds tables")
    assert "['sparse/a', 'sparse/b']" in msg and "['sparse/a', 'sparse/c']" in msg


def test_dim_differs(saved):
    model = M.Tiny(dynemb.EmbeddingBagCollection(M.tables(dim_a=5)), width=5 + 3 + 3)
    msg = expect_untouched(saved, model, match="dim is 4 in the checkpoint, expected 5")
    assert "'sparse/a'" in msg


def test_optimizer_type_differs(saved):
    model, _ = fresh(optimizer_a=dynemb.SGD(lr=0.1))
    expect_untouched(saved, model, match="optimizer is Adam in the checkpoint, expected SGD")


def test_score_policy_differs(saved):
    tables = [dynemb.TableConfig(**{**t.__dict__, "score": dynemb.ScorePolicy.LFU})
              for t in M.tables()]
    model, _ = fresh(tables)
    expect_untouched(saved, model, match="score policy lru in the checkpoint, expected lfu")


def test_routing_mode_differs_without_reshard(saved):
    model, opt = fresh(routing=dynemb.Routing.ROUNDROBIN)
    msg = expect_untouched(saved, model, match="reshard=True")
    assert "saved over 1 rank(s) with routing hash_roundrobin" in msg
    assert "runs over 1 rank(s) with routing roundrobin" in msg
    checkpoint.load(saved, model=model, dense_optimizer=opt, reshard=True)  # allowed with it
    assert model.sparse.tables["a"].size() > 0


def test_capacity_too_small(saved):
    tables = M.tables()
    tables[0] = dynemb.TableConfig(**{**tables[0].__dict__, "capacity": 8})
    model, _ = fresh(tables)
    expect_untouched(saved, model, match="raise the table's capacity")


def test_dense_mismatches(saved):
    model, opt = trained_other()
    sgd = torch.optim.SGD(model.mlp.parameters(), lr=0.1)
    expect_untouched(saved, model, sgd,
                     match="dense optimizer is torch.optim.adam.Adam in the checkpoint, expected "
                           "torch.optim.sgd.SGD")
    model.mlp[2] = torch.nn.Linear(8, 2)
    expect_untouched(saved, model, match=r"'mlp.2.weight' has shape \(1, 8\) in the checkpoint "
                                         r"but \(2, 8\) in the model")
    model.mlp.append(torch.nn.Linear(2, 1))
    expect_untouched(saved, model, match="in the model but not the checkpoint")


def test_dense_optimizer_not_saved(tmp_path):
    model, opt = fresh()
    checkpoint.save(tmp_path / "ck", model=model, step=0)
    expect_untouched(tmp_path / "ck", model, opt, match="has no dense optimizer state")
    assert checkpoint.load(tmp_path / "ck", model=model) == 0


def _copy(saved, tmp_path):
    import shutil  # noqa: PLC0415

    dst = tmp_path / "copy"
    shutil.copytree(saved, dst)
    return dst, json.loads((dst / "manifest.json").read_text())


def _part(manifest) -> str:
    return manifest["tables"]["sparse/a"]["ranks"][0]["parts"][0]["file"]


def test_flipped_byte_fails_checksum(saved, tmp_path):
    path, m = _copy(saved, tmp_path)
    f = path / _part(m)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    model, opt = trained_other()
    msg = expect_untouched(path, model, opt, match="fails its checksum")
    assert _part(m) in msg and m["files"][_part(m)]["sha256"] in msg


def test_truncated_and_missing_files(saved, tmp_path):
    path, m = _copy(saved, tmp_path)
    f = path / _part(m)
    size = f.stat().st_size
    f.write_bytes(f.read_bytes()[:size - 10])
    model, opt = trained_other()
    expect_untouched(path, model, opt, match=f"has {size - 10} bytes, expected {size}")
    f.unlink()
    expect_untouched(path, model, opt, match="is missing")
    dense = path / m["dense"]["files"][0]
    dense.write_bytes(b"")
    expect_untouched(path, model, opt, match="dense/rank00000.pt has 0 bytes")


def test_bad_manifests(saved, tmp_path):
    model, _ = trained_other()
    expect_untouched(tmp_path / "absent", model, match="is not a directory")
    path, m = _copy(saved, tmp_path)
    (path / "manifest.json").write_text('{"format": "dynemb-checkpoint", "format_')
    expect_untouched(path, model, match="not readable JSON")
    (path / "manifest.json").write_text(json.dumps({**m, "format_version": 99}))
    expect_untouched(path, model, match=f"format version 99, expected {checkpoint.FORMAT_VERSION}")
    (path / "manifest.json").unlink()
    expect_untouched(path, model, match="has no manifest.json")


def test_bad_arguments(tmp_path):
    model, _ = fresh()
    for bad in (-1, 1 << 63):  # refused before anything is written, not at commit
        with pytest.raises(CheckpointError, match=r"expected step an int in \[0, 92233\d+\]"):
            checkpoint.save(tmp_path / "x", model=model, step=bad)
    with pytest.raises(CheckpointError, match="expected model= a torch.nn.Module"):
        checkpoint.save(tmp_path / "x", model=object(), step=0)
    with pytest.raises(CheckpointError, match="expected dense_optimizer="):
        checkpoint.save(tmp_path / "x", model=model, dense_optimizer=object(), step=0)
    assert not (tmp_path / "x").exists() and not list(tmp_path.iterdir())
    assert issubclass(CheckpointError, dynemb.errors.DynembError)


def test_bucket_overflow_is_caught_before_loading(tmp_path):
    """Rows that fit the capacity but not the hash buckets of a table of another geometry are
    refused before any row is loaded (a full table of 8 buckets into one of 9)."""
    def ebc(capacity):
        return dynemb.EmbeddingBagCollection([dynemb.TableConfig(
            name="t", dim=2, features=["f"], capacity=capacity, bucket_capacity=8)])

    full = ebc(64)
    for lo in range(0, 1000, 4):  # LRU evicts: every bucket ends full
        full.tables["t"].find_or_insert(torch.arange(lo, lo + 4))
    assert full.tables["t"].size() == 64
    checkpoint.save(tmp_path / "ck", model=full, step=1)
    other = ebc(68)
    assert other.tables["t"].capacity() == 72
    with pytest.raises(CheckpointError, match=r"find their hash bucket full \(buckets of 8 slots; "
                                              r"this table has 9 buckets"):
        checkpoint.load(tmp_path / "ck", model=other)
    assert other.tables["t"].size() == 0
    roomy = ebc(256)
    checkpoint.load(tmp_path / "ck", model=roomy)
    assert roomy.tables["t"].size() == 64
