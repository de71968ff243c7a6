"""Access profiles: how a table is used, and the hit rates that follow for each storage option.

A profile gives, per training step, the ids looked up (``lookups_per_step``, all ranks together)
and how they repeat. Two sources:

- a **Zipf law** (``zipf_alpha``; 0 is uniform) over ``num_ids`` distinct ids: LRU hit rates by
  Che's approximation (a cache of K rows holds the ids requested within a characteristic time T,
  with ``sum_i 1 - exp(-p_i T) = K``; the hit rate is ``sum_i p_i (1 - exp(-p_i T))``), evaluated
  on exact head ranks plus geometric bins of the tail, so 10^9 ids cost a few thousand terms;
- **sampled ids** (``AccessProfile.from_ids``): the LRU miss-ratio curve measured on the ids
  themselves, from each access's stack distance (distinct other ids since its previous access);
  long samples are spatially sampled (ids whose hash falls below a rate R, distances scaled by
  1/R) so the cost stays bounded. The first half of the sample only warms the stack. A sample
  cannot tell an id seen once from one that recurs after it ends, so beyond the distinct ids of
  its first half the curve follows the Zipf law fitted to the sample (:func:`fit_law`): the
  planner predicts a long run's steady state, not the sampled steps' cold start.

A HYBRID table splits its keys between the tiers by a hash of the key, so its hbm share is x on
average whatever the skew; under skew, though, a few hot keys carry much of the traffic and land
in one tier or the other (at Zipf 1.05 over 4e5 ids the hottest key alone is 8 % of lookups, and
the share scatters by about +-0.05 around x). Sampled ids give the exact split: a profile keeps
the tier hashes of its ``HOT_KEYS`` most looked-up keys (:class:`Placement`) and counts the rest
at x; a Zipf-law profile may carry the placement of a sample of the same traffic.

``hit_rate(rows)`` is the share of lookups an LRU of ``rows`` rows serves. With row-wise
sharding over W ranks each rank sees about 1/W of the ids, so a shard's cache of ``r`` rows hits
like a cache of ``r * W`` rows on the whole stream: callers pass whole-table row counts.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from dynemb.errors import PlanningError
from dynemb.kernels.hashing import TIER_SEED, fmix64, to_signed
from dynemb.kernels.jit import njit

EXACT_RANKS = 1024
"""Zipf ranks summed one by one before the geometric bins of the tail take over."""
TAIL_BINS = 2048
SAMPLE_LIMIT = 1 << 20
"""Sampled ids beyond this are spatially sampled down to about this many."""
HOT_KEYS = 4096
"""Keys whose HYBRID tier a profile of sampled ids places exactly (the most looked up)."""
_TIER_SPACE = 1 << 31
"""A key's tier position ``tier_hash(key) >>> 33`` lies in [0, 2^31); bucket ``(pos * nb) >> 31``."""


@njit(cache=True)
def _stack_distances(codes: np.ndarray, n_keys: int) -> np.ndarray:
    """LRU stack distance of each access of ``codes`` (dense ids in [0, n_keys)): the number of
    distinct other ids accessed since its previous access, or -1 at its first (a Fenwick tree
    over positions marks each id's latest access)."""
    n = codes.size
    tree = np.zeros(n + 1, dtype=np.int64)
    last = np.full(n_keys, -1, dtype=np.int64)
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        k = codes[i]
        j = last[k]
        if j < 0:
            out[i] = -1
        else:
            s = 0  # marks in (j, i): prefix(i) - prefix(j + 1)
            p = i
            while p > 0:
                s += tree[p]
                p -= p & (-p)
            p = j + 1
            while p > 0:
                s -= tree[p]
                p -= p & (-p)
            out[i] = s
            p = j + 1
            while p <= n:
                tree[p] -= 1
                p += p & (-p)
        last[k] = i
        p = i + 1
        while p <= n:
            tree[p] += 1
            p += p & (-p)
    return out


