"""One tensor-level interface over the two kernel implementations.

``NUMBA`` runs the compiled CPU kernels on zero-copy numpy views of CPU tensors; ``TORCH`` runs
the vectorised torch twins (any device); ``triton`` runs Triton kernels (CUDA, or CPU tensors in
Triton's interpreter). Tables pick one by device (``backend_for``); tests run each against the
same models.

Index operations: ``find(ix, keys, custom, policy, step, touch, pin, prev=None)`` (``prev``: an
(N,) int64 journal of the scores it touched), ``restore_scores(ix, slots, prev)`` (undoes those
touches), ``insert(ix, keys, custom, policy, step, atomic=False)`` (``atomic``: every key is
placed or nothing changes), ``finish``, ``unpin`` (both free the pins of a lookup's slots;
the pins of slots held by lookups in flight, their hold counts, are put back afterwards, which
costs nothing when the index holds none: ``HashIndex.held_pins``), ``erase``, and ``lookup``,
one call's find, insert and numbering (:class:`Resolved`): the torch backend runs the steps
above one after another, the numba backend fuses them (``kernels.lookup_numba``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from dynemb.batch import all_finite
from dynemb.config import Initializer, InitKind
from dynemb.errors import ConfigError
from dynemb.kernels import index_numba as inb
from dynemb.kernels import index_torch as ito
from dynemb.kernels import lookup_numba as lnb
from dynemb.kernels import pooling_numba as pnb
from dynemb.kernels import pooling_torch as pto
from dynemb.kernels import rows_numba as rnb
from dynemb.kernels import rows_torch as rto
from dynemb.kernels.hashing import home_bucket, index_hash
from dynemb.kernels.threads import parts_for, ranges, resolve, run_parts

_NO_QUANTILES = torch.zeros(2, dtype=torch.float32)
_EMPTY = torch.empty(0, dtype=torch.int64)  # (no journal, no entries, nothing evicted)
_NO_ROWS = torch.empty(0, 1, dtype=torch.float32)  # (no ddr tier)
_NO_ORDER = np.empty(0, np.int64)  # (lookup_numba: every occurrence)
INIT_CODES = {
    InitKind.NORMAL: rnb.INIT_NORMAL,
    InitKind.TRUNCATED_NORMAL: rnb.INIT_TRUNCATED_NORMAL,
    InitKind.UNIFORM: rnb.INIT_UNIFORM,
    InitKind.CONSTANT: rnb.INIT_CONSTANT,
}


def init_params(init: Initializer, device: torch.device) -> tuple[int, float, float, torch.Tensor]:
    """(kind code, a, b, quantile table on ``device``) as the init kernels take them."""
    code = INIT_CODES[init.kind]
    if init.kind == InitKind.UNIFORM:
        return code, init.low, init.high, _NO_QUANTILES
    if init.kind == InitKind.CONSTANT:
        return code, init.value, 0.0, _NO_QUANTILES
    bound = init.bound if init.kind == InitKind.TRUNCATED_NORMAL else rnb.NORMAL_BOUND
    return code, init.mean, init.std, rto.quantile_table(bound, device)


def _np(t: torch.Tensor):
    return t.detach().numpy()


class Resolved(NamedTuple):
    """One call's keys (N,) resolved against an index (``lookup``).

    An atomic call where some key got no slot has changed nothing: only ``failed`` counts then.
    """

    inverse: torch.Tensor
    """(N,) int64: the entry of each occurrence."""
    unique_slots: torch.Tensor
    """(U,) int64: each entry's slot, -1 for none (every occurrence without a slot is an entry)."""
    unique_pos: torch.Tensor
    """(U,) int64: each entry's first occurrence."""
    slots: torch.Tensor
    """(N,) int64: each occurrence's slot or -1."""
    inserted: torch.Tensor | None
    """(N,) bool: the occurrences that created a row (None for a call that inserts nothing)."""
    fresh: torch.Tensor
    """(F,) int64: those occurrences, in the order they inserted."""
    evicted: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    """(keys, slots, scores) of the rows evicted, in order."""
    failed: int
    """Occurrences that got no slot (not counting those admission kept out)."""
    tiers: list[int]
    """Hits in hbm, hits in ddr, misses in hbm, misses in ddr: a key's occurrences hit when it
    had a row before the call; a miss is in the tier of the key's home bucket."""
    miss: torch.Tensor | None
    """(M,) int64: the occurrences without a row before the call, when admission judged them."""
    away: int | None = None
    """Entries without an hbm row (-1 or a ddr row), when the backend counted them (the triton
    lookup: the table then finds them without reading the device again)."""
    rowless: int | None = None
    """Entries without a row, counted with ``away``."""
    reserved: int = 0
    """Occurrences of the reserved empty key (a batch changed after it was checked; only the
    triton lookup, which does not check again, counts them): counted in ``failed``."""
    carried: tuple | None = None
    """What the triton lookup's caller asked to bring back with its one read (``carry``)."""
    rejected: int = 0
    """Occurrences admission kept out, when the lookup judged them itself (the triton lookup
    given ``admission``; ``miss`` is then None)."""


