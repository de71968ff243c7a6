"""Holds: a lookup's rows kept in place until its gradients are applied (a mixin of both
resolvers, ``dynemb.table.resolver`` and ``dynemb.table.caching``: the one place holds are
taken, counted and released).

A lookup made with ``hold=True`` holds every row it resolved: the table's index slot, or for a
CACHING table the cache slot of a cached row or the backing slot of a row served from the
backing store. A held slot is never chosen as an eviction victim (by a later lookup,
``find_or_insert``, ``insert_or_assign``, the cache's own evictions when it fetches or
prefetches, or the cache making room for the backing store), and a backing row held that way
is not fetched into the cache (one copy, the one the held lookup updates). Holds count: a row
held by two lookups stays held until both are released. ``apply_gradients`` releases its
lookup, also when it raises (non-finite gradients under ``nonfinite="raise"``: the lookup is
spent either way); ``release`` releases one explicitly (an eval lookup, an error path). A new
key whose bucket is full of held or pinned rows gets no row: ``on_full`` decides, as for any
full bucket. Like every call of a table, ``release`` must not run concurrently with another.

What a user asks for explicitly still happens to a held row (``erase``, ``load_rows`` over its
key, a checkpoint load): the held lookup then finds its rows again by key when it applies, as
any lookup does after an eviction (``stats().stale_updates`` counts rows that are gone). The
hold stays on the slot until released, whatever key the slot holds meanwhile.

A resolver names the indexes whose slots its lookups hold (``hold_indexes``: the single index,
or the cache's and then the backing store's) and splits a lookup's row ids into slots of each
(``hold_parts``); :class:`Holding` does the rest, and the table's ``lookup(hold=True)``,
``release`` and ``held_rows`` call it.
"""

from __future__ import annotations

import torch

from dynemb.errors import InputError
from dynemb.table.index import HashIndex
from dynemb.table.stats import Holds, Lookup


class Holding:
    """Taking, counting and releasing holds, over the indexes a resolver names.

    A resolver sets ``hold_indexes`` and implements :meth:`hold_parts`.
    """

    hold_indexes: tuple[HashIndex, ...]
    """The indexes whose slots a lookup holds (CACHING: the cache's, then the backing
    store's)."""

    def hold_parts(self, rids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The slots of each of ``hold_indexes`` that hold the global row ids ``rids`` (all >= 0,
        distinct)."""
        raise NotImplementedError

    def _on_device(self, lk: Lookup) -> bool:
        """Whether ``lk``'s holds are taken without reading the device: its row ids are slots
        of the first index (a single index, or a CACHING lookup whose entries all are cached:
        ``away`` 0), whose backend's reads wait for a GPU (``HashIndex.hold_where``)."""
        return self.hold_indexes[0].backend.reads_wait and (len(self.hold_indexes) == 1
                                                            or lk.away == 0)

    def hold(self, lk: Lookup) -> None:
        """Holds every row ``lk`` resolved (its ``unique_slots`` >= 0, which are distinct)."""
        if self._on_device(lk):
            parts = (lk.unique_slots,  # -1 entries included: skipped
                     *(ix.keys[:0] for ix in self.hold_indexes[1:]))
            self.hold_indexes[0].hold_where(parts[0])
        else:
            parts = self.hold_parts(lk.unique_slots[lk.unique_slots >= 0])
            for ix, slots in zip(self.hold_indexes, parts):
                ix.hold(slots)
        lk.held, lk.holds = True, Holds(self, parts)

    def release(self, lk: Lookup, table_name: str) -> None:
        """Drops the holds of ``lk`` (see ``DynamicTable.release``); ``table_name`` names the
        table in the error for a lookup held by another table."""
        rec = lk.holds
        if rec is None or not rec.live:
            lk.held, lk.holds = False, None
            return
        if rec.owner is not self:
            raise InputError(f"table {table_name!r}: release() got a lookup held by another "
                             "table; release a lookup on the table that looked it up.")
        for ix, slots in zip(self.hold_indexes, rec.slots):
            if ix.backend.reads_wait:  # (also for holds taken by ``hold``: the same pins)
                ix.release_where(slots)
            else:
                ix.release(slots)
        rec.live = False
        lk.held, lk.holds = False, None

    def held_rows(self) -> int:
        """Rows (slots) held right now by lookups in flight."""
        return sum(ix.held for ix in self.hold_indexes)
