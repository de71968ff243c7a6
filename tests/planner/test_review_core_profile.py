"""Access profiles and plans at their edges: hit rates that round past 1, degenerate samples,
the measured curve's extension by the fitted law, tables too small for their pinned mode, and
hostile plan files."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dynemb
from dynemb import planner
from dynemb.config import Storage, StorageMode
from dynemb.errors import PlanningError
from dynemb.planner.profile import MissCurve, Placement, _che_hit_rate, fit_law

AUTO = Storage(mode=StorageMode.AUTO)


def test_a_very_skewed_law_plans_with_hit_rates_within_one():
    """Che's sum for Zipf 3.1 over 10^9 ids rounds to 1.0000000000000004 at 10^8 rows: the
    plan used to fail on its own TableChoice (hit rate outside [0, 1])."""
    for rows in (44_721_360.0, 97_249_247.0, 459_863_298.0):
        assert 0.0 <= _che_hit_rate(3.1, 10**9, rows) <= 1.0
    table = dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=120_000_000,
                               storage=AUTO)
    topo = planner.Topology(world_size=1, ranks_per_host=1, hbm_bytes_per_rank=1 << 40,
                            ddr_bytes_per_host=1 << 40)
    profile = planner.AccessProfile(lookups_per_step=1e5, zipf_alpha=3.1, num_ids=10**9)
    choice = planner.plan([table], topo, profiles={"t": profile}).tables["t"]
    assert choice.mode == StorageMode.HBM_ONLY and choice.predicted_hit_rate == 1.0


def test_hybrid_shares_of_a_placement_stay_within_one():
    """The hot keys' shares summed in floats may pass 1 by a rounding; the shares may not."""
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(300):
        k = int(rng.integers(2, 30))
        ids = np.repeat(np.arange(k, dtype=np.int64), rng.integers(1, 20, k))
        placement = Placement.from_ids(ids, [ids])
        for nb in (2, 10, 1000):
            worst = max(worst, *placement.hbm_shares(nb - 1, nb))
    assert 0.99 < worst <= 1.0


def test_fit_law_on_degenerate_samples():
    """One id repeated is a universe of one; every id distinct has no end in sight; 64 ids is
    the least a law is fitted to; negative ids and the int64 extremes are ids like any other."""
    info = np.iinfo(np.int64)
    assert fit_law(np.full(64, 5, dtype=np.int64)) == (0.0, 1)
    assert fit_law(np.arange(63, dtype=np.int64)) is None
    assert fit_law(np.arange(64, dtype=np.int64))[1] > 10**9
    cyclic = np.tile(np.array([info.min, info.max, 0, -1], dtype=np.int64), 30)
    alpha, num = fit_law(cyclic)
    assert 0 <= alpha <= 2 and 4 <= num <= 8
    profile = planner.AccessProfile.from_ids(cyclic, steps=4)
    assert profile.hit_rate(4, 0) == 1.0 and profile.hit_rate(3, 0) == 0.0  # an LRU of a cycle
    one = planner.AccessProfile.from_ids(np.full(100, -7, dtype=np.int64), steps=2)
    assert (one.num_ids, one.unique_per_step, one.hit_rate(1, 0)) == (1, 1.0, 1.0)


def zipf_ids(n: int, num_ids: int, alpha: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = np.arange(1, num_ids + 1, dtype=np.float64) ** -alpha
    return rng.choice(num_ids, size=n, p=p / p.sum()).astype(np.int64) * 7919 - 10**6


@pytest.mark.parametrize("alpha,limit", [(0.0, 1 << 20), (0.6, 3000), (1.0, 10_000),
                                         (1.3, 3000)])
def test_the_curve_extended_by_its_law_is_monotone_and_within_one(alpha, limit):
    """Measured up to the anchor, the fitted law beyond it, spatially sampled (and corrected)
    below ``limit``: the hit rate never falls as rows grow, and stays in [0, 1]."""
    ids = zipf_ids(40_000, 20_000, alpha, seed=int(alpha * 10))
    profile = planner.AccessProfile.from_ids(ids, steps=8, sample_limit=limit)
    curve = profile.curve
    assert isinstance(curve, MissCurve) and curve.law is not None
    rows = np.unique(np.concatenate([np.arange(0, 2000, 7), np.geomspace(1, 1e12, 600).round(),
                                     [curve.anchor - 1, curve.anchor, curve.anchor + 1]]))
    rates = np.array([profile.hit_rate(float(r), 0) for r in rows])
    assert (np.diff(rates) >= 0).all() and rates.min() >= 0.0 and rates.max() <= 1.0
    assert rates[-1] > 0.95  # a table that holds every id hits in steady state


def test_a_pinned_mode_that_cannot_be_built_says_why():
    """A shard of 2 rows is one bucket: HYBRID needs two. The error names the table, the shard
    and what to change (it used to name only the table and its rows)."""
    table = dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=5,
                               storage=Storage(mode=StorageMode.HYBRID, cache_load_factor=0.5))
    topo = planner.Topology(world_size=4, ranks_per_host=3, hbm_bytes_per_rank=1 << 30,
                            ddr_bytes_per_host=1 << 30)
    with pytest.raises(PlanningError, match=r"'t'.*2 rows over 4 rank.*needs at least 2.*raise "
                                            r"capacity or lower bucket_capacity"):
        planner.plan([table], topo)
    table = dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=5, storage=AUTO)
    assert planner.plan([table], topo).tables["t"].mode == StorageMode.HBM_ONLY


def test_a_plan_file_with_optimal_not_a_bool_is_malformed(tmp_path):
    table = dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=1000, storage=AUTO)
    topo = planner.Topology(world_size=1, ranks_per_host=1, hbm_bytes_per_rank=1 << 30,
                            ddr_bytes_per_host=1 << 30)
    path = tmp_path / "plan.json"
    planner.plan([table], topo).save(path)
    data = json.loads(path.read_text())
    data["optimal"] = "no"  # bool("no") is True: a plan not proven optimal read as optimal
    path.write_text(json.dumps(data))
    with pytest.raises(PlanningError, match="malformed.*optimal"):
        planner.Plan.load(path)


@pytest.mark.parametrize("alpha", [1.0 - 1e-15, 1.0 + 1e-15, 1.0 + 1e-13, 1.0 + 1e-9])
def test_laws_next_to_alpha_one_are_next_to_its_hit_rates(alpha):
    """The tail bins' mass (h^(1-a) - l^(1-a)) / (1-a) cancelled to 0 next to a = 1: the
    bracket of Che's time then divided by 0."""
    for rows in (1e3, 1e5, 1e7):
        assert _che_hit_rate(alpha, 10**8, rows) == pytest.approx(
            _che_hit_rate(1.0, 10**8, rows), abs=1e-6)
    profile = planner.AccessProfile(lookups_per_step=1000, zipf_alpha=alpha, num_ids=10**8)
    assert profile.unique_ids(0) == pytest.approx(
        planner.AccessProfile(lookups_per_step=1000, zipf_alpha=1.0,
                              num_ids=10**8).unique_ids(0), rel=1e-6)