Admit = Callable[[torch.Tensor], torch.Tensor]
"""Admission: the positions (M,) of occurrences without a row -> the positions it lets in."""


def _tiers(ix, keys: torch.Tensor, slots: torch.Tensor, hbm_rows: int) -> list[int]:
    """``Resolved.tiers`` of a find's ``slots`` (vectorised)."""
    hit = slots >= 0
    in_hbm = slots < hbm_rows
    mk = keys[~hit]
    miss_hbm = home_bucket(mk, index_hash(mk), ix.num_buckets, ix.split) < ix.split
    return torch.stack([(hit & in_hbm).sum(), (hit & ~in_hbm).sum(), miss_hbm.sum(),
                        (~miss_hbm).sum()]).tolist()


def staged_lookup(be, ix, keys, custom, policy, step, *, touch: bool, insert: bool,
                  atomic: bool, admit: Admit | None, hbm_rows: int) -> Resolved:
    """``lookup`` as its steps: ``find`` (touching and pinning), admission, ``insert`` of the
    admitted misses, ``finish``. The reference for the numba backend's fused lookup."""
    prev = torch.empty_like(keys) if atomic and touch else None
    slots = be.find(ix, keys, custom, policy, step, touch, True, prev)
    tiers = _tiers(ix, keys, slots, hbm_rows)
    inserted, miss = None, None
    fresh = torch.empty(0, dtype=torch.int64, device=keys.device)
    ev = (fresh, fresh, fresh)
    failed = 0
    if insert:
        inserted = torch.zeros(keys.numel(), dtype=torch.bool, device=keys.device)
        miss = torch.nonzero(slots < 0).flatten()
        new = miss if admit is None else admit(miss)
        if new.numel():
            mcustom = custom[new] if custom.numel() else custom
            new_slots, fresh_mask, ev = be.insert(ix, keys[new], mcustom, policy, step, atomic)
            failed = int((new_slots < 0).sum())
            if failed and atomic:
                if prev is not None:
                    be.restore_scores(ix, slots, prev)
                be.unpin(ix, slots)
                return Resolved(fresh, fresh, fresh, slots, None, fresh, ev, failed, tiers, miss)
            slots[new] = new_slots
            inserted[new] = fresh_mask
            fresh = new[fresh_mask]
    inverse, unique_slots, unique_pos = be.finish(ix, slots)
    return Resolved(inverse, unique_slots, unique_pos, slots, inserted, fresh, ev, failed, tiers,
                    None if admit is None else miss)