@dataclass(frozen=True)
class MissCurve:
    """An LRU miss-ratio curve measured on sampled ids: ``distances`` (sorted, already scaled to
    the whole stream) of the counted accesses that had a previous access; ``accesses`` counted
    (the rest were first sightings: misses at any size); ``correction``: accesses the spatial
    sample should have had minus those it had, counted as hits at distance 0 (SHARDS' adjustment
    for the few hottest ids falling in or out of the sample)."""

    distances: np.ndarray
    accesses: int
    correction: float = 0.0
    anchor: float = math.inf
    """Rows up to which the measured curve is the whole truth: the distinct ids of the sample's
    first half (an id first seen in the second half was last seen, if ever, before the sample:
    its distance is at least that)."""
    law: tuple[float, int] | None = None
    """``(alpha, num_ids)`` of the Zipf law fitted to the sample (:func:`fit_law`): it extends
    the curve beyond ``anchor``, where the sample cannot tell an id it saw once from one it will
    see again."""

    def measured(self, rows: float) -> float:
        """Share of the sample's counted accesses at a stack distance below ``rows``."""
        total = self.accesses + self.correction
        if total <= 0:
            return 0.0
        hits = int(np.searchsorted(self.distances, rows, side="left")) + self.correction
        return min(1.0, max(0.0, hits / total))

    def hit_rate(self, rows: float) -> float:
        """The measured curve up to ``anchor``; beyond it, the measured value at ``anchor`` plus
        what the fitted law adds from ``anchor`` to ``rows`` (never below the measured curve)."""
        got = self.measured(rows)
        if self.law is None or rows <= self.anchor:
            return got
        alpha, n = self.law
        more = _che_hit_rate(alpha, n, float(rows)) - _che_hit_rate(alpha, n, self.anchor)
        return min(1.0, max(got, self.measured(self.anchor) + more))


@dataclass(frozen=True)
class Placement:
    """Where a HYBRID table's hottest keys live: each hot key's tier position (sorted), the
    cumulative share of lookups and of per-step distinct keys of the keys up to it, and the
    shares of every other key (placed at x on average)."""

    positions: np.ndarray
    lookups: np.ndarray
    distinct: np.ndarray
    rest_lookups: float
    rest_distinct: float

    @classmethod
    def from_ids(cls, ids: np.ndarray, windows: list[np.ndarray]) -> Placement:
        """The placement of the ``HOT_KEYS`` most looked-up keys of ``ids`` (all sampled
        lookups); ``windows``: the ids of each step (for the share of per-step distinct keys)."""
        keys, counts = np.unique(ids, return_counts=True)
        return cls.from_counts(keys, counts, [np.unique(part) for part in windows])

    @classmethod
    def from_counts(cls, keys: np.ndarray, counts: np.ndarray,
                    window_keys: list[np.ndarray]) -> Placement:
        """:meth:`from_ids` of the sample's distinct ``keys`` (sorted), their lookup ``counts``
        and the distinct keys of each step (``window_keys``)."""
        present = np.zeros(keys.size, dtype=np.int64)
        for distinct in window_keys:
            present[np.searchsorted(keys, distinct)] += 1
        top = np.argsort(-counts, kind="stable")[:HOT_KEYS]
        pos = (fmix64(torch.from_numpy(keys[top]) ^ to_signed(TIER_SEED)) >> 33) \
            & (_TIER_SPACE - 1)
        order = np.argsort(pos.numpy(), kind="stable")
        share_l = counts[top][order] / max(1, counts.sum())
        share_d = present[top][order] / max(1, present.sum())
        return cls(pos.numpy()[order], np.cumsum(share_l), np.cumsum(share_d),
                   float(1.0 - share_l.sum()), float(1.0 - share_d.sum()))

    def hbm_shares(self, split: int, num_buckets: int) -> tuple[float, float]:
        """(share of lookups, share of per-step distinct keys) whose key a HYBRID shard of
        ``num_buckets`` buckets, ``split`` of them in hbm, keeps in hbm."""
        thr = -(-split * _TIER_SPACE // num_buckets)  # position < thr <=> bucket < split
        i = int(np.searchsorted(self.positions, thr, side="left"))
        frac = thr / _TIER_SPACE
        hot_l = float(self.lookups[i - 1]) if i else 0.0
        hot_d = float(self.distinct[i - 1]) if i else 0.0
        # shares summed in floats may pass 1 by a rounding
        return (min(1.0, hot_l + self.rest_lookups * frac),
                min(1.0, hot_d + self.rest_distinct * frac))


@functools.lru_cache(maxsize=256)
def _zipf_terms(alpha: float, num_ids: int, exact: int = EXACT_RANKS,
                bins: int = TAIL_BINS) -> tuple[np.ndarray, np.ndarray]:
    """(probability of one id, number of ids) per term: ``exact`` head ranks, the tail in
    ``bins`` geometric bins."""
    head = np.arange(1, min(num_ids, exact) + 1, dtype=np.float64)
    weights = [head ** -alpha]
    counts = [np.ones_like(head)]
    if num_ids > exact:
        edges = np.unique(np.geomspace(exact + 1, num_ids + 1, bins + 1).round())
        lo, hi = edges[:-1], edges[1:]  # ranks [lo, hi)
        if alpha == 1.0:
            mass = np.log(hi - 0.5) - np.log(lo - 0.5)
        else:  # the integral of r^-alpha over [lo, hi) - 1/2, without cancelling near alpha 1
            s, span = 1.0 - alpha, np.log((hi - 0.5) / (lo - 0.5))
            mass = (lo - 0.5) ** s * np.expm1(s * span) / s
        counts.append(hi - lo)
        weights.append(mass / (hi - lo))
    w, c = np.concatenate(weights), np.concatenate(counts)
    return w / float((w * c).sum()), c


LAW_POINTS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)
"""Shares of a sample after which its distinct ids are counted to fit its law."""
MAX_IDS = 10**13
"""The largest universe a fitted law may have (a sample of distinct ids only fits it)."""


