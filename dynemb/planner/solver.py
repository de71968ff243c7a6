"""The planner's exact solver: one option per table, minimum total cost, within two budgets.

The problem is a multiple-choice knapsack with two resources (hbm bytes, ddr bytes). The solver
does not bin bytes:

1. **Exact arithmetic.** Bytes are ints; costs are rounded to ``COST_QUANTUM`` (1e-9 of the
   cost unit) and summed as ints, so two plans compare exactly and ties are broken the same way
   every time: lower cost, then lower hbm, then lower ddr, then the lexicographically smallest
   list of option indices (earlier tables take their lower-numbered options first). The
   tables' largest options may need at most 2^62 bytes of a tier, and 2^62 quanta of cost,
   together (``SUM_LIMIT``: every sum then fits an int64; more is a ``PlanningError``); a
   budget beyond what they need binds nothing and is capped there.
2. **Reduction.** Options that do not fit a budget alone are dropped, and so are options another
   option of the same table dominates (no more cost, hbm and ddr; on a full tie, the higher
   index), which can never be in the unique best plan.
3. **Lagrangian bound.** For multipliers ``lh, ld >= 0``, ``sum_t min_o (cost + lh*hbm + ld*ddr)
   - lh*H - ld*D`` is a lower bound of every feasible plan's cost (the LP bound at the best
   multipliers, found by nested bisection on the subgradients). Each option's reduced cost
   ``r = cost + lh*hbm + ld*ddr - min_o(...)`` bounds what choosing it adds, so options with
   ``bound + r`` above the best plan found so far (a greedy repair of the Lagrangian choice) are
   fixed out before anything else.
4. **Dynamic program**: the tables left with several options extend a list of partial plans
   one table at a time (largest first); a partial plan is dropped when its cost plus the LP
   bound of the tables still to come (hbm exact, by each table's lower convex hull) exceeds the
   best plan, or when another one dominates it: no more hbm and less cost when ddr cannot bind
   (the largest ddr options left fit together), no more hbm, cost and ddr when it can (see
   ``_Program``). This is the usual exact method for multiple-choice knapsacks (dominance plus
   bounds over a small core) and proves 1,000 tables in well under a second on typical
   instances.
5. **Search** (if the program outgrows ``STATE_LIMIT`` partial plans): a depth-
   first branch and bound over the same tables, children in order of their LP bound, pruned by
   the bound and the budgets' remaining room; identical tables take non-decreasing options.

Both are exact. Their work depends on how many options survive the bound, not on the number of
ranks (the caller sums bytes per rank and per host before calling). If the search needs more
than ``node_limit`` nodes it stops with the best plan found, ``optimal=False`` and the proven
``gap`` (the plan costs at most that much more than the optimum), and says so in the log.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dynemb.errors import PlanningError
from dynemb.planner.search import _Best, _offer, _Program, _Search

logger = logging.getLogger(__name__)

COST_QUANTUM = 1e-9
"""Costs are compared in whole multiples of this (of the cost unit, e.g. 1e-9 ms)."""
NODE_LIMIT = 2_000_000


@dataclass(frozen=True, kw_only=True)
class Option:
    """One way to place a table: its bytes per budget and its predicted cost."""

    hbm_bytes: int
    """Bytes charged to the hbm budget (an int >= 0)."""
    ddr_bytes: int
    """Bytes charged to the ddr budget (an int >= 0)."""
    cost: float
    """Predicted cost (e.g. ms per step), finite and >= 0."""

    def __post_init__(self) -> None:
        for name in ("hbm_bytes", "ddr_bytes"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise PlanningError(f"Option.{name}: expected an int >= 0, found {v!r}.")
            object.__setattr__(self, name, int(v))
        c = self.cost
        if not isinstance(c, (int, float, np.floating)) or isinstance(c, bool) \
                or not math.isfinite(c) or c < 0:
            raise PlanningError(f"Option.cost: expected a finite number >= 0, found {c!r}.")
        if c / COST_QUANTUM >= 2**53:
            raise PlanningError(f"Option.cost: {c!r} is too large to sum exactly in units of "
                                f"{COST_QUANTUM}; express costs in a larger unit.")
        object.__setattr__(self, "cost", float(c))


@dataclass(frozen=True, kw_only=True)
class Solution:
    """The chosen option per table and the plan's totals."""

    choices: tuple[int, ...]
    """Index of the chosen option in each table's list."""
    cost: float
    """Sum of the chosen options' costs."""
    hbm_bytes: int
    """Sum of the chosen options' hbm bytes (<= the hbm budget)."""
    ddr_bytes: int
    """Sum of the chosen options' ddr bytes (<= the ddr budget)."""
    optimal: bool = True
    """False only if the search hit its node limit (see ``gap``)."""
    gap: float = 0.0
    """Proven bound on how much cheaper the optimum can be (0 when optimal)."""
    nodes: int = 0
    """The work done after the bound fixed what it could: states of the dynamic program, plus
    nodes of the search where it ran."""


