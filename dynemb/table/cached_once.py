"""A CACHING table's lookups on the CUDA path, with one read from the device.

``CachedResolver.resolve`` (``dynemb.table.caching``) resolves a call's misses in the backing
store between the cache's find and its insert, and reads the device at each step. On the
triton backend, without admission, :func:`resolve_once` runs the call in an order that reads
once:

1. **The cache, on the device** (``kernels.triton_lookup.lookup`` on the cache index): find
   the keys (touching and pinning them), insert the misses (evicting cached rows by score) and
   number the entries by key. Its one read brings back the counts and, in (N + 1)-long
   buffers, the misses (position, key, cache slot or -1, whether it made the slot) and the
   cached rows the insert evicted (slot, backing slot, score, write step, dirty flag).
2. **The backing store, on the host** (its index lives in host memory, numba kernels): the
   evicted cached rows go back to it (dirty rows copied back by a GPU kernel, in place in the
   page-locked ddr rows; their scores and write steps; their pins freed), the misses are found
   there and the new keys inserted (evicting table rows by score; rows initialised in place).
3. **Back to the device, without a read**: the misses' backing rows are copied into the cache
   slots they took, with their backing slots, write steps and scores, and the entries get
   their row ids. Only arrays the host computed travel, host to device.

Every backend takes these steps (numba and torch read freely on the host: ``_cache_staged``),
so the CPU path is the CUDA path's reference. The staged order (kept for admission, which must
judge a miss before it may take a cache slot) gives the same result except on two rare paths:
a key that gets no backing row (its backing bucket is full of rows the call uses or cached
rows, or it is the reserved key), or whose backing row a lookup in flight holds, takes a cache
slot and gives it back (the epoch then moves: a later call may fetch into the freed slot);
and a backing bucket full of cached rows: the rows this call evicted from the cache become
evictable when the backing store retries, so it may evict other rows than the staged order.
Those paths read the device again; a call without them, the common case, reads once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from dynemb.batch import CHANGED_BATCH, EMPTY_KEY
from dynemb.config import ScorePolicy
from dynemb.errors import InputError
from dynemb.kernels.index_numba import PIN_CACHED, PIN_FREE
from dynemb.kernels.index_torch import compact, dedup
from dynemb.table.pinned import upload
from dynemb.table.state import Saved
from dynemb.table.stats import Lookup

if TYPE_CHECKING:
    from dynemb.table.caching import CachedResolver


class Entries(NamedTuple):
    """A call's occurrences (N,) in the cache: each one's cache slot (-1: none) and, on the
    triton backend, the entries, one per distinct key (``inverse`` (N,), ``unique_slots`` and
    ``unique_pos`` (U,)); None on the host backends, which number entries at the end."""

    slots: torch.Tensor
    inverse: torch.Tensor | None = None
    unique_slots: torch.Tensor | None = None
    unique_pos: torch.Tensor | None = None


def resolve_once(r: CachedResolver, keys: torch.Tensor, *, touch: bool, insert: bool,
                 custom: torch.Tensor, keep_evicted: bool, saved: Saved | None) -> Lookup:
    """``CachedResolver.resolve`` (same arguments and result) in the cache-first order; ``keys``
    (N > 0,) on the table's device, ``touch == insert`` (a training or an eval lookup), no
    admission."""
    prev = torch.empty_like(keys) if saved is not None and touch else None
    phase = _cache_once if r.index.backend.reads_wait else _cache_staged
    entries, misses, evicted = phase(r, keys, custom, touch, insert, prev)
    pos, mkeys, mslot, mcustom, made = misses
    st = r.state
    if touch:
        st.counters["hbm_hits"] += keys.numel() - pos.numel()
        st.counters["hbm_misses"] += pos.numel()
        r.unflushed = True
    call = _Call(r, keys, entries, prev, saved, pos, mkeys, made, mcustom)
    if evicted is not None:
        call.evicted = _evicted(r, *evicted)
    return call.finish(touch, insert, keep_evicted, mslot)


def _cache_once(r: CachedResolver, keys, custom, touch, insert, prev):
    """The cache's part on the triton backend, with the call's one read: (entries, the misses
    ``(positions, keys, cache slots, custom scores, whether each made its slot)`` and the
    evicted cached rows ``(slots, backing slots, scores, write steps, dirty)`` or None, both
    in host memory)."""
    cx, n, dev = r.index, keys.numel(), r.device
    given = custom.numel() > 0

    def carry(slots, hit, ins):
        cols = [torch.arange(n, device=dev), keys, slots, *([custom] if given else [])]
        if ins is None:
            bufs, m = compact(~hit, *cols)
            return bufs, [m]
        new, made, evicted, ev_scores = ins
        bufs, m = compact(~hit, *cols, made.to(torch.int64))
        s = new.clamp(min=0)
        more, e = compact(evicted, new, r.home[s], ev_scores, cx.written[s],
                          r.dirty[s].to(torch.int64))
        return bufs + more, [m, e]

    res = cx.backend.lookup(cx, keys, custom, r.policy, r.state.step, touch=touch,
                            insert=insert, atomic=False, admit=None, hbm_rows=cx.num_slots,
                            prev=prev, release_pins=False, carry=carry)
    host, counts = res.carried
    m = counts[0]
    pos, mkeys, mslot = host[:3, :m]
    made = host[3 + given, :m].bool() if insert else torch.zeros(m, dtype=torch.bool)
    misses = (pos, mkeys, mslot, host[3, :m] if given else mkeys[:0], made)
    evicted = tuple(host[-5:, :counts[1]]) if insert and counts[1] else None
    entries = Entries(res.slots, res.inverse, res.unique_slots, res.unique_pos)
    return entries, misses, evicted


def _cache_staged(r: CachedResolver, keys, custom, touch, insert, prev):
    """:func:`_cache_once` on the numba and torch backends (the cache's find, then its insert
    of the misses; reads are free on the host)."""
    cx, st = r.index, r.state
    be, given = cx.backend, custom.numel() > 0
    ok = keys != EMPTY_KEY  # (the reserved key, in a batch changed after its check, is a miss
    if bool(ok.all()):      # that never takes a slot, as in the triton lookup)
        slots = be.find(cx, keys, custom, r.policy, st.step, touch, True, prev)
    else:
        sub = None if prev is None else torch.empty_like(keys[ok])
        slots = torch.full_like(keys, -1)
        slots[ok] = be.find(cx, keys[ok], custom[ok] if given else custom, r.policy, st.step,
                            touch, True, sub)
        if prev is not None:
            prev[ok] = sub
    pos = torch.nonzero(slots < 0).flatten()
    mkeys, mcustom = keys[pos], custom[pos] if given else custom
    made, evicted = torch.zeros(pos.numel(), dtype=torch.bool, device=keys.device), None
    new_keys = torch.nonzero(mkeys != EMPTY_KEY).flatten()
    if insert and new_keys.numel():
        new, made_new, (_, es, esc) = be.insert(
            cx, mkeys[new_keys], mcustom[new_keys] if given else mcustom, r.policy, st.step)
        slots[pos[new_keys]] = new
        made[new_keys] = made_new
        if es.numel():
            evicted = (es, r.home[es], esc, cx.written[es], r.dirty[es])
    host = r.backing.keys.device  # (a torch backend's CUDA cache: its results to the host)
    return (Entries(slots),
            tuple(t.to(host) for t in (pos, mkeys, slots[pos], mcustom, made)),
            None if evicted is None else tuple(t.to(host) for t in evicted))


def _own_entries(pos: torch.Tensor, keys: torch.Tensor, rowless: torch.Tensor) -> torch.Tensor:
    """The positions among ``pos`` (M,) ascending, of keys ``keys`` (M,), where ``rowless``,
    that are not their key's first occurrence (host arrays): entries are numbered by key, but
    every occurrence without a row is its own entry (as in the other modes)."""
    rp, rk = pos[rowless], keys[rowless]
    if rp.numel() < 2:
        return rp[:0]
    distinct, group = torch.unique(rk, return_inverse=True)
    first = torch.full((distinct.numel(),), rp.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, group, torch.arange(rp.numel()), "amin")
    return rp[first[group] != torch.arange(rp.numel())]


def _evicted(r: CachedResolver, slots, home, scores, written, dirty) -> torch.Tensor:
    """Cached rows the cache's insert evicted (host arrays) go back to the backing store: dirty
    rows copied back (a device kernel) with their write steps, every score. Returns their
    backing slots, still pinned as cached: the staged order evicts them from the cache after
    the backing store's insert, so that insert must not evict them (``_Call.unpin``)."""
    bx, st = r.backing, r.state
    st.epoch += 1
    st.counters["cache_evictions"] += slots.numel()
    d = dirty.bool()
    n_dirty = int(d.sum())
    if n_dirty:
        r.store.store_back(slots[d], home[d])
        bx.written[home[d]] = written[d]
        st.counters["write_backs"] += n_dirty
    bx.scores[home] = scores
    on_dev = upload(slots, r.device)
    r.home[on_dev] = -1
    r.dirty[on_dev] = False
    return home