def _put_back(ix, held: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Restores the hold counts (pins) of held slots that a ``finish``/``unpin`` freed."""
    if held is not None:
        ix.pins[held[0]] = held[1]


class NumbaBackend:
    """Compiled CPU kernels, a call's work split over ``threads`` threads (None: torch's count
    at the time of the call) with bit-identical results for any count (``kernels.threads``)."""

    name = "numba"
    reads_wait = False
    """Whether reading a result back to the host waits for a device: tables on such a backend
    keep counts on the device and check nothing a host-side check already covered."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads

    def _parts(self, work: int) -> int:
        return parts_for(resolve(self.threads), work)

    def _split(self, n: int, fn: Callable[[int, int], object]) -> None:
        """Runs ``fn(lo, hi)`` over contiguous ranges covering ``[0, n)``, one per part."""
        spans = ranges(n, self._parts(n))
        run_parts(lambda p: fn(*spans[p]), len(spans))

    def find(self, ix, keys, custom, policy, step, touch, pin, prev=None):
        slots = torch.empty_like(keys)
        inb.find_pass(_np(keys), _np(custom), _np(ix.keys), _np(ix.scores), _np(ix.digests),
                      _np(ix.pins), ix.num_buckets, ix.split, ix.width - 1, policy, step, touch, pin,
                      _np(slots), _np(_EMPTY if prev is None else prev))
        return slots

    def restore_scores(self, ix, slots, prev):
        inb.restore_scores(_np(slots), _np(prev), _np(ix.scores))

    def find_rows(self, ix, keys, hbm, ddr, row_split, dim, out, fill=None):
        """(slot of each key or -1, the positions of the -1s), each found key's row (slot s:
        row s of ``hbm`` below ``row_split``, else of ``ddr``) copied into ``out[i, :dim]`` in
        the same pass (``index_numba.find_rows``), the keys split over the threads; the rows
        of the -1s set to ``fill`` unless it is None."""
        n = keys.numel()
        slots, missing = torch.empty_like(keys), torch.empty_like(keys)
        k, sl, o, m = _np(keys), _np(slots), _np(out), _np(missing)
        args = (_np(ix.keys), _np(ix.digests), ix.num_buckets, ix.split, ix.width - 1,
                _np(hbm), _np(_NO_ROWS if ddr is None else ddr), row_split, dim)
        spans = ranges(n, self._parts(n))
        fills = (0.0 if fill is None else float(fill), fill is not None)
        counts = run_parts(lambda p: inb.find_rows(
            k[slice(*spans[p])], *args, sl[slice(*spans[p])], o[slice(*spans[p])],
            m[slice(*spans[p])], *fills), len(spans))
        if len(spans) == 1:
            return slots, missing[:counts[0]]
        return slots, torch.cat([missing[lo:lo + c] + lo for (lo, _), c in zip(spans, counts)])

    def put_where(self, dst, idx, value):
        d, i = _np(dst), _np(idx)
        self._split(i.shape[0], lambda lo, hi: inb.put_where(d, i[lo:hi], value))

    def all_finite(self, t):
        """``batch.all_finite``: for float32, one compiled pass of comparisons split over the
        threads by rows (a step's gradient, 29,000 rows of 64: torch's sum took 0.2-0.4 ms on
        one thread)."""
        if t.dtype != torch.float32:
            return all_finite(t)
        a = _np(t.contiguous()).reshape(-1)
        rows = t.shape[0] if t.dim() else 1  # (a part's worth of work is rows, not elements)
        spans = ranges(a.shape[0], self._parts(rows))
        return all(run_parts(lambda p: rnb.all_finite(a[slice(*spans[p])]), len(spans)))

    def insert(self, ix, keys, custom, policy, step, atomic=False):
        n = keys.numel()
        slots = torch.empty_like(keys)
        inserted = torch.zeros(n, dtype=torch.bool)
        ev_keys, ev_slots, ev_scores = (torch.empty_like(keys) for _ in range(3))
        n_ev = inb.insert_pass(
            _np(keys), _np(custom), _np(ix.keys), _np(ix.scores), _np(ix.digests),
            _np(ix.pins), ix.num_buckets, ix.split, ix.width - 1, policy, step, atomic,
            _np(slots), _np(inserted), _np(ev_keys), _np(ev_slots), _np(ev_scores),
            _np(ix.counts))
        return slots, inserted, (ev_keys[:n_ev], ev_slots[:n_ev], ev_scores[:n_ev])

    def lookup(self, ix, keys, custom, policy, step, *, touch, insert, atomic, admit, hbm_rows):
        """``staged_lookup``'s result, fused: each distinct key probed once, the index's buckets
        split over the threads (``kernels.lookup_numba``)."""
        n = keys.numel()
        parts = self._parts(n)
        m = lnb.set_size(n)
        sets = [np.empty((m, 2), np.int64) for _ in range(parts)]
        first, slots, slot_at, free_at = (np.empty(n, np.int64) for _ in range(4))
        journal = np.empty((parts, 3 * n if atomic else 0, 5), np.int64)
        tiers = np.zeros((parts, 4), np.int64)
        nk, cu = _np(keys), _np(custom)
        ixa = (_np(ix.keys), _np(ix.scores), _np(ix.digests), _np(ix.pins), ix.num_buckets,
               ix.split, ix.width - 1, policy, step)
        orders = [_NO_ORDER]
        if parts > 1:  # each part's occurrences: those whose home bucket is in its range
            owner = np.empty(n, np.int32)
            spans = ranges(n, parts)
            run_parts(lambda p: lnb.owners(nk[slice(*spans[p])], ix.num_buckets, ix.split, parts,
                                           owner[slice(*spans[p])]), parts)
            orders = [np.empty(n, np.int64) for _ in range(parts)]

        def probe(p):
            if parts > 1:
                orders[p] = orders[p][:lnb.part_order(owner, p, orders[p])]
            return lnb.probe(parts == 1, orders[p], nk, cu, *ixa, touch, hbm_rows, sets[p],
                             first, slots, slot_at, free_at, journal[p], tiers[p])

        n_j = run_parts(probe, parts)
        inverse, uslot, ufree, upos = (np.empty(n, np.int64) for _ in range(4))
        n_u = lnb.number_first(first, slot_at, free_at, inverse, uslot, ufree, upos)
        tier_counts = tiers.sum(0).tolist()
        t = torch.from_numpy
        inserted, miss, failed = None, None, 0
        fresh, ev = _EMPTY, (_EMPTY, _EMPTY, _EMPTY)
        if insert:
            ins = np.zeros(n, np.bool_)
            allowed = np.empty(0, np.bool_)
            if admit is not None:
                miss = torch.nonzero(t(slots) < 0).flatten()
                allowed = np.zeros(n, np.bool_)
                allowed[admit(miss).numpy()] = True
            ev_keys, ev_scores = np.empty(n, np.int64), np.empty(n, np.int64)
            ev_slots = np.full(n, -1, np.int64)
            out = np.zeros((parts, 5), np.int64)
            run_parts(lambda p: lnb.place(parts == 1, orders[p], nk, cu, *ixa, allowed, inverse,
                                          slots, uslot, ufree, journal[p], n_j[p], ins, ev_keys,
                                          ev_slots, ev_scores, out[p]), parts)
            failed = int(out[:, 2].sum())
            fresh_pos, ev_out = np.empty(n, np.int64), np.empty((3, n), np.int64)
            n_ins, n_ev = lnb.events(ins, ev_keys, ev_slots, ev_scores, fresh_pos, ev_out)
            ev = (t(ev_out[0, :n_ev]), t(ev_out[1, :n_ev]), t(ev_out[2, :n_ev]))
            if failed and atomic:
                for p in range(parts):
                    lnb.undo(journal[p], int(out[p, 4]), *ixa[:4])
                return Resolved(_EMPTY, _EMPTY, _EMPTY, t(slots), None, _EMPTY, ev,
                                failed, tier_counts, miss)
            lnb.count(_np(ix.counts), out)
            inserted, fresh = t(ins), t(fresh_pos[:n_ins])
        unique_slots, unique_pos = np.empty(n, np.int64), np.empty(n, np.int64)
        u = lnb.number(slots, inverse, uslot, upos, n_u, ixa[3], unique_slots, unique_pos)
        return Resolved(t(inverse), t(unique_slots[:u]), t(unique_pos[:u]), t(slots), inserted,
                        fresh, ev, failed, tier_counts, miss)

    def finish(self, ix, slots):
        inverse, unique_slots, unique_pos = (torch.empty_like(slots) for _ in range(3))
        held = ix.held_pins(slots) if ix.held else None
        u = inb.finish(_np(slots), _np(ix.pins), _np(inverse), _np(unique_slots), _np(unique_pos))
        _put_back(ix, held)
        return inverse, unique_slots[:u], unique_pos[:u]

    def unpin(self, ix, slots):
        held = ix.held_pins(slots) if ix.held else None
        inb.unpin(_np(slots), _np(ix.pins))
        _put_back(ix, held)

    def first_repeat(self, keys):
        """``index_torch.first_repeat``, by a hash set on the host."""
        i, j = lnb.first_repeat(_np(keys))
        return None if j < 0 else (int(i), int(j))

    def erase(self, ix, keys):
        slots = torch.empty_like(keys)
        inb.erase(_np(keys), _np(ix.keys), _np(ix.scores), _np(ix.digests), ix.num_buckets,
                  ix.split, ix.width - 1, _np(slots), _np(ix.counts))
        return slots

    def init_rows(self, dst, dst_rows, keys, dim, state_value, init, table_mix):
        kind, a, b, quantiles = init_params(init, dst.device)
        d, r, k, q = _np(dst), _np(dst_rows), _np(keys), _np(quantiles)
        self._split(r.shape[0], lambda lo, hi: rnb.init_rows(
            d, r[lo:hi], k[lo:hi], dim, state_value, kind, a, b, q, table_mix))

    def gather(self, rows, slots, dim, out):
        r, s, o = _np(rows), _np(slots), _np(out)
        self._split(s.shape[0], lambda lo, hi: rnb.gather(r, s[lo:hi], dim, o[lo:hi]))

    def scatter(self, rows, slots, values, start):
        r, s, v = _np(rows), _np(slots), _np(values.contiguous())
        self._split(s.shape[0], lambda lo, hi: rnb.scatter(r, s[lo:hi], v[lo:hi], start))

    def copy_rows(self, src, src_rows, dst, dst_rows):
        a, ai, b, bi = _np(src), _np(src_rows), _np(dst), _np(dst_rows)
        self._split(ai.shape[0], lambda lo, hi: rnb.copy_rows(a, ai[lo:hi], b, bi[lo:hi]))

    def pool(self, rows, extra, src, inverse, lengths, weights, batch, dim, mean, out):
        args = (_np(rows), _np(extra), _np(src), _np(inverse), _np(lengths), _np(weights),
                batch, dim, mean, _np(out), 0)
        # split by bags, into as many parts as the ids are worth
        bags = ranges(lengths.shape[0], self._parts(inverse.shape[0]))
        run_parts(lambda p: pnb.pool(*args, *bags[p]), len(bags))

    def pool_backward(self, gout, rows, extra, src, inverse, lengths, weights, batch, dim, mean,
                      grads, wgrad):
        pnb.pool_backward(_np(gout.contiguous()), 0, _np(rows), _np(extra), _np(src),
                          _np(inverse), _np(lengths), _np(weights), batch, dim, mean, _np(grads),
                          _np(wgrad))

    def optimizer(self, name):
        kernel = getattr(rnb, name)

        def run(rows, slots, grads, *args):
            r, s, g = _np(rows), _np(slots), _np(grads.contiguous())
            self._split(s.shape[0], lambda lo, hi: kernel(r, s[lo:hi], g[lo:hi], *args))

        return run


