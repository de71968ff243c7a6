"""Criteo-like synthetic click data with a known best achievable AUC.

Each sample has ``num_dense`` dense features (log1p of log-normal counts, as Criteo's integer
columns are usually fed) and ``num_sparse`` one-id sparse fields whose ids follow a bounded
Zipf(α) law over the field's vocabulary (rank r has probability ∝ ∫ x^-α dx over [r+1, r+2),
α = 1.05 by default; vocabularies up to 10^9). Ids are the ranks scrambled by fmix64 into
[0, 2**62): raw, sparse-looking ids with no vocabulary.

Labels come from a hidden logistic model::

    logit = b + Σ_j a_j·(x_j − μ_j)/s_j                       dense, linear
              + Σ_f c_f·d(r_f)·z_f(r_f)                      one effect per id
              + Σ_(f,g) γ/√k · d(r_f)·d(r_g)·<u_f(r_f), u_g(r_g)>   a few pairwise interactions
    label ~ Bernoulli(sigmoid(logit))

where ``z`` and the k-vectors ``u`` are standard normals hashed from (seed, field, rank) and
``d(r) = 1 / (1 + r / head)`` lets effects fade along the tail (ids seen too rarely to learn carry
little signal). The AUC of ``sigmoid(logit)`` on the eval samples, the best any model can reach,
is carried in ``Batch.true_prob`` and reported.

Randomness is counter-based: every draw is fmix64 of (stream, sample index, purpose), so any
sample can be made directly. Streams are independent per rank (training) and the eval set is one
global stream split over the ranks; batch i of a rank is the same whatever the batch order,
number of dataloader workers or resume point.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dynemb.batch import SparseBatch
from dynemb.data.base import (
    ID_MASK, Batch, DataSource, FeatureInfo, is_int, is_number, rank_slice, require,
)
from dynemb.kernels.hashing import fmix64

_U64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
MAX_VOCAB = 10**9
CRITEO_LIKE_VOCAB = (1460, 583, 100_000, 100_000, 305, 24, 12517, 633, 3, 93145, 5683, 100_000,
                     3194, 27, 14992, 100_000, 10, 5652, 2173, 4, 100_000, 18, 15, 100_000, 105,
                     100_000)
"""The 26 Criteo Kaggle cardinalities, capped at 10^5."""


@dataclass(frozen=True, kw_only=True)
class SyntheticConfig:
    """The synthetic data set (see the module docstring for the hidden model)."""

    num_dense: int = 13
    """Dense features per sample."""
    num_sparse: int = 26
    """Sparse fields per sample (one id each)."""
    vocab_sizes: tuple[int, ...] = CRITEO_LIKE_VOCAB
    """Distinct ids per sparse field, each in [1, 10^9]; one value applies to every field."""
    alpha: float = 1.05
    """Zipf exponent of the ids of every field (> 0; larger: more skewed)."""
    head: float = 1000.0
    """Rank scale of the fading effects: an id of rank r carries 1 / (1 + r / head) of them."""
    signal: float = 1.0
    """Scale of every hidden effect (0: labels are coin flips at base_rate)."""
    num_interactions: int = 4
    """Pairwise interactions of sparse fields in the hidden model."""
    base_rate: float = 0.25
    """Click rate the bias aims at (the realised rate also depends on the effects)."""
    eval_samples: int = 50_000
    """Held-out samples (one global stream, split over the ranks)."""
    seed: int = 0
    """Seeds the hidden model and every stream."""

    def __post_init__(self) -> None:
        own = "SyntheticConfig"
        for name in ("num_dense", "num_interactions"):
            value = getattr(self, name)
            require(is_int(value) and 0 <= value <= 10_000, own, name, value,
                    "an int in [0, 10000]")
        require(is_int(self.num_sparse) and 1 <= self.num_sparse <= 10_000, own, "num_sparse",
                self.num_sparse, "an int in [1, 10000]")
        vocab = self.vocab_sizes
        if is_int(vocab):
            vocab = (vocab,) * self.num_sparse
        require(isinstance(vocab, (tuple, list)) and len(vocab) == self.num_sparse
                and all(is_int(v) and 1 <= v <= MAX_VOCAB for v in vocab), own, "vocab_sizes",
                self.vocab_sizes, f"one int or {self.num_sparse} ints in [1, 10^9]")
        object.__setattr__(self, "vocab_sizes", tuple(vocab))
        for name in ("alpha", "head"):
            require(is_number(getattr(self, name)) and getattr(self, name) > 0, own, name,
                    getattr(self, name), "a finite number > 0")
        require(is_number(self.signal) and self.signal >= 0, own, "signal", self.signal,
                "a finite number >= 0")
        require(is_number(self.base_rate) and 0 < self.base_rate < 1, own, "base_rate",
                self.base_rate, "a number in (0, 1)")
        require(is_int(self.eval_samples) and self.eval_samples >= 1, own, "eval_samples",
                self.eval_samples, "an int >= 1")
        require(is_int(self.seed) and 0 <= self.seed < 2**62, own, "seed", self.seed,
                "an int in [0, 2**62)")


def _mix(*parts: int) -> int:
    """A 64-bit salt (as int64) from integers, by chained fmix64 on Python ints."""
    x = 0x243F6A8885A308D3
    for p in parts:
        x = (x ^ ((p * _GOLDEN) & _U64)) & _U64
        for mult in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
            x ^= x >> 33
            x = (x * mult) & _U64
        x ^= x >> 33
    return x - (1 << 64) if x >= 1 << 63 else x


def _salts(seed: int, kind: int, count: int, *extra: int) -> torch.Tensor:
    """(count, 1) int64 salts, one per field (or dense column), for one purpose."""
    return torch.tensor([[_mix(seed, kind, i, *extra)] for i in range(count)], dtype=torch.int64)


def _uniform(keys: torch.Tensor, salt: int | torch.Tensor) -> torch.Tensor:
    """float64 uniforms in (0, 1), one per int64 key (``keys + salt`` broadcast)."""
    h = fmix64(keys + salt)
    return (((h >> 11) & ((1 << 53) - 1)).double() + 0.5) * 2.0**-53


def _normal(keys: torch.Tensor, salt: int | torch.Tensor) -> torch.Tensor:
    """float64 standard normals, one per int64 key (``keys + salt`` broadcast)."""
    return torch.special.ndtri(_uniform(keys, salt))


def zipf_ranks(u: torch.Tensor, vocab: torch.Tensor | int, alpha: float) -> torch.Tensor:
    """Inverse CDF of the bounded power law: float64 uniforms -> int64 ranks in [0, vocab),
    rank r with probability ∝ ∫ x^-α over [r+1, r+2). ``vocab`` broadcasts against ``u``."""
    vocab = torch.as_tensor(vocab, dtype=torch.int64)
    top = vocab.double() + 1.0
    if abs(alpha - 1.0) < 1e-9:
        x = torch.exp(u * torch.log(top))
    else:
        e = 1.0 - alpha
        x = ((top**e - 1.0) * u + 1.0) ** (1.0 / e)
    return torch.minimum(x.floor().long() - 1, vocab - 1).clamp_(min=0)


class _Hidden:
    """The hidden logistic model's fixed coefficients and salts, drawn from the seed.

    Scales: the dense part has standard deviation about 0.5·signal, the id effects together
    about 1.2·signal (head ids), each interaction about 0.5·signal."""

    def __init__(self, cfg: SyntheticConfig) -> None:
        g = torch.Generator().manual_seed(cfg.seed)
        f64 = torch.float64
        self.mu = (0.5 + 2.5 * torch.rand(cfg.num_dense, generator=g, dtype=f64))[:, None]
        self.sd = (0.5 + torch.rand(cfg.num_dense, generator=g, dtype=f64))[:, None]
        w = torch.randn(cfg.num_dense, generator=g, dtype=f64)
        self.dense_w = 0.5 * cfg.signal * w / w.norm().clamp(min=1e-12)
        c = 0.2 + 0.8 * torch.rand(cfg.num_sparse, generator=g, dtype=f64)
        self.field_w = (1.2 * cfg.signal * c / c.norm())[:, None]
        pairs = [torch.randperm(cfg.num_sparse, generator=g)[:2].tolist()
                 for _ in range(cfg.num_interactions if cfg.num_sparse > 1 else 0)]
        self.left = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        self.right = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        self.pair_w = 0.5 * cfg.signal
        self.bias = math.log(cfg.base_rate / (1.0 - cfg.base_rate))
        self.k = 4  # width of the interaction vectors
        self.vocab = torch.tensor(cfg.vocab_sizes, dtype=torch.int64)[:, None]
        s, f = cfg.seed, cfg.num_sparse
        self.effect_salt = _salts(s, 3, f)
        self.vector_salt = torch.cat([_salts(s, 4, f, c) for c in range(self.k)], dim=1)
        self.id_salt = _salts(s, 6, f)
        self.stream_salts = {}  # stream -> (id salts (F, 1), dense salts (D, 1), label salt)

    def stream(self, seed: int, stream: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if stream not in self.stream_salts:
            self.stream_salts[stream] = (_salts(seed, 1, len(self.vocab), stream),
                                         _salts(seed, 2, len(self.mu), stream),
                                         _mix(seed, 5, stream))
        return self.stream_salts[stream]


class SyntheticData(DataSource):
    """Criteo-like synthetic click data (see the module docstring).

    Args:
        config: the generator's settings.
    """

    def __init__(self, config: SyntheticConfig | None = None) -> None:
        self.config = cfg = config or SyntheticConfig()
        self.hidden = _Hidden(cfg)
        names = [f"c{f + 1}" for f in range(cfg.num_sparse)]
        features = [FeatureInfo(n, num_ids=v) for n, v in zip(names, cfg.vocab_sizes)]
        super().__init__(name="synthetic", dense_names=[f"i{j + 1}" for j in range(cfg.num_dense)],
                         features=features, has_true_prob=True)
        pairs = zip(self.hidden.left.tolist(), self.hidden.right.tolist())
        self.info = {"eval_samples": cfg.eval_samples, "alpha": cfg.alpha,
                     "vocab_sizes": list(cfg.vocab_sizes),
                     "interactions": [[names[f], names[h]] for f, h in pairs]}

    def _fade(self, ranks: torch.Tensor) -> torch.Tensor:
        return 1.0 / (1.0 + ranks.double() / self.config.head)

    def generate(self, index: torch.Tensor, stream: int) -> Batch:
        """The samples ``index`` ((B,) int64 positions) of ``stream`` (an int naming it)."""
        cfg, hid = self.config, self.hidden
        id_salt, dense_salt, label_salt = hid.stream(cfg.seed, stream)
        ranks = zipf_ranks(_uniform(index[None, :], id_salt), hid.vocab, cfg.alpha)  # (F, B)
        counts = torch.floor(torch.exp(hid.mu + hid.sd * _normal(index[None, :], dense_salt)))
        dense = torch.log1p(counts)  # (D, B)
        fade = self._fade(ranks)
        logit = hid.bias + hid.dense_w @ ((dense - hid.mu) / hid.sd)
        logit = logit + (hid.field_w * fade * _normal(ranks, hid.effect_salt)).sum(0)
        if hid.left.numel():
            left = _normal(ranks[hid.left][:, None, :], hid.vector_salt[hid.left][:, :, None])
            right = _normal(ranks[hid.right][:, None, :], hid.vector_salt[hid.right][:, :, None])
            dots = (left * right).sum(1) * fade[hid.left] * fade[hid.right]  # (P, B)
            logit = logit + hid.pair_w / math.sqrt(hid.k) * dots.sum(0)
        prob = torch.sigmoid(logit)
        labels = (_uniform(index, label_salt) < prob).float()
        ids = (fmix64(ranks + hid.id_salt) & ID_MASK).reshape(-1)
        sparse = SparseBatch(features=self.feature_names, values=ids,
                             lengths=torch.ones(ids.numel(), dtype=torch.int64))
        return Batch(dense=dense.T.float().contiguous(), sparse=sparse, labels=labels,
                     true_prob=prob.float())

    def _range(self, lo: int, hi: int, stream: int, batch_size: int) -> Iterator[Batch]:
        for start in range(lo, hi, batch_size):
            yield self.generate(torch.arange(start, min(hi, start + batch_size)), stream)

    def train_batches(self, batch_size: int, *, rank: int = 0, world_size: int = 1,
                      start: int = 0, worker: int = 0, num_workers: int = 1) -> Iterator[Batch]:
        """Endless batches of this rank's own stream: batch i holds its samples
        [i·batch_size, (i+1)·batch_size). ``worker`` of ``num_workers`` yields batches
        start + worker, start + worker + num_workers, ... (so workers never overlap)."""
        stream = _mix(1, rank)
        i = start + worker
        while True:
            yield self.generate(torch.arange(i * batch_size, (i + 1) * batch_size), stream)
            i += num_workers

    def eval_batches(self, batch_size: int, *, rank: int = 0,
                     world_size: int = 1) -> Iterator[Batch]:
        part = rank_slice(self.config.eval_samples, rank, world_size)
        return self._range(part.start, part.stop, _mix(2), batch_size)

    def train_sample_batches(self, batch_size: int, max_samples: int, *, rank: int = 0,
                             world_size: int = 1) -> Iterator[Batch]:
        """The first ``max_samples / world_size`` samples of this rank's training stream."""
        part = rank_slice(max_samples, rank, world_size)
        return self._range(0, part.stop - part.start, _mix(1, rank), batch_size)


class SyntheticIterable(torch.utils.data.IterableDataset):
    """Training batches for a ``torch.utils.data.DataLoader(..., batch_size=None)``: each
    dataloader worker yields its own share of the batches (see ``train_batches``)."""

    def __init__(self, data: SyntheticData, batch_size: int, *, rank: int = 0,
                 start: int = 0) -> None:
        self.data, self.batch_size, self.rank, self.start = data, batch_size, rank, start

    def __iter__(self) -> Iterator[Batch]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return self.data.train_batches(self.batch_size, rank=self.rank, start=self.start,
                                       worker=worker, num_workers=workers)