class _Call:
    """The host's part of one call: ``pos``, ``mkeys``, ``made``, ``mcustom`` (M,) are the
    misses' positions, keys, whether each made its cache slot, and custom scores (host)."""

    def __init__(self, r: CachedResolver, keys, entries: Entries, prev, saved, pos, mkeys, made,
                 mcustom):
        self.r, self.keys, self.entries, self.prev, self.saved = r, keys, entries, prev, saved
        self.pos, self.mkeys, self.made, self.mcustom = pos, mkeys, made, mcustom
        self.evicted: torch.Tensor | None = None  # backing slots of evicted cached rows

    def unpin(self) -> bool:
        """Frees the backing pins of the cached rows the call evicted; whether there were
        any."""
        home, self.evicted = self.evicted, None
        if home is None:
            return False
        self.r.backing.pins[home] = PIN_FREE
        return True

    def finish(self, touch: bool, insert: bool, keep_evicted: bool, mslot) -> Lookup:
        r, res, dev = self.r, self.entries, self.r.device
        bx, st, life = r.backing, r.state, r.life
        mkeys, pos = self.mkeys, self.pos
        inserted = torch.zeros(self.keys.numel(), dtype=torch.bool, device=dev) \
            if insert else None
        evicted, failed = life.evicted_none(), 0
        final = mslot.clone()  # each miss's row id
        gave_back = False
        if mkeys.numel():
            bs = torch.full_like(mkeys, -1)
            ok = mkeys != EMPTY_KEY  # (the reserved key, in a batch changed after its check,
            bs[ok] = bx.backend.find(bx, mkeys[ok], mkeys[:0], st.policy, st.step, False,
                                     True)  # is never looked up: it finds no row)
            existed = bs >= 0
            if touch:
                k = int(existed.sum())
                st.counters["ddr_hits"] += k
                st.counters["ddr_misses"] += mkeys.numel() - k
            base = torch.where(existed, bx.scores[bs.clamp(min=0)], 0)  # before this call
            if insert:
                evicted, failed = self._insert(bs, existed, inserted, keep_evicted)
            self.unpin()
            keep = self.made & (bs >= 0) & ~bx.is_held(bs.clamp(min=0))
            if bool(keep.any()):
                self._fetch(mslot[keep], bs[keep], existed[keep], base[keep])
            back = self.made & ~keep
            if bool(back.any()):  # cache slots given back (a key without a backing row here)
                r.index.backend.erase(r.index, upload(mkeys[back], dev))
                final = torch.where(torch.isin(mslot, mslot[back]), -1, final)
                gave_back = True
            served = (final < 0) & (bs >= 0)  # read and updated in the backing store
            final = torch.where(served, bs + r.row_offset, final)
            bx.backend.unpin(bx, bs)
            bx.pins[bs[keep]] = PIN_CACHED
            by = served & existed
            if touch and bool(by.any()):  # they touch their backing scores
                bx.backend.find(bx, mkeys[by], self.mcustom[by] if self.mcustom.numel()
                                else self.mcustom, st.policy, st.step, True, False)
        self.unpin()
        r.index.backend.unpin(r.index, res.slots)  # (the call's pins; holds stay)
        inverse, unique, upos, away, rowless = self._entries(final) if res.inverse is None \
            else self._entries_by_key(final, mslot)
        if failed:
            r.on_full(failed)
        lk = Lookup(unique_keys=self.keys[upos], unique_slots=unique, inverse=inverse,
                    inserted=inserted, evicted=evicted, epoch=st.epoch, away=away,
                    rowless=rowless)
        if gave_back:
            # A slot given back is free: a later call may fetch into it, without evicting
            # anything, a key this lookup (or one in flight) serves from the backing store.
            # Those lookups must then find the cached copy: the epoch moves past them all.
            st.epoch += 1
        return lk

    def _entries(self, final):
        """(inverse, unique row ids, first occurrences, entries away from hbm, entries without
        a row) on a host backend: by cache slot, or by row id where the backing store serves
        some (``dedup``); each occurrence without a row its own entry."""
        rid = self.entries.slots.clone()
        rid[upload(self.pos, rid.device)] = upload(final, rid.device)
        if bool((final >= self.r.row_offset).any()):
            inverse, unique, upos = dedup(rid)
        else:
            cx = self.r.index
            inverse, unique, upos = cx.backend.finish(cx, rid)
        away = int(((unique < 0) | (unique >= self.r.row_offset)).sum())
        return inverse, unique, upos, away, int((unique < 0).sum())

    def _entries_by_key(self, final, mslot):
        """:meth:`_entries` on the triton backend without a read: its lookup numbered the
        entries by key; the host's arrays give the misses their row ids, and each further
        occurrence of a key without a row its own entry."""
        res, dev, mkeys, pos = self.entries, self.r.device, self.mkeys, self.pos
        inverse, unique, upos = res.inverse, res.unique_slots, res.unique_pos
        change = final != mslot
        if bool(change.any()):
            unique.index_put_((inverse[upload(pos[change], dev)],), upload(final[change], dev))
        split = _own_entries(pos, mkeys, final < 0)
        if split.numel():
            at = upload(split, dev)
            inverse[at] = unique.numel() + torch.arange(at.numel(), device=dev)
            unique = torch.cat([unique, torch.full_like(at, -1)])
            upos = torch.cat([upos, at])
        far = (final < 0) | (final >= self.r.row_offset)
        return (inverse, unique, upos, int(torch.unique(mkeys[far]).numel()) + split.numel(),
                int(torch.unique(mkeys[final < 0]).numel()) + split.numel())

    def _insert(self, bs, existed, inserted, keep_evicted):
        """The misses new to the table get backing rows (in place in ``bs``), initialised;
        returns (the table's evictions, occurrences that got no row)."""
        r, mkeys, dev = self.r, self.mkeys, self.r.device
        atomic = self.saved is not None
        reserved = mkeys == EMPTY_KEY
        if atomic and bool(reserved.any()):
            self._undo(bs)
            r.state.restore(self.saved)
            raise InputError(f"table {r.config.name!r}: lookup: found the reserved empty key "
                             f"{EMPTY_KEY} among the ids ({CHANGED_BATCH}); nothing changed.")
        absent = torch.nonzero(~existed & ~reserved).flatten()
        evicted = r.life.evicted_none()
        if absent.numel():
            given = self.mcustom.numel() > 0
            slots, fresh, ev = r._backing_insert(
                mkeys[absent], self.mcustom[absent] if given else self.mcustom, atomic,
                then=self.unpin)
            n_failed = int((slots < 0).sum())
            if n_failed and atomic:
                self._undo(bs)
                r.refuse(n_failed, self.saved)
            evicted = r.life.take_evicted(*ev, with_rows=keep_evicted, offset=r.row_offset)
            r.life.init_rows(r.backing, slots[fresh], upload(mkeys[absent][fresh], dev),
                             r.row_offset)
            bs[absent] = slots
            inserted[upload(self.pos[absent][fresh], dev)] = True
        return evicted, int((bs < 0).sum())

    def _fetch(self, dst, src, existed, base) -> None:
        """The backing rows ``src`` (backing slots) into the cache slots ``dst`` their keys
        took, with their backing slots, write steps and scores (host arrays)."""
        r, dev = self.r, self.r.device
        cx, policy = r.index, r.state.score
        r.store.fetch(src, dst)
        d = upload(dst, dev)
        r.home[d] = upload(src, dev)
        r.dirty[d] = False
        cx.written[d] = upload(r.backing.written[src], dev)
        # the backing score as this lookup touches it (the insert scored the key as new;
        # keys new to the table keep that)
        ex = upload(dst[existed], dev)
        if policy == ScorePolicy.LFU:
            cx.scores[ex] += upload(base[existed], dev)
        elif policy == ScorePolicy.STEP or (policy == ScorePolicy.CUSTOM
                                            and not self.mcustom.numel()):
            cx.scores[ex] = upload(base[existed], dev)

    def _undo(self, bs) -> None:
        """An atomic call that fails: the cache keys it made leave again, its touches and pins
        are undone (cached rows it evicted stay moved to the backing store, contents kept)."""
        r, res, dev = self.r, self.entries, self.r.device
        cx = r.index
        self.unpin()
        r.backing.backend.unpin(r.backing, bs)
        if self.prev is not None:
            hit = torch.ones(self.keys.numel(), dtype=torch.bool, device=dev)
            hit[upload(self.pos, dev)] = False
            cx.backend.restore_scores(cx, torch.where(hit, res.slots, -1), self.prev)
        if bool(self.made.any()):
            cx.backend.erase(cx, upload(self.mkeys[self.made], dev))
        cx.backend.unpin(cx, res.slots)
        saved = self.saved[1]  # the evictions happened: they stay counted
        for name in ("cache_evictions", "write_backs"):
            saved[name] = self.r.state.counters[name]