class TorchBackend:
    """Vectorised torch reference kernels (CPU or CUDA)."""

    name = "torch"
    reads_wait = False  # (the reference: it reads what it needs, on any device)

    def find(self, ix, keys, custom, policy, step, touch, pin, prev=None):
        return ito.find_pass(ix, keys, custom, policy, step, touch, pin, prev)

    def restore_scores(self, ix, slots, prev):
        ito.restore_scores(ix, slots, prev)

    def put_where(self, dst, idx, value):
        """``dst[idx] = value`` where ``idx >= 0`` (those distinct), without a host read."""
        ito.put_where(dst, idx, value)

    @staticmethod
    def all_finite(t):
        return all_finite(t)

    def insert(self, ix, keys, custom, policy, step, atomic=False):
        return ito.insert_pass(ix, keys, custom, policy, step, atomic)

    def lookup(self, ix, keys, custom, policy, step, *, touch, insert, atomic, admit, hbm_rows):
        return staged_lookup(self, ix, keys, custom, policy, step, touch=touch, insert=insert,
                             atomic=atomic, admit=admit, hbm_rows=hbm_rows)

    def finish(self, ix, slots):
        held = ix.held_pins(slots) if ix.held else None
        out = ito.finish(ix, slots)
        _put_back(ix, held)
        return out

    def unpin(self, ix, slots):
        held = ix.held_pins(slots) if ix.held else None
        ito.unpin(ix, slots)
        _put_back(ix, held)

    def erase(self, ix, keys):
        return ito.erase(ix, keys)

    def first_repeat(self, keys):
        return ito.first_repeat(keys)

    def init_rows(self, dst, dst_rows, keys, dim, state_value, init, table_mix):
        rto.init_rows(dst, dst_rows, keys, dim, state_value, *init_params(init, dst.device),
                      table_mix)

    def gather(self, rows, slots, dim, out):
        rto.gather(rows, slots, dim, out)

    def scatter(self, rows, slots, values, start):
        """``rows[slots[u], start:...] = values[u]`` for slots >= 0 (a host read on CUDA)."""
        rto.scatter(rows, slots, values, start)

    def copy_rows(self, src, src_rows, dst, dst_rows):
        rto.copy_rows(src, src_rows, dst, dst_rows)

    def pool(self, *args):
        pto.pool(*args)

    def pool_backward(self, *args):
        pto.pool_backward(*args)

    def optimizer(self, name):
        return getattr(rto, name)


