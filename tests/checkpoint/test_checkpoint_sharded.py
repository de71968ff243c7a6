"""Sharded checkpoints on gloo ranks: a 2-rank resume equals uninterrupted training; a W = 2
hash_roundrobin checkpoint reshards to W = 3 and to a plain collection (W = 1, no
torch.distributed), roundrobin reshards to hash_roundrobin: every key on its owner, with its
row, optimizer state and score, none lost or duplicated; without reshard the load is refused on
every rank; base + delta of W = 2 equals the full checkpoint at W = 1."""

from __future__ import annotations

import json

import pytest
import torch

import dynemb
from dynemb import checkpoint
from dynemb.distributed import route

import _dist as D
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
    dense = {k.removeprefix("mlp."): v for k, v in model.state_dict().items()}
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
