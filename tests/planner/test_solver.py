"""planner.solve against brute force: random instances, traps for binned DPs, budgets at the edge."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynemb.errors import PlanningError
from dynemb.planner import search
from dynemb.planner.solver import COST_QUANTUM, Option, solve


def brute_force(options, hbm: int, ddr: int):
    """The best plan by enumeration, with the solver's order: cost (in quanta), hbm, ddr, choices."""
    best = None
    for pick in itertools.product(*[range(len(o)) for o in options]):
        chosen = [options[t][i] for t, i in enumerate(pick)]
        h, d = sum(o.hbm_bytes for o in chosen), sum(o.ddr_bytes for o in chosen)
        if h <= hbm and d <= ddr:
            key = (sum(round(o.cost / COST_QUANTUM) for o in chosen), h, d, pick)
            best = key if best is None or key < best else best
    return best


def check(options, hbm: int, ddr: int) -> None:
    want = brute_force(options, hbm, ddr)
    if want is None:
        with pytest.raises(PlanningError):
            solve(options, hbm_budget=hbm, ddr_budget=ddr)
        return
    got = solve(options, hbm_budget=hbm, ddr_budget=ddr)
    assert got.choices == want[3]
    assert (got.hbm_bytes, got.ddr_bytes) == want[1:3]
    assert got.optimal and got.gap == 0.0
    assert got.cost == pytest.approx(sum(options[t][i].cost for t, i in enumerate(want[3])))


option = st.builds(Option, hbm_bytes=st.integers(0, 120), ddr_bytes=st.integers(0, 120),
                   cost=st.one_of(st.integers(0, 6).map(float),
                                  st.floats(0, 50, allow_nan=False, allow_infinity=False)))


def _combinations(options) -> int:
    n = 1
    for o in options:
        n *= len(o)
    return n


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.filter_too_much])
@given(options=st.lists(st.lists(option, min_size=1, max_size=20), min_size=1, max_size=6)
       .filter(lambda o: _combinations(o) <= 20_000),
       hbm=st.integers(0, 400), ddr=st.integers(0, 400))
def test_equals_brute_force(options, hbm, ddr):
    check(options, hbm, ddr)
    check(options, hbm, 10**6)  # ddr cannot bind: the dynamic program decides


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.filter_too_much])
@given(options=st.lists(st.lists(option, min_size=1, max_size=12), min_size=1, max_size=6)
       .filter(lambda o: _combinations(o) <= 20_000),
       hbm=st.integers(0, 400))
def test_the_search_alone_equals_brute_force(options, hbm):
    """With the dynamic program switched off, the depth-first search decides every instance."""
    limit = search.STATE_LIMIT
    search.STATE_LIMIT = -1
    try:
        check(options, hbm, 10**6)
    finally:
        search.STATE_LIMIT = limit


@settings(max_examples=100, deadline=None)
@given(table=st.lists(option, min_size=1, max_size=8), copies=st.integers(2, 6),
       hbm=st.integers(0, 400), ddr=st.integers(0, 400))
def test_identical_tables_tie_break_like_brute_force(table, copies, hbm, ddr):
    """Identical tables tie on every permutation: the smallest choice list wins."""
    check([table] * copies, hbm, ddr)
    check([table] * copies, hbm, 10**6)


def test_trap_for_binned_dynamic_programs():
    """The cheap option of table 0 fits only beside the smallest option of table 1, by one byte
    of slack: bins that round bytes up miss it; bins that round down accept a plan over budget."""
    big = 10**9
    options = [[Option(hbm_bytes=big - 7, ddr_bytes=0, cost=1.0),
                Option(hbm_bytes=0, ddr_bytes=big, cost=5.0)],
               [Option(hbm_bytes=7, ddr_bytes=0, cost=2.0),
                Option(hbm_bytes=8, ddr_bytes=0, cost=0.5)]]
    got = solve(options, hbm_budget=big, ddr_budget=big)
    assert got.choices == (0, 0) and got.hbm_bytes == big  # exactly at budget is feasible
    check(options, big, big)
    check(options, big - 1, big)


def test_zero_budgets():
    cpu_only = [[Option(hbm_bytes=10, ddr_bytes=0, cost=1.0),
                 Option(hbm_bytes=0, ddr_bytes=30, cost=3.0)]] * 3
    assert solve(cpu_only, hbm_budget=0, ddr_budget=90).choices == (1, 1, 1)
    assert solve(cpu_only, hbm_budget=30, ddr_budget=0).choices == (0, 0, 0)
    with pytest.raises(PlanningError, match="ddr in total"):
        solve(cpu_only, hbm_budget=0, ddr_budget=89)


def test_monotone_in_budget():
    rng = random.Random(3)
    options = [[Option(hbm_bytes=rng.randint(0, 50), ddr_bytes=rng.randint(0, 50),
                       cost=rng.random()) for _ in range(6)] for _ in range(5)]
    last = None
    for hbm in range(60, 260, 7):
        try:
            cost = solve(options, hbm_budget=hbm, ddr_budget=120).cost
        except PlanningError:
            assert last is None
            continue
        assert last is None or cost <= last + 1e-12
        last = cost
    assert last is not None