class TritonBackend(TorchBackend):
    """Triton kernels for the index (probe with digests, insert one bucket per program), pooling
    and the optimizers (``kernels.triton_index``, ``kernels.triton_rows``); the steps between
    kernels (touching, numbering, row initialisation) are the torch backend's. The default on
    CUDA; on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``, how CI tests it)."""

    name = "triton"
    reads_wait = True  # CUDA (in the interpreter on CPU too: a model of that path)

    def __init__(self) -> None:
        from dynemb.kernels import (  # noqa: PLC0415 (imports triton)
            triton_index, triton_lookup, triton_rows,
        )

        self._ix, self._rows, self._lookup = triton_index, triton_rows, triton_lookup

    # Kernels index their arguments as contiguous arrays: every entry point makes them so (a
    # strided view of keys on the GPU, ``ids[:, 0]``, would otherwise be read wrongly).

    def find(self, ix, keys, custom, policy, step, touch, pin, prev=None):
        keys, custom = keys.contiguous(), custom.contiguous()
        return ito.find_pass(ix, keys, custom, policy, step, touch, pin, prev,
                             slots=self._ix.probe(ix, keys))

    def lookup(self, ix, keys, custom, policy, step, *, touch, insert, atomic, admit, hbm_rows,
               **once):
        """One read from the device per call (``kernels.triton_lookup``; ``once``: its
        keywords, such as ``admission`` to judge misses on the device, or those of a caller
        that finishes the call); with ``admit``, which judges misses on the host, the staged
        steps."""
        keys, custom = keys.contiguous(), custom.contiguous()
        if admit is not None:
            return super().lookup(ix, keys, custom, policy, step, touch=touch, insert=insert,
                                  atomic=atomic, admit=admit, hbm_rows=hbm_rows)
        return self._lookup.lookup(self, ix, keys, custom, policy, step, touch=touch,
                                   insert=insert, atomic=atomic, hbm_rows=hbm_rows, **once)

    def insert(self, ix, keys, custom, policy, step, atomic=False):
        slots, inserted, evicted, ev_keys, ev_scores, failed = self._ix.insert(
            ix, keys.contiguous(), custom.contiguous(), policy, step, atomic)
        if atomic and bool(failed.any()):  # nothing was written: nothing to count
            return slots, torch.zeros_like(inserted), (_EMPTY, _EMPTY, _EMPTY)
        self._ix.count_insert(ix, inserted, evicted, failed)
        return slots, inserted, (ev_keys[evicted], slots[evicted], ev_scores[evicted])

    def erase(self, ix, keys):
        return ito.erase(ix, keys, slots=self._ix.probe(ix, keys.contiguous()))

    def unpin(self, ix, slots):
        self._lookup.release(ix, slots.contiguous())  # (frees the call's pins only: no read)

    # Rows by global row id over both tiers of a store (``RowStore.in_place``).
    rows_in_place = True

    def tier_gather(self, hbm, ddr, ids, ncols, out):
        self._rows.gather_rows(hbm, ddr, ids.contiguous(), ncols, out)

    def tier_scatter(self, hbm, ddr, ids, values, start):
        self._rows.scatter_rows(hbm, ddr, ids.contiguous(), values, start)

    def tier_copy(self, hbm, ddr, src, dst):
        self._rows.copy_rows(hbm, ddr, src.contiguous(), dst.contiguous())

    def pool(self, *args):
        self._rows.pool(*args)

    def pool_backward(self, gout, *args):
        self._rows.pool_backward(gout.contiguous(), *args)

    def optimizer(self, name):
        return self._rows.optimizer(name)


