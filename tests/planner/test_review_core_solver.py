"""planner.solve at its edges: plans exactly at budget whose shares do not sum to 1 in floats,
bytes far from 0 that differ by a few, sums near 2^62, and both exact paths (the dynamic program
and the search) on ties; the dynamic program's dominance rule against its definition."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dynemb.errors import PlanningError
from dynemb.planner import search
from dynemb.planner.solver import SUM_LIMIT, Option, solve
from test_solver import brute_force, check  # the same folder: pytest puts it on the path


def check_both_paths(options, hbm: int, ddr: int) -> None:
    """The dynamic program (where it runs) and the search alone both equal brute force."""
    check(options, hbm, ddr)
    limit = search.STATE_LIMIT
    search.STATE_LIMIT = -1
    try:
        check(options, hbm, ddr)
    finally:
        search.STATE_LIMIT = limit


def options_of(rows) -> list[list[Option]]:
    return [[Option(hbm_bytes=h, ddr_bytes=d, cost=c) for h, d, c in table] for table in rows]


# the only plan within 25 bytes of hbm is every table's smallest: 7+2+7+1+6+2 = 25, but
# 7/25 + 2/25 + ... = 1.0000000000000002 in floats
AT_BUDGET = [[(7, 0, 9.18), (10, 1, 3.12)], [(2, 3, 5.0), (9, 0, 0.45)],
             [(12, 1, 9.07), (7, 3, 0.78)], [(3, 0, 1.95), (1, 0, 3.15)],
             [(6, 0, 3.38), (14, 0, 2.16)], [(2, 0, 7.97), (18, 0, 9.18)]]


def test_a_plan_exactly_at_budget_whose_shares_exceed_one_in_floats():
    options = options_of(AT_BUDGET)
    got = solve(options, hbm_budget=25, ddr_budget=59)
    assert got.hbm_bytes == 25 and got.choices == (0, 0, 1, 1, 0, 0)
    check_both_paths(options, 25, 59)
    # the same in ddr: the tiers swapped
    swapped = [[Option(hbm_bytes=o.ddr_bytes, ddr_bytes=o.hbm_bytes, cost=o.cost) for o in t]
               for t in options]
    check_both_paths(swapped, 59, 25)


option = st.builds(lambda h, d, c: (h, d, c), st.integers(0, 40), st.integers(0, 40),
                   st.one_of(st.integers(0, 4).map(float), st.floats(0, 20)))
instances = st.lists(st.lists(option, min_size=1, max_size=8), min_size=1, max_size=5).filter(
    lambda rows: np.prod([len(r) for r in rows]) <= 5000)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.filter_too_much])
@given(rows=instances, data=st.data())
@example(rows=AT_BUDGET, data=None)
def test_budgets_exactly_at_some_plan_equal_brute_force(rows, data):
    """Budgets set to the totals of a plan (one tier, the other or both): that plan is feasible,
    so the best one is found and is no costlier."""
    smallest = [min(range(len(r)), key=lambda j: r[j][0]) for r in rows]  # data None: these
    pick = smallest if data is None else [data.draw(st.integers(0, len(r) - 1)) for r in rows]
    hbm = sum(r[j][0] for r, j in zip(rows, pick))
    ddr = sum(r[j][1] for r, j in zip(rows, pick))
    options = options_of(rows)
    for h, d in ((hbm, ddr), (hbm, 10**6), (10**6, ddr)):
        check_both_paths(options, h, d)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.filter_too_much])
@given(rows=instances, base=st.sampled_from([1 << 40, 10**15]), scale=st.sampled_from([1, 10]),
       hbm=st.integers(0, 200), ddr=st.one_of(st.integers(0, 200), st.just(10**6)))
@example(rows=[[(10, 90, 1.0), (30, 110, 0.0), (30, 110, 2.0)]] * 3, base=1 << 40, scale=1,
         hbm=510, ddr=200)
def test_large_bytes_that_differ_by_a_few_equal_brute_force(rows, base, scale, hbm, ddr):
    """Shards of a TiB or a PB whose options differ by bytes: the bound's float error grows
    with the bytes, and the bound must stay a bound."""
    options = [[Option(hbm_bytes=base + h * scale, ddr_bytes=base + d * scale, cost=c)
                for h, d, c in table] for table in rows]
    total = base * len(rows)
    check_both_paths(options, total + hbm * scale, total + ddr * scale)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hbms=st.lists(st.integers(0, 6), min_size=1, max_size=3),
       table=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 3)),
                      min_size=1, max_size=7),
       copies=st.integers(2, 5), other=st.booleans(), hbm=st.integers(0, 30),
       ddr=st.one_of(st.integers(0, 12), st.just(10**6)))
def test_identical_tables_and_equal_hbm_on_both_paths(hbms, table, copies, other, hbm, ddr):
    """Options share a few hbm values and costs, tables are copies (one may differ): every
    permutation ties, and both exact paths pick brute force's plan."""
    rows = [[(hbms[i % len(hbms)], d, float(c)) for i, d, c in table]] * copies
    if other:
        rows = rows + [[(hbms[0], 1, 1.0), (hbms[-1], 0, 2.0)]]
    options = options_of(rows)
    if np.prod([len(r) for r in rows]) <= 20_000:
        check_both_paths(options, hbm, ddr)