def test_errors_name_the_tier_and_what_would_fit():
    options = [[Option(hbm_bytes=5 << 30, ddr_bytes=0, cost=1.0)],
               [Option(hbm_bytes=1 << 30, ddr_bytes=0, cost=1.0)]]
    with pytest.raises(PlanningError, match=r"'big' alone does not fit.*hbm.*5\.00 GiB"):
        solve(options, hbm_budget=4 << 30, ddr_budget=0, names=["big", "small"])
    with pytest.raises(PlanningError, match=r"hbm in total.*at least 6\.00 GiB"):
        solve(options, hbm_budget=5 << 30, ddr_budget=0)
    # each budget alone can be met, not both: the smallest-hbm options need all the ddr
    joint = [[Option(hbm_bytes=4, ddr_bytes=0, cost=1.0),
              Option(hbm_bytes=0, ddr_bytes=4, cost=2.0)]] * 3
    with pytest.raises(PlanningError, match="both budgets at once.*at least 8 bytes of hbm"):
        solve(joint, hbm_budget=4, ddr_budget=4)
    assert solve([], hbm_budget=0, ddr_budget=0).choices == ()
    for bad in (-1, 1.5, True):
        with pytest.raises(PlanningError, match="hbm_budget"):
            solve(options, hbm_budget=bad, ddr_budget=0)
    with pytest.raises(PlanningError, match="cost"):
        Option(hbm_bytes=1, ddr_bytes=0, cost=float("nan"))
    with pytest.raises(PlanningError, match="no options"):
        solve([[]], hbm_budget=1, ddr_budget=1)


def test_node_limit_reports_a_proven_gap():
    rng = random.Random(7)
    options = [[Option(hbm_bytes=rng.randint(1, 1000), ddr_bytes=0, cost=rng.random())
                for _ in range(8)] for _ in range(40)]
    full = solve(options, hbm_budget=12_000, ddr_budget=0)
    capped = solve(options, hbm_budget=12_000, ddr_budget=0, node_limit=1)
    assert full.optimal and capped.hbm_bytes <= 12_000
    assert capped.cost >= full.cost - 1e-9
    assert capped.optimal or capped.cost - full.cost <= capped.gap + 1e-9


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(points=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 4)),
                       min_size=0, max_size=40))
def test_the_three_way_dominance_keeps_exactly_the_undominated_states(points):
    """When ddr can bind, the program drops a state only if another has no more hbm, cost and
    ddr and differs from it (brute force over every pair, ties kept together)."""
    from dynemb.planner.search import _undominated_3d

    h, c, d = (np.array([p[i] for p in points], dtype=np.int64) for i in range(3))
    kept = sorted(_undominated_3d(h, c, d, np.zeros(len(points), dtype=np.int64)).tolist())
    want = [i for i, p in enumerate(points)
            if not any(all(q[k] <= p[k] for k in range(3)) and q != p for q in points)]
    assert kept == want


def test_a_binding_ddr_budget_is_proven_quickly():
    """20 realistic tables at W = 64 with ddr binding: the depth-first search alone needed more
    than 2,000,000 nodes without proving the optimum; the dynamic program with three-way
    dominance proves it at once."""
    import dynemb
    from dynemb import planner

    rng = np.random.default_rng(0)
    opts = [dynemb.SGD(lr=0.01), dynemb.Adam(lr=0.001), dynemb.RowWiseAdagrad(lr=0.01)]
    topo = planner.Topology(world_size=64, ranks_per_host=8, hbm_bytes_per_rank=1 << 50,
                            ddr_bytes_per_host=1 << 55)
    options = []
    for i in range(20):
        cap = int(10 ** rng.uniform(4, 8))
        cfg = dynemb.TableConfig(name=f"t{i}", dim=int(rng.choice([16, 32, 64, 128])),
                                 features=[f"f{i}"], capacity=cap,
                                 optimizer=opts[int(rng.integers(3))],
                                 storage=dynemb.Storage(mode=dynemb.StorageMode.AUTO))
        prof = planner.AccessProfile(lookups_per_step=float(int(10 ** rng.uniform(3, 6))),
                                     zipf_alpha=float(rng.choice([0.0, 0.8, 1.05, 1.2])),
                                     num_ids=cap)
        options.append([o for o, _ in planner.table_options(
            cfg, prof, topo, planner.default_cost_model("cpu"))])
    full = sum(min(o.hbm_bytes for o in opts if o.ddr_bytes == 0) for opts in options)
    sol = solve(options, hbm_budget=int(0.3 * full), ddr_budget=int(0.8 * full),
                node_limit=100_000)
    assert sol.optimal and sol.nodes < 100_000


@pytest.mark.parametrize("state_limit", [search.STATE_LIMIT, -1])
def test_tables_identical_after_the_bound_tie_break_in_table_order(monkeypatch, state_limit):
    """Tables 0 and 2 keep the same two options after the bound but differ in the options it
    fixed out (so in size): the smallest choices put the lower index on table 0 (found by
    hypothesis: both paths returned (18, 1, 14, 0))."""
    monkeypatch.setattr(search, "STATE_LIMIT", state_limit)
    o = lambda h, d, c: Option(hbm_bytes=h, ddr_bytes=d, cost=c)  # noqa: E731
    t0 = [o(61, 0, 0), o(0, 0, 3)] + [o(60, 0, 0)] * 12 + [o(31, 0, 1)] + [o(0, 0, 3)] * 3 \
        + [o(11, 0, 2)]
    t2 = [o(0, 0, 3)] * 6 + [o(0, 13, 3), o(60, 37, 0), o(60, 90, 0), o(97, 60, 0),
                             o(60, 59, 0), o(103, 60, 0), o(61, 0, 0), o(61, 0, 0),
                             o(31, 0, 1), o(0, 0, 3), o(0, 0, 3), o(61, 0, 0), o(11, 0, 2)]
    tables = [t0, [o(0, 0, 2)] + [o(27, 0, 0)] * 7, t2, [o(77, 0, 0)]]
    assert brute_force(tables, 154, 0)[3] == (14, 1, 18, 0)
    check(tables, 154, 0)