NUMBA = NumbaBackend()
TORCH = TorchBackend()
BACKENDS = {"numba": NUMBA, "torch": TORCH}
NAMES = ("numba", "torch", "triton")  # triton's backend is made on first use (it imports triton)
_TRITON: list[TritonBackend] = []


def _triton(device: torch.device) -> TritonBackend:
    from dynemb.kernels import triton_index  # noqa: PLC0415 (imports triton)

    if not triton_index.available(device):
        if triton_index.triton is None:
            why = "triton is not installed"
        elif device.type == "cpu":
            why = ("on CPU tensors Triton kernels run only in its interpreter: set "
                   "TRITON_INTERPRET=1 before triton is first imported (a test mode; CPU tables "
                   "are faster with backend='numba')")
        else:
            why = f"Triton kernels run on CUDA or CPU tensors, found device {device}"
        raise ConfigError(f"backend 'triton' cannot run here: {why}.")
    if not _TRITON:
        _TRITON.append(TritonBackend())
    return _TRITON[0]


def backend_for(device: torch.device, name: str | None = None, threads: int | None = None):
    """The backend named ``name`` ("numba", "torch" or "triton"), or the default for ``device``
    (numba on CPU; triton on CUDA where it is installed, else torch); the numba backend splits
    its calls over ``threads`` threads (None: torch's count)."""
    if name is None:
        if device.type == "cpu":
            name = "numba"
        else:
            from dynemb.kernels import triton_index  # noqa: PLC0415 (imports triton)

            name = "triton" if triton_index.available(device) else "torch"
    if name not in NAMES:
        raise ConfigError(f"backend: expected one of {list(NAMES)}, found {name!r}.")
    if name == "numba" and device.type != "cpu":
        raise ConfigError(f"backend 'numba' runs on CPU tensors only, found device {device}; "
                          "use backend='triton' or 'torch' (the defaults for CUDA).")
    if name == "triton":
        return _triton(device)
    if name == "numba" and threads is not None:
        return NumbaBackend(threads)
    return BACKENDS[name]
