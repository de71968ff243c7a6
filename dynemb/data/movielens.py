"""MovieLens 100K as a click-through-rate data set, read from the copy inside ``recbole==1.2.1``.

The ratings are GroupLens's; their license forbids redistribution, so dynemb never copies them:
it reads the files the PyPI package ``recbole`` ships (``pip install --no-deps recbole==1.2.1``,
which ``make install`` does) without importing that package.

CTR view: label = rating >= 4 (55 % positive). Sparse features: user, item, age bucket, gender,
occupation, zip prefix, release year, genres (multi-hot), hour and weekday of the rating (UTC).
Dense features (no label information): age, release year, the movie's age when rated, number
of genres, and (optionally) how many ratings the user and the item had before this one (by
timestamp); standardised with the training part's mean and deviation. Splits: random 80/20
(seeded) or by time (the last 20 % of ratings by timestamp are held out).

Everything is precomputed into tensors once (the data set is small); each epoch's samples are
gathered once in its order, and a batch is a few slices of them.
"""

from __future__ import annotations

import enum
import importlib.util
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dynemb.batch import SparseBatch
from dynemb.data.base import Batch, DataSource, FeatureInfo, rank_slice, string_id
from dynemb.errors import ConfigError

logger = logging.getLogger(__name__)

CITATION = ("MovieLens 100K, GroupLens Research (https://grouplens.org/datasets/movielens/): "
            "F. Maxwell Harper and Joseph A. Konstan. 2015. The MovieLens Datasets: History and "
            "Context. ACM Transactions on Interactive Intelligent Systems (TiiS) 5, 4: 19:1-19:19. "
            "https://doi.org/10.1145/2827872 (read from the copy shipped in recbole==1.2.1; "
            "not redistributed).")
SPARSE = ("user", "item", "age", "gender", "occupation", "zip", "year", "genres", "hour",
          "weekday")
DENSE = ("age", "release_year", "movie_age", "num_genres")
AGE_BUCKETS = (18, 25, 35, 45, 50, 56)
"""Upper ends of the age buckets (the MovieLens 1M grouping): <18, 18-24, ..., 50-55, 56+."""
ZIP_PREFIX = 3
"""Leading characters of the zip code kept (the US sectional center)."""
_cited = False


class Split(str, enum.Enum):
    """How ratings are divided into training and held-out parts."""

    RANDOM = "random"
    """A seeded random permutation: the last ``eval_fraction`` of it is held out."""
    TIME = "time"
    """By timestamp: the latest ``eval_fraction`` of the ratings are held out."""


def dataset_dir() -> Path:
    """The ``dataset_example/ml-100k`` folder inside the installed ``recbole`` package.

    Found with ``importlib.util.find_spec`` on the top-level package, which locates it without
    running any of its code (recbole's own dependencies need not be installed).

    Raises:
        ConfigError: recbole is not installed or lacks the folder.
    """
    spec = importlib.util.find_spec("recbole")
    fix = "install it with `pip install --no-deps recbole==1.2.1` (`make install` does)"
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"movielens-100k: expected the PyPI package recbole==1.2.1 (it ships "
                          f"the MovieLens 100K files), found it not installed; {fix}.")
    for location in spec.submodule_search_locations:
        folder = Path(location) / "dataset_example" / "ml-100k"
        if (folder / "ml-100k.inter").is_file():
            return folder
    raise ConfigError(f"movielens-100k: expected dataset_example/ml-100k/ml-100k.inter inside "
                      f"recbole at {list(spec.submodule_search_locations)}, found none; {fix}.")


