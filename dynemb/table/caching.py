"""The hbm cache of a CACHING table over its ddr backing store.

The backing store (``table.index`` + the ddr rows) holds every row of the table and evicts by the
table's score policy; the cache (its own index + the hbm rows) holds up to x·T of them. A
training lookup:

1. finds its keys in the cache (touching and pinning them);
2. finds the misses in the backing store, creating rows there for new keys (admission applies);
3. brings the misses into the cache, writing back its evicted dirty rows first;
4. serves from the backing store any key the cache could not take (a bucket full of rows this
   lookup uses or lookups in flight hold): its row id is then a ddr row, which the module path
   reads and updates there.

A cached key's backing slot is pinned (``PIN_CACHED``): the backing store never evicts a row
the cache holds, so the cache is always a subset of the backing store. Scores and write steps
travel with a row between the two; updates land in the cache (dirty) until written back.

Holds (``lookup(hold=True)``, see ``dynemb.table.holds``): a held cache slot's pin holds its
hold count (``PIN_LOCKED`` and below), so neither the cache's evictions nor
:meth:`Cache._release` take it; a backing row held by a lookup that was served from the backing store is not fetched
into the cache while held (later lookups are served from the backing store too), so the held
lookup's row id stays the row's only copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dynemb.config import ScorePolicy
from dynemb.errors import ConfigError
from dynemb.kernels.hashing import home_bucket, index_hash
from dynemb.kernels.index_numba import P_LRU, P_NO_EVICTION, PIN_CACHED, PIN_FREE
from dynemb.kernels.index_torch import dedup
from dynemb.table.index import HashIndex
from dynemb.table.stats import Lookup

if TYPE_CHECKING:
    from dynemb.table.storage import DdrFiles
    from dynemb.table.table import DynamicTable


class Cache:
    """The cache index, each cached row's backing slot (``home``) and dirty flag."""

    def __init__(self, table: DynamicTable, files: DdrFiles | None) -> None:
        lay = table.layout
        self.table = table
        self.files = files
        self.index = HashIndex(lay.cache_buckets, lay.cache_width, table.device, table.backend)
        self.home = torch.full((self.index.num_slots,), -1, dtype=torch.int64, device=table.device)
        self.dirty = torch.zeros(self.index.num_slots, dtype=torch.bool, device=table.device)
        # A cache must always be able to evict: NO_EVICTION tables cache by recency (LRU).
        self.policy = P_LRU if table._policy == P_NO_EVICTION else table._policy
        self.unflushed = False

    @property
    def backing(self) -> HashIndex:
        return self.table.index

    def nbytes(self) -> int:
        return (self.index.nbytes() + self.home.numel() * self.home.element_size()
                + self.dirty.numel() * self.dirty.element_size())

    # ------------------------------------------------------------------ lookups

    def resolve(self, keys: torch.Tensor, *, touch: bool, insert: bool, admit: bool,
                custom: torch.Tensor, keep_evicted: bool, saved: tuple | None) -> Lookup:
        """``DynamicTable._resolve`` for a CACHING table (``table.step`` already advanced).

        ``saved`` (an atomic call: ``on_full`` RAISE): the table's step and counters before the
        call; if a new key cannot get a backing row, every change is undone and the call raises.
        Until then the call has only touched (journaled) and pinned, and possibly moved cached
        rows of full buckets to the backing store (their contents unchanged)."""
        t, cx, bx = self.table, self.index, self.backing
        step, c = t.step, t._counters
        prev = torch.empty_like(keys) if saved is not None and touch else None
        cs = cx.backend.find(cx, keys, custom, self.policy, step, touch, True, prev)
        miss = torch.nonzero(cs < 0).flatten()
        if touch:
            c["hbm_hits"] += keys.numel() - miss.numel()
            c["hbm_misses"] += miss.numel()
            self.unflushed = True
        inserted = torch.zeros(keys.numel(), dtype=torch.bool, device=t.device) if insert else None
        evicted, failed, bs = t._evicted_none(), 0, None
        if miss.numel():
            bdev = bx.keys.device
            mkeys = keys[miss].to(bdev)
            mcustom = custom[miss].to(bdev) if custom.numel() else custom.to(bdev)
            bs = bx.backend.find(bx, mkeys, mcustom[:0], t._policy, step, False, True)
            existed = bs >= 0
            if touch:
                c["ddr_hits"] += int(existed.sum())
                c["ddr_misses"] += int((~existed).sum())
            base = torch.where(existed, bx.scores[bs.clamp(min=0)], 0)  # scores before this call
            if insert:
                absent = torch.nonzero(~existed).flatten()
                new = t._admitted(mkeys, absent, admit)
                if new.numel():
                    slots, fresh, ev = self._backing_insert(
                        mkeys[new], mcustom[new] if mcustom.numel() else mcustom, saved is not None)
                    failed = int((slots < 0).sum())
                    if failed and saved is not None:
                        bx.backend.unpin(bx, bs)
                        if prev is not None:
                            cx.backend.restore_scores(cx, cs, prev)
                        cx.backend.unpin(cx, cs)
                        t._refuse(failed, saved)
                    evicted = t._take_evicted(*ev, with_rows=keep_evicted)
                    t._init_rows(bx, slots[fresh], mkeys[new][fresh].to(t.device))
                    bs[new] = slots
                    inserted[miss[new.to(t.device)]] = fresh.to(t.device)
                t._record_admission(mkeys, absent, bs, admit)
                placed = self._fetch(mkeys, bs, existed, base, mcustom, lookup=True)
                cs[miss] = placed.to(t.device)
                if touch:  # occurrences served from the backing store touch its scores
                    by = (placed < 0) & existed
                    if bool(by.any()):
                        bx.backend.find(bx, mkeys[by], mcustom[by] if mcustom.numel() else mcustom,
                                        t._policy, step, True, False)
        return self._finish(keys, cs, miss, bs, inserted, evicted, failed)

    def _backing_insert(self, keys: torch.Tensor, custom: torch.Tensor, atomic: bool):
        """Inserts new keys into the backing store. Cached rows are pinned there, so a bucket
        whose rows are all cached refuses new keys: then the cached rows homed in the refusing
        buckets that this call does not use leave the cache (written back), and the refused
        keys are inserted again, evicting by score like any full bucket. ``atomic``: each
        attempt places every key or changes nothing (the second attempt retries them all)."""
        t, bx = self.table, self.backing
        slots, fresh, ev = bx.backend.insert(bx, keys, custom, t._policy, t.step, atomic)
        fail = torch.nonzero(slots < 0).flatten()
        if fail.numel() and t._policy != P_NO_EVICTION and self._release(keys[fail]):
            if atomic:
                return bx.backend.insert(bx, keys, custom, t._policy, t.step, True)
            again, fresh2, ev2 = bx.backend.insert(
                bx, keys[fail], custom[fail] if custom.numel() else custom, t._policy, t.step)
            slots[fail], fresh[fail] = again, fresh2
            ev = tuple(torch.cat([a, b]) for a, b in zip(ev, ev2))
        return slots, fresh, ev

    def _release(self, keys: torch.Tensor) -> bool:
        """Drops from the cache the rows, not pinned by the running lookup nor held by lookups
        in flight, whose backing slots are in the buckets of ``keys``; returns whether there
        were any."""
        cx, bx = self.index, self.backing
        buckets = home_bucket(keys, index_hash(keys), bx.num_buckets, bx.split)
        occ = cx.occupied(0, cx.num_slots)
        occ = occ[cx.pins[occ] == PIN_FREE]
        home_bucket_of = (self.home[occ] // bx.width).to(buckets.device)
        victims = occ[torch.isin(home_bucket_of, buckets).to(occ.device)]
        self._drop_slots(victims, write_back=True)
        return victims.numel() > 0

    def _finish(self, keys, cs, miss, bs, inserted, evicted, failed) -> Lookup:
        """Releases the pins of both indexes and numbers the entries by row id."""
        t, cx, bx = self.table, self.index, self.backing
        rid = cs
        if bs is not None:
            away = cs[miss] < 0
            fetched = bs[(~away).to(bs.device) & (bs >= 0)]
            bx.backend.finish(bx, bs)
            bx.pins[fetched] = PIN_CACHED
            if bool(away.any()):
                rid = cs.clone()
                served = bs.to(t.device)[away]
                rid[miss[away]] = torch.where(served >= 0, served + t.row_offset, -1)
        if rid is cs:
            inverse, unique_rids, unique_pos = cx.backend.finish(cx, cs)
        else:  # some entries live in the backing store: number them by global row id
            cx.backend.unpin(cx, cs)
            inverse, unique_rids, unique_pos = dedup(rid)
        if failed:
            t._on_full(failed)
        return Lookup(unique_keys=keys[unique_pos], unique_slots=unique_rids,
                            inverse=inverse, inserted=inserted, evicted=evicted, epoch=t._epoch)

    def _fetch(self, mkeys: torch.Tensor, bs: torch.Tensor, existed: torch.Tensor,
               base: torch.Tensor, mcustom: torch.Tensor, *, lookup: bool) -> torch.Tensor:
        """Brings the rows of occurrences ``mkeys`` found at backing slots ``bs`` (-1: none) into
        the cache; returns each occurrence's cache slot (-1: not cached). ``existed``/``base``:
        whether the key was in the backing store before this call, and its score there."""
        t, cx, bx = self.table, self.index, self.backing
        placed = torch.full_like(bs, -1)
        got = torch.nonzero(bs >= 0).flatten()
        if bx.held:  # rows held where they are (served from the backing store) stay there
            got = got[~bx.is_held(bs[got])]
        if got.numel() == 0:
            return placed
        gkeys = mkeys[got].to(t.device)
        gcustom = mcustom[got].to(t.device) if mcustom.numel() else t._no_scores
        cslots, cfresh, cev = cx.backend.insert(cx, gkeys, gcustom, self.policy, t.step)
        self._evict(*cev)
        first = torch.nonzero(cfresh).flatten()
        dst, src = cslots[first], bs[got][first.to(bs.device)]
        t.store.fetch(src, dst)
        self.home[dst] = src.to(t.device)
        self.dirty[dst] = False
        cx.written[dst] = bx.written[src].to(t.device)
        self._carry_scores(dst, existed[got][first.to(bs.device)].to(t.device),
                           base[got][first.to(bs.device)].to(t.device), lookup,
                           custom_given=gcustom.numel() > 0)
        placed[got] = cslots.to(bs.device)
        return placed

    def _carry_scores(self, dst, existed, base, lookup: bool, *, custom_given: bool) -> None:
        """The score of a row fetched into cache slots ``dst``: its backing score ``base`` as this
        lookup touches it (the kernel scored it as a new key; keys new to the table keep that)."""
        cx, policy = self.index, self.table.config.score
        if not lookup:  # prefetch: the row was not used, its score stays what it was
            cx.scores[dst] = base
            return
        ex = torch.nonzero(existed).flatten()
        if policy == ScorePolicy.LFU:
            cx.scores[dst[ex]] += base[ex]
        elif policy == ScorePolicy.STEP or (policy == ScorePolicy.CUSTOM and not custom_given):
            cx.scores[dst[ex]] = base[ex]

    def _evict(self, keys: torch.Tensor, slots: torch.Tensor, scores: torch.Tensor) -> None:
        """Writes back cache rows the cache index evicted (before their slots are reused)."""
        if slots.numel() == 0:
            return
        t, bx = self.table, self.backing
        t._epoch += 1
        t._counters["cache_evictions"] += slots.numel()
        self._write_back(slots)
        home = self.home[slots].to(bx.keys.device)
        bx.scores[home] = scores.to(bx.scores.device)
        bx.pins[home] = PIN_FREE
        self.home[slots] = -1

    def _write_back(self, slots: torch.Tensor) -> int:
        """Copies the dirty rows among cache ``slots`` to their backing rows, with their write
        steps; returns how many."""
        t, bx = self.table, self.backing
        d = slots[self.dirty[slots]]
        if d.numel():
            home = self.home[d].to(bx.keys.device)
            t.store.store_back(d, home)
            bx.written[home] = self.index.written[d].to(bx.written.device)
            self.dirty[d] = False
            t._counters["write_backs"] += d.numel()
        return d.numel()

    def mark_written(self, rids: torch.Tensor) -> None:
        """Rows ``rids`` (>= 0) were written at the table's step: cached ones become dirty."""
        t = self.table
        step, stamp = t.step, t.config.score == ScorePolicy.STEP
        self.unflushed = True
        cached = rids < t.layout.hbm_rows
        c = rids[cached]
        self.dirty[c] = True
        self.index.written[c] = step
        b = (rids[~cached] - t.row_offset).to(self.backing.keys.device)
        self.backing.written[b] = step
        if stamp:
            self.index.scores[c] = step
            self.backing.scores[b] = step

    def locate(self, keys: torch.Tensor) -> torch.Tensor:
        """Global row id of each key (cached or in the backing store) or -1, touching nothing."""
        rid = self.index.find(keys)
        miss = torch.nonzero(rid < 0).flatten()
        if miss.numel():
            bs = self.backing.find(keys[miss].to(self.backing.keys.device)).to(keys.device)
            rid[miss] = torch.where(bs >= 0, bs + self.table.row_offset, -1)
        return rid

    # ------------------------------------------------------------------ maintenance

    def prefetch(self, keys: torch.Tensor) -> int:
        """Fetches the rows of ``keys`` that the backing store holds into the cache."""
        t, cx, bx = self.table, self.index, self.backing
        cs = cx.backend.find(cx, keys, t._no_scores, self.policy, t.step, False, True)
        miss = torch.nonzero(cs < 0).flatten()
        fetched = 0
        if miss.numel():
            mkeys = keys[miss].to(bx.keys.device)
            bs = bx.backend.find(bx, mkeys, t._no_scores.to(mkeys.device), t._policy, t.step,
                                 False, True)
            existed = bs >= 0
            base = torch.where(existed, bx.scores[bs.clamp(min=0)], 0)
            placed = self._fetch(mkeys, bs, existed, base, t._no_scores[:0], lookup=False)
            cs[miss] = placed.to(t.device)
            ok = placed >= 0
            bx.backend.unpin(bx, bs)
            fetched_slots = torch.unique(bs[ok])
            bx.pins[fetched_slots] = PIN_CACHED
            fetched = fetched_slots.numel()
            self.unflushed = self.unflushed or fetched > 0
        cx.backend.unpin(cx, cs)
        t._counters["prefetched"] += fetched
        return fetched

    def drop(self, keys: torch.Tensor, *, write_back: bool = True) -> None:
        """Removes ``keys`` from the cache (writing dirty rows back unless ``write_back`` is
        False, e.g. before erasing them)."""
        slots = self.index.find(keys)
        self._drop_slots(slots[slots >= 0], write_back=write_back)

    def _drop_slots(self, slots: torch.Tensor, *, write_back: bool) -> None:
        cx, bx = self.index, self.backing
        if slots.numel() == 0:
            return
        home = self.home[slots].to(bx.keys.device)
        if write_back:
            self._write_back(slots)
            bx.scores[home] = cx.scores[slots].to(bx.scores.device)
        bx.pins[home] = PIN_FREE
        self.dirty[slots] = False
        self.home[slots] = -1
        cx.backend.erase(cx, cx.keys[slots].clone())
        self.table._epoch += 1
        self.unflushed = True

    def flush(self) -> int:
        """Writes every dirty cached row and every cached score back; syncs ddr files."""
        if not self.unflushed:
            return 0
        t, cx, bx = self.table, self.index, self.backing
        occ = cx.occupied(0, cx.num_slots)
        written = self._write_back(occ)
        home = self.home[occ].to(bx.keys.device)
        bx.scores[home] = cx.scores[occ].to(bx.scores.device)
        if self.files is not None:
            self.files.flush(self.header())
        self.unflushed = False
        return written

    def header(self) -> dict:
        """What a reopened backing store must match, and the table's counters to restore."""
        t = self.table
        return {"format": 1, "table": t.name, "dim": t.dim,
                "optimizer": type(t.config.optimizer).__name__,
                "state_width": t.optimizer.state_width, "num_buckets": t.layout.num_buckets,
                "bucket_width": t.layout.width, "step": t.step, "optimizer_step": t.optimizer.step}

    def reopened(self, header: dict) -> None:
        """Checks a reopened backing store's header against this table and restores its steps."""
        want = {k: v for k, v in self.header().items() if k not in ("step", "optimizer_step")}
        found = {k: header.get(k) for k in want}
        if found != want:
            raise ConfigError(f"table {self.table.name!r}: the backing store in "
                              f"{str(self.files.dir)!r} was written by another configuration: "
                              f"expected {want}, found {found}.")
        self.table.step = int(header["step"])
        self.table.optimizer.step = int(header["optimizer_step"])
