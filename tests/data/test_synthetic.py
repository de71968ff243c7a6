"""Synthetic Criteo-like data: determinism, independent streams per rank and worker, Zipf ids,
huge vocabularies, the known best AUC, and config validation."""

from __future__ import annotations

import pytest
import torch

from dynemb.batch import EMPTY_KEY
from dynemb.data import SyntheticConfig, SyntheticData, SyntheticIterable
from dynemb.data.synthetic import zipf_ranks
from dynemb.errors import ConfigError
from dynemb.train.metrics import roc_auc

SMALL = SyntheticConfig(num_dense=3, num_sparse=4, vocab_sizes=(10, 1000, 10**6, 10**9),
                        eval_samples=3000, seed=7)


def test_batches_have_the_criteo_layout_by_default():
    data = SyntheticData()
    b = next(data.train_batches(32))
    assert b.dense.shape == (32, 13) and b.dense.dtype == torch.float32
    assert b.sparse.features == tuple(f"c{i}" for i in range(1, 27))
    assert b.sparse.values.numel() == 26 * 32 and bool((b.sparse.lengths == 1).all())
    assert set(b.labels.unique().tolist()) <= {0.0, 1.0}
    assert b.true_prob.shape == (32,) and bool(((b.true_prob > 0) & (b.true_prob < 1)).all())
    assert bool((b.dense >= 0).all())  # log1p of counts


def test_deterministic_and_restartable():
    a = list(zip(range(3), SyntheticData(SMALL).train_batches(16)))
    b = next(SyntheticData(SMALL).train_batches(16, start=2))
    assert torch.equal(a[2][1].sparse.values, b.sparse.values)
    assert torch.equal(a[2][1].labels, b.labels) and torch.equal(a[2][1].dense, b.dense)


def test_streams_differ_per_rank_and_seed():
    data = SyntheticData(SMALL)
    r0 = next(data.train_batches(64, rank=0, world_size=2))
    r1 = next(data.train_batches(64, rank=1, world_size=2))
    other = next(SyntheticData(SyntheticConfig(**{**SMALL.__dict__, "seed": 8})).train_batches(64))
    assert not torch.equal(r0.sparse.values, r1.sparse.values)
    assert not torch.equal(r0.sparse.values, other.sparse.values)


def test_workers_split_the_batches_without_overlap():
    data = SyntheticData(SMALL)
    single = [b.sparse.values for _, b in zip(range(6), data.train_batches(8))]
    w0 = [b.sparse.values for _, b in zip(range(3), data.train_batches(8, worker=0, num_workers=2))]
    w1 = [b.sparse.values for _, b in zip(range(3), data.train_batches(8, worker=1, num_workers=2))]
    interleaved = [x for pair in zip(w0, w1) for x in pair]
    assert all(torch.equal(a, b) for a, b in zip(single, interleaved))


def test_dataloader_workers():
    loader = torch.utils.data.DataLoader(SyntheticIterable(SyntheticData(SMALL), 8),
                                         batch_size=None, num_workers=2)
    got = [b.sparse.values for _, b in zip(range(4), loader)]
    want = [b.sparse.values for _, b in zip(range(4), SyntheticData(SMALL).train_batches(8))]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_ids_are_raw_nonnegative_and_within_each_vocabulary():
    data = SyntheticData(SMALL)
    b = next(data.train_batches(4000))
    for name, vocab in zip(data.feature_names, SMALL.vocab_sizes):
        ids = b.sparse.feature(name)[0]
        assert bool((ids >= 0).all()) and bool((ids < 2**62).all())
        assert bool((ids != EMPTY_KEY).all())
        assert torch.unique(ids).numel() <= vocab
    assert torch.unique(b.sparse.feature("c1")[0]).numel() == 10  # all 10 ids of a tiny field


def test_zipf_ranks_follow_the_power_law():
    u = torch.rand(200_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ranks = zipf_ranks(u, 10**9, 1.05)
    assert int(ranks.min()) >= 0 and int(ranks.max()) < 10**9
    counts = torch.bincount(ranks[ranks < 100], minlength=100).double()
    # P(r) ∝ ∫ x^-1.05 over [r+1, r+2): rank 0 vs rank 9 ≈ (1.5 / 10.5)^-1.05 ≈ 7.7
    assert counts[0] / counts[9] == pytest.approx(7.7, rel=0.1)
    flat = zipf_ranks(u, 100, 1.0)
    assert int(flat.max()) == 99


def test_best_auc_is_known_and_eval_is_split_over_ranks():
    data = SyntheticData(SMALL)
    parts = [list(data.eval_batches(500, rank=r, world_size=3)) for r in range(3)]
    labels = torch.cat([b.labels for p in parts for b in p])
    prob = torch.cat([b.true_prob for p in parts for b in p])
    whole = torch.cat([b.labels for b in data.eval_batches(1000)])
    assert labels.numel() == 3000 and torch.equal(labels, whole)
    assert 0.6 < roc_auc(prob, labels) < 1.0
    flat = SyntheticData(SyntheticConfig(**{**SMALL.__dict__, "signal": 0.0}))
    b = next(flat.eval_batches(3000))
    assert abs(roc_auc(b.true_prob + torch.rand(3000) * 1e-3, b.labels) - 0.5) < 0.05
    assert b.labels.mean() == pytest.approx(0.25, abs=0.03)  # base_rate


@pytest.mark.parametrize("field,value,match", [
    ("vocab_sizes", (10, 20), "4 ints in \\[1, 10\\^9\\]"),
    ("vocab_sizes", 10**10, "10\\^9"),
    ("alpha", 0.0, "alpha"),
    ("base_rate", 1.0, "base_rate"),
    ("num_sparse", 0, "num_sparse"),
    ("eval_samples", 0, "eval_samples"),
])
def test_config_validation(field, value, match):
    with pytest.raises(ConfigError, match=match):
        SyntheticConfig(**{**SMALL.__dict__, field: value})


def test_one_vocabulary_for_every_field():
    assert SyntheticConfig(num_sparse=3, vocab_sizes=50).vocab_sizes == (50, 50, 50)