def read_atomic(path: Path) -> dict[str, list[str]]:
    """Reads one of recbole's atomic files: tab-separated, a typed header (``user_id:token``).

    Returns:
        ``{column name without its type: [value per row]}``.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        header = f.readline().rstrip("\n").split("\t")
        names = [h.split(":")[0] for h in header]
        columns: list[list[str]] = [[] for _ in names]
        for n, line in enumerate(f, start=2):
            parts = line.rstrip("\n").split("\t")
            if len(parts) != len(names):
                raise ConfigError(f"{path}:{n}: expected {len(names)} tab-separated fields "
                                  f"({names}), found {len(parts)}.")
            for col, value in zip(columns, parts):
                col.append(value)
    return dict(zip(names, columns))


def _age_bucket(age: int) -> int:
    return sum(age >= edge for edge in AGE_BUCKETS)


def _year(text: str) -> int | None:
    return int(text) if text.isdigit() and len(text) == 4 else None


@dataclass
class _Columns:
    """Per-rating feature columns: for each sparse feature a padded (N, K) id matrix and (N,)
    lengths; dense (N, D) raw values; labels (N,); timestamps (N,)."""

    ids: dict[str, torch.Tensor]
    lengths: dict[str, torch.Tensor]
    dense: torch.Tensor
    labels: torch.Tensor
    timestamps: torch.Tensor


def _lookup(values: dict[int, object], size: int, fill: object = 0) -> list:
    """A list indexed by id (ids are small ints here), ``fill`` where an id is absent."""
    out = [fill] * size
    for key, value in values.items():
        out[key] = value
    return out


@dataclass
class _Rows:
    """Samples gathered once in some order; batches are cut from them by slicing.

    Attributes:
        values: per sparse feature, the (N_f,) ids of every sample, sample after sample.
        offsets: per sparse feature, where each sample's ids start ((n + 1,) int64).
        lengths: per sparse feature, the (n,) bag lengths.
        dense: (n, D) dense features; labels: (n,) labels.
    """

    values: list[torch.Tensor]
    offsets: list[np.ndarray]
    lengths: list[torch.Tensor]
    dense: torch.Tensor
    labels: torch.Tensor

    def cut(self, lo: int, hi: int) -> Batch:
        """The samples [lo, hi) as a batch."""
        values = torch.cat([v[int(o[lo]):int(o[hi])] for v, o in zip(self.values, self.offsets)])
        lengths = torch.cat([n[lo:hi] for n in self.lengths])
        return Batch(dense=self.dense[lo:hi], labels=self.labels[lo:hi],
                     sparse=SparseBatch(features=SPARSE, values=values, lengths=lengths))


def _user_columns(folder: Path) -> dict[str, torch.Tensor]:
    """Indexed by user id: age (years, float), and the ids of age bucket, gender, occupation
    and zip prefix."""
    users = read_atomic(folder / "ml-100k.user")
    keys = [int(u) for u in users["user_id"]]
    size = max(keys) + 1
    cols = {
        "age_years": [float(a) for a in users["age"]],
        "age": [_age_bucket(int(a)) for a in users["age"]],
        "gender": [string_id(g) for g in users["gender"]],
        "occupation": [string_id(o) for o in users["occupation"]],
        "zip": [string_id(z[:ZIP_PREFIX]) for z in users["zip_code"]],
    }
    return {name: torch.tensor(_lookup(dict(zip(keys, col)), size)) for name, col in cols.items()}


def _item_columns(folder: Path) -> dict[str, torch.Tensor]:
    """Indexed by item id: release year (NaN if unknown), whether it is known, and the genre
    ids padded (K,) with their count."""
    items = read_atomic(folder / "ml-100k.item")
    keys = [int(i) for i in items["item_id"]]
    size = max(keys) + 1
    years = [_year(y) for y in items["release_year"]]
    genres, counts = _padded([[string_id(g) for g in c.split()] for c in items["class"]])
    by_key = torch.tensor(keys)
    out = {
        "year_value": torch.tensor(_lookup({k: float(y) for k, y in zip(keys, years) if y}, size,
                                           float("nan"))),
        "genres": torch.zeros(size, genres.shape[1], dtype=torch.int64),
        "num_genres": torch.zeros(size, dtype=torch.int64),
    }
    out["genres"][by_key] = genres
    out["num_genres"][by_key] = counts
    return out


def _padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) int64 ids padded with 0, and (N,) lengths."""
    width = max(1, max(len(r) for r in rows))
    out = torch.zeros(len(rows), width, dtype=torch.int64)
    for n, r in enumerate(rows):
        out[n, :len(r)] = torch.tensor(r, dtype=torch.int64)
    return out, torch.tensor([len(r) for r in rows], dtype=torch.int64)


def _utc_year(stamps: torch.Tensor) -> torch.Tensor:
    """(N,) calendar year (UTC) of each unix timestamp."""
    years = stamps.numpy().astype("datetime64[s]").astype("datetime64[Y]").astype("int64")
    return torch.from_numpy(years + 1970)


