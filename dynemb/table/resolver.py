"""Resolvers: how a table maps keys to rows, one interface for every storage mode.

A :class:`~dynemb.DynamicTable` holds one resolver and its verbs delegate to it:

* :class:`SingleIndexResolver` (HBM_ONLY, HYBRID): one hash index over the table's rows; a
  slot of it is a global row id.
* ``dynemb.table.caching.CachedResolver`` (CACHING): a cache index over the hbm rows in front
  of a backing index over the ddr rows, which holds every row of the table.

:class:`Resolver` is what both share: the index of every row of the table (``table_index``:
the single index, or the backing store), exact placement for ``load_rows``, ``erase``, the
``on_full`` decision with the table's size in its message, and holds (``dynemb.table.holds``).
A resolver reads and advances the table's :class:`~dynemb.table.state.TableState` and creates,
initialises and evicts rows through its :class:`~dynemb.table.lifecycle.RowLifecycle`; it
never reaches into the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import torch

from dynemb.batch import CHANGED_BATCH, EMPTY_KEY
from dynemb.config import ScorePolicy, StorageMode, TableConfig
from dynemb.errors import InputError
from dynemb.kernels.index_numba import P_NO_EVICTION
from dynemb.table.holds import Holding
from dynemb.table.index import HashIndex
from dynemb.table.lifecycle import RowLifecycle
from dynemb.table.memory import Layout
from dynemb.table.state import Saved, TableState
from dynemb.table.stats import Lookup
from dynemb.table.storage import RowStore


class Resolver(Holding):
    """What every resolver has and does (see the module docstring).

    Args:
        config: the table's configuration.
        layout: the table's storage layout.
        state: the table's shared state.
        life: the table's row life cycle.
        store: the table's row store.
        table_index: the index of every row of the table (slot 0 is global row ``row_offset``).
        row_offset: the global row id of ``table_index``'s slot 0.
    """

    def __init__(self, config: TableConfig, layout: Layout, state: TableState,
                 life: RowLifecycle, store: RowStore, table_index: HashIndex,
                 row_offset: int) -> None:
        self.config, self.layout = config, layout
        self.state, self.life, self.store = state, life, store
        self.table_index = table_index
        self.row_offset = row_offset
        self.device = store.hbm.device

    # ------------------------------------------------------------------ the interface

    def resolve(self, keys: torch.Tensor, *, touch: bool, insert: bool, admit: bool,
                custom: torch.Tensor, keep_evicted: bool, saved: Saved | None) -> Lookup:
        """Finds (touching scores, with ``touch``) and inserts (with ``insert``; through
        admission with ``admit``) the keys (N,) int64 of one call, on the table's device.

        The table has already advanced its step for a touching call. ``custom``: (N,) int64
        scores or an empty tensor. ``keep_evicted``: copy the evicted rows out. ``saved`` (an
        atomic call: ``on_full`` RAISE and ``insert``): the state before the call; if a new key
        cannot get a row, everything is undone and :class:`CapacityError` raised."""
        raise NotImplementedError

    def locate(self, keys: torch.Tensor) -> torch.Tensor:
        """Global row id of each key (N,) or -1, touching nothing."""
        raise NotImplementedError

    def locate_rows(self, keys: torch.Tensor, out: torch.Tensor, fill: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`locate` that also writes each found key's embedding into ``out`` (N, dim), in
        one pass, and ``fill`` into the rows of keys without one unless it is None: (row ids,
        the positions of the -1s), or None where this resolver has no such pass (``out`` then
        unwritten)."""
        return None

    def mark_written(self, rids: torch.Tensor, *, cached_only: bool = False) -> None:
        """Rows ``rids`` (distinct; -1 for none) were written at the current step: their write
        step, a STEP score (and a cached row's dirty flag). ``cached_only``: every row is an
        hbm row or -1 (``Lookup.away`` 0)."""
        raise NotImplementedError

    def flush(self) -> int:
        """Writes copies back to where they belong; returns the rows written (none: 0)."""
        return 0

    def prefetch(self, keys: torch.Tensor) -> int:
        """Brings rows of ``keys`` closer ahead of their lookup; returns how many (none: 0)."""
        return 0

    def index_bytes(self) -> tuple[int, int]:
        """(hbm, ddr) bytes of the indexes."""
        raise NotImplementedError

    def tier_rows(self) -> tuple[int, int]:
        """(hbm, ddr) rows held (``TableStats.hbm_rows``, ``ddr_rows``)."""
        raise NotImplementedError

    def backing_evictions(self) -> int:
        """Rows evicted from a CACHING backing store (``TableStats.backing_evictions``)."""
        return 0

    def store_header(self) -> dict | None:
        """What the ddr store's header records at close (None: nothing beyond the files')."""
        return None

    def reopen_check(self) -> Callable[[dict], None] | None:
        """What checks a reopened ddr store's header against the table, or None (nothing)."""
        return None

    # ------------------------------------------------------------------ shared

    def place(self, keys: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Slots of ``table_index`` for distinct ``keys`` (N,), inserting missing ones without
        evicting anything and without touching scores (``load_rows``): (slots (N,), 0), or
        (-, the number of keys that found no free slot) having inserted nothing."""
        ix, be = self.table_index, self.table_index.backend
        bkeys = keys.to(ix.keys.device)
        none = self.state.no_scores.to(bkeys.device)
        slots = be.find(ix, bkeys, none, P_NO_EVICTION, self.state.step, False, True)
        miss = torch.nonzero(slots < 0).flatten()
        failed = 0
        if miss.numel():  # never evicts, all or nothing: a key without a free slot fails
            new, _, _ = be.insert(ix, bkeys[miss], none, P_NO_EVICTION, self.state.step, True)
            failed = int((new < 0).sum())
            if not failed:
                slots[miss] = new
        be.unpin(ix, slots)
        return slots, failed

    def erase(self, keys: torch.Tensor) -> torch.Tensor:
        """Removes distinct ``keys`` (N,); returns each one's former slot or -1 (absent)."""
        ix = self.table_index
        return ix.backend.erase(ix, keys.to(ix.keys.device))

    def on_full(self, failed: int) -> None:
        """``RowLifecycle.on_full`` for ``failed`` occurrences of a call that completed."""
        ix = self.table_index
        self.life.on_full(failed, held=self.held_rows(), size=ix.size(), capacity=ix.num_slots)

    def refuse(self, failed: int, saved: Saved) -> NoReturn:
        """``RowLifecycle.refuse``: undoes an atomic call's step and counters, then raises."""
        ix = self.table_index
        self.life.refuse(failed, saved, held=self.held_rows(), size=ix.size(),
                         capacity=ix.num_slots)


class SingleIndexResolver(Resolver):
    """HBM_ONLY and HYBRID: one index whose slot s is global row s (HYBRID: slots of the
    buckets below ``index.split`` are hbm rows, the others ddr rows)."""

    def __init__(self, config: TableConfig, layout: Layout, state: TableState,
                 life: RowLifecycle, store: RowStore, index: HashIndex) -> None:
        super().__init__(config, layout, state, life, store, index, 0)
        self.hold_indexes = (index,)
        self.backend = index.backend

    def resolve(self, keys: torch.Tensor, *, touch: bool, insert: bool, admit: bool,
                custom: torch.Tensor, keep_evicted: bool, saved: Saved | None) -> Lookup:
        ix, life = self.table_index, self.life
        judge, once = None, {}
        if insert and admit and life.admission is not None:
            if self.backend.reads_wait:  # triton: judged and counted on the device
                once = {"admission": life.admission}
            else:
                def judge(miss: torch.Tensor) -> torch.Tensor:
                    return life.admitted(keys, miss, True)
        r = self.backend.lookup(ix, keys, custom, self.state.policy, self.state.step,
                                touch=touch, insert=insert, atomic=saved is not None,
                                admit=judge, hbm_rows=self.layout.hbm_rows, **once)
        if r.rejected:
            self.state.counters["admission_rejected"] += r.rejected
        if r.reserved and saved is not None:  # the lookup changed nothing
            self.state.restore(saved)
            raise InputError(f"table {self.config.name!r}: lookup: found the reserved empty key "
                             f"{EMPTY_KEY} among the ids ({CHANGED_BATCH}); nothing changed.")
        if r.failed and saved is not None:
            self.refuse(r.failed, saved)  # the lookup changed nothing
        if touch:
            c = self.state.counters
            for name, n in zip(("hbm_hits", "ddr_hits", "hbm_misses", "ddr_misses"), r.tiers):
                if n:
                    c[name] += n
        evicted = life.take_evicted(*r.evicted, with_rows=keep_evicted, offset=0)
        if r.fresh.numel():
            life.init_rows(ix, r.slots[r.fresh], keys[r.fresh], 0)
        if judge is not None:
            life.record_admission(keys, r.miss, r.slots, True)
        if r.failed:
            self.on_full(r.failed)
        return Lookup(unique_keys=keys[r.unique_pos], unique_slots=r.unique_slots,
                      inverse=r.inverse, inserted=r.inserted, evicted=evicted,
                      epoch=self.state.epoch, away=r.away, rowless=r.rowless)

    def locate(self, keys: torch.Tensor) -> torch.Tensor:
        return self.table_index.find(keys)

    def locate_rows(self, keys: torch.Tensor, out: torch.Tensor, fill: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        fused, st = getattr(self.backend, "find_rows", None), self.store
        if fused is None:  # (the compiled CPU backend has it)
            return None
        return fused(self.table_index, keys, st.hbm, st.ddr, st.split, st.dim, out, fill)

    def mark_written(self, rids: torch.Tensor, *, cached_only: bool = False) -> None:
        ix, step = self.table_index, self.state.step
        self.backend.put_where(ix.written, rids, step)
        if self.state.score == ScorePolicy.STEP:
            self.backend.put_where(ix.scores, rids, step)

    def hold_parts(self, rids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (rids,)  # a single index: the row id is the slot

    def index_bytes(self) -> tuple[int, int]:
        return self.table_index.nbytes(), 0

    def tier_rows(self) -> tuple[int, int]:
        size = self.table_index.size()
        if self.layout.mode == StorageMode.HBM_ONLY:
            return size, 0
        hbm = int((self.table_index.digests[:self.layout.hbm_rows] >= 2).sum())
        return hbm, size - hbm
