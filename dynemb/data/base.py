"""What every data source yields: :class:`Batch` (dense features, sparse ids, labels), and the
:class:`DataSource` interface the training loop reads.

A source serves three streams, each split over the ranks of a job so that every rank reads its
own part: ``train_batches`` (endless, deterministic, restartable at any batch index),
``eval_batches`` (the held-out samples, once) and ``train_sample_batches`` (the first samples of
the training data, once, for the train AUC).
"""

from __future__ import annotations

import abc
import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from dynemb.batch import SparseBatch
from dynemb.errors import ConfigError

ID_MASK = (1 << 62) - 1
"""Ids made from strings or hashes are kept in [0, 2**62): never the reserved empty key."""


@dataclass(frozen=True)
class Batch:
    """One batch of B samples.

    Attributes:
        dense: (B, D) float32 dense features (D may be 0).
        sparse: the sparse ids of every feature (feature-major, see :class:`SparseBatch`).
        labels: (B,) float32 click labels in {0, 1}.
        true_prob: (B,) float32 probability the labels were drawn with, when the source knows
            it (synthetic data); the AUC of these is the best any model can reach.
    """

    dense: torch.Tensor
    sparse: SparseBatch
    labels: torch.Tensor
    true_prob: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """B, the number of samples."""
        return int(self.labels.numel())

    def to(self, device: torch.device | str) -> Batch:
        """This batch on ``device`` (itself if it is there already)."""
        if self.labels.device == torch.device(device):
            return self
        prob = None if self.true_prob is None else self.true_prob.to(device)
        return Batch(dense=self.dense.to(device), sparse=self.sparse.to(device),
                     labels=self.labels.to(device), true_prob=prob)


def empty_batch(dense_dim: int, features: Sequence[str], with_prob: bool = False) -> Batch:
    """A batch of 0 samples (a rank with no data left still joins the collective lookups)."""
    sparse = SparseBatch(features=list(features), values=torch.zeros(0, dtype=torch.int64),
                         lengths=torch.zeros(0, dtype=torch.int64))
    return Batch(dense=torch.zeros(0, dense_dim), sparse=sparse, labels=torch.zeros(0),
                 true_prob=torch.zeros(0) if with_prob else None)


def string_id(text: str) -> int:
    """A stable int64 id in [0, 2**62) for a string token (blake2b; the same on every run)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ID_MASK


def rank_slice(n: int, rank: int, world_size: int) -> slice:
    """The contiguous part of ``n`` items that ``rank`` of ``world_size`` takes (sizes differ by
    at most one)."""
    lo = n * rank // world_size
    return slice(lo, n * (rank + 1) // world_size)


@dataclass(frozen=True)
class FeatureInfo:
    """What a source knows about one sparse feature.

    Attributes:
        name: feature name (also the name of its table).
        num_ids: distinct ids expected, when known (sizes the table), else None.
        multi_hot: True when a sample may hold several ids (a bag), e.g. genres.
    """

    name: str
    num_ids: int | None = None
    multi_hot: bool = False


class DataSource(abc.ABC):
    """A data set the training loop can read: dense and sparse features and click labels.

    Args:
        name: short name, e.g. ``"movielens-100k"``.
        dense_names: names of the D dense features (columns of ``Batch.dense``).
        features: the sparse features, in ``Batch.sparse`` order.
        has_true_prob: whether batches carry ``true_prob`` (synthetic data).
    """

    def __init__(self, *, name: str, dense_names: Sequence[str], features: Sequence[FeatureInfo],
                 has_true_prob: bool = False) -> None:
        self.name = name
        self.dense_names = tuple(dense_names)
        self.features = tuple(features)
        self.has_true_prob = has_true_prob
        self.info: dict = {}
        """Facts to report with the run (sizes, positive rate, citation, ...)."""

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)

    @abc.abstractmethod
    def train_batches(self, batch_size: int, *, rank: int = 0, world_size: int = 1,
                      start: int = 0) -> Iterator[Batch]:
        """Endless training batches of this rank, beginning at batch index ``start``.

        Deterministic: batch i is the same whenever it is asked for, so a resumed run passes
        ``start=step`` and sees what an uninterrupted run would have.

        Args:
            batch_size: samples per rank per batch.
            rank: this process's rank; world_size: ranks in the job.
            start: index of the first batch to yield.
        """

    @abc.abstractmethod
    def eval_batches(self, batch_size: int, *, rank: int = 0,
                     world_size: int = 1) -> Iterator[Batch]:
        """This rank's part of the held-out samples, once (the parts of all ranks are disjoint
        and together are the whole eval set)."""

    @abc.abstractmethod
    def train_sample_batches(self, batch_size: int, max_samples: int, *, rank: int = 0,
                             world_size: int = 1) -> Iterator[Batch]:
        """This rank's part of (up to) the first ``max_samples`` training samples, once: the
        samples the train AUC and log loss are measured on."""

    def empty(self) -> Batch:
        """A batch of 0 samples with this source's features."""
        return empty_batch(len(self.dense_names), self.feature_names, self.has_true_prob)


def require(ok: bool, owner: str, name: str, value: object, expected: str) -> None:
    """Raises ConfigError ``owner.name: expected ..., found ...`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{owner}.{name}: expected {expected}, found {value!r}.")


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A finite int or float that is not a bool."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))