def load_columns(folder: Path) -> _Columns:
    """Reads the three files and builds every feature column of the CTR view."""
    inter = read_atomic(folder / "ml-100k.inter")
    user_cols, item_cols = _user_columns(folder), _item_columns(folder)
    u = torch.tensor([int(x) for x in inter["user_id"]])
    i = torch.tensor([int(x) for x in inter["item_id"]])
    stamps = torch.tensor([int(float(t)) for t in inter["timestamp"]], dtype=torch.int64)
    labels = torch.tensor([float(r) >= 4.0 for r in inter["rating"]], dtype=torch.float32)
    year = item_cols["year_value"][i]
    known = ~torch.isnan(year)
    days = torch.div(stamps, 86400, rounding_mode="floor")
    single = {"user": u, "item": i, "age": user_cols["age"][u], "gender": user_cols["gender"][u],
              "occupation": user_cols["occupation"][u], "zip": user_cols["zip"][u],
              "year": torch.where(known, year, 0.0).long(),
              "hour": torch.div(stamps, 3600, rounding_mode="floor") % 24,
              "weekday": (days + 3) % 7}  # 1970-01-01 was a Thursday (Monday = 0)
    ids = {name: col[:, None] for name, col in single.items()}
    lengths = {name: torch.ones(len(u), dtype=torch.int64) for name in single}
    lengths["year"] = known.long()
    ids["genres"], lengths["genres"] = item_cols["genres"][i], item_cols["num_genres"][i]
    movie_age = (_utc_year(stamps).float() - year).clamp(min=0.0)  # NaN where unknown
    dense = torch.stack([user_cols["age_years"][u].float(), year.float(), movie_age.float(),
                         lengths["genres"].float()], dim=1)
    return _Columns(ids={n: ids[n] for n in SPARSE}, lengths={n: lengths[n] for n in SPARSE},
                    dense=dense, labels=labels, timestamps=stamps)


