"""A collection's tables in one compiled call per stage: lookup, pooling, backward and update.

A pooled collection of many small tables (Criteo has 26 fields, one id each per sample) spends
most of a step on the Python and dispatch cost around each table's kernels, not in them. The
drivers here loop over a group of tables inside one compiled call and run, for each table, the
very kernels a table runs alone (``lookup_numba``, ``rows_numba``, ``pooling_numba``), on the
same arrays in the same order: the results are bit-identical to the tables called one by one.

The tables' arrays are passed by address (``addr`` (T, A_WIDTH) int64: each table's index
keys, scores, digests, pins, write steps and counts, its rows and its initializer's quantile
table), viewed in place (:func:`_view`) with the shapes in ``ip``: one compiled function for
any number of tables, nothing converted per call. The caller keeps every array alive. The
per-call data of all tables lies in shared buffers, table t's at its offsets: ids
``[ko[t], ko[t+1])`` (also its occurrences' and entries' rows in the (N,) buffers), bags
``[bo[t], bo[t+1])``, output columns ``[ip[t, I_COL], + F·dim)``, gradient elements
``[go[t], go[t+1])``. A call covers tables ``[t_lo, t_hi)``: a part (``kernels.threads``);
tables share nothing, so parts run at once. Where a table holds more than a part's share of the
ids, the tables run one after another instead, each split inside as its own calls split it
(the ``*_part`` kernels: the lookup by bucket ranges, new rows, bags and entries by ranges;
a table too small to split runs whole).

``ip`` (T, I_WIDTH) int64 and ``fp`` (T, 3) float64 hold each table's fixed parameters;
``res`` (T, R_WIDTH) int64 what each table's call did.
"""

from __future__ import annotations

import numpy as np
from numba import carray, types
from numba.extending import intrinsic

from dynemb.kernels import index_numba as inb
from dynemb.kernels import lookup_numba as lnb
from dynemb.kernels import pooling_numba as pnb
from dynemb.kernels import rows_numba as rnb
from dynemb.kernels.index_numba import P_STEP
from dynemb.kernels.jit import njit

# ip columns: the index, the rows, the initializer, the pooling, the optimizer
(I_BUCKETS, I_SPLIT, I_BMASK, I_POLICY, I_HBM_ROWS, I_DIM, I_INIT, I_MIX, I_MEAN, I_FEATURES,
 I_COL, I_OPT, I_JOURNAL, I_ATOMIC, I_ROW_WIDTH, I_QUANTILES, I_DDR_ROWS) = range(17)
I_WIDTH = 17
# addr columns (A_DDR: a HYBRID table's ddr rows, global row ids from I_HBM_ROWS on)
A_KEYS, A_SCORES, A_DIGESTS, A_PINS, A_WRITTEN, A_COUNTS, A_ROWS, A_QUANTILES, A_DDR = range(9)
A_WIDTH = 9
F_A, F_B, F_STATE = 0, 1, 2  # fp columns: the initializer's (a, b), new rows' optimizer state
OPT_SGD, OPT_ADAGRAD, OPT_ROWWISE, OPT_ADAM = 0, 1, 2, 3
OPT_CODES = {"sgd": OPT_SGD, "adagrad": OPT_ADAGRAD, "rowwise_adagrad": OPT_ROWWISE,
             "adam": OPT_ADAM}
# res columns: tiers (4, as lookup_numba.probe counts them), place's out (5), distinct keys,
# entries, whether the table failed and was undone (an atomic table), whether its lookup ran
(R_TIERS, R_INSERTED, R_EVICTED, R_FAILED, R_NEW, R_JOURNAL, R_DISTINCT, R_ENTRIES, R_UNDONE,
 R_DONE) = (0, 4, 5, 6, 7, 8, 9, 10, 11, 12)
R_WIDTH = 13
_I64, _I32, _U8, _F32 = (np.empty(0, d) for d in (np.int64, np.int32, np.uint8, np.float32))


