"""The exact part of the planner's solver: the dynamic program and the depth-first search over
the tables the bound leaves with several options (see :mod:`dynemb.planner.solver`).

Candidates are ``(option index, cost in quanta, hbm bytes, ddr bytes)`` tuples per table.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dynemb.kernels.jit import njit


@dataclass
class _Best:
    key: tuple | None = None
    choice: list[int] | None = None


def _key(cands, pick: Sequence[int]) -> tuple:
    cq = h = d = 0
    idx = []
    for cs, j in zip(cands, pick):
        i, c1, h1, d1 = cs[j]
        cq, h, d = cq + c1, h + h1, d + d1
        idx.append(i)
    return cq, h, d, tuple(idx)


def _offer(best: _Best, cands, pick: Sequence[int], hbm: int, ddr: int) -> None:
    key = _key(cands, pick)
    if key[1] <= hbm and key[2] <= ddr and (best.key is None or key < best.key):
        best.key, best.choice = key, list(pick)


def _hull(points: list[tuple[int, float]]) -> tuple[int, float, np.ndarray, np.ndarray]:
    """A table's options as (hbm, cost) points: the smallest-hbm point (cheapest among those)
    and the segments of the lower convex hull from it to the cheapest point (dh, dc): the
    fractional choices that trade hbm for cost best, slopes increasing."""
    pts = sorted(points)
    chain: list[tuple[int, float]] = []
    for p in pts:
        if chain and chain[-1][0] == p[0]:
            continue  # same hbm, costlier
        while len(chain) >= 2:
            (h1, c1), (h2, c2) = chain[-2], chain[-1]
            if (c2 - c1) * (p[0] - h1) >= (p[1] - c1) * (h2 - h1):
                chain.pop()  # chain[-1] is on or above the segment chain[-2] -> p
            else:
                break
        chain.append(p)
    end = min(range(len(chain)), key=lambda i: (chain[i][1], chain[i][0]))
    chain = chain[:end + 1]
    dh = np.array([b[0] - a[0] for a, b in zip(chain, chain[1:])], dtype=np.float64)
    dc = np.array([b[1] - a[1] for a, b in zip(chain, chain[1:])], dtype=np.float64)
    return chain[0][0], chain[0][1], dh, dc


class _Suffix:
    """The LP bound of the tables from a search level down: with hbm room C, the cheapest
    fractional plan of those tables (greedy over their hull segments, best slope first)."""

    def __init__(self, base_c: float, base_h: int, base_d: int, slope: np.ndarray,
                 dh: np.ndarray, dc: np.ndarray) -> None:
        self.base_c, self.base_h, self.base_d = base_c, base_h, base_d
        self.slope, self.dh, self.dc = slope, dh, dc
        self.cum_h_np = np.concatenate(([0.0], np.cumsum(dh)))
        self.cum_c_np = np.concatenate(([0.0], np.cumsum(dc)))
        self.slopes_np = np.concatenate((slope, [0.0]))
        # plain lists: bisect and indexing on them are far cheaper than numpy calls per node
        self.cum_h, self.cum_c = self.cum_h_np.tolist(), self.cum_c_np.tolist()
        self.n = int(slope.size)
        self.slopes = slope.tolist()

    def extend(self, c0: float, h0: int, dmin: int, dh: np.ndarray, dc: np.ndarray) -> _Suffix:
        """This suffix with one more table (its hull from ``_hull``) on top."""
        slope = np.concatenate((self.slope, dc / dh))
        order = np.argsort(slope, kind="stable")
        return _Suffix(self.base_c + c0, self.base_h + h0, self.base_d + dmin, slope[order],
                       np.concatenate((self.dh, dh))[order], np.concatenate((self.dc, dc))[order])

    def bounds(self, room: np.ndarray) -> np.ndarray:
        """:meth:`bound` of every entry of ``room`` (>= 0)."""
        i = np.searchsorted(self.cum_h_np, room, side="right") - 1
        return self.base_c + self.cum_c_np[i] + self.slopes_np[i] * (room - self.cum_h_np[i])

    def bound(self, room: float) -> float:
        i = bisect.bisect_right(self.cum_h, room) - 1
        if i < self.n:
            return self.base_c + self.cum_c[i] + self.slopes[i] * (room - self.cum_h[i])
        return self.base_c + self.cum_c[i]


@dataclass
class _Search:
    """The depth-first search over the tables left with several options. A node's bound is the
    LP bound of the tables below it (hbm exact, ddr priced by its Lagrange multiplier), so a
    partial plan that leaves hbm the rest cannot use well is cut early."""

    cands: list
    hbm: int
    ddr: int
    best: _Best
    node_limit: int
    nodes: int = 0

    def run(self, keep: list[list[int]], red: np.ndarray, tol: float, sh: float, sd: float,
            ld: float) -> bool:
        """Searches every plan the bound cannot rule out; False if it hit the node limit."""
        pick = [ks[0] for ks in keep]
        free, same, opts = _free_tables(self.cands, keep, sh, sd)
        if not free:
            _offer(self.best, self.cands, pick, self.hbm, self.ddr)
            return True
        mu = ld / sd  # ddr priced per byte
        price = lambda c: c[1] + mu * c[3]  # noqa: E731
        # per level: (option, its rank among the table's kept options, reduced cost, priced cost,
        # hbm, ddr); identical tables compare ranks (their candidate lists may differ)
        levels = [sorted(((j, r, float(red[t, j]), price(self.cands[t][j]), self.cands[t][j][2],
                           self.cands[t][j][3]) for r, j in enumerate(keep[t])),
                         key=lambda c: c[2]) for t in free]
        fixed = [t for t in range(len(self.cands)) if len(keep[t]) == 1]
        base = (sum(price(self.cands[t][pick[t]]) for t in fixed),
                sum(self.cands[t][pick[t]][2] for t in fixed),
                sum(self.cands[t][pick[t]][3] for t in fixed))
        suffix = _suffixes(opts, mu)  # suffix[k]: the tables free[k:]
        return self._dfs(free, levels, same, suffix, pick, base, mu * self.ddr, tol)

    def _dfs(self, free, levels, same, suffix, pick, base, ddr_price, tol) -> bool:
        n = len(free)
        kids: list[list] = [[] for _ in range(n + 1)]  # per level: children left, best last
        chosen = [-1] * n
        level = 0
        kids[0] = self._children(0, levels, same, suffix, chosen, base)
        while level >= 0:
            if level == n:
                _offer(self.best, self.cands, pick, self.hbm, self.ddr)
                level -= 1
                continue
            limit = self.best.key[0] + tol + ddr_price
            stack = kids[level]
            while stack and stack[-1][0] > limit:
                stack.clear()  # sorted: every child left is cut by the new incumbent
            if not stack:
                level -= 1
                continue
            _, j, rank, state = stack.pop()
            self.nodes += 1
            if self.nodes > self.node_limit:
                return False
            chosen[level] = rank
            pick[free[level]] = j
            level += 1
            if level < n:
                kids[level] = self._children(level, levels, same, suffix, chosen, state)
        return True

    def _children(self, level, levels, same, suffix, chosen, state) -> list:
        """The options of level ``level`` that the budgets and the bound allow, as (bound,
        option, state after it), the most promising last."""
        c0, h0, d0 = state
        below = suffix[level + 1]
        out = []
        for j, rank, _, c, h, d in levels[level]:
            if same[level] and rank < chosen[level - 1]:
                continue
            nh, nd, nc = h0 + h, d0 + d, c0 + c
            room = self.hbm - nh - below.base_h
            if room < 0 or nd + below.base_d > self.ddr:
                continue
            out.append((nc + below.bound(room), j, rank, (nc, nh, nd)))
        out.sort(key=lambda x: (-x[0], -x[1]))
        return out


STATE_LIMIT = 2_000_000
"""Partial plans the dynamic program may keep at one table before it hands over to the search."""


class _Program:
    """The dynamic program over the tables left with several options.

    A state is a partial plan of the tables so far: its hbm, cost (in quanta) and ddr. Each
    table extends every state by each of its options; a state is dropped when it cannot fit
    (the smallest options of the tables left do not fit in the room left), when it cannot beat
    the best plan found (its cost plus the LP bound of the tables left exceeds it), and when
    another state is better: while ddr cannot bind, no more hbm and less cost, or the same hbm
    and cost and less ddr; when it can, no more hbm, cost and ddr (one of them less). States
    equal in all three are all kept, and the plan with the smallest choices is picked at the
    end. Tables go largest first (the bound then cuts early);
    identical tables are adjacent and take non-decreasing options (permutations tie exactly).
    """

    def __init__(self, cands: list, hbm: int, ddr: int, best: _Best,
                 ddr_binds: bool = False) -> None:
        self.cands, self.hbm, self.ddr, self.best = cands, hbm, ddr, best
        self.ddr_binds = ddr_binds
        """Whether ddr can bind: then a state is dominated only by one with no more hbm, cost
        and ddr (see :func:`_pareto3`), else by one with no more hbm and cost."""
        self.states = 0

    def run(self, keep: list[list[int]], tol: float, sh: float, sd: float) -> bool:
        """Finds the best plan among those the bound allows (offered to ``best``); False if the
        states outgrew ``STATE_LIMIT``."""
        cands = self.cands
        free, same, opts = _free_tables(cands, keep, sh, sd)
        fixed = [cands[t][ks[0]] for t, ks in enumerate(keep) if len(ks) == 1]
        suffix = _suffixes(opts, 0.0)
        h, c, d = (np.array([sum(o[i] for o in fixed)], dtype=np.int64) for i in (2, 1, 3))
        last = np.zeros(1, dtype=np.int64)
        trail = []
        limit = self.best.key[0] + tol
        for k in range(len(free)):
            n = len(opts[k])
            oh, oc, od = (np.array([o[i] for o in opts[k]], dtype=np.int64) for i in (2, 1, 3))
            # option-major: n runs, each sorted by hbm as the states are (see _undominated_states)
            h2, c2, d2 = ((y[:, None] + x[None, :]).ravel() for x, y in ((h, oh), (c, oc), (d, od)))
            j = np.repeat(np.arange(n), h.size)
            parent = np.tile(np.arange(h.size), n)
            below = suffix[k + 1]
            room = self.hbm - h2 - below.base_h
            ok = (room >= 0) & (d2 + below.base_d <= self.ddr)
            if same[k]:
                ok &= j >= last[parent]
            ok[ok] = c2[ok] + below.bounds(room[ok]) <= limit
            nxt = np.where(ok)[0]
            last2 = j[nxt] if k + 1 < len(free) and same[k + 1] else np.zeros(nxt.size, np.int64)
            prune = _undominated_3d if self.ddr_binds else _undominated_states
            kept = nxt[prune(h2[nxt], c2[nxt], d2[nxt], last2)]
            h, c, d = h2[kept], c2[kept], d2[kept]
            last = j[kept] if k + 1 < len(free) and same[k + 1] else np.zeros(kept.size, np.int64)
            trail.append((parent[kept], j[kept]))
            self.states += h.size
            if h.size > STATE_LIMIT:
                return False
            if h.size == 0:
                return True
        self._finish(free, keep, trail, h, c, d)
        return True

    def _finish(self, free, keep, trail, h, c, d) -> None:
        """Offers the plan with the smallest choices among the best final states."""
        if h.size == 0:
            return
        best = np.lexsort((d, h, c))[0]
        tied = np.where((c == c[best]) & (h == h[best]) & (d == d[best]))[0]
        picks = np.tile(np.array([ks[0] for ks in keep], dtype=np.int64), (tied.size, 1))
        i = tied
        for k in range(len(free) - 1, -1, -1):
            parent, j = trail[k]
            picks[:, free[k]] = np.array(keep[free[k]], dtype=np.int64)[j[i]]
            i = parent[i]
        for pick in picks.tolist():
            _offer(self.best, self.cands, pick, self.hbm, self.ddr)


def _undominated_states(h: np.ndarray, c: np.ndarray, d: np.ndarray,
                        last: np.ndarray) -> np.ndarray:
    """Indices (in order of hbm) of the states no other state with the same ``last`` beats: kept
    are those with less cost than every state of less hbm, and, among the states of their hbm,
    the least cost and then the least ddr; states equal in all of hbm, cost and ddr stand or
    fall together. The states arrive as runs sorted by hbm (the previous table's kept states,
    shifted by each option), so a stable sort by hbm is a merge."""
    out = []
    one = last.size == 0 or last.min() == last.max()
    for value in last[:1] if one else np.unique(last):
        idx = np.arange(last.size) if one else np.flatnonzero(last == value)
        order = idx[np.argsort(h[idx], kind="stable")]
        hh, cc, dd = h[order], c[order], d[order]
        starts = np.flatnonzero(np.r_[True, hh[1:] != hh[:-1]])  # blocks of one hbm
        block = np.cumsum(np.r_[True, hh[1:] != hh[:-1]]) - 1
        least_c = np.minimum.reduceat(cc, starts)
        cheapest = cc == least_c[block]
        least_d = np.minimum.reduceat(np.where(cheapest, dd, np.iinfo(np.int64).max), starts)
        before = np.r_[np.iinfo(np.int64).max, np.minimum.accumulate(least_c)[:-1]]
        out.append(order[cheapest & (dd == least_d[block]) & (least_c[block] < before[block])])
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def _undominated_3d(h: np.ndarray, c: np.ndarray, d: np.ndarray,
                    last: np.ndarray) -> np.ndarray:
    """Indices (in order of hbm) of the states no other state with the same ``last`` dominates
    in all three of hbm, cost and ddr (no more of each, less of one); states equal in all three
    stand or fall together. For programs where ddr can bind."""
    out = []
    one = last.size == 0 or last.min() == last.max()
    for value in last[:1] if one else np.unique(last):
        idx = np.arange(last.size) if one else np.flatnonzero(last == value)
        order = idx[np.lexsort((d[idx], c[idx], h[idx]))]
        out.append(order[_pareto3(h[order], c[order], d[order])])
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


@njit(cache=True)
def _pareto3(h: np.ndarray, c: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Keep-mask of states sorted by (hbm, cost, ddr): a state is dropped when an earlier one
    (no more hbm) has no more cost and no more ddr and differs from it. The earlier states'
    undominated (cost, ddr) points form a staircase (cost rising, ddr falling): the one of
    largest cost <= c has the least ddr of those, so one binary search answers each state."""
    n = h.size
    keep = np.zeros(n, dtype=np.bool_)
    sc = np.empty(n, dtype=np.int64)
    sd = np.empty(n, dtype=np.int64)
    m = 0
    i = 0
    while i < n:
        j = i
        while j + 1 < n and h[j + 1] == h[i] and c[j + 1] == c[i] and d[j + 1] == d[i]:
            j += 1
        lo, hi = 0, m
        while lo < hi:
            mid = (lo + hi) // 2
            if sc[mid] <= c[i]:
                lo = mid + 1
            else:
                hi = mid
        k = lo - 1
        if k < 0 or sd[k] > d[i]:  # undominated: keep the group, put it on the staircase
            keep[i:j + 1] = True
            start = k if k >= 0 and sc[k] == c[i] else k + 1
            end = k + 1
            while end < m and sd[end] >= d[i]:
                end += 1
            gone = end - start  # points the new one dominates: [start, end)
            if gone == 0:
                for t in range(m, start, -1):
                    sc[t] = sc[t - 1]
                    sd[t] = sd[t - 1]
            elif gone > 1:
                for t in range(end, m):
                    sc[t - gone + 1] = sc[t]
                    sd[t - gone + 1] = sd[t]
            m += 1 - gone
            sc[start] = c[i]
            sd[start] = d[i]
        i = j + 1
    return keep