def _distinct_after(alpha: float, num_ids: int, draws: np.ndarray) -> np.ndarray:
    """Expected distinct ids after each of ``draws`` lookups of Zipf(alpha) over num_ids (on
    coarse terms: a fit needs a few digits)."""
    p, c = _zipf_terms(alpha, num_ids, 128, 256)
    return (c * -np.expm1(-np.outer(draws, p))).sum(axis=1)


def fit_law(ids: np.ndarray, first_seen: np.ndarray | None = None) -> tuple[float, int] | None:
    """The Zipf law ``(alpha, num_ids)`` whose expected count of distinct ids after m lookups
    matches the sample's at m = n (exactly: ``num_ids`` by bisection for each alpha) and best
    matches it at n/16, n/8, n/4 and n/2 (squared log ratio; alpha on a grid of 0.1, then of
    0.01 around the best). How fast new ids stop appearing tells the universe and the skew
    apart: on samples of a Zipf law both come back within a few percent. None for fewer than 64
    ids. ``first_seen``: the sorted positions of each distinct id's first lookup, if known."""
    n = ids.size
    if n < 64:
        return None
    first = np.sort(np.unique(ids, return_index=True)[1]) if first_seen is None else first_seen
    draws = np.array([round(f * n) for f in LAW_POINTS], dtype=np.float64)
    seen = np.searchsorted(first, draws, side="left").astype(np.float64)

    def universe(alpha: float) -> int:
        lo, hi = math.log(seen[-1]), math.log(MAX_IDS)
        for _ in range(18):  # to 1e-4 of the universe
            mid = 0.5 * (lo + hi)
            if _distinct_after(alpha, max(1, round(math.exp(mid))), draws[-1:])[0] < seen[-1]:
                lo = mid
            else:
                hi = mid
        return max(1, round(math.exp(hi)))

    def error(alpha: float) -> tuple[float, float, int]:
        num = universe(alpha)
        return float((np.log(_distinct_after(alpha, num, draws[:-1]) / seen[:-1]) ** 2).sum()), \
            alpha, num

    best = min(error(a / 10) for a in range(21))
    best = min([best] + [error(round(best[1] + d / 100, 2)) for d in range(-9, 10)
                         if d and 0 <= best[1] + d / 100 <= 2])
    return best[1], best[2]


