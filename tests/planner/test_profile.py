"""Access profiles: LRU hit rates from a Zipf law (Che) and from sampled ids (stack distances)
against a brute-force LRU simulation."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

from dynemb.errors import PlanningError
from dynemb.planner import AccessProfile
from dynemb.planner.profile import _stack_distances, fit_law


def lru_hit_rate(ids: np.ndarray, rows: int, warm_from: int) -> float:
    """Share of accesses at positions >= warm_from that an LRU cache of ``rows`` ids serves."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for i, k in enumerate(ids.tolist()):
        if k in cache:
            cache.move_to_end(k)
            hits += i >= warm_from
        else:
            cache[k] = None
            if len(cache) > rows:
                cache.popitem(last=False)
    return hits / (ids.size - warm_from)


def zipf_ids(n: int, num_ids: int, alpha: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = np.arange(1, num_ids + 1, dtype=np.float64) ** -alpha
    return rng.choice(num_ids, size=n, p=p / p.sum()).astype(np.int64) * 7919 + 3


@pytest.mark.parametrize("rows", [1, 7, 50, 300, 2000])
def test_measured_curve_equals_a_brute_force_lru(rows):
    ids = zipf_ids(6000, 3000, 0.9)
    prof = AccessProfile.from_ids(torch.from_numpy(ids), steps=6)
    assert prof.curve.measured(rows) == pytest.approx(lru_hit_rate(ids, rows, ids.size // 2))
    if rows <= prof.curve.anchor:  # the sample alone decides the hit rate there
        assert prof.hit_rate(rows, 0) == prof.curve.measured(rows)
    assert prof.lookups_per_step == 1000
    per_step = np.mean([np.unique(part).size for part in np.array_split(ids, 6)])
    assert prof.unique_per_step == pytest.approx(per_step)


@pytest.mark.parametrize("alpha", [0.0, 0.8, 1.05, 1.3])
def test_che_approximation_is_close_to_a_simulated_lru(alpha):
    num_ids = 4000
    ids = zipf_ids(120_000, num_ids, alpha, seed=1)
    prof = AccessProfile(lookups_per_step=1000, zipf_alpha=alpha, num_ids=num_ids)
    for rows in (40, 400, 2000):
        assert prof.hit_rate(rows, 0) == pytest.approx(lru_hit_rate(ids, rows, 20_000), abs=0.02)
    assert prof.hit_rate(num_ids, 0) == 1.0 and prof.hit_rate(0, 0) == 0.0


def steady_lru_hit_rate(law: tuple[float, int], rows: int, seed: int) -> float:
    """An LRU of ``rows`` ids long after it started: brute force on a trace 12 times the
    universe, hits counted over its last sixth."""
    ids = zipf_ids(12 * law[1], law[1], law[0], seed=seed)
    dist = _stack_distances(np.unique(ids, return_inverse=True)[1].astype(np.int64), law[1])
    tail = dist[-2 * law[1]:]
    return float(((tail >= 0) & (tail < rows)).mean())


@pytest.mark.parametrize("alpha", [0.0, 0.8, 1.2])
def test_a_short_sample_predicts_the_steady_state_of_a_table_that_holds_its_ids(alpha):
    """Eight steps of 3,300 lookups of a 20,000-id law see half to three quarters of the ids:
    as measured, an id first seen in the sample is a miss at any size. The fitted law extends
    the curve beyond what the sample can tell: a cache or table of any size then hits as an LRU
    does long after it started (brute force), and a table holding every id hits ~1. (At
    alpha 1.2 the tail carries so little traffic that the sample cannot pin the universe, only
    the hit rates.)"""
    num = 20_000
    sample = zipf_ids(8 * 3300, num, alpha, seed=11)
    prof = AccessProfile.from_ids(sample, steps=8)
    assert prof.zipf_alpha == pytest.approx(alpha, abs=0.1)
    if alpha < 1:
        assert prof.num_ids == pytest.approx(num, rel=0.1)
    for rows in (2_000, 8_000, 14_000):
        assert prof.hit_rate(rows, 0) == pytest.approx(
            steady_lru_hit_rate((alpha, num), rows, seed=12), abs=0.02)
    assert prof.hit_rate(4 * num, 0) > 0.99 > 0.95 > prof.curve.measured(4 * num)


def test_fit_law_needs_a_sample_and_caps_a_universe_of_distinct_ids():
    assert fit_law(np.arange(10, dtype=np.int64)) is None
    alpha, num = fit_law(np.arange(5000, dtype=np.int64))  # every id new: no end in sight
    assert num > 10**9
    prof = AccessProfile.from_ids(np.arange(5000, dtype=np.int64), steps=5)
    assert prof.hit_rate(10**6, 0) < 0.01


def test_expected_distinct_ids_per_step_match_sampling():
    prof = AccessProfile(lookups_per_step=2000, zipf_alpha=1.05, num_ids=10_000)
    got = np.mean([np.unique(zipf_ids(2000, 10_000, 1.05, seed=s)).size for s in range(20)])
    assert prof.unique_ids(0) == pytest.approx(got, rel=0.03)


def test_spatial_sampling_stays_close_to_the_exact_curve():
    ids = zipf_ids(400_000, 50_000, 1.05, seed=2)
    exact = AccessProfile.from_ids(ids, steps=10, sample_limit=1 << 30)
    sampled = AccessProfile.from_ids(ids, steps=10, sample_limit=60_000)
    for rows in (500, 5_000, 20_000):
        assert sampled.hit_rate(rows, 0) == pytest.approx(exact.hit_rate(rows, 0), abs=0.03)


def test_one_ranks_share_of_the_samples_describes_the_whole_table():
    """Rank 0 of 2 sees every other sample: the same law, half the ids per step."""
    ids = zipf_ids(40_000, 4000, 1.0, seed=3)
    whole = AccessProfile.from_ids(ids, steps=10)
    half = AccessProfile.from_ids(ids[::2], steps=10, world_size=2)
    assert half.lookups_per_step == whole.lookups_per_step
    assert half.unique_per_step == pytest.approx(whole.unique_per_step, rel=0.03)
    for rows in (100, 1000):
        assert half.hit_rate(rows, 0) == pytest.approx(whole.hit_rate(rows, 0), abs=0.03)


def test_bad_profiles_are_planning_errors():
    for kw in (dict(lookups_per_step=-1), dict(lookups_per_step=float("nan")),
               dict(lookups_per_step=1, zipf_alpha=-0.5), dict(lookups_per_step=1, num_ids=0),
               dict(lookups_per_step=1, unique_per_step=2)):
        with pytest.raises(PlanningError):
            AccessProfile(**kw)
    with pytest.raises(PlanningError, match="int64"):
        AccessProfile.from_ids(np.zeros(3, dtype=np.int32))
    with pytest.raises(PlanningError, match="steps"):
        AccessProfile.from_ids(np.zeros(3, dtype=np.int64), steps=0)
    empty = AccessProfile.from_ids(np.zeros(0, dtype=np.int64))
    assert empty.hit_rate(10, 0) == 0.0 and empty.lookups_per_step == 0


@pytest.mark.parametrize("hot_keys", [16, 4096])
def test_hybrid_hbm_share_follows_where_the_hot_keys_landed(hot_keys):
    """A HYBRID table under Zipf(1.3): its measured share of lookups served from hbm is the
    profile's placement of the sampled keys (exact when every key is hot), not x."""
    from dynemb import Storage, StorageMode, TableConfig
    from dynemb.config import SGD
    from dynemb.nn import EmbeddingBagCollection
    from dynemb.planner import profile as profile_mod

    ids = zipf_ids(40_000, 3000, 1.3, seed=5)
    x = 0.3
    cfg = TableConfig(name="t", dim=4, features=["f"], capacity=8192, optimizer=SGD(lr=0.1),
                      storage=Storage(mode=StorageMode.HYBRID, cache_load_factor=x))
    ebc = EmbeddingBagCollection([cfg])
    table = ebc.tables["t"]
    table.lookup(torch.from_numpy(np.unique(ids)), train=True)  # every key has its row
    measured = float((table.locate(torch.from_numpy(ids)) < table.layout.hbm_rows)
                     .double().mean())
    before = profile_mod.HOT_KEYS
    try:
        profile_mod.HOT_KEYS = hot_keys
        prof = AccessProfile.from_ids(ids, steps=10)
    finally:
        profile_mod.HOT_KEYS = before
    lay = table.layout
    share, _ = prof.hbm_shares(lay.split, lay.num_buckets)
    if hot_keys >= 3000:
        assert share == pytest.approx(measured, abs=1e-12)
    else:
        assert abs(share - measured) < 0.02
    blind = lay.split / lay.num_buckets
    assert abs(blind - measured) > 0.03  # the hot keys' tiers matter here: x alone misses
    assert AccessProfile(lookups_per_step=1.0).hbm_shares(lay.split, lay.num_buckets) == \
        (blind, blind)
    ebc.close()