def _free_tables(cands: list, keep: list[list[int]], sh: float, sd: float):
    """The tables with several options left, largest first, identical ones adjacent in table
    order: (table indices, whether each equals the one before, its candidates)."""
    free = [t for t, ks in enumerate(keep) if len(ks) > 1]
    opts_of = {t: [cands[t][j] for j in keep[t]] for t in free}
    # the size of the options left: tables whose options left are identical sort together
    size = {t: max(h / sh + d / sd for _, _, h, d in opts_of[t]) for t in free}
    free.sort(key=lambda t: (-size[t], tuple(opts_of[t]), t))
    opts = [opts_of[t] for t in free]
    same = [k > 0 and opts[k - 1] == opts[k] for k in range(len(free))]
    return free, same, opts


def _suffixes(opts: list[list[tuple[int, int, int, int]]], mu: float) -> list[_Suffix]:
    """``out[k]``: the LP bound of the tables ``opts[k:]`` (ddr priced at ``mu`` per byte)."""
    empty = np.zeros(0)
    out = [_Suffix(0.0, 0, 0, empty, empty, empty)]
    for cs in reversed(opts):
        h0, c0, dh, dc = _hull([(c[2], c[1] + mu * c[3]) for c in cs])
        out.append(out[-1].extend(c0, h0, min(c[3] for c in cs), dh, dc))
    out.reverse()
    return out