def _quantize(cost: float) -> int:
    return int(round(cost / COST_QUANTUM))


def _check_budget(name: str, value: object) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise PlanningError(f"solve: {name} must be an int >= 0 (bytes), found {value!r}.")
    return int(value)


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"


class _Tables:
    """The candidates of every table after reduction: (original index, cost_q, hbm, ddr)."""

    def __init__(self, options: Sequence[Sequence[Option]], hbm: int, ddr: int,
                 names: Sequence[str]) -> None:
        self.cands: list[list[tuple[int, int, int, int]]] = []
        for t, opts in enumerate(options):
            if len(opts) == 0:
                raise PlanningError(f"solve: table {names[t]!r} has no options.")
            cands = [(i, _quantize(o.cost), o.hbm_bytes, o.ddr_bytes) for i, o in enumerate(opts)
                     if o.hbm_bytes <= hbm and o.ddr_bytes <= ddr]
            if not cands:
                raise _alone_error(names[t], opts, hbm, ddr)
            self.cands.append(_undominated(cands))


def _undominated(cands: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Drops options another one beats or ties on (cost, hbm, ddr) with a lower index."""
    order = sorted(cands, key=lambda c: (c[1], c[2], c[3], c[0]))
    kept: list[tuple[int, int, int, int]] = []
    for c in order:
        if not any(k[1] <= c[1] and k[2] <= c[2] and k[3] <= c[3] for k in kept):
            kept.append(c)
    return sorted(kept)


def _alone_error(name: str, opts: Sequence[Option], hbm: int, ddr: int) -> PlanningError:
    fit_h = [o for o in opts if o.hbm_bytes <= hbm]
    if not fit_h:
        need = min(o.hbm_bytes for o in opts)
        return PlanningError(
            f"table {name!r} alone does not fit: its smallest option needs {_human(need)} of hbm, "
            f"the hbm budget is {_human(hbm)}; an hbm budget of {_human(need)} would fit it "
            "(or give the table less capacity, or allow it a ddr tier).")
    need = min(o.ddr_bytes for o in fit_h)
    return PlanningError(
        f"table {name!r} alone does not fit: within the hbm budget ({_human(hbm)}) its smallest "
        f"option needs {_human(need)} of ddr, the ddr budget is {_human(ddr)}; a ddr budget of "
        f"{_human(need)} would fit it.")


def _total_error(cands: list[list[tuple[int, int, int, int]]], hbm: int,
                 ddr: int) -> PlanningError | None:
    """A tier whose budget the tables' smallest options already exceed together."""
    for tier, col, budget, fix in (("hbm", 2, hbm, "allow ddr tiers"),
                                   ("ddr", 3, ddr, "move tables to hbm")):
        need = sum(min(c[col] for c in cs) for cs in cands)
        if need > budget:
            return PlanningError(
                f"the tables do not fit in {tier} in total: every plan needs at least "
                f"{_human(need)} of {tier}, the budget is {_human(budget)} (each table fits "
                f"alone). Raise the {tier} budget to at least that, or reduce capacities, or "
                f"{fix}.")
    return None


SUM_LIMIT = 1 << 62
"""The most the largest options of all tables may need together, in bytes of a tier or in cost
quanta (every sum the solver forms then fits an int64)."""


def _exact_budgets(cands: list[list[tuple[int, int, int, int]]], hbm: int,
                   ddr: int) -> tuple[int, int]:
    """The budgets capped at what the tables' largest options need together (a budget beyond
    that binds nothing); checks that every sum the solver forms fits an int64."""
    most = [sum(max(c[col] for c in cs) for cs in cands) for col in (1, 2, 3)]
    for what, total in zip(("cost quanta", "bytes of hbm", "bytes of ddr"), most):
        if total > SUM_LIMIT:
            raise PlanningError(
                f"solve: the tables' largest options need {total:,} {what} together; expected "
                f"at most {SUM_LIMIT:,} (2^62) to sum them exactly. Express "
                f"{'costs' if what.startswith('cost') else 'bytes'} in a larger unit.")
    return min(hbm, most[1]), min(ddr, most[2])


class _Lagrangian:
    """Arrays of every candidate (tables x max options, padded with +inf) and the bound."""

    def __init__(self, cands: list[list[tuple[int, int, int, int]]], hbm: int, ddr: int) -> None:
        width = max(len(cs) for cs in cands)
        shape = (len(cands), width)
        self.cost = np.full(shape, np.inf)
        self.hb = np.zeros(shape, dtype=np.int64)  # exact bytes (padding: 0, at cost inf)
        self.db = np.zeros(shape, dtype=np.int64)
        for t, cs in enumerate(cands):
            for j, (_, cq, h, d) in enumerate(cs):
                self.cost[t, j], self.hb[t, j], self.db[t, j] = cq, h, d
        self.h, self.d = self.hb.astype(np.float64), self.db.astype(np.float64)
        # bytes in budget units keep the multipliers in the range of the costs
        self.hbm, self.ddr = hbm, ddr
        self.sh, self.sd = max(hbm, 1), max(ddr, 1)
        self.h /= self.sh
        self.d /= self.sd
        self.rows = np.arange(len(cands))

    def evaluate(self, lh: float, ld: float) -> tuple[float, float, float, np.ndarray]:
        """(bound, hbm slope, ddr slope, argmin per table) at multipliers (lh, ld)."""
        red = self.cost + lh * self.h + ld * self.d
        arg = np.argmin(red, axis=1)
        m = red[self.rows, arg]
        # the slopes' signs exactly (in floats, shares that sum to the budget may exceed 1)
        sh = (int(self.hb[self.rows, arg].sum()) - self.hbm) / self.sh
        sd = (int(self.db[self.rows, arg].sum()) - self.ddr) / self.sd
        return float(m.sum()) - lh - ld, sh, sd, arg

    def _best_ld(self, lh: float, feasible: list) -> tuple[float, tuple]:
        """The ddr multiplier maximising the bound for ``lh`` (bisection on its slope), and
        the evaluation there."""
        ev = self.evaluate(lh, 0.0)
        feasible.append(ev)
        if ev[2] <= 0:
            return 0.0, ev
        lo, hi = 0.0, 1.0
        while True:
            ev = self.evaluate(lh, hi)
            feasible.append(ev)
            if ev[2] <= 0 or hi > 1e30:
                break
            lo, hi = hi, hi * 4
        best = (hi, ev)
        for _ in range(50):
            mid = 0.5 * (lo + hi)
            e = self.evaluate(lh, mid)
            feasible.append(e)
            if e[0] > best[1][0]:
                best = (mid, e)
            if e[2] > 0:
                lo = mid
            else:
                hi = mid
        return best

    def maximise(self) -> tuple[float, float, float, list]:
        """(bound, lh, ld, every evaluation made): the best multipliers found."""
        seen: list = []
        ld0, best = self._best_ld(0.0, seen)
        best_l = (best[0], 0.0, ld0)
        if best[1] > 0:
            lo, hi = 0.0, 1.0
            while True:
                ld, ev = self._best_ld(hi, seen)
                if ev[0] > best_l[0]:
                    best_l = (ev[0], hi, ld)
                if ev[1] <= 0 or hi > 1e30:
                    break
                lo, hi = hi, hi * 4
            for _ in range(40):
                mid = 0.5 * (lo + hi)
                ld, ev = self._best_ld(mid, seen)
                if ev[0] > best_l[0]:
                    best_l = (ev[0], mid, ld)
                if ev[1] > 0:
                    lo = mid
                else:
                    hi = mid
        return best_l[0], best_l[1], best_l[2], seen


def _repair(lag: _Lagrangian, pick: np.ndarray, hbm: int, ddr: int) -> np.ndarray | None:
    """Greedy: switch options (the least cost per budget share freed) until both budgets hold,
    then fill the room left (:func:`_improve`). None if no feasible plan is reached."""
    pick = pick.copy()
    rows = lag.rows
    for _ in range(lag.cost.size):
        h, d = int(lag.hb[rows, pick].sum()), int(lag.db[rows, pick].sum())
        over_h, over_d = max(0, h - hbm), max(0, d - ddr)
        if not over_h and not over_d:
            return _improve(lag, pick, h, d, hbm, ddr)
        cur = (lag.cost[rows, pick], lag.hb[rows, pick], lag.db[rows, pick])
        freed = np.zeros(lag.cost.shape)
        if over_h:
            freed += np.minimum(over_h, cur[1][:, None] - lag.hb) / max(hbm, 1)
        if over_d:
            freed += np.minimum(over_d, cur[2][:, None] - lag.db) / max(ddr, 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            rate = np.where(freed > 0, (lag.cost - cur[0][:, None]) / freed, np.inf)
        t, j = np.unravel_index(np.argmin(rate), rate.shape)
        if not np.isfinite(rate[t, j]):
            return None
        pick[t] = j
    return None


def _improve(lag: _Lagrangian, pick: np.ndarray, h: int, d: int, hbm: int,
             ddr: int) -> np.ndarray:
    """Greedy fill of the room left: take the switch that saves the most cost per budget share
    it uses (a free saving first), while one fits."""
    rows = lag.rows
    while True:
        c0, h0, d0 = lag.cost[rows, pick], lag.hb[rows, pick], lag.db[rows, pick]
        dh, dd = lag.hb - h0[:, None], lag.db - d0[:, None]
        save = c0[:, None] - lag.cost
        ok = (save > 0) & (h + dh <= hbm) & (d + dd <= ddr)
        if not ok.any():
            return pick
        used = np.maximum(dh, 0) / max(hbm, 1) + np.maximum(dd, 0) / max(ddr, 1)
        with np.errstate(divide="ignore", over="ignore"):
            rate = np.where(ok, np.where(used > 0, save / np.maximum(used, 1e-300), np.inf), -1.0)
        t, j = np.unravel_index(np.argmax(rate), rate.shape)
        h, d = h + int(dh[t, j]), d + int(dd[t, j])
        pick[t] = j


def solve(options: Sequence[Sequence[Option]], *, hbm_budget: int, ddr_budget: int,
          names: Sequence[str] | None = None, node_limit: int = NODE_LIMIT) -> Solution:
    """The cheapest choice of one option per table with total hbm <= ``hbm_budget`` and total
    ddr <= ``ddr_budget`` (a plan exactly at budget fits).

    Args:
        options: per table, its options (at least one).
        hbm_budget: bytes (int >= 0).
        ddr_budget: bytes (int >= 0).
        names: table names for error messages (default ``table 0``, ...).
        node_limit: search nodes before giving up on proving optimality (see module docs).

    Returns:
        The best plan: lowest cost, then lowest hbm, then lowest ddr, then the lexicographically
        smallest ``choices``.

    Raises:
        PlanningError: no plan fits; the message names the tier, what the smallest plan needs and
            the budget that would fit, and tells a table that cannot fit alone from tables that
            do not fit together.
    """
    hbm, ddr = _check_budget("hbm_budget", hbm_budget), _check_budget("ddr_budget", ddr_budget)
    names = [f"table {t}" for t in range(len(options))] if names is None else list(names)
    if len(names) != len(options):
        raise PlanningError(f"solve: {len(options)} option lists but {len(names)} names.")
    if not options:
        return Solution(choices=(), cost=0.0, hbm_bytes=0, ddr_bytes=0)
    for t, opts in enumerate(options):
        if not all(isinstance(o, Option) for o in opts):
            raise PlanningError(f"solve: the options of {names[t]!r} must be planner.Option.")
    cands = _Tables(options, hbm, ddr, names).cands
    error = _total_error(cands, hbm, ddr)
    if error is not None:
        raise error
    budgets = hbm, ddr
    hbm, ddr = _exact_budgets(cands, hbm, ddr)
    lag = _Lagrangian(cands, hbm, ddr)
    lb, lh, ld, seen = lag.maximise()
    best = _Best()
    for _, sh, sd, arg in seen:  # Lagrangian choices that happen to fit, and their repairs
        if sh <= 0 and sd <= 0:
            _offer(best, cands, [int(a) for a in arg], hbm, ddr)
    fixed = _repair(lag, lag.evaluate(lh, ld)[3], hbm, ddr)
    if fixed is not None:
        _offer(best, cands, fixed.tolist(), hbm, ddr)
    if best.key is None:  # no incumbent: search with an infinite bound
        best.key = (math.inf, 0, 0, ())
    red = lag.cost + lh * lag.h + ld * lag.d
    # float error of the bounds, in quanta: relative to the largest terms they sum
    size = np.where(np.isfinite(red), red, 0.0).max(axis=1).sum() + lh + ld
    tol = 1e-9 * (size + abs(lb) + abs(best.key[0])) + 1.0
    red = red - red.min(axis=1, keepdims=True)
    keep = [[j for j in range(len(cs)) if lb + red[t, j] <= best.key[0] + tol]
            for t, cs in enumerate(cands)]  # options the bound allows
    search = _Search(cands, hbm, ddr, best, node_limit)
    complete = False
    binds = sum(max(cands[t][j][3] for j in ks) for t, ks in enumerate(keep)) > ddr
    program = _Program(cands, hbm, ddr, best, ddr_binds=binds)
    complete = program.run(keep, tol, lag.sh, lag.sd)
    search.nodes = program.states
    search.node_limit += program.states  # the limit is on the search's own nodes
    if not complete:
        complete = search.run(keep, red, tol, lag.sh, lag.sd, ld)
    if best.choice is None:
        if not complete:
            raise PlanningError(f"solve: no plan found within {node_limit} search nodes.")
        raise _joint_error(options, *budgets, names)
    choices = tuple(cands[t][j][0] for t, j in enumerate(best.choice))
    gap = 0.0 if complete else max(0.0, (best.key[0] - lb) * COST_QUANTUM)
    if not complete:
        logger.warning("planner: the search stopped after %d nodes; the plan is within %.6g of "
                       "the optimum (raise node_limit to prove optimality)", node_limit, gap)
    return Solution(choices=choices,
                    cost=math.fsum(options[t][i].cost for t, i in enumerate(choices)),
                    hbm_bytes=best.key[1], ddr_bytes=best.key[2], optimal=complete, gap=gap,
                    nodes=search.nodes)


def _joint_error(options: Sequence[Sequence[Option]], hbm: int, ddr: int,
                 names: Sequence[str]) -> PlanningError:
    """Each table fits and each budget's minimum fits, but not both at once: the hbm budget a
    plan within the ddr budget needs."""
    by_hbm = [[Option(hbm_bytes=0, ddr_bytes=o.ddr_bytes, cost=o.hbm_bytes / (1 << 30))
               for o in opts] for opts in options]
    least = solve(by_hbm, hbm_budget=0, ddr_budget=ddr, names=names)
    need_bytes = sum(options[t][i].hbm_bytes for t, i in enumerate(least.choices))
    return PlanningError(
        f"no plan meets both budgets at once: every plan within the ddr budget ({_human(ddr)}) "
        f"needs at least {_human(need_bytes)} of hbm, the hbm budget is {_human(hbm)} (each "
        "budget alone can be met). An hbm budget of that size would fit; or raise the ddr "
        "budget.")
