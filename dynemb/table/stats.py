"""Result records of table operations and the table's counters."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from dynemb.errors import InputError


@dataclass
class Lookup:
    """One resolved lookup: N key occurrences mapped onto U unique entries.

    ``unique_slots[u]`` is the global row id of entry u (see ``dynemb.table.memory.Layout``), or
    -1 (no row: eval mode, not admitted, failed); every occurrence without a row is its own
    entry. ``epoch`` is the table's eviction epoch after the lookup: if it changed by backward,
    rows are located again by key.
    """

    unique_keys: torch.Tensor
    unique_slots: torch.Tensor
    inverse: torch.Tensor
    inserted: torch.Tensor | None
    evicted: Evicted
    epoch: int
    away: int | None = None
    """Entries without an hbm row (-1 or a ddr row), when the lookup counted them (the triton
    backend's): ``DynamicTable.sources`` then finds them without reading the device."""
    rowless: int | None = None
    """Entries without a row (-1), when the lookup counted them (as ``away``)."""
    held: bool = False
    """True while the lookup holds its rows (``lookup(hold=True)``, until ``release`` or
    ``apply_gradients``): no later call evicts them."""
    holds: Holds | None = field(default=None, repr=False, compare=False)
    """What the lookup holds, while it does (the table's record, shared by copies)."""
    table: int | None = field(default=None, repr=False, compare=False)
    """The token of the table that made it (``DynamicTable.token``), None where unknown:
    ``apply_gradients`` refuses another table's lookup before changing anything."""


class Holds:
    """The slots a held lookup holds, per index of its table's resolver (``hold_indexes``
    order; ``owner`` is that resolver). ``live`` turns False once released, so a copy of the
    lookup cannot release twice (copies, deep ones included, share the record)."""

    def __init__(self, owner: object, slots: tuple[torch.Tensor, ...]) -> None:
        self.owner = owner
        self.slots = slots
        self.live = True

    def __copy__(self) -> Holds:
        return self

    def __deepcopy__(self, memo: dict) -> Holds:
        return self


@dataclass(frozen=True)
class FindResult:
    """``values`` (N, dim): the row of each key, or the eval initializer where ``found`` (N,) is
    False."""

    values: torch.Tensor
    found: torch.Tensor


@dataclass(frozen=True)
class Evicted:
    """Rows a call evicted, with everything needed to keep them elsewhere (E rows)."""

    keys: torch.Tensor
    """(E,) int64."""
    embeddings: torch.Tensor | None
    """(E, dim) float32; None where the call did not ask for rows (``lookup`` by default)."""
    optimizer_state: torch.Tensor | None
    """(E, state_width) float32; None with ``embeddings``."""
    scores: torch.Tensor
    """(E,) int64: the scores they had."""

    def __len__(self) -> int:
        return self.keys.numel()


@dataclass(frozen=True)
class InsertResult:
    """``values`` (N, dim) after the call; ``inserted`` (N,) bool marks the occurrence that
    created a row; ``evicted`` the rows pushed out to make room."""

    values: torch.Tensor
    inserted: torch.Tensor
    evicted: Evicted


@dataclass(frozen=True)
class ExportBatch:
    """The occupied slots of a slot range: keys (K,), embeddings (K, dim), optimizer_state
    (K, state_width), scores (K,)."""

    keys: torch.Tensor
    embeddings: torch.Tensor
    optimizer_state: torch.Tensor
    scores: torch.Tensor


@dataclass(frozen=True, kw_only=True)
class TableStats:
    """Counters of one table since it was built. Nothing is dropped silently: every key that did
    not get a row is in ``failed_inserts`` or ``admission_rejected``, every admission sighting
    that was forgotten in ``forgotten_sightings``, every gradient row with NaN or inf in
    ``nonfinite_grads``."""

    size: int
    """Rows held."""
    capacity: int
    """Slots."""
    step: int
    """Score-touching calls and erases so far (training lookups, find_or_insert,
    insert_or_assign, erase): the clock of LRU/STEP scores and of write steps."""
    optimizer_step: int
    """Optimizer updates applied."""
    lookups: int
    """Ids looked up by score-touching calls (occurrences)."""
    hits: int
    """Of ``lookups``, the occurrences whose key already had a row (``find`` is not counted)."""
    hbm_hits: int
    """Of ``lookups``, the occurrences served from hbm (HBM_ONLY: every hit)."""
    hbm_misses: int
    """Of ``lookups``, the occurrences that looked in hbm and did not find their key there."""
    ddr_hits: int
    """Occurrences found in ddr (HYBRID: keys of the ddr tier; CACHING: cache misses found in the
    backing store)."""
    ddr_misses: int
    """Occurrences that looked in ddr and did not find their key (new keys)."""
    inserted: int
    """Rows created."""
    evicted: int
    """Rows evicted to make room (returned to the caller)."""
    failed_inserts: int
    """Occurrences that could not get a row (full bucket, no eviction possible)."""
    admission_rejected: int
    """Occurrences refused by admission (seen fewer than threshold times)."""
    counter_evictions: int
    """Keys dropped from the admission counter table when it was full (their counts are in
    ``forgotten_sightings``)."""
    counter_overflows: int
    """Occurrences of keys that found no room in the admission counter table (every slot of
    their bucket held a key of the same call): judged on that call alone, then not remembered."""
    forgotten_sightings: int
    """Admission sightings forgotten: the counts of evicted counters plus ``counter_overflows``."""
    nonfinite_grads: int
    """Gradient rows (one per updated row and step) that held NaN or inf; what happened to them
    is ``TableConfig.nonfinite``'s choice (skipped, raised, or applied)."""
    erased: int
    """Rows erased by ``erase``."""
    stale_updates: int
    """Gradient rows dropped because their key was evicted between lookup and backward."""
    hbm_rows: int
    """Rows held in hbm (CACHING: cached rows)."""
    ddr_rows: int
    """Rows held in ddr (CACHING: the backing store, which holds every row)."""
    cache_evictions: int
    """CACHING: rows evicted from the cache to make room (written back if dirty, never lost)."""
    write_backs: int
    """CACHING: dirty rows written back to the backing store (evictions and ``flush``)."""
    backing_evictions: int
    """CACHING: rows evicted from the backing store (evicted from the table as a whole; also in
    ``evicted``, and returned to the caller)."""
    prefetched: int
    """CACHING: rows ``prefetch`` brought into the cache."""
    held_rows: int = 0
    """Rows (slots) held right now by lookups in flight (``lookup(hold=True)``); not a counter."""

    @property
    def load_factor(self) -> float:
        return self.size / self.capacity if self.capacity else 0.0

    def __str__(self) -> str:
        """A readable summary: occupancy, rates and every non-zero counter."""
        head = (f"{self.size:,} of {self.capacity:,} rows (load factor {self.load_factor:.3f}); "
                f"step {self.step:,}, optimizer step {self.optimizer_step:,}; "
                f"{self.lookups:,} lookups: hit rate {self.hit_rate:.4f} (key had a row), hbm "
                f"hit rate {self.hbm_hit_rate:.4f} (served from hbm)")
        skip = {"size", "capacity", "step", "optimizer_step", "lookups", "hits", "hbm_hits"}
        rest = [f"{f.name} {getattr(self, f.name):,}" for f in dataclasses.fields(self)
                if f.name not in skip and getattr(self, f.name)]
        return head + ("; " + ", ".join(rest) if rest else "")

    @property
    def hit_rate(self) -> float:
        """Share of lookups whose key had a row (in any tier)."""
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def hbm_hit_rate(self) -> float:
        """Share of lookups served from hbm (CACHING: the cache hit rate)."""
        return self.hbm_hits / self.lookups if self.lookups else 0.0


class EvictionLog:
    """Keys evicted from a table or erased, with the table step of each, once started (for
    incremental exports). Off until :meth:`start`: it grows with the churn between trims."""

    def __init__(self, empty: torch.Tensor) -> None:
        self._entries: list[tuple[int, torch.Tensor]] | None = None
        self._start = 0
        self._empty = empty

    def start(self, step: int, *, restart: bool = False) -> None:
        if self._entries is None or restart:
            self._entries, self._start = [], step

    def add(self, step: int, keys: torch.Tensor) -> None:
        if self._entries is not None and keys.numel():
            self._entries.append((step, keys.to(self._empty.device).clone()))

    def since(self, step: int, owner: str) -> torch.Tensor:
        """Distinct keys logged at a step after ``step``."""
        if self._entries is None or step < self._start:
            state = "never started" if self._entries is None else f"starts at step {self._start}"
            raise InputError(f"{owner}: evictions since step {step} are unknown: the eviction "
                             f"log {state} (call track_evictions() before that step).")
        parts = [k for s, k in self._entries if s > step]
        return torch.unique(torch.cat(parts)) if parts else self._empty.clone()

    def export(self) -> tuple[int | None, list[tuple[int, torch.Tensor]]]:
        """(the step it starts at, or None when off; its (step, keys) entries)."""
        return (None, []) if self._entries is None else (self._start, list(self._entries))

    def restore(self, start: int | None, entries: list[tuple[int, torch.Tensor]]) -> None:
        """Puts back what :meth:`export` gave."""
        self._start = 0 if start is None else start
        self._entries = None if start is None else [
            (s, k.to(self._empty.device).clone()) for s, k in entries]

    def trim(self, step: int) -> None:
        """Forgets entries at or before ``step``."""
        if self._entries is not None:
            self._entries = [(s, k) for s, k in self._entries if s > step]
            self._start = max(self._start, step)