@intrinsic
def _pointer(typingctx, address, like):
    """The int64 ``address`` as a pointer to elements of ``like``'s dtype."""
    ptr = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr))

    return ptr(address, like), codegen


@njit(cache=True, inline="always")
def _view(addr, t, a, like, shape):
    """Table t's array ``a`` (an ``A_*`` column), of ``like``'s dtype and ``shape``."""
    return carray(_pointer(addr[t, a], like), shape)


@njit(cache=True, inline="always")
def _index(addr, ip, t):
    """Table t's index arrays: keys, scores, digests, pins."""
    n = ip[t, I_BUCKETS] * (ip[t, I_BMASK] + 1)
    return (_view(addr, t, A_KEYS, _I64, (n,)), _view(addr, t, A_SCORES, _I64, (n,)),
            _view(addr, t, A_DIGESTS, _U8, (n,)), _view(addr, t, A_PINS, _I32, (n,)))


@njit(cache=True, inline="always")
def _written(addr, ip, t):
    return _view(addr, t, A_WRITTEN, _I64, (ip[t, I_BUCKETS] * (ip[t, I_BMASK] + 1),))


@njit(cache=True, inline="always")
def _rows(addr, ip, t):
    """Table t's hbm rows and ddr rows (a HYBRID table's; else none)."""
    width = ip[t, I_ROW_WIDTH]
    hbm = _view(addr, t, A_ROWS, _F32, (ip[t, I_HBM_ROWS], width))
    if ip[t, I_DDR_ROWS] == 0:
        return hbm, hbm[:0]
    return hbm, _view(addr, t, A_DDR, _F32, (ip[t, I_DDR_ROWS], width))


@njit(cache=True, inline="always")
def _tiers(rids, split):
    """(hbm, ddr) row numbers of global row ids ``rids`` (-1 where in the other tier or none),
    as ``RowStore.parts`` splits them."""
    hbm = np.empty_like(rids)
    ddr = np.empty_like(rids)
    for i in range(rids.shape[0]):
        r = rids[i]
        hbm[i] = r if r < split else -1
        ddr[i] = r - split if r >= split else -1
    return hbm, ddr


@njit(cache=True, inline="always")
def _sources(rids, split):
    """The pooling kernels' ``src`` of entries ``rids`` with ``extra`` = the ddr rows."""
    src = np.empty_like(rids)
    for i in range(rids.shape[0]):
        r = rids[i]
        src[i] = r if r < split else -1 - (r - split)
    return src


