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
:meth:`CachedResolver._release` take it; a backing row held by a lookup that was served from
the backing store is not fetched into the cache while held (later lookups are served from the
backing store too), so the held lookup's row id stays the row's only copy.

:class:`CachedResolver` is the resolver of a CACHING table (``dynemb.table.resolver``): it
reads and advances the table's shared state (step, epoch, counters, eviction log) and creates,
initialises and evicts backing rows through the table's row life cycle, like the single-index
resolver; ``DynamicTable.cache`` is this object.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dynemb.config import ScorePolicy, TableConfig
from dynemb.errors import ConfigError
from dynemb.kernels.hashing import home_bucket, index_hash
from dynemb.kernels.index_numba import C_EVICTED, P_LRU, P_NO_EVICTION, PIN_CACHED, PIN_FREE
from dynemb.kernels.index_torch import dedup
from dynemb.optim.rules import RowOptimizer
from dynemb.table.cached_once import resolve_once
from dynemb.table.index import HashIndex
from dynemb.table.lifecycle import RowLifecycle
from dynemb.table.memory import Layout
from dynemb.table.resolver import Resolver
from dynemb.table.state import Saved, TableState
from dynemb.table.stats import Lookup
from dynemb.table.storage import DdrFiles, RowStore


class CachedResolver(Resolver):
    """The cache index (``index``) over the backing store (``backing``, the table's index), each
    cached row's backing slot (``home``) and dirty flag.

    Args:
        config, layout, state, life, store: the table's (see ``Resolver``).
        backing: the backing store's index (every row of the table; its slot s is global row
            ``layout.hbm_rows + s``).
        optimizer: the table's row optimizer (its step is in the store's header).
        files: the ddr store's files, or None.
    """

    def __init__(self, config: TableConfig, layout: Layout, state: TableState,
                 life: RowLifecycle, store: RowStore, backing: HashIndex,
                 optimizer: RowOptimizer, files: DdrFiles | None) -> None:
        super().__init__(config, layout, state, life, store, backing, layout.hbm_rows)
        self.backing = backing
        self.optimizer = optimizer
        self.files = files
        dev = self.device
        self.index = HashIndex(layout.cache_buckets, layout.cache_width, dev, store.backend)
        self.home = torch.full((self.index.num_slots,), -1, dtype=torch.int64, device=dev)
        self.dirty = torch.zeros(self.index.num_slots, dtype=torch.bool, device=dev)
        # A cache must always be able to evict: NO_EVICTION tables cache by recency (LRU).
        self.policy = P_LRU if state.policy == P_NO_EVICTION else state.policy
        self.unflushed = False
        self.hold_indexes = (self.index, backing)

    def nbytes(self) -> int:
        return (self.index.nbytes() + self.home.numel() * self.home.element_size()
                + self.dirty.numel() * self.dirty.element_size())

    def index_bytes(self) -> tuple[int, int]:
        return self.nbytes(), self.backing.nbytes()

    def tier_rows(self) -> tuple[int, int]:
        return self.index.size(), self.backing.size()

    def backing_evictions(self) -> int:
        return self.backing.count(C_EVICTED)

    def hold_parts(self, rids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cached = rids < self.row_offset
        return rids[cached], (rids[~cached] - self.row_offset).to(self.backing.keys.device)

    # ------------------------------------------------------------------ lookups

    def resolve(self, keys: torch.Tensor, *, touch: bool, insert: bool, admit: bool,
                custom: torch.Tensor, keep_evicted: bool, saved: Saved | None) -> Lookup:
        """``Resolver.resolve`` for a CACHING table: training calls and finds without admission
        go cache first (``dynemb.table.cached_once``: one read from the device on the triton
        backend); with admission, which judges misses before they may take a cache slot, and
        for a lookup that touches without inserting, the staged order below.

        ``saved`` (an atomic call: ``on_full`` RAISE): the table's step and counters before the
        call; if a new key cannot get a backing row, every change is undone and the call raises.
        Until then the call has only touched (journaled) and pinned, and possibly moved cached
        rows of full buckets to the backing store (their contents unchanged)."""
        cx, bx, life, st = self.index, self.backing, self.life, self.state
        if keys.numel() and touch == insert and not (admit and life.admission is not None):
            return resolve_once(self, keys, touch=touch, insert=insert, custom=custom,
                                keep_evicted=keep_evicted, saved=saved)
        step, c, dev = st.step, st.counters, self.device
        prev = torch.empty_like(keys) if saved is not None and touch else None
        cs = cx.backend.find(cx, keys, custom, self.policy, step, touch, True, prev)
        miss = torch.nonzero(cs < 0).flatten()
        if touch:
            c["hbm_hits"] += keys.numel() - miss.numel()
            c["hbm_misses"] += miss.numel()
            self.unflushed = True
        inserted = torch.zeros(keys.numel(), dtype=torch.bool, device=dev) if insert else None
        evicted, failed, bs = life.evicted_none(), 0, None
        if miss.numel():
            bdev = bx.keys.device
            mkeys = keys[miss].to(bdev)
            mcustom = custom[miss].to(bdev) if custom.numel() else custom.to(bdev)
            bs = bx.backend.find(bx, mkeys, mcustom[:0], st.policy, step, False, True)
            existed = bs >= 0
            if touch:
                c["ddr_hits"] += int(existed.sum())
                c["ddr_misses"] += int((~existed).sum())
            base = torch.where(existed, bx.scores[bs.clamp(min=0)], 0)  # scores before this call
            if insert:
                absent = torch.nonzero(~existed).flatten()
                new = life.admitted(mkeys, absent, admit)
                if new.numel():
                    slots, fresh, ev = self._backing_insert(
                        mkeys[new], mcustom[new] if mcustom.numel() else mcustom, saved is not None)
                    failed = int((slots < 0).sum())
                    if failed and saved is not None:
                        bx.backend.unpin(bx, bs)
                        if prev is not None:
                            cx.backend.restore_scores(cx, cs, prev)
                        cx.backend.unpin(cx, cs)
                        self.refuse(failed, saved)
                    evicted = life.take_evicted(*ev, with_rows=keep_evicted, offset=self.row_offset)
                    life.init_rows(bx, slots[fresh], mkeys[new][fresh].to(dev), self.row_offset)
                    bs[new] = slots
                    inserted[miss[new.to(dev)]] = fresh.to(dev)
                life.record_admission(mkeys, absent, bs, admit)
                placed = self._fetch(mkeys, bs, existed, base, mcustom, lookup=True)
                cs[miss] = placed.to(dev)
                if touch:  # occurrences served from the backing store touch its scores
                    by = (placed < 0) & existed
                    if bool(by.any()):
                        bx.backend.find(bx, mkeys[by], mcustom[by] if mcustom.numel() else mcustom,
                                        st.policy, step, True, False)
        return self._finish(keys, cs, miss, bs, inserted, evicted, failed)

    def _backing_insert(self, keys: torch.Tensor, custom: torch.Tensor, atomic: bool,
                        then: Callable[[], bool] | None = None):
        """Inserts new keys into the backing store. Cached rows are pinned there, so a bucket
        whose rows are all cached refuses new keys: then the cached rows homed in the refusing
        buckets that this call does not use leave the cache (written back), and the refused
        keys are inserted again, evicting by score like any full bucket. ``atomic``: each
        attempt places every key or changes nothing (the second attempt retries them all).
        ``then``: run after the first attempt; True if it freed backing rows (a retry then)."""
        bx, policy, step = self.backing, self.state.policy, self.state.step
        slots, fresh, ev = bx.backend.insert(bx, keys, custom, policy, step, atomic)
        freed = then is not None and then()
        fail = torch.nonzero(slots < 0).flatten()
        if fail.numel() and policy != P_NO_EVICTION and (self._release(keys[fail]) or freed):
            if atomic:
                return bx.backend.insert(bx, keys, custom, policy, step, True)
            again, fresh2, ev2 = bx.backend.insert(
                bx, keys[fail], custom[fail] if custom.numel() else custom, policy, step)
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
        cx, bx = self.index, self.backing
        rid = cs
        if bs is not None:
            away = cs[miss] < 0
            fetched = bs[(~away).to(bs.device) & (bs >= 0)]
            bx.backend.finish(bx, bs)
            bx.pins[fetched] = PIN_CACHED
            if bool(away.any()):
                rid = cs.clone()
                served = bs.to(self.device)[away]
                rid[miss[away]] = torch.where(served >= 0, served + self.row_offset, -1)
        away = None  # (counted where every entry is cached: none away)
        if rid is cs:
            inverse, unique_rids, unique_pos = cx.backend.finish(cx, cs)
            away = 0
        else:  # some entries live in the backing store: number them by global row id
            cx.backend.unpin(cx, cs)
            inverse, unique_rids, unique_pos = dedup(rid)
        if failed:
            self.on_full(failed)
        return Lookup(unique_keys=keys[unique_pos], unique_slots=unique_rids,
                      inverse=inverse, inserted=inserted, evicted=evicted, epoch=self.state.epoch,
                      away=away, rowless=away)

    def _fetch(self, mkeys: torch.Tensor, bs: torch.Tensor, existed: torch.Tensor,
               base: torch.Tensor, mcustom: torch.Tensor, *, lookup: bool) -> torch.Tensor:
        """Brings the rows of occurrences ``mkeys`` found at backing slots ``bs`` (-1: none) into
        the cache; returns each occurrence's cache slot (-1: not cached). ``existed``/``base``:
        whether the key was in the backing store before this call, and its score there."""
        cx, bx, dev = self.index, self.backing, self.device
        placed = torch.full_like(bs, -1)
        got = torch.nonzero(bs >= 0).flatten()
        if bx.held:  # rows held where they are (served from the backing store) stay there
            got = got[~bx.is_held(bs[got])]
        if got.numel() == 0:
            return placed
        gkeys = mkeys[got].to(dev)
        gcustom = mcustom[got].to(dev) if mcustom.numel() else self.state.no_scores
        cslots, cfresh, cev = cx.backend.insert(cx, gkeys, gcustom, self.policy, self.state.step)
        self._evict(*cev)
        first = torch.nonzero(cfresh).flatten()
        dst, src = cslots[first], bs[got][first.to(bs.device)]
        self.store.fetch(src, dst)
        self.home[dst] = src.to(dev)
        self.dirty[dst] = False
        cx.written[dst] = bx.written[src].to(dev)
        self._carry_scores(dst, existed[got][first.to(bs.device)].to(dev),
                           base[got][first.to(bs.device)].to(dev), lookup,
                           custom_given=gcustom.numel() > 0)
        placed[got] = cslots.to(bs.device)
        return placed

    def _carry_scores(self, dst, existed, base, lookup: bool, *, custom_given: bool) -> None:
        """The score of a row fetched into cache slots ``dst``: its backing score ``base`` as this
        lookup touches it (the kernel scored it as a new key; keys new to the table keep that)."""
        cx, policy = self.index, self.state.score
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
        bx = self.backing
        self.state.epoch += 1
        self.state.counters["cache_evictions"] += slots.numel()
        self._write_back(slots)
        home = self.home[slots].to(bx.keys.device)
        bx.scores[home] = scores.to(bx.scores.device)
        bx.pins[home] = PIN_FREE
        self.home[slots] = -1

    def _write_back(self, slots: torch.Tensor) -> int:
        """Copies the dirty rows among cache ``slots`` to their backing rows, with their write
        steps; returns how many."""
        bx = self.backing
        d = slots[self.dirty[slots]]
        if d.numel():
            home = self.home[d].to(bx.keys.device)
            self.store.store_back(d, home)
            bx.written[home] = self.index.written[d].to(bx.written.device)
            self.dirty[d] = False
            self.state.counters["write_backs"] += d.numel()
        return d.numel()

    def mark_written(self, rids: torch.Tensor, *, cached_only: bool = False) -> None:
        """Rows ``rids`` (-1 for none) were written at the table's step: cached ones become
        dirty. ``cached_only``: every row is a cached row (or -1), as in a lookup that counted
        no entry away from hbm: marked on the device, without reading it."""
        step, stamp = self.state.step, self.state.score == ScorePolicy.STEP
        self.unflushed = True
        if cached_only:
            ok = rids >= 0  # (an amax leaves the flags of the others as they are)
            self.dirty.view(torch.uint8).scatter_reduce_(0, torch.where(ok, rids, 0),
                                                         ok.to(torch.uint8), "amax")
            be = self.index.backend
            be.put_where(self.index.written, rids, step)
            if stamp:
                be.put_where(self.index.scores, rids, step)
            return
        rids = rids[rids >= 0]
        cached = rids < self.row_offset
        c = rids[cached]
        self.dirty[c] = True
        self.index.written[c] = step
        b = (rids[~cached] - self.row_offset).to(self.backing.keys.device)
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
            rid[miss] = torch.where(bs >= 0, bs + self.row_offset, -1)
        return rid

    # ------------------------------------------------------------------ maintenance

    def prefetch(self, keys: torch.Tensor) -> int:
        """Fetches the rows of ``keys`` that the backing store holds into the cache."""
        cx, bx, st = self.index, self.backing, self.state
        none = st.no_scores
        cs = cx.backend.find(cx, keys, none, self.policy, st.step, False, True)
        miss = torch.nonzero(cs < 0).flatten()
        fetched = 0
        if miss.numel():
            mkeys = keys[miss].to(bx.keys.device)
            bs = bx.backend.find(bx, mkeys, none.to(mkeys.device), st.policy, st.step, False,
                                 True)
            existed = bs >= 0
            base = torch.where(existed, bx.scores[bs.clamp(min=0)], 0)
            placed = self._fetch(mkeys, bs, existed, base, none[:0], lookup=False)
            cs[miss] = placed.to(self.device)
            ok = placed >= 0
            bx.backend.unpin(bx, bs)
            fetched_slots = torch.unique(bs[ok])
            bx.pins[fetched_slots] = PIN_CACHED
            fetched = fetched_slots.numel()
            self.unflushed = self.unflushed or fetched > 0
        cx.backend.unpin(cx, cs)
        st.counters["prefetched"] += fetched
        return fetched

    def place(self, keys: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``Resolver.place``: loaded rows go to the backing store, not through the cache (the
        cached copies of ``keys`` are written back and dropped first)."""
        self.drop(keys)
        self.unflushed = True
        return super().place(keys)

    def erase(self, keys: torch.Tensor) -> torch.Tensor:
        """``Resolver.erase``: the cached copies of ``keys`` are dropped unwritten first."""
        self.drop(keys, write_back=False)
        gone = super().erase(keys)
        if bool((gone >= 0).any()):
            self.unflushed = True
        return gone

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
        self.state.epoch += 1
        self.unflushed = True

    def flush(self) -> int:
        """Writes every dirty cached row and every cached score back; syncs ddr files."""
        if not self.unflushed:
            return 0
        cx, bx = self.index, self.backing
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
        cfg, lay = self.config, self.layout
        return {"format": 1, "table": cfg.name, "dim": cfg.dim,
                "optimizer": type(cfg.optimizer).__name__,
                "state_width": self.optimizer.state_width, "num_buckets": lay.num_buckets,
                "bucket_width": lay.width, "score": cfg.score.value, "step": self.state.step,
                "optimizer_step": self.optimizer.step}

    def store_header(self) -> dict:
        return self.header()

    def reopen_check(self) -> Callable[[dict], None]:
        return self.check_reopened

    def check_reopened(self, header: dict) -> None:
        """Checks a reopened backing store's header against this table and restores its steps."""
        want = {k: v for k, v in self.header().items() if k not in ("step", "optimizer_step")}
        found = {k: header.get(k) for k in want}
        if "score" not in header:  # (a store closed before headers named their score policy)
            found["score"] = want["score"]
        if found != want:  # (scores mean steps, counts or the user's: only under their policy)
            raise ConfigError(f"table {self.config.name!r}: the backing store in "
                              f"{str(self.files.dir)!r} was written by another configuration: "
                              f"expected {want}, found {found}.")
        self.state.step = int(header["step"])
        self.optimizer.step = int(header["optimizer_step"])
