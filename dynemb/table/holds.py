"""Holds: a lookup's rows kept in place until its gradients are applied (a mixin of
``DynamicTable``).

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
"""

from __future__ import annotations

import torch

from dynemb.errors import InputError
from dynemb.table.index import HashIndex
from dynemb.table.stats import Holds, Lookup


class TableHolds:
    """``release``, ``held_rows`` and the hold bookkeeping of a :class:`~dynemb.DynamicTable`."""

    def release(self, lk: Lookup) -> None:
        """Drops the holds of ``lk`` (a lookup of this table made with ``hold=True``): its rows
        become evictable again, unless another lookup in flight holds them too. A no-op for a
        lookup that holds nothing (never held, or released already, e.g. by
        ``apply_gradients``)."""
        rec = lk.holds
        if rec is None or not rec.live:
            lk.held, lk.holds = False, None
            return
        if rec.owner is not self:
            raise InputError(f"table {self.name!r}: release() got a lookup held by another "
                             "table; release a lookup on the table that looked it up.")
        for ix, slots in zip(self._hold_indexes(), rec.slots):
            ix.release(slots)
        rec.live = False
        lk.held, lk.holds = False, None

    def held_rows(self) -> int:
        """Rows (slots) held right now by lookups in flight; 0 once every held lookup has been
        released or applied."""
        return sum(ix.held for ix in self._hold_indexes())

    def _hold_indexes(self) -> tuple[HashIndex, ...]:
        """The indexes whose slots a lookup holds (CACHING: the cache's, then the backing
        store's)."""
        if self.cache is None:
            return (self.index,)
        return (self.cache.index, self.index)

    def _hold(self, lk: Lookup) -> None:
        """Holds every row ``lk`` resolved (its ``unique_slots`` >= 0, which are distinct)."""
        rids = lk.unique_slots[lk.unique_slots >= 0]
        if self.cache is None:  # a single index: the row id is the slot
            parts: tuple[torch.Tensor, ...] = (rids,)
        else:
            cached = rids < self.row_offset
            parts = (rids[cached], (rids[~cached] - self.row_offset).to(self.index.keys.device))
        for ix, slots in zip(self._hold_indexes(), parts):
            ix.hold(slots)
        lk.held, lk.holds = True, Holds(self, parts)