@njit(cache=True, nogil=True)
def lookup(t_lo, t_hi, keys, ko, addr, ip, steps, bset,
           first, slots, slot_at, free_at, inverse, uslot, ufree, upos, inserted, ev_keys,
           ev_slots, ev_scores, journal, res):
    """Finds and inserts the ids of tables ``[t_lo, t_hi)`` as ``NumbaBackend.lookup`` does for
    one table in one part (``probe``, ``number_first``, ``place``), touching scores at
    ``steps[t]``. Changes only the index (keys, scores, digests, pins), so a table can be undone
    (:func:`undo`) from its journal rows ``[3·ko[t], 3·ko[t+1])`` when ``ip[t, I_JOURNAL]``.
    An atomic table (``ip[t, I_ATOMIC]``, which journals) where an id got no row is undone at
    once and the part stops there (``res[t, R_UNDONE]``); a table whose lookup ran has
    ``res[t, R_DONE]``.
    ``bset``: the part's batch-local set (``lookup_numba.probe``), at least ``set_size`` slots
    of its largest table; ``ev_slots`` prefilled with -1."""
    custom = _I64
    allowed = np.empty(0, np.bool_)
    for t in range(t_lo, t_hi):
        lo, hi = ko[t], ko[t + 1]
        n = hi - lo
        m = lnb.set_size_nb(n)
        jr = journal[3 * lo:3 * hi] if ip[t, I_JOURNAL] else journal[:0]
        ikeys, iscores, dig, pins = _index(addr, ip, t)
        a = (ip[t, I_BUCKETS], ip[t, I_SPLIT], ip[t, I_BMASK], ip[t, I_POLICY], steps[t])
        r = res[t]
        r[:] = 0
        n_j = lnb.probe(True, _I64, keys[lo:hi], custom, ikeys, iscores, dig, pins, a[0], a[1],
                        a[2], a[3], a[4], True, ip[t, I_HBM_ROWS], bset[:m],
                        first[lo:hi], slots[lo:hi], slot_at[lo:hi], free_at[lo:hi], jr,
                        r[R_TIERS:R_TIERS + 4])
        r[R_DISTINCT] = lnb.number_first(first[lo:hi], slot_at[lo:hi], free_at[lo:hi],
                                         inverse[lo:hi], uslot[lo:hi], ufree[lo:hi],
                                         upos[lo:hi])
        lnb.place(True, _I64, keys[lo:hi], custom, ikeys, iscores, dig, pins, a[0], a[1], a[2],
                  a[3], a[4], allowed, inverse[lo:hi], slots[lo:hi], uslot[lo:hi], ufree[lo:hi],
                  jr, n_j, inserted[lo:hi], ev_keys[lo:hi], ev_slots[lo:hi], ev_scores[lo:hi],
                  r[R_INSERTED:R_INSERTED + 5])
        r[R_DONE] = 1
        if ip[t, I_ATOMIC] and r[R_FAILED] > 0:
            lnb.undo(jr, r[R_JOURNAL], ikeys, iscores, dig, pins)
            r[R_UNDONE] = 1
            return


@njit(cache=True, nogil=True)
def undo(t_lo, t_hi, ko, addr, ip, journal, res):
    """Undoes the lookups of tables ``[t_lo, t_hi)`` that ran and were not undone (a table
    before them failed an atomic call: the collection stops there, as a loop over its tables
    would)."""
    for t in range(t_lo, t_hi):
        r = res[t]
        if r[R_DONE] and not r[R_UNDONE]:
            ikeys, iscores, dig, pins = _index(addr, ip, t)
            lnb.undo(journal[3 * ko[t]:3 * ko[t + 1]], r[R_JOURNAL], ikeys, iscores, dig, pins)
            r[R_UNDONE] = 1


@njit(cache=True, nogil=True)
def owners(t, a, b, keys, ko, ip, parts, owner):
    """``lookup_numba.owners`` of table t's ids ``[a, b)`` (positions within the table)."""
    lo = ko[t]
    lnb.owners(keys[lo + a:lo + b], ip[t, I_BUCKETS], ip[t, I_SPLIT], parts, owner[a:b])


@njit(cache=True, nogil=True)
def probe_part(t, p, keys, ko, addr, ip, steps, owner, order, bset, first, slots, slot_at,
               free_at, journal, tiers):
    """Part p of table t's probe (:func:`lookup`'s first stage split by bucket ranges, as
    ``NumbaBackend.lookup`` splits a table): lists the part's occurrences in ``order`` and
    probes them. Returns (their count, the journal's length)."""
    lo, hi = ko[t], ko[t + 1]
    c = lnb.part_order(owner, p, order)
    ikeys, iscores, dig, pins = _index(addr, ip, t)
    n_j = lnb.probe(False, order[:c], keys[lo:hi], _I64, ikeys, iscores, dig, pins,
                    ip[t, I_BUCKETS], ip[t, I_SPLIT], ip[t, I_BMASK], ip[t, I_POLICY], steps[t],
                    True, ip[t, I_HBM_ROWS], bset, first[lo:hi], slots[lo:hi], slot_at[lo:hi],
                    free_at[lo:hi], journal, tiers)
    return c, n_j


