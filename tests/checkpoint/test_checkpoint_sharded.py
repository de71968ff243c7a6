"""Sharded checkpoints on gloo ranks: a 2-rank resume equals uninterrupted training; a W = 2
hash_roundrobin checkpoint reshards to W = 3 and to a plain collection (W = 1, no
torch.distributed), roundrobin reshards to hash_roundrobin: every key on its owner, with its
row, optimizer state and score, none lost or duplicated; without reshard the load is refused on
every rank; base + delta of W = 2 equals the full checkpoint at W = 1. Tables at capacity at
W = 2 reshard to W = 1 and W = 3 at the same capacity, dropping (and reporting) the
lowest-scored rows of overfull buckets, every kept row equal to the saved one."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import dynemb
from dynemb import checkpoint
from dynemb.distributed import route

import _dist as D
import _full as F
import _models as M

pytestmark = pytest.mark.slow
_jobs: dict[str, list[dict]] = {}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("sharded")


@pytest.fixture(scope="module")
def w2(out):
    if "w2" not in _jobs:
        _jobs["w2"] = D.spawn("w2", 2, out)
    return _jobs["w2"]


@pytest.fixture(scope="module")
def w3(out, w2):
    if "w3" not in _jobs:
        _jobs["w3"] = D.spawn("w3", 3, out)
    return _jobs["w3"]


def _assert_on_owners(per_rank: list[dict], mode) -> None:
    w = len(per_rank)
    for rank, snap in enumerate(per_rank):
        for key, rec in snap.items():
            owners = route(rec["keys"], w, mode)
            assert bool((owners == rank).all()), (key, rank)
    for key in per_rank[0]:
        keys = torch.cat([s[key]["keys"] for s in per_rank])
        assert keys.numel() == torch.unique(keys).numel(), key  # no key twice


def test_two_rank_resume_equals_uninterrupted(w2):
    for rank, res in enumerate(w2):
        assert res["loaded_step"] == D.CUT
        for (loss, logits), (ref_loss, ref_logits) in zip(res["resumed"], res["ref"][D.CUT:]):
            assert loss == ref_loss, rank
            assert torch.equal(logits, ref_logits), rank
        M.assert_same_tables(res["resumed_tables"], res["ref_tables"])
    assert all(r["saved"]["sparse/a"]["keys"].numel() > 0 for r in w2)


def test_reshard_two_to_three_ranks(w2, w3):
    for res in w3:
        assert res["error"] is not None and "reshard=True" in res["error"]
        assert "saved over 2 rank(s) with routing hash_roundrobin" in res["error"]
        assert "runs over 3 rank(s) with routing hash_roundrobin" in res["error"]
        assert res["untouched"] and res["step"] == D.CUT
        assert all(torch.equal(v, w2[0]["saved_dense"][k]) for k, v in res["dense"].items())
    _assert_on_owners([r["tables"] for r in w3], D.HR)
    M.assert_same_tables(M.union([r["tables"] for r in w3]), M.union([r["saved"] for r in w2]),
                         admission=False)


def test_reshard_two_ranks_to_plain_collection(w2, out):
    assert not torch.distributed.is_initialized()
    model = M.Tiny(dynemb.EmbeddingBagCollection(M.tables()))
    opt = torch.optim.Adam(model.mlp.parameters(), lr=0.01)
    with pytest.raises(checkpoint.CheckpointError, match="runs over 1 rank"):
        checkpoint.load(out / "hash", model=model, dense_optimizer=opt)
    assert checkpoint.load(out / "hash", model=model, dense_optimizer=opt, reshard=True) == D.CUT
    want = M.union([r["saved"] for r in w2])
    for key, rec in M.snapshot(model).items():  # admission counters of both ranks merged too
        if "admission" in rec:
            keys = torch.cat([r["saved"][key]["admission"][0] for r in w2])
            assert torch.equal(rec["admission"][0], torch.sort(keys).values)
    M.assert_same_tables(M.snapshot(model), want, admission=False)
    dense = model.mlp.state_dict()
    assert all(torch.equal(v, w2[0]["saved_dense"][k]) for k, v in dense.items())
    M.train(model, opt, range(D.CUT, D.CUT + 1))


def test_roundrobin_to_hash_roundrobin(w2):
    assert all("saved over 2 rank(s) with routing roundrobin" in r["rr_error"] for r in w2)
    _assert_on_owners([r["rr_as_hash"] for r in w2], D.HR)
    M.assert_same_tables(M.union([r["rr_as_hash"] for r in w2]),
                         M.union([r["rr_saved"] for r in w2]), admission=False)


def test_incremental_two_ranks_to_one(w2, out):
    def plain():
        return M.Tiny(dynemb.EmbeddingBagCollection(M.tables()))

    a = plain()
    checkpoint.load(out / "base", model=a, reshard=True)
    assert checkpoint.load(out / "delta", model=a, reshard=True) == 4
    b = plain()
    checkpoint.load(out / "full", model=b, reshard=True)
    M.assert_same_tables(M.snapshot(a), M.snapshot(b))


def test_inspect_two_rank_checkpoint(w2, out):
    text = checkpoint.inspect.describe(out / "hash")
    assert "kind full, step 3, world size 2" in text
    assert "dense: optimizer torch.optim.adam.Adam, replicated on every rank, 2 file(s)" in text
    rows = [r["saved"]["sparse/a"]["keys"].numel() for r in w2]
    lines = text.splitlines()
    start = lines.index(next(ln for ln in lines if ln.startswith("table 'sparse/a'")))
    for rank, n in enumerate(rows):  # the rank lines under the table's header
        assert lines[start + 2 + rank].split()[:2] == [str(rank), f"{n:,}"]
    assert f"total {sum(rows):,} rows" in text
    files = json.loads((out / "hash" / "manifest.json").read_text())["files"]
    assert checkpoint.inspect.verify_all(out / "hash") == len(files)


def _saved_full(w2) -> dict:
    assert all(r["at_capacity"] for r in w2)
    return {n: F.merge([r["full_saved"][n] for r in w2]) for n in F.MODES}


def test_full_tables_reshard_two_ranks_to_one(w2, out, caplog):
    """Full tables (HBM_ONLY, HYBRID, CACHING) saved at W = 2 load at W = 1 with the same
    capacity: the rows that do not fit their bucket are dropped, lowest score first, logged and
    returned; every kept row is the saved one. Before: load(reshard=True) raised."""
    saved = _saved_full(w2)
    model = dynemb.EmbeddingBagCollection(F.configs())
    dropped: dict = {}
    with caplog.at_level(logging.WARNING, logger="dynemb.checkpoint.reader"):
        assert checkpoint.load(out / "full_tables", model=model, reshard=True,
                               dropped=dropped) == 7
    assert sorted(dropped) == sorted(F.MODES)
    for name, table in model.tables.items():
        kept, out_rows = F.rows(table), F.batch_rows(dropped[name])
        n = out_rows["keys"].numel()
        assert n > 0 and f"table {name!r}: 256 of its rows" in caplog.text
        assert f"dropped {n} (on_full=warn" in caplog.text
        F.assert_kept_and_dropped(kept, out_rows, saved[name])
        F.assert_highest_kept(table, kept, out_rows)


def test_full_tables_reshard_two_ranks_to_three(w2, w3):
    saved = _saved_full(w2)
    assert all(r["full_step"] == 7 for r in w3)
    _assert_on_owners([r["full_kept"] for r in w3], D.HR)
    for name in F.MODES:
        kept = F.merge([r["full_kept"][name] for r in w3])
        outs = [r["full_dropped"][name] for r in w3 if name in r["full_dropped"]]
        assert outs, name  # some bucket overflowed somewhere: it was reported
        F.assert_kept_and_dropped(kept, F.merge(outs), saved[name])
        for r in w3:  # per rank: dropped rows never outrank kept ones of their bucket
            kb, db, width = r["full_buckets"][name]
            if db is None:
                continue
            k, d = r["full_kept"][name], r["full_dropped"][name]
            for b in torch.unique(db).tolist():
                assert int((kb == b).sum()) == width
                worst = min(zip(k["scores"][kb == b].tolist(), (-k["keys"][kb == b]).tolist()))
                best = max(zip(d["scores"][db == b].tolist(), (-d["keys"][db == b]).tolist()))
                assert best < worst
