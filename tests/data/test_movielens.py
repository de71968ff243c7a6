"""MovieLens 100K from recbole's bundled copy: the files are found without importing recbole,
and the CTR view (labels, features, splits, rank slices) is built as documented."""

from __future__ import annotations

import datetime
import sys

import pytest
import torch

from dynemb.data import MovieLens100K, Split, string_id
from dynemb.data.movielens import (
    AGE_BUCKETS, SPARSE, _Columns, _prior_counts, dataset_dir, load_columns,
)
from dynemb.errors import ConfigError


@pytest.fixture(scope="module")
def ml() -> MovieLens100K:
    return MovieLens100K()


def test_files_are_found_without_running_recbole():
    folder = dataset_dir()
    assert (folder / "ml-100k.inter").is_file() and (folder / "ml-100k.user").is_file()
    assert folder.parts[-2:] == ("dataset_example", "ml-100k")
    assert "recbole" not in sys.modules  # find_spec located it; nothing of recbole ran


def test_ctr_view_sizes_labels_and_features(ml):
    assert ml.info["samples"] == 100_000
    assert ml.info["train_samples"] == 80_000 and ml.info["eval_samples"] == 20_000
    assert ml.info["positive_rate"] == pytest.approx(0.5537, abs=1e-4)  # rating >= 4
    assert ml.feature_names == SPARSE
    num_ids = {f.name: f.num_ids for f in ml.features}
    assert num_ids["user"] == 943 and num_ids["item"] == 1682
    assert num_ids["gender"] == 2 and num_ids["occupation"] == 21 and num_ids["weekday"] == 7
    assert num_ids["age"] == len(AGE_BUCKETS) + 1 and num_ids["hour"] == 24
    assert [f.name for f in ml.features if f.multi_hot] == ["genres"]
    assert ml.dense_names[-2:] == ("user_history", "item_history")
    assert ml.dense[ml.train_index].mean(0).abs().max() < 1e-4  # standardised on train


def test_first_rating_features(ml):
    """ml-100k.inter's first line: user 196 (49, M, writer, 55105) rated item 242 (Kolya,
    1996, Comedy) 3 stars at 881250949 (1997-12-04 15:55:49 UTC, a Thursday)."""
    b = ml.batch(torch.tensor([0]))
    feats = {name: b.sparse.feature(name)[0].tolist() for name in SPARSE}
    when = datetime.datetime.fromtimestamp(881250949, tz=datetime.timezone.utc)
    assert feats["user"] == [196] and feats["item"] == [242] and feats["year"] == [1996]
    assert feats["age"] == [4]  # 45-49
    assert feats["gender"] == [string_id("M")] and feats["occupation"] == [string_id("writer")]
    assert feats["zip"] == [string_id("551")]
    assert feats["genres"] == [string_id("Comedy")]
    assert feats["hour"] == [when.hour] and feats["weekday"] == [when.weekday()]
    assert b.labels.tolist() == [0.0]


def test_genres_are_multi_hot_and_unknown_years_are_empty_bags(ml):
    index = torch.arange(5000)
    b = ml.batch(index)
    genres = b.sparse.feature("genres")[1]
    assert genres.min() >= 1 and genres.max() >= 3
    items = b.sparse.feature("item")[0]
    year_lengths = b.sparse.feature("year")[1]
    assert bool((year_lengths[items == 267] == 0).all())  # "unkonwn" release year
    assert bool((year_lengths[items != 267] == 1).all())


def test_history_counts_earlier_ratings_only():
    """user_history / item_history: log1p of the ratings the user / item had before."""
    stamps = torch.tensor([50, 10, 30, 10, 20])
    users = torch.tensor([1, 1, 2, 1, 2])
    items = torch.tensor([7, 8, 7, 7, 9])
    cols = _Columns(ids={"user": users[:, None], "item": items[:, None]}, lengths={},
                    dense=torch.zeros(5, 0), labels=torch.zeros(5), timestamps=stamps)
    counts = torch.expm1(_prior_counts(cols)).round().long()
    # user 1 rated at 10 (row 1), 10 (row 3, after row 1 in file order), 50 (row 0)
    assert counts[:, 0].tolist() == [2, 0, 1, 1, 0]
    # item 7 rated at 10 (row 3), 30 (row 2), 50 (row 0)
    assert counts[:, 1].tolist() == [2, 0, 1, 0, 0]


def test_splits_are_disjoint_and_time_split_holds_out_the_latest():
    ml = MovieLens100K(split=Split.TIME, count_features=False)
    train, held = ml.train_index, ml.eval_index
    assert torch.unique(torch.cat([train, held])).numel() == 100_000
    assert len(ml.dense_names) == 4
    stamps = load_columns(dataset_dir()).timestamps
    assert stamps[train].max() <= stamps[held].min()


def test_random_split_depends_on_the_seed(ml):
    other = MovieLens100K(seed=1)
    assert not torch.equal(ml.eval_index, other.eval_index)
    assert torch.equal(ml.eval_index, MovieLens100K(seed=0).eval_index)


def test_ranks_take_slices_of_the_same_global_batch(ml):
    whole = next(ml.train_batches(8, start=3))
    parts = [next(ml.train_batches(4, rank=r, world_size=2, start=3)) for r in range(2)]
    assert torch.equal(torch.cat([p.labels for p in parts]), whole.labels)
    assert torch.equal(torch.cat([p.dense for p in parts]), whole.dense)
    evals = [torch.cat([b.labels for b in ml.eval_batches(3000, rank=r, world_size=3)])
             for r in range(3)]
    assert sum(e.numel() for e in evals) == 20_000


def test_train_batches_restart_at_any_step(ml):
    it = ml.train_batches(64)
    batches = [next(it) for _ in range(1252)]  # crosses an epoch (1250 batches of 64)
    again = next(ml.train_batches(64, start=1251))
    assert torch.equal(again.sparse.values, batches[1251].sparse.values)


def test_bad_arguments():
    with pytest.raises(ConfigError, match="eval_fraction"):
        MovieLens100K(eval_fraction=1.5)
    with pytest.raises(ConfigError, match="larger than the 80000 training samples"):
        next(MovieLens100K().train_batches(100_000))