@njit(cache=True, nogil=True)
def number_first(t, ko, first, slot_at, free_at, inverse, uslot, ufree, upos, res):
    """``lookup_numba.number_first`` of table t, between its probe and its place parts."""
    lo, hi = ko[t], ko[t + 1]
    res[t, R_DISTINCT] = lnb.number_first(first[lo:hi], slot_at[lo:hi], free_at[lo:hi],
                                          inverse[lo:hi], uslot[lo:hi], ufree[lo:hi],
                                          upos[lo:hi])


@njit(cache=True, nogil=True)
def place_part(t, order, keys, ko, addr, ip, steps, inverse, slots, uslot, ufree, journal, n_j,
               inserted, ev_keys, ev_slots, ev_scores, out):
    """A part of table t's place: the occurrences ``order`` its :func:`probe_part` listed."""
    lo, hi = ko[t], ko[t + 1]
    ikeys, iscores, dig, pins = _index(addr, ip, t)
    lnb.place(False, order, keys[lo:hi], _I64, ikeys, iscores, dig, pins, ip[t, I_BUCKETS],
              ip[t, I_SPLIT], ip[t, I_BMASK], ip[t, I_POLICY], steps[t], np.empty(0, np.bool_),
              inverse[lo:hi], slots[lo:hi], uslot[lo:hi], ufree[lo:hi], journal, n_j,
              inserted[lo:hi], ev_keys[lo:hi], ev_slots[lo:hi], ev_scores[lo:hi], out)


@njit(cache=True, nogil=True)
def undo_parts(t, addr, ip, journals, out):
    """Undoes table t's split lookup: each part's journal (``journals`` (P, ·, 5), lengths
    ``out[:, 4]``; the parts touched disjoint buckets)."""
    ikeys, iscores, dig, pins = _index(addr, ip, t)
    for p in range(journals.shape[0]):
        lnb.undo(journals[p], out[p, 4], ikeys, iscores, dig, pins)


@njit(cache=True, nogil=True)
def finish(t_lo, t_hi, keys, ko, bo, batch, addr, ip, fp, steps, slots, inverse, uslot, upos,
           inserted, ev_keys, ev_slots, ev_scores, fresh_pos, ev_out, unique_slots, unique_pos,
           lengths, weights, out, pool, res):
    """Completes the lookups of tables ``[t_lo, t_hi)`` whose ``pool[t]`` is not negative (as
    ``NumbaBackend.lookup`` and ``SingleIndexResolver.resolve`` do after ``place``): counts,
    events (``fresh_pos``, ``ev_out`` (3, N) at the table's ids), entries (``unique_slots``,
    ``unique_pos`` at its ids; ``res[t, R_ENTRIES]``), pins freed, new rows initialised and
    written at ``steps[t]``; then, where ``pool[t]`` is 1, pools its bags into its columns of
    ``out`` (B, C), with the per-id ``weights`` (N,) float32 or empty (none)."""
    for t in range(t_lo, t_hi):
        if pool[t] < 0:
            continue
        n_ins = _settle(t, ko, addr, ip, slots, inverse, uslot, upos, inserted, ev_keys,
                        ev_slots, ev_scores, fresh_pos, ev_out, unique_slots, unique_pos, res)
        _init_new(t, 0, n_ins, keys, ko, addr, ip, fp, steps, slots, fresh_pos)
        if pool[t] == 1:
            _pool(t, 0, bo[t + 1] - bo[t], ko, bo, batch, addr, ip, inverse, unique_slots,
                  lengths, weights, out, res)


@njit(cache=True, nogil=True)
def settle(t, ko, addr, ip, slots, inverse, uslot, upos, inserted, ev_keys, ev_slots, ev_scores,
           fresh_pos, ev_out, unique_slots, unique_pos, res):
    """:func:`finish`'s first stage for table t (counts, events, entries, pins): the one that
    stays on one thread. Returns the count of new rows."""
    return _settle(t, ko, addr, ip, slots, inverse, uslot, upos, inserted, ev_keys, ev_slots,
                   ev_scores, fresh_pos, ev_out, unique_slots, unique_pos, res)