@functools.lru_cache(maxsize=65536)
def _che_hit_rate(alpha: float, num_ids: int, rows: float) -> float:
    """Che's approximation of an LRU of ``rows`` rows over Zipf(alpha) on ``num_ids`` ids: the
    characteristic time T solves ``sum_i 1 - exp(-p_i T) = rows`` (bisection on log T)."""
    if rows >= num_ids:
        return 1.0
    if rows <= 0:
        return 0.0
    p, c = _zipf_terms(alpha, num_ids)
    lo, hi = math.log(rows) - 1.0, math.log(rows / float(p.min())) + 1.0  # T brackets
    while float((c * -np.expm1(-p * math.exp(lo))).sum()) > rows:
        lo -= 4.0
    for _ in range(48):
        mid = 0.5 * (lo + hi)
        if float((c * -np.expm1(-p * math.exp(mid))).sum()) < rows:
            lo = mid
        else:
            hi = mid
    return min(1.0, float((c * p * -np.expm1(-p * math.exp(hi))).sum()))  # <= 1 despite rounding


@dataclass(frozen=True, kw_only=True)
class AccessProfile:
    """How one table is used per training step (all ranks together)."""

    lookups_per_step: float
    """Ids looked up per step (occurrences)."""
    zipf_alpha: float = 0.0
    """Skew of the ids: their popularity falls as rank^-alpha (0: uniform)."""
    num_ids: int | None = None
    """Distinct ids the traffic draws from (None: as many as the table has rows)."""
    unique_per_step: float | None = None
    """Distinct ids per step (None: predicted from the Zipf law)."""
    curve: MissCurve | None = field(default=None, repr=False)
    """Measured LRU curve (``from_ids``); when set it replaces the Zipf law."""
    placement: Placement | None = field(default=None, repr=False)
    """The tiers of the hottest keys (``from_ids``; see :class:`Placement`); None: every key's
    tier is a coin of weight x."""

    def __post_init__(self) -> None:
        ok = isinstance(self.lookups_per_step, (int, float)) and not isinstance(
            self.lookups_per_step, bool) and math.isfinite(self.lookups_per_step)
        if not ok or self.lookups_per_step < 0:
            raise PlanningError(f"AccessProfile.lookups_per_step: expected a finite number >= 0, "
                                f"found {self.lookups_per_step!r}.")
        a = self.zipf_alpha
        if not isinstance(a, (int, float)) or isinstance(a, bool) or not 0 <= a <= 4:
            raise PlanningError(f"AccessProfile.zipf_alpha: expected a number in [0, 4] "
                                f"(0: uniform), found {a!r}.")
        n = self.num_ids
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise PlanningError(f"AccessProfile.num_ids: expected an int >= 1 or None, found {n!r}.")
        u = self.unique_per_step
        if u is not None and not (isinstance(u, (int, float)) and 0 <= u <= self.lookups_per_step):
            raise PlanningError(f"AccessProfile.unique_per_step: expected a number in [0, "
                                f"lookups_per_step], found {u!r}.")

    @classmethod
    def from_ids(cls, ids: torch.Tensor | np.ndarray, *, steps: int = 1, world_size: int = 1,
                 sample_limit: int = SAMPLE_LIMIT) -> AccessProfile:
        """The profile of ``ids`` (int64, in the order they were looked up) of ``steps``
        consecutive training steps: lookups and distinct ids per step, and the LRU curve.

        ``world_size`` W > 1: the ids are one rank's share of each step (its samples of the
        global batch, an unbiased subsample). The whole step then looks up W times as many ids;
        its distinct ids are counted over windows of W consecutive local steps (as many ids as
        one global step); the LRU curve needs no change (a subsample of the samples has the
        same popularity law, so an LRU of K rows hits as often)."""
        ids = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids).reshape(-1)
        if ids.dtype != np.int64:
            raise PlanningError(f"AccessProfile.from_ids: expected int64 ids, found {ids.dtype}.")
        for name, v in (("steps", steps), ("world_size", world_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanningError(f"AccessProfile.from_ids: {name} must be an int >= 1, "
                                    f"found {v!r}.")
        if ids.size == 0:
            return cls(lookups_per_step=0.0, unique_per_step=0.0,
                       curve=MissCurve(np.zeros(0, dtype=np.int64), 0))
        windows = max(1, steps // world_size)  # each as many ids as one global step
        used = ids[:ids.size * windows * world_size // steps] if steps >= world_size else ids
        window_keys = [np.unique(part) for part in np.array_split(used, windows)]
        uniq = sum(k.size for k in window_keys) / windows
        rate = min(1.0, sample_limit / ids.size)
        sample = ids
        if rate < 1.0:  # spatial sampling: keep every access of the ids hashed below the rate
            top = (fmix64(torch.from_numpy(ids)) >> 11) & ((1 << 53) - 1)  # uniform in [0, 2^53)
            sample = ids[(top < int(rate * 2.0**53)).numpy()]
        codes = np.unique(sample, return_inverse=True)[1].astype(np.int64)
        dist = _stack_distances(codes, int(codes.max()) + 1 if codes.size else 0)
        warm = dist[dist.size // 2:]
        expected = rate * (ids.size - ids.size // 2)
        keys, first, counts = np.unique(ids, return_index=True, return_counts=True)
        first_seen = np.sort(first)
        law = fit_law(ids, first_seen)
        curve = MissCurve(np.sort(warm[warm >= 0]).astype(np.float64) / rate, int(warm.size),
                          expected - warm.size if rate < 1.0 else 0.0,  # anchor: the distinct
                          anchor=float(np.searchsorted(first_seen, ids.size // 2)),  # 1st half
                          law=law)
        return cls(lookups_per_step=ids.size * world_size / steps,
                   unique_per_step=float(min(uniq, ids.size * world_size / steps)),
                   zipf_alpha=law[0] if law else 0.0,
                   num_ids=law[1] if law else int(keys.size), curve=curve,
                   placement=Placement.from_counts(keys, counts, window_keys))

    def hit_rate(self, rows: float, num_ids: int) -> float:
        """Share of lookups an LRU of ``rows`` rows serves (``num_ids``: the default universe)."""
        if self.curve is not None:
            return self.curve.hit_rate(rows)
        return _che_hit_rate(float(self.zipf_alpha), self.num_ids or num_ids, float(rows))

    def hbm_shares(self, split: int, num_buckets: int) -> tuple[float, float]:
        """(share of lookups, share of per-step distinct keys) a HYBRID shard with ``split`` of
        its ``num_buckets`` buckets in hbm keeps there: exact for the profile's hot keys
        (:class:`Placement`), ``split / num_buckets`` for the rest."""
        if self.placement is not None:
            return self.placement.hbm_shares(split, num_buckets)
        return split / num_buckets, split / num_buckets

    def unique_ids(self, num_ids: int) -> float:
        """Distinct ids per step (measured, or ``sum_i 1 - exp(-p_i L)`` under the Zipf law)."""
        if self.unique_per_step is not None:
            return float(self.unique_per_step)
        return _che_unique(float(self.zipf_alpha), self.num_ids or num_ids,
                           float(self.lookups_per_step))


@functools.lru_cache(maxsize=4096)
def _che_unique(alpha: float, num_ids: int, lookups: float) -> float:
    p, c = _zipf_terms(alpha, num_ids)
    return float((c * -np.expm1(-p * lookups)).sum())
