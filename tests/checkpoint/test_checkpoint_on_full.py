"""A full checkpoint whose rows do not fit the loading table's hash buckets (another geometry,
or a table at capacity under another world size): ``on_full`` RAISE refuses before anything
changes; WARN (the default with ``reshard=True``) and COUNT keep each full bucket's
highest-scored rows, drop the rest, log per table and return the dropped rows. HBM_ONLY, HYBRID
(split index) and CACHING (backing index) tables."""

from __future__ import annotations

import logging

import pytest
import torch

import dynemb
from dynemb import checkpoint
from dynemb.checkpoint import CheckpointError
from dynemb.checkpoint.fit import lowest_scored

import _full as F


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """A checkpoint of three tables at capacity 256 (32 buckets of 8), every bucket full."""
    path = tmp_path_factory.mktemp("full") / "ck"
    src = dynemb.EmbeddingBagCollection(F.configs())
    F.fill(src)
    assert all(t.size() == t.capacity() == 256 for t in src.tables.values())
    checkpoint.save(path, model=src, step=4)
    return path, {n: F.rows(t) for n, t in src.tables.items()}


def test_raise_refuses_before_any_change(full):
    path, _ = full
    other = dynemb.EmbeddingBagCollection(F.configs(264))  # 33 buckets: keys hash elsewhere
    other.tables["h"].find_or_insert(torch.arange(5))
    before = F.rows(other.tables["h"])
    for kw in ({}, {"on_full": "raise"}, {"on_full": dynemb.OnFull.RAISE, "reshard": True}):
        with pytest.raises(CheckpointError, match="find their hash bucket full .* pass "
                                                  "on_full='warn'"):
            checkpoint.load(path, model=other, **kw)
        assert all(torch.equal(v, before[k]) for k, v in F.rows(other.tables["h"]).items())
        assert other.tables["y"].size() == 0


@pytest.mark.parametrize("on_full", ["warn", "count"])
def test_warn_and_count_keep_the_highest_scores(full, caplog, on_full):
    path, saved = full
    other = dynemb.EmbeddingBagCollection(F.configs(264))
    dropped: dict = {}
    with caplog.at_level(logging.INFO, logger="dynemb.checkpoint.reader"):
        assert checkpoint.load(path, model=other, on_full=on_full, dropped=dropped) == 4
    assert sorted(dropped) == ["c", "h", "y"]
    for name, table in other.tables.items():
        kept, out = F.rows(table), F.batch_rows(dropped[name])
        assert out["keys"].numel() > 0 and table.size() == 256 - out["keys"].numel()
        F.assert_kept_and_dropped(kept, out, saved[name])
        F.assert_highest_kept(table, kept, out)
        line = next(r for r in caplog.records if f"table '{name}'" in r.getMessage())
        assert line.levelno == (logging.WARNING if on_full == "warn" else logging.INFO)
        assert f"dropped {out['keys'].numel()} (on_full={on_full}" in line.getMessage()


def test_reshard_defaults_to_warn_and_a_fitting_load_drops_nothing(full, caplog):
    path, saved = full
    other = dynemb.EmbeddingBagCollection(F.configs(264))
    with caplog.at_level(logging.WARNING, logger="dynemb.checkpoint.reader"):
        checkpoint.load(path, model=other, reshard=True)
    assert caplog.text.count("did not fit their hash buckets") == 3
    same = dynemb.EmbeddingBagCollection(F.configs())
    dropped: dict = {}
    checkpoint.load(path, model=same, reshard=True, dropped=dropped)
    assert dropped == {}
    for name, table in same.tables.items():
        assert all(torch.equal(v, saved[name][k]) for k, v in F.rows(table).items())
    with pytest.raises(CheckpointError, match="on_full must be one of"):
        checkpoint.load(path, model=same, on_full="evict")


def test_lowest_scored_orders_by_score_then_key():
    keys = torch.tensor([5, 1, 9, 3, 7, 2])
    scores = torch.tensor([1, 1, 3, 2, 0, 1])
    buckets = torch.tensor([0, 0, 0, 0, 1, 1])
    # bucket 0 keeps 9 (score 3), 3 (score 2), then of the score-1 ties key 1 before key 5;
    # bucket 1 keeps 2 (score 1) before 7 (score 0)
    assert lowest_scored(keys, scores, buckets, 3).tolist() == [5]
    assert lowest_scored(keys, scores, buckets, 1).tolist() == [1, 3, 5, 7]
    assert lowest_scored(keys, scores, buckets, 4).tolist() == []


def test_admission_counters_that_do_not_fit_keep_the_highest_counts(tmp_path, caplog):
    """A table's counters saved from more ranks (or a bigger counter table) than the loading
    table holds: the highest counts are kept and a warning says how many, never all dropped."""
    def model(counters: int) -> dynemb.EmbeddingBagCollection:
        adm = dynemb.Admission(threshold=1000, counter_capacity=counters)
        return dynemb.EmbeddingBagCollection([dynemb.TableConfig(
            name="t", dim=2, features=["f"], capacity=64, admission=adm)])

    src = model(256)
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        ids = torch.randint(0, 200, (300,), generator=g)
        ones = torch.ones(300, dtype=torch.int64)
        src(dynemb.SparseBatch(features=["f"], values=ids, lengths=ones))
    keys, counts = src.tables["t"].admission.export()
    assert keys.numel() > 16
    checkpoint.save(tmp_path / "ck", model=src, step=6)
    dst = model(16)
    with caplog.at_level(logging.WARNING, logger="dynemb.checkpoint.reader"):
        checkpoint.load(tmp_path / "ck", model=dst)
    assert f"kept 16 of {keys.numel()}" in caplog.text
    got_keys, got_counts = dst.tables["t"].admission.export()
    assert got_keys.numel() == 16
    assert int(got_counts.min()) >= int(torch.sort(counts, descending=True).values[15])
    saved = dict(zip(keys.tolist(), counts.tolist()))
    assert all(saved[k] == c for k, c in zip(got_keys.tolist(), got_counts.tolist()))