@njit(cache=True, nogil=True)
def init_part(t, a, b, keys, ko, addr, ip, fp, steps, slots, fresh_pos):
    """Table t's new rows ``[a, b)`` (of its ``fresh_pos``) initialised and marked written."""
    _init_new(t, a, b, keys, ko, addr, ip, fp, steps, slots, fresh_pos)


@njit(cache=True, nogil=True)
def pool_part(t, bag_lo, bag_hi, ko, bo, batch, addr, ip, inverse, unique_slots, lengths,
              weights, out, res):
    """Table t's bags ``[bag_lo, bag_hi)`` (of its own) pooled into ``out``."""
    _pool(t, bag_lo, bag_hi, ko, bo, batch, addr, ip, inverse, unique_slots, lengths, weights,
          out, res)


@njit(cache=True, inline="always")
def _settle(t, ko, addr, ip, slots, inverse, uslot, upos, inserted, ev_keys, ev_slots, ev_scores,
            fresh_pos, ev_out, unique_slots, unique_pos, res):
    lo, hi = ko[t], ko[t + 1]
    lnb.count(_view(addr, t, A_COUNTS, _I64, (4,)), res[t:t + 1, R_INSERTED:R_INSERTED + 5])
    n_ins, _ = lnb.events(inserted[lo:hi], ev_keys[lo:hi], ev_slots[lo:hi], ev_scores[lo:hi],
                          fresh_pos[lo:hi], ev_out[:, lo:hi])
    res[t, R_ENTRIES] = lnb.number(slots[lo:hi], inverse[lo:hi], uslot[lo:hi], upos[lo:hi],
                                   res[t, R_DISTINCT], _index(addr, ip, t)[3],
                                   unique_slots[lo:hi], unique_pos[lo:hi])
    return n_ins


@njit(cache=True, inline="always")
def _init_new(t, a, b, keys, ko, addr, ip, fp, steps, slots, fresh_pos):
    if b <= a:
        return
    lo = ko[t]
    at = fresh_pos[lo + a:lo + b] + lo
    new = slots[at]
    dim, split = ip[t, I_DIM], ip[t, I_HBM_ROWS]
    hbm, ddr = _rows(addr, ip, t)
    q = _view(addr, t, A_QUANTILES, _F32, (ip[t, I_QUANTILES],))
    init = (dim, fp[t, F_STATE], ip[t, I_INIT], fp[t, F_A], fp[t, F_B], q, ip[t, I_MIX])
    if ddr.shape[0] == 0:
        rnb.init_rows(hbm, new, keys[at], *init)
    else:  # each tier's rows in order, as RowStore.init
        in_hbm, in_ddr = _tiers(new, split)
        h, d = in_hbm >= 0, in_ddr >= 0
        rnb.init_rows(hbm, in_hbm[h], keys[at][h], *init)
        rnb.init_rows(ddr, in_ddr[d], keys[at][d], *init)
    inb.put_where(_written(addr, ip, t), new, steps[t])


@njit(cache=True, inline="always")
def _pool(t, bag_lo, bag_hi, ko, bo, batch, addr, ip, inverse, unique_slots, lengths, weights,
          out, res):
    lo, hi = ko[t], ko[t + 1]
    rids = unique_slots[lo:lo + res[t, R_ENTRIES]]
    dim, split = ip[t, I_DIM], ip[t, I_HBM_ROWS]
    hbm, ddr = _rows(addr, ip, t)
    src = rids if ddr.shape[0] == 0 else _sources(rids, split)
    pnb.pool(hbm, ddr, src, inverse[lo:hi], lengths[bo[t]:bo[t + 1]],
             weights[lo:hi] if weights.shape[0] else weights, batch, dim, ip[t, I_MEAN] != 0,
             out, ip[t, I_COL], bag_lo, bag_hi)


