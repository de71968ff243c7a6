"""A pooled collection's tables in one compiled call per stage (``kernels.grouped_numba``).

An :class:`~dynemb.EmbeddingBagCollection` of many small tables pays a few hundred Python
calls per table per step around kernels that each do a few microseconds of work. Its
:class:`TableGroup` runs the lookup, pooling, backward and fused update of every table it holds
in one compiled call per stage (split over threads by tables; a table holding more than a
thread's share of the ids is split inside instead, as its own calls split it), bit-identical to
the tables called one by one, and keeps the per-table Python work to counting.

A table joins its collection's group when its kernels can run there: a CPU table on the numba
backend, HBM_ONLY or HYBRID, without admission, CUSTOM scores, gradient clipping or ddr files
(:func:`groupable`). A step runs grouped when it trains (updates rows) and its per-id weights, if
any, need no gradient; any other step, and every table outside the group, takes the per-table
path. A pipeline's held lookups hold their rows grouped as they would table by table. Inside a
grouped step a table falls back to the per-table code for what is rare: ids that got no row
(``on_full`` WARN/COUNT), rows evicted or erased between forward and backward, gradients
holding NaN or inf.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dynemb.batch import (
    CHANGED_BATCH, EMPTY_KEY, SparseBatch, check_keys, check_table_lengths,
)
from dynemb.config import OnFull, PoolingMode, ScorePolicy, StorageMode
from dynemb.errors import InputError
from dynemb.kernels import grouped_numba as gnb
from dynemb.kernels import lookup_numba as lnb
from dynemb.kernels.backend import init_params
from dynemb.kernels.threads import parts_for, ranges, resolve, run_parts
from dynemb.table.stats import Lookup
from dynemb.table.table import DynamicTable

_TIERS = ("hbm_hits", "ddr_hits", "hbm_misses", "ddr_misses")


def groupable(table: DynamicTable) -> bool:
    """Whether ``table``'s steps can run in its collection's group (see the module docstring)."""
    c = table.config
    return (table.backend.name == "numba"
            and table.mode in (StorageMode.HBM_ONLY, StorageMode.HYBRID)
            and table.admission is None and c.score != ScorePolicy.CUSTOM
            and c.optimizer.max_grad_norm is None and table.files is None)


def splits_well(ko: np.ndarray, parts: int) -> bool:
    """Whether a grouped call over tables with key offsets ``ko`` keeps ``parts`` threads busy
    split by whole tables: one part, or no table with more than a part's share of the ids.
    Else each table is split inside, stage after stage."""
    return parts == 1 or bool(np.diff(ko).max() * parts <= ko[-1])


class TableGroup:
    """The tables of a collection that run grouped, with what the compiled calls need of them
    (built once: a table's arrays are never replaced).

    Args:
        tables: groupable tables (:func:`groupable`), in the collection's order.
        make_state: builds the per-table pooled state (``nn.modules._PoolState``) a table falls
            back to: ``make_state(table, lookup, lengths (F·B,), weights (N,) or empty, batch
            size)``.
    """

    def __init__(self, tables: Sequence[DynamicTable], make_state: Callable) -> None:
        self.tables = list(tables)
        self.make_state = make_state
        self.features = tuple(f for t in self.tables for f in t.config.features)
        n = len(self.tables)
        self.ip = ip = np.zeros((n, gnb.I_WIDTH), np.int64)
        self.fp = np.zeros((n, 3), np.float64)
        self.addr = np.zeros((n, gnb.A_WIDTH), np.int64)
        self.arrays: list[torch.Tensor] = []  # what ``addr`` points into, kept alive
        atomic = [t.config.on_full == OnFull.RAISE for t in self.tables]
        self.journals = any(atomic)  # an atomic table's failure undoes the tables after it
        self.cols: list[tuple[int, int]] = []
        col = 0
        for i, t in enumerate(self.tables):
            ix, c = t.index, t.config
            kind, a, b, q = init_params(c.initializer, torch.device("cpu"))
            ip[i, gnb.I_BUCKETS], ip[i, gnb.I_SPLIT], ip[i, gnb.I_BMASK] = \
                ix.num_buckets, ix.split, ix.width - 1
            ip[i, gnb.I_POLICY], ip[i, gnb.I_HBM_ROWS] = t.state.policy, t.layout.hbm_rows
            ip[i, gnb.I_DIM], ip[i, gnb.I_INIT], ip[i, gnb.I_MIX] = t.dim, kind, t.life.init_mix
            ip[i, gnb.I_MEAN] = c.pooling == PoolingMode.MEAN
            ip[i, gnb.I_FEATURES], ip[i, gnb.I_COL] = len(c.features), col
            ip[i, gnb.I_OPT] = gnb.OPT_CODES[t.optimizer.kernel_args(1)[0]]
            ip[i, gnb.I_JOURNAL], ip[i, gnb.I_ATOMIC] = self.journals, atomic[i]
            ip[i, gnb.I_ROW_WIDTH], ip[i, gnb.I_QUANTILES] = t.rows.shape[1], q.numel()
            ddr = t.store.ddr
            ip[i, gnb.I_DDR_ROWS] = 0 if ddr is None else ddr.shape[0]
            self.fp[i] = (a, b, t.optimizer.initial_state)
            arrays = {gnb.A_KEYS: ix.keys, gnb.A_SCORES: ix.scores, gnb.A_DIGESTS: ix.digests,
                      gnb.A_PINS: ix.pins, gnb.A_WRITTEN: ix.written, gnb.A_COUNTS: ix.counts,
                      gnb.A_ROWS: t.rows, gnb.A_QUANTILES: q}
            if ddr is not None:
                arrays[gnb.A_DDR] = ddr
            for where, x in arrays.items():
                self.arrays.append(x)
                self.addr[i, where] = x.data_ptr()
            self._check(t, arrays)
            width = len(c.features) * t.dim
            self.cols.append((col, col + width))
            col += width
        self.width = col
        self.firsts = np.cumsum([0] + [len(t.config.features) for t in self.tables[:-1]])
        self._grads = np.empty(0, np.float32)  # the gradient buffer, kept between steps

    @staticmethod
    def _check(t: DynamicTable, arrays: dict[int, torch.Tensor]) -> None:
        """The arrays are what the kernels view at their addresses (``gnb._view``)."""
        slots = t.index.num_buckets * t.index.width
        want = {gnb.A_KEYS: (torch.int64, slots), gnb.A_SCORES: (torch.int64, slots),
                gnb.A_DIGESTS: (torch.uint8, slots), gnb.A_PINS: (torch.int32, slots),
                gnb.A_WRITTEN: (torch.int64, slots), gnb.A_COUNTS: (torch.int64, 4),
                gnb.A_ROWS: (torch.float32, t.layout.hbm_rows * t.rows.shape[1]),
                gnb.A_QUANTILES: (torch.float32, arrays[gnb.A_QUANTILES].numel()),
                gnb.A_DDR: (torch.float32, t.layout.ddr_rows * t.rows.shape[1])}
        for where, x in arrays.items():
            if (x.dtype, x.numel()) != want[where] or not x.is_contiguous() or x.is_cuda:
                raise AssertionError(f"table {t.name!r}: array {where} is not what the grouped "
                                     "kernels read")

    @property
    def grad_bytes(self) -> int:
        """Bytes of the gradient buffer kept between steps (the grouped tables' own
        ``grad_scratch`` stays empty)."""
        return self._grads.nbytes

    def threads(self) -> int:
        """Threads a grouped call splits over: the fewest any of its tables asks for."""
        return min(resolve(t.config.threads) for t in self.tables)

    def spans(self, ko: np.ndarray) -> list[tuple[int, int]]:
        """Contiguous ranges of tables, one per part, with about equal numbers of ids (key
        offsets ``ko``)."""
        n = int(ko[-1])
        parts = parts_for(self.threads(), n)
        if parts == 1:
            return [(0, len(self.tables))]
        cuts = np.searchsorted(ko[1:], [n * p // parts for p in range(1, parts)], side="right")
        edges = sorted({0, len(self.tables), *(int(c) for c in cuts)})
        return list(zip(edges[:-1], edges[1:]))

    def ids(self, batch: SparseBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               np.ndarray]:
        """(keys (N,), lengths (F·B,), weights (N,) float32 or empty, key offsets (T + 1,))
        of the group's features, table after table, checked as each table's lookup would
        check them."""
        offs, b = batch.feature_offsets, batch.batch_size
        w = batch.weights
        # copies, as a table's own lookup makes: backward reads them, whatever the caller does
        # to the batch meanwhile (a loader reusing its buffers)
        if batch.features == self.features:
            keys, lengths = batch.values.clone(), batch.lengths.to(torch.int64, copy=True)
            weights = None if w is None else w.detach().to(torch.float32, copy=True)
            sizes = np.diff(offs)
        else:
            at = [batch.features.index(f) for f in self.features]
            keys = torch.cat([batch.values[offs[f]:offs[f + 1]] for f in at])
            lengths = batch.lengths.view(len(batch.features), b)[at].flatten().to(torch.int64)
            weights = None if w is None else torch.cat(
                [w[offs[f]:offs[f + 1]] for f in at]).detach().to(torch.float32)
            sizes = np.asarray([offs[f + 1] - offs[f] for f in at], np.int64)
        if keys.numel() != int(sizes.sum()) or (weights is not None
                                                 and weights.numel() != keys.numel()):
            raise InputError("EmbeddingBagCollection: the batch's values no longer match its "
                             f"features ({CHANGED_BATCH})")
        if weights is None:
            weights = torch.empty(0, dtype=torch.float32)
        keys, lengths, weights = keys.contiguous(), lengths.contiguous(), weights.contiguous()
        firsts = self.firsts
        per_table = np.add.reduceat(sizes, firsts)
        ko = np.zeros(len(self.tables) + 1, np.int64)
        np.cumsum(per_table, out=ko[1:])
        if keys.numel() and int(keys.min()) == EMPTY_KEY:  # the table's own message
            i = int(np.searchsorted(ko, int(torch.nonzero(keys == EMPTY_KEY)[0]), "right")) - 1
            check_keys(keys[ko[i]:ko[i + 1]], f"table {self.tables[i].name!r}: lookup")
        ln = lengths.numpy()
        by_table = np.add.reduceat(ln.reshape(-1, b).sum(axis=1), firsts)
        if ln.min() < 0 or ln.max() > ko[-1] or not np.array_equal(by_table, per_table):
            for i, t in enumerate(self.tables):  # the per-table check names the culprit
                part = lengths[firsts[i] * b:(firsts[i] + len(t.config.features)) * b]
                check_table_lengths(part, int(per_table[i]), t.name)
        return keys, lengths, weights, ko

    def _probe(self, kn: np.ndarray, ko: np.ndarray, steps: np.ndarray,
               spans: list[tuple[int, int]]) -> tuple[tuple[np.ndarray, ...], np.ndarray, int]:
        """The lookup driver over the ids ``kn`` (N,), split by ``spans`` of tables: (what
        ``finish`` reads: slots, inverse, uslot, upos, inserted, ev_keys, ev_slots, ev_scores;
        the per-table results; the first table that failed atomically, or T: every table after
        it undone). Its scratch (the sets, the journal, the probe paths) is freed on return,
        before the pooled output is allocated."""
        n, n_t = int(ko[-1]), len(self.tables)
        scratch, found, journal, res = self._arrays(n)
        run_parts(lambda p: self._lookup_whole(*spans[p], kn, ko, steps, scratch, found, journal,
                                               res), len(spans))
        undone = np.flatnonzero(res[:, gnb.R_UNDONE])
        stop = int(undone[0]) if undone.size else n_t
        if stop < n_t:
            gnb.undo(stop + 1, n_t, ko, self.addr, self.ip, journal, res)
        return found, res, stop

    def _arrays(self, n: int) -> tuple[tuple, tuple, np.ndarray, np.ndarray]:
        """A lookup's arrays for N ids: (its scratch: first, slot_at, free_at, ufree; what
        ``finish`` reads: slots, inverse, uslot, upos, inserted, ev_keys, ev_slots (-1),
        ev_scores; the journal; the per-table results)."""
        first, slot_at, free_at, ufree, slots, inverse, uslot, upos, ev_keys, ev_scores = (
            np.empty(n, np.int64) for _ in range(10))
        found = (slots, inverse, uslot, upos, np.zeros(n, np.bool_), ev_keys,
                 np.full(n, -1, np.int64), ev_scores)
        journal = np.empty((3 * n if self.journals else 0, 5), np.int64)
        res = np.zeros((len(self.tables), gnb.R_WIDTH), np.int64)
        return (first, slot_at, free_at, ufree), found, journal, res

    def _lookup_whole(self, lo: int, hi: int, kn: np.ndarray, ko: np.ndarray, steps: np.ndarray,
                      scratch: tuple, found: tuple, journal: np.ndarray, res: np.ndarray) -> None:
        """``gnb.lookup`` of tables ``[lo, hi)``, each in one part (``_arrays``' arrays)."""
        first, slot_at, free_at, ufree = scratch
        slots, inverse, uslot, upos, inserted, ev_keys, ev_slots, ev_scores = found
        m = lnb.set_size(int(np.diff(ko[lo:hi + 1]).max(initial=0)))
        gnb.lookup(lo, hi, kn, ko, self.addr, self.ip, steps, np.empty((m, 2), np.int64), first,
                   slots, slot_at, free_at, inverse, uslot, ufree, upos, inserted, ev_keys,
                   ev_slots, ev_scores, journal, res)

    def _by_tables(self, kn: np.ndarray, ko: np.ndarray, bo: np.ndarray, b: int,
                   steps: np.ndarray, ln: np.ndarray, wn: np.ndarray,
                   spans: list[tuple[int, int]]) -> tuple[tuple, np.ndarray, int, torch.Tensor]:
        """Every table's lookup, then every table's finish, split by ``spans`` of tables:
        ((slots, inverse, uslot, upos, inserted, ev_keys, ev_slots, ev_scores, fresh_pos,
        ev_out, unique_slots, unique_pos), the per-table results, the first table that failed
        atomically or T, the pooled output)."""
        n, n_t = int(ko[-1]), len(self.tables)
        found, res, stop = self._probe(kn, ko, steps, spans)
        failed = res[:, gnb.R_FAILED]
        pool = np.where(np.arange(n_t) < stop, np.where(failed > 0, 0, 1), -1).astype(np.int64)
        fresh_pos, unique_slots, unique_pos = (np.empty(n, np.int64) for _ in range(3))
        done = (*found, fresh_pos, np.empty((3, n), np.int64), unique_slots, unique_pos)
        out = torch.empty(b, self.width, dtype=torch.float32)
        on = out.numpy()
        run_parts(lambda p: gnb.finish(*spans[p], kn, ko, bo, b, self.addr, self.ip, self.fp,
                                       steps, *done, ln, wn, on, pool, res), len(spans))
        return done, res, stop, out

    def _inside(self, kn: np.ndarray, ko: np.ndarray, bo: np.ndarray, b: int, steps: np.ndarray,
                ln: np.ndarray, wn: np.ndarray) -> tuple[tuple, np.ndarray, int, torch.Tensor]:
        """Each table's lookup then its finish, table after table, each split inside over the
        threads (so that an interrupt leaves at most the table in flight half done, as table
        by table; a run of tables too small to split goes through one compiled call per
        stage); returns as :meth:`_by_tables`."""
        n, n_t = int(ko[-1]), len(self.tables)
        scratch, found, journal, res = self._arrays(n)
        done = (*found, np.empty(n, np.int64), np.empty((3, n), np.int64),
                np.empty(n, np.int64), np.empty(n, np.int64))
        pool = np.ones(n_t, np.int64)
        out = torch.empty(b, self.width, dtype=torch.float32)
        thr = self.threads()
        whole = [parts_for(thr, int(ko[t + 1] - ko[t])) == 1 for t in range(n_t)] + [False]
        t = 0
        try:
            while t < n_t:
                hi = t + 1
                while whole[t] and whole[hi]:
                    hi += 1
                j = journal if self.ip[t:hi, gnb.I_ATOMIC].any() else journal[:0]
                stop = self._look_inside(t, hi, kn, ko, steps, scratch, found, j, res)
                pool[t:stop] = res[t:stop, gnb.R_FAILED] == 0
                if stop > t:
                    self._finish_inside(t, stop, kn, ko, bo, b, steps, done, ln, wn,
                                        out.numpy(), pool, res)
                if stop < hi:
                    return done, res, stop, out
                t = hi
        except BaseException:  # (an interrupt) the tables done before count their lookups
            _count(self.tables, ko, res, t, done[9])
            raise
        return done, res, n_t, out

    def _look_inside(self, t: int, hi: int, kn: np.ndarray, ko: np.ndarray, steps: np.ndarray,
                     scratch: tuple, found: tuple, journal: np.ndarray, res: np.ndarray) -> int:
        """The lookup of tables ``[t, hi)``: one table split by bucket ranges over the threads,
        as ``NumbaBackend.lookup`` splits it (probe parts, numbering, place parts), or tables
        too small to split in one call; returns the table that failed atomically (undone), or
        ``hi``."""
        n = int(ko[t + 1] - ko[t])
        parts = parts_for(self.threads(), n)
        if parts == 1:
            self._lookup_whole(t, hi, kn, ko, steps, scratch, found, journal, res)
            undone = np.flatnonzero(res[t:hi, gnb.R_UNDONE])
            return t + int(undone[0]) if undone.size else hi
        first, slot_at, free_at, ufree = scratch
        slots, inverse, uslot, upos, inserted, ev_keys, ev_slots, ev_scores = found
        addr, ip = self.addr, self.ip
        owner = np.empty(n, np.int32)
        spans = ranges(n, parts)
        run_parts(lambda p: gnb.owners(t, *spans[p], kn, ko, ip, parts, owner), parts)
        m = lnb.set_size(n)
        orders = [np.empty(n, np.int64) for _ in range(parts)]
        journals = np.empty((parts, 3 * n if ip[t, gnb.I_ATOMIC] else 0, 5), np.int64)
        tiers = np.zeros((parts, 4), np.int64)
        probed = run_parts(lambda p: gnb.probe_part(
            t, p, kn, ko, addr, ip, steps, owner, orders[p], np.empty((m, 2), np.int64), first,
            slots, slot_at, free_at, journals[p], tiers[p]), parts)
        gnb.number_first(t, ko, first, slot_at, free_at, inverse, uslot, ufree, upos, res)
        out = np.zeros((parts, 5), np.int64)
        run_parts(lambda p: gnb.place_part(
            t, orders[p][:probed[p][0]], kn, ko, addr, ip, steps, inverse, slots, uslot, ufree,
            journals[p], probed[p][1], inserted, ev_keys, ev_slots, ev_scores, out[p]), parts)
        r = res[t]
        r[gnb.R_TIERS:gnb.R_TIERS + 4] = tiers.sum(0)
        r[gnb.R_INSERTED:gnb.R_INSERTED + 4] = out[:, :4].sum(0)
        r[gnb.R_DONE] = 1
        if ip[t, gnb.I_ATOMIC] and r[gnb.R_FAILED] > 0:
            gnb.undo_parts(t, addr, ip, journals, out)
            r[gnb.R_UNDONE] = 1
            return t
        return hi

    def lookup(self, batch: SparseBatch, timer: Callable, hold: bool = False) -> GroupStep:
        """Looks the batch up in every table of the group and pools it (the forward of a
        training step). A table whose ids cannot all get a row with ``on_full`` RAISE raises
        :class:`~dynemb.errors.CapacityError` having changed nothing, as its own lookup
        would; the tables before it in the group have been looked up, those after it not. (A
        collection looks its group up before its other tables, so when a table outside the
        group raises, every grouped table has been looked up; a batch changed after it was
        built is refused before any grouped table changes.)
        ``hold``: each table's rows stay in place until the step's backward (``held``: what
        a pipeline's ``release`` drops if the backward never runs), as ``lookup(hold=True)``.

        With threads, a call splits by whole tables where that keeps the threads busy
        (:func:`splits_well`); where a table holds more than a part's share of the ids, the
        tables run one after another, each split inside by buckets, new rows, bags and entries
        as its own calls would split it."""
        keys, lengths, weights, ko = self.ids(batch)
        b, n_t = batch.batch_size, len(self.tables)
        bo = np.zeros(n_t + 1, np.int64)
        np.cumsum(self.ip[:, gnb.I_FEATURES] * b, out=bo[1:])
        n = int(ko[-1])
        kn, ln = keys.numpy(), lengths.numpy()
        steps = np.array([t.state.step + 1 for t in self.tables], np.int64)
        spans = self.spans(ko) if splits_well(ko, parts_for(self.threads(), n)) else None
        args = (kn, ko, bo, b, steps, ln, weights.numpy())
        done, res, stop, out = (self._inside(*args) if spans is None
                                else self._by_tables(*args, spans))
        _, inverse, _, _, inserted, _, _, _, _, ev_out, unique_slots, unique_pos = done
        failed = res[:, gnb.R_FAILED]
        step = GroupStep(group=self, keys=keys, lengths=lengths, weights=weights, batch=b,
                         ko=ko, bo=bo, spans=spans, inverse=inverse, unique_slots=unique_slots,
                         unique_pos=unique_pos, inserted=inserted, res=res, timer=timer)
        step.record(stop, ev_out)
        if stop < n_t:
            t = self.tables[stop]
            t.resolver.refuse(int(failed[stop]), t.state.snapshot())
        if hold:
            for i, t in enumerate(self.tables):
                lk = step.lookup_of(i)
                t.resolver.hold(lk)
                step.held.append((t, lk))
        for i in np.flatnonzero(failed[:stop] > 0):  # ids without a row: the table pools itself
            st = step.fallback(int(i))
            lo, hi = self.cols[i]
            out[:, lo:hi] = st.pool()
        step.values = out
        return step

    def _finish_inside(self, t: int, hi: int, kn: np.ndarray, ko: np.ndarray, bo: np.ndarray,
                       b: int, steps: np.ndarray, done: tuple[np.ndarray, ...], ln: np.ndarray,
                       wn: np.ndarray, on: np.ndarray, pool: np.ndarray, res: np.ndarray) -> None:
        """``gnb.finish`` of tables ``[t, hi)`` (``pool``) as :meth:`_look_inside` looked them
        up: one table's new rows and bags split over the threads, or the small ones in one
        call."""
        thr, addr, ip = self.threads(), self.addr, self.ip
        slots, inverse, uslot, upos, inserted, ev_keys, ev_slots, ev_scores, fresh_pos, ev_out, \
            unique_slots, unique_pos = done
        n = int(ko[t + 1] - ko[t])
        if parts_for(thr, n) == 1:
            gnb.finish(t, hi, kn, ko, bo, b, addr, ip, self.fp, steps, *done, ln, wn, on, pool,
                       res)
            return
        n_ins = gnb.settle(t, ko, addr, ip, slots, inverse, uslot, upos, inserted, ev_keys,
                           ev_slots, ev_scores, fresh_pos, ev_out, unique_slots, unique_pos, res)
        news = ranges(n_ins, parts_for(thr, n_ins))
        run_parts(lambda p: gnb.init_part(t, *news[p], kn, ko, addr, ip, self.fp, steps, slots,
                                          fresh_pos), len(news))
        if pool[t] == 1:  # split by bags, into as many parts as the ids are worth
            bags = ranges(int(bo[t + 1] - bo[t]), parts_for(thr, n))
            run_parts(lambda p: gnb.pool_part(t, *bags[p], ko, bo, b, addr, ip, inverse,
                                              unique_slots, ln, wn, on, res), len(bags))


def _count(tables: Sequence[DynamicTable], ko: np.ndarray, res: np.ndarray, stop: int,
           ev_out: np.ndarray) -> tuple[dict, list[int]]:
    """Counts the lookups of the tables before ``stop`` as their own lookups would: step,
    lookups, tiers, evictions, ids that got no row; returns (table position -> the rows it
    evicted, where it evicted any; each table's eviction epoch after its lookup)."""
    sizes = np.diff(ko).tolist()
    evicted, epochs = {}, []
    for i, t, r in zip(range(stop), tables, res[:stop].tolist()):
        st = t.state
        st.touch(sizes[i])
        c = st.counters
        for name, v in zip(_TIERS, r[gnb.R_TIERS:gnb.R_TIERS + 4]):
            if v:
                c[name] += v
        n_ev = r[gnb.R_EVICTED]
        if n_ev:
            ev = torch.from_numpy(ev_out[:, ko[i]:ko[i] + n_ev])
            evicted[i] = t.life.take_evicted(ev[0], ev[1], ev[2], with_rows=False, offset=0)
        if r[gnb.R_FAILED]:
            t.resolver.on_full(r[gnb.R_FAILED])
        epochs.append(st.epoch)
    return evicted, epochs


@dataclass
class GroupStep:
    """One training step's lookup of a :class:`TableGroup`, until its backward."""

    group: TableGroup
    keys: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor
    """(N,) float32 per-id weights, or empty."""
    batch: int
    ko: np.ndarray
    bo: np.ndarray
    spans: list[tuple[int, int]] | None
    """The parts' ranges of tables (``TableGroup.spans``), for backward too; None: each table
    split inside."""
    inverse: np.ndarray
    unique_slots: np.ndarray
    unique_pos: np.ndarray
    inserted: np.ndarray
    res: np.ndarray
    timer: Callable = contextlib.nullcontext
    values: torch.Tensor | None = None
    """(B, group width) the pooled output; handed to autograd (and dropped here) by forward."""
    evicted: dict = field(default_factory=dict)
    """Table position -> the rows its lookup evicted (``Evicted``), where it evicted any."""
    epochs: list[int] = field(default_factory=list)
    """Each table's eviction epoch after its lookup."""
    states: dict = field(default_factory=dict)
    """Table position -> its per-table pooled state, for the tables that fell back."""
    lookups: dict = field(default_factory=dict)
    """Table position -> its lookup (``lookup_of``), once made."""
    held: list = field(default_factory=list)
    """(table, lookup) of each table whose rows the step holds, until its backward."""

    def record(self, stop: int, ev_out: np.ndarray) -> None:
        """Counts the lookups of the tables before ``stop`` (:func:`_count`)."""
        self.evicted, self.epochs = _count(self.group.tables, self.ko, self.res, stop, ev_out)

    def lookup_of(self, i: int) -> Lookup:
        """Table ``i``'s lookup as its own lookup would have returned it (made once)."""
        if i not in self.lookups:
            self.lookups[i] = self._lookup(i)
        return self.lookups[i]

    def _lookup(self, i: int) -> Lookup:
        t, lo, hi = self.group.tables[i], int(self.ko[i]), int(self.ko[i + 1])
        u = int(self.res[i, gnb.R_ENTRIES])
        f = torch.from_numpy
        return Lookup(unique_keys=self.keys[lo:hi][f(self.unique_pos[lo:lo + u])],
                      unique_slots=f(self.unique_slots[lo:lo + u]),
                      inverse=f(self.inverse[lo:hi]), inserted=f(self.inserted[lo:hi]),
                      evicted=self.evicted.get(i) or t.life.evicted_none(),
                      epoch=self.epochs[i])

    def fallback(self, i: int):  # noqa: ANN201  (nn.modules._PoolState)
        """Table ``i``'s per-table pooled state (made once)."""
        if i not in self.states:
            g, b = self.group, self.batch
            w = self.weights[self.ko[i]:self.ko[i + 1]] if self.weights.numel() else self.weights
            self.states[i] = g.make_state(g.tables[i], self.lookup_of(i),
                                          self.lengths[self.bo[i]:self.bo[i + 1]], w, b)
        return self.states[i]

    def backward(self, gout: torch.Tensor) -> None:
        """Sums ``gout`` (B, group width) per entry and applies each table's fused optimizer.

        Tables are taken last to first, as autograd runs the backwards of tables called one by
        one: where a table's own code raises (``nonfinite`` RAISE), the tables after it have
        been updated and those before it not."""
        g = self.group
        n_t = len(g.tables)
        gout = gout.detach().to(torch.float32)
        todo = np.zeros(n_t, np.uint8)
        sizes = np.zeros(n_t, np.int64)
        for i, t in enumerate(g.tables):
            if i not in self.states and t.state.epoch == self.epochs[i]:
                todo[i] = 1  # else it fell back in forward, or rows moved since: its own code
                sizes[i] = self.res[i, gnb.R_ENTRIES] * t.dim
        go = np.zeros(n_t + 1, np.int64)
        np.cumsum(sizes, out=go[1:])
        if g._grads.size < go[-1]:
            g._grads = np.empty(max(int(go[-1]), g._grads.size * 5 // 4), np.float32)
        grads, bad = g._grads, np.zeros(n_t, np.uint8)
        gn = gout.contiguous().numpy()
        args = (self.ko, self.bo, go, self.batch, gn, g.ip, self.inverse, self.lengths.numpy(),
                self.weights.numpy(), grads, todo, bad)
        if self.spans is None:  # pooling backward on one thread, each table's check split
            gnb.gradients(0, n_t, *args, False)
            for i in np.flatnonzero(todo).tolist():
                t = g.tables[i]
                bad[i] = not t.backend.all_finite(torch.from_numpy(grads[go[i]:go[i + 1]]).view(
                    int(self.res[i, gnb.R_ENTRIES]), t.dim))
        else:
            run_parts(lambda p: gnb.gradients(*self.spans[p], *args, True), len(self.spans))
        grouped = (todo != 0) & (bad == 0)
        i = n_t
        try:
            for i in reversed(range(n_t)):
                t = g.tables[i]
                if todo[i] and bad[i]:  # NaN or inf: the table's nonfinite rule
                    u = int(self.res[i, gnb.R_ENTRIES])
                    rows = torch.from_numpy(grads[go[i]:go[i + 1]]).view(u, t.dim)
                    t.apply_gradients(self.lookup_of(i), rows)
                elif not todo[i]:
                    lo, hi = g.cols[i]
                    self.fallback(i).backward(gout[:, lo:hi], False)
        except BaseException:
            grouped[:i + 1] = False  # the tables before the one that raised stay as they are
            raise
        finally:
            self._update(grouped, go, grads)

    def _update(self, which: np.ndarray, go: np.ndarray, grads: np.ndarray) -> None:
        """The fused update of the tables ``which`` with their summed gradients, each one an
        optimizer step, releasing their held lookups as ``apply_gradients`` does."""
        g = self.group
        n_t = len(g.tables)
        fa = np.zeros((n_t, 5), np.float64)
        steps = np.zeros(n_t, np.int64)
        for i in np.flatnonzero(which).tolist():
            t = g.tables[i]
            t.optimizer.step += 1
            args = t.optimizer.kernel_args(t.optimizer.step)[1]
            fa[i, :len(args)] = args
            steps[i] = t.state.step
        args = (self.ko, go, g.addr, g.ip, fa, steps, self.unique_slots, grads)
        todo = which.astype(np.uint8)
        if self.spans is None:  # each big table's entries split over the threads
            for i in np.flatnonzero(which).tolist():
                u = int(self.res[i, gnb.R_ENTRIES])
                rows = ranges(u, parts_for(g.threads(), u))
                if len(rows) > 1:
                    run_parts(lambda p: gnb.update_part(i, *rows[p], *args), len(rows))
                    todo[i] = 0
            gnb.update(0, n_t, *args, todo)  # the others
        else:
            run_parts(lambda p: gnb.update(*self.spans[p], *args, todo), len(self.spans))
        for i in np.flatnonzero(which).tolist():
            lk = self.lookups.get(i)
            if lk is not None and lk.holds is not None:
                g.tables[i].release(lk)