def test_sums_beyond_int64_are_refused_and_huge_budgets_bind_nothing():
    """Bytes whose sums could overflow an int64 are a PlanningError, not an OverflowError or a
    wrapped sum; 2^62 in all is still exact; a budget of 2^70 is as good as an unbounded one."""
    big = 1 << 62
    three = [[Option(hbm_bytes=big, ddr_bytes=0, cost=1.0),
              Option(hbm_bytes=big // 4, ddr_bytes=0, cost=5.0)]] * 3
    for budget in ((1 << 63) - 1, 1 << 63, 1 << 70):
        with pytest.raises(PlanningError, match="2\\^62"):
            solve(three, hbm_budget=budget, ddr_budget=0)
    exact = [[Option(hbm_bytes=big // 4, ddr_bytes=big // 4, cost=1.0),
              Option(hbm_bytes=big // 8, ddr_bytes=big // 8, cost=3.0)]] * 4
    check_both_paths(exact, big // 2 + big // 8, big)
    assert solve(exact, hbm_budget=big // 2 + big // 8, ddr_budget=big).choices == (0, 1, 1, 1)
    rows = [[(3, 5, 1.0), (1, 2, 2.0), (0, 9, 0.5)], [(4, 0, 1.0), (2, 2, 0.25)]]
    options = options_of(rows)
    for hbm, ddr in ((1 << 70, 1 << 70), (1 << 70, 4), (3, 1 << 70)):
        got = solve(options, hbm_budget=hbm, ddr_budget=ddr)
        want = brute_force(options, min(hbm, 100), min(ddr, 100))
        assert (got.choices, got.hbm_bytes, got.ddr_bytes) == (want[3], want[1], want[2])
    with pytest.raises(PlanningError, match="cost quanta"):
        solve([[Option(hbm_bytes=0, ddr_bytes=0, cost=9e6)]] * 600, hbm_budget=0, ddr_budget=0)
    assert SUM_LIMIT == big


def undominated_by_definition(h, c, d, last) -> list[int]:
    """The states no other state with the same ``last`` beats: less hbm and no more cost, or
    the same hbm and less cost, or the same hbm and cost and less ddr."""
    keep = []
    for s in range(h.size):
        group = last == last[s]
        beaten = group & (((h < h[s]) & (c <= c[s])) |
                          ((h == h[s]) & ((c < c[s]) | ((c == c[s]) & (d < d[s])))))
        if not beaten.any():
            keep.append(s)
    return keep


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3), st.integers(0, 2),
                               st.integers(0, 2)), max_size=40))
def test_the_programs_dominance_rule_keeps_exactly_the_undominated_states(rows):
    arr = np.array(rows, dtype=np.int64).reshape(-1, 4)
    h, c, d, last = arr.T
    for groups in (last, np.zeros_like(last)):
        got = sorted(search._undominated_states(h, c, d, groups).tolist())
        assert got == undominated_by_definition(h, c, d, groups)



def test_the_node_limit_counts_the_searchs_own_nodes(monkeypatch):
    """When the dynamic program outgrows its states and hands over, the search still gets
    ``node_limit`` nodes of its own: what it proves alone within them it proves after the
    program too (the program's states used to eat the search's allowance)."""
    rng = np.random.default_rng(5)
    options = [[Option(hbm_bytes=int(h), ddr_bytes=0, cost=float(1000 - h + 3 * rng.random()))
                for h in rng.integers(1, 1000, 6)] for _ in range(14)]
    budget = 14 * 500 + 37
    monkeypatch.setattr(search, "STATE_LIMIT", -1)
    alone = solve(options, hbm_budget=budget, ddr_budget=0)
    assert alone.optimal and alone.nodes > 1000  # the search has real work to do
    monkeypatch.setattr(search, "STATE_LIMIT", 50)
    after = solve(options, hbm_budget=budget, ddr_budget=0, node_limit=alone.nodes)
    assert after.nodes > alone.nodes  # the program ran first
    assert after.optimal and after.choices == alone.choices