def split_indices(columns: _Columns, split: Split, eval_fraction: float,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, eval indices) of the ratings, int64."""
    n = columns.labels.numel()
    n_eval = round(n * eval_fraction)
    if split == Split.TIME:
        order = torch.argsort(columns.timestamps, stable=True)
    else:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order[:n - n_eval], order[n - n_eval:]


def _prior_counts(columns: _Columns) -> torch.Tensor:
    """(N, 2) ``log1p`` of how many ratings the rating's user, and its item, had before it (by
    timestamp; ties in file order): the length of their history when it was made."""
    n = columns.timestamps.numel()
    out = []
    for name in ("user", "item"):
        ids = columns.ids[name][:, 0]
        order = torch.argsort(columns.timestamps, stable=True)
        order = order[torch.argsort(ids[order], stable=True)]  # by id, then by time
        sorted_ids = ids[order]
        first = torch.ones(n, dtype=torch.bool)
        first[1:] = sorted_ids[1:] != sorted_ids[:-1]
        group_start = torch.nonzero(first).squeeze(1)[torch.cumsum(first.long(), 0) - 1]
        prior = torch.empty(n, dtype=torch.int64)
        prior[order] = torch.arange(n) - group_start
        out.append(torch.log1p(prior.float()))
    return torch.stack(out, dim=1)


def _standardise(dense: torch.Tensor, train: torch.Tensor) -> torch.Tensor:
    """Dense columns minus the training part's mean over its deviation; unknown (NaN) values
    become 0 (the mean)."""
    part = dense[train]
    mean = torch.nanmean(part, dim=0)
    std = torch.sqrt(torch.nanmean((part - mean) ** 2, dim=0)).clamp(min=1e-6)
    return torch.nan_to_num((dense - mean) / std, nan=0.0)


class MovieLens100K(DataSource):
    """The MovieLens 100K ratings as a CTR data set (see the module docstring).

    Args:
        split: RANDOM (seeded 80/20) or TIME (the latest ``eval_fraction`` held out).
        eval_fraction: share of the ratings held out for evaluation, in (0, 1).
        seed: seeds the random split and the order of training samples in each epoch.
        count_features: add ``log1p`` of the number of ratings the sample's user, and its
            item, made or received before it (by timestamp) as dense features
            ("user_history", "item_history"): what a live system knows when it scores the
            sample. They carry no labels.
        folder: where the ``ml-100k.*`` files are (default: inside the installed recbole).
    """

    def __init__(self, *, split: Split = Split.RANDOM, eval_fraction: float = 0.2, seed: int = 0,
                 count_features: bool = True, folder: Path | None = None) -> None:
        global _cited
        if not 0.0 < eval_fraction < 1.0:
            raise ConfigError(f"movielens-100k: eval_fraction expected in (0, 1), found "
                              f"{eval_fraction!r}.")
        cols = load_columns(folder or dataset_dir())
        self.train_index, self.eval_index = split_indices(cols, Split(split), eval_fraction, seed)
        dense, dense_names = cols.dense, DENSE
        if count_features:
            dense = torch.cat([dense, _prior_counts(cols)], dim=1)
            dense_names = (*DENSE, "user_history", "item_history")
        self.dense = _standardise(dense, self.train_index)
        self.ids, self.lengths, self.labels = cols.ids, cols.lengths, cols.labels
        self.seed = seed
        self._epoch: tuple[int, _Rows] | None = None
        features = [FeatureInfo(name, num_ids=self._distinct(name), multi_hot=name == "genres")
                    for name in SPARSE]
        super().__init__(name="movielens-100k", dense_names=dense_names, features=features)
        self.info = {"samples": int(self.labels.numel()), "split": Split(split).value,
                     "train_samples": int(self.train_index.numel()),
                     "eval_samples": int(self.eval_index.numel()),
                     "positive_rate": round(float(self.labels.mean()), 4),
                     "citation": CITATION}
        if not _cited:
            logger.info("Data: %s", CITATION)
            _cited = True

    def _distinct(self, name: str) -> int:
        mask = torch.arange(self.ids[name].shape[1]) < self.lengths[name][:, None]
        return int(torch.unique(self.ids[name][mask]).numel())

    def gather(self, index: torch.Tensor) -> _Rows:
        """The samples at ``index`` ((n,) int64 rating positions), gathered once in that order;
        batches are then cut from them by slicing."""
        values, offsets, lengths = [], [], []
        for name in SPARSE:
            ids = self.ids[name].index_select(0, index)
            n = self.lengths[name].index_select(0, index)
            if ids.shape[1] == 1:
                values.append(ids[:, 0] if bool(n.all()) else ids[:, 0][n.bool()])
            else:
                values.append(ids[torch.arange(ids.shape[1]) < n[:, None]])
            ends = torch.cumsum(n, 0).numpy()
            offsets.append(np.concatenate([np.zeros(1, dtype=ends.dtype), ends]))
            lengths.append(n)
        return _Rows(values=values, offsets=offsets, lengths=lengths,
                     dense=self.dense.index_select(0, index),
                     labels=self.labels.index_select(0, index))

    def batch(self, index: torch.Tensor) -> Batch:
        """The samples at ``index`` ((B,) int64 rating positions)."""
        return self.gather(index).cut(0, index.numel())

    def _epoch_rows(self, epoch: int) -> _Rows:
        """The training samples in the order of ``epoch`` (one permutation per epoch)."""
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch + 1)
            order = self.train_index[torch.randperm(self.train_index.numel(), generator=g)]
            self._epoch = (epoch, self.gather(order))
        return self._epoch[1]

    def train_batches(self, batch_size: int, *, rank: int = 0, world_size: int = 1,
                      start: int = 0) -> Iterator[Batch]:
        """Endless batches; step i takes global batch i of the epoch's permutation (batch_size
        x world_size samples, the incomplete last one of an epoch dropped) and this rank its
        slice, so a job sees the same samples per step at any world size."""
        global_batch = batch_size * world_size
        per_epoch = self.train_index.numel() // global_batch
        if per_epoch == 0:
            raise ConfigError(f"movielens-100k: the batch of {global_batch} samples (all ranks) "
                              f"is larger than the {self.train_index.numel()} training samples.")
        step = start
        while True:
            epoch, j = divmod(step, per_epoch)
            lo = j * global_batch + rank * batch_size
            yield self._epoch_rows(epoch).cut(lo, lo + batch_size)
            step += 1

    def _chunks(self, index: torch.Tensor, batch_size: int, rank: int,
                world_size: int) -> Iterator[Batch]:
        rows = self.gather(index[rank_slice(index.numel(), rank, world_size)])
        for lo in range(0, rows.labels.numel(), batch_size):
            yield rows.cut(lo, min(lo + batch_size, rows.labels.numel()))

    def eval_batches(self, batch_size: int, *, rank: int = 0,
                     world_size: int = 1) -> Iterator[Batch]:
        return self._chunks(self.eval_index, batch_size, rank, world_size)

    def train_sample_batches(self, batch_size: int, max_samples: int, *, rank: int = 0,
                             world_size: int = 1) -> Iterator[Batch]:
        return self._chunks(self.train_index[:max_samples], batch_size, rank, world_size)