@njit(cache=True, nogil=True)
def gradients(t_lo, t_hi, ko, bo, go, batch, gout, ip, inverse, lengths, weights, grads, todo,
              bad, check):
    """Pooling backward of tables ``[t_lo, t_hi)`` with ``todo[t]``: sums ``gout`` (B, C) per
    entry, scaled by ``weights`` as :func:`finish` pooled, into the table's (U, dim) gradient
    at ``grads[go[t]:go[t+1]]``, as ``pool_backward``; with ``check``, ``bad[t]`` where an
    element is not finite (else the caller checks, split over threads)."""
    none = np.empty(0, np.float32)
    for t in range(t_lo, t_hi):
        if not todo[t]:
            continue
        lo, hi = ko[t], ko[t + 1]
        dim = ip[t, I_DIM]
        g = grads[go[t]:go[t + 1]].reshape((go[t + 1] - go[t]) // dim, dim)
        rows = np.empty((0, dim), np.float32)  # (pooling backward reads rows only for wgrad)
        pnb.pool_backward(gout, ip[t, I_COL], rows, rows, inverse[:0], inverse[lo:hi],
                          lengths[bo[t]:bo[t + 1]], weights[lo:hi] if weights.shape[0] else none,
                          batch, dim, ip[t, I_MEAN] != 0, g, none)
        if check:
            bad[t] = not rnb.all_finite(grads[go[t]:go[t + 1]])


@njit(cache=True, nogil=True)
def update(t_lo, t_hi, ko, go, addr, ip, fa, steps, unique_slots, grads, todo):
    """The fused optimizer of tables ``[t_lo, t_hi)`` with ``todo[t]`` (``ip[t, I_OPT]``,
    hyper-parameters ``fa[t]``) on their entries' rows with the gradients :func:`gradients`
    summed; the rows updated are marked written at ``steps[t]`` (and their STEP scores)."""
    for t in range(t_lo, t_hi):
        if todo[t]:
            _update_table(t, 0, (go[t + 1] - go[t]) // ip[t, I_DIM], ko, go, addr, ip, fa, steps,
                          unique_slots, grads)


@njit(cache=True, nogil=True)
def update_part(t, a, b, ko, go, addr, ip, fa, steps, unique_slots, grads):
    """:func:`update` of table t's entries ``[a, b)`` (they hold distinct rows)."""
    _update_table(t, a, b, ko, go, addr, ip, fa, steps, unique_slots, grads)


@njit(cache=True, inline="always")
def _update_table(t, a, b, ko, go, addr, ip, fa, steps, unique_slots, grads):
    dim = ip[t, I_DIM]
    g = grads[go[t]:go[t + 1]].reshape((go[t + 1] - go[t]) // dim, dim)[a:b]
    us = unique_slots[ko[t] + a:ko[t] + b]
    hbm, ddr = _rows(addr, ip, t)
    if ddr.shape[0] == 0:
        _update(ip[t, I_OPT], hbm, us, g, fa[t])
    else:  # each tier its own rows, as RowOptimizer.apply over RowStore.parts
        in_hbm, in_ddr = _tiers(us, ip[t, I_HBM_ROWS])
        _update(ip[t, I_OPT], hbm, in_hbm, g, fa[t])
        _update(ip[t, I_OPT], ddr, in_ddr, g, fa[t])
    inb.put_where(_written(addr, ip, t), us, steps[t])
    if ip[t, I_POLICY] == P_STEP:
        inb.put_where(_index(addr, ip, t)[1], us, steps[t])


@njit(cache=True, inline="always")
def _update(kind, rows, slots, g, a):
    """The fused optimizer ``kind`` (``OPT_*``) on ``rows[slots]`` (-1: none) with
    hyper-parameters ``a``."""
    if kind == OPT_SGD:
        rnb.sgd(rows, slots, g, a[0], a[1])
    elif kind == OPT_ADAGRAD:
        rnb.adagrad(rows, slots, g, a[0], a[1], a[2])
    elif kind == OPT_ROWWISE:
        rnb.rowwise_adagrad(rows, slots, g, a[0], a[1], a[2])
    else:
        rnb.adam(rows, slots, g, a[0], a[1], a[2], a[3], a[4])
