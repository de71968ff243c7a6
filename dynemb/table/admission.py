"""Frequency admission: a bounded counter table decides which new keys get a row."""

from __future__ import annotations

import torch

from dynemb.config import Admission
from dynemb.kernels.index_numba import C_EVICTED, C_FAILED, P_LFU, P_NO_EVICTION
from dynemb.errors import CapacityError, InputError
from dynemb.table.index import HashIndex
from dynemb.table.memory import COUNTER_BUCKET, index_geometry

_NO_SCORES = torch.empty(0, dtype=torch.int64)


class AdmissionFilter:
    """Counts occurrences of keys without a row; admits a key once its count reaches the
    threshold (and forgets it then).

    A call first judges its keys (:meth:`judge`, which changes nothing) and, once it has
    succeeded, records what happened (:meth:`record`). Sightings can be forgotten in exactly
    two places, both counted: when the counter table is full, its least-counted key that this
    call did not touch is evicted (its count is lost: ``counter_evictions`` keys, their counts
    in ``forgotten_sightings``); a key that finds no room at all (every slot of its bucket holds
    a key of this call) is judged on its occurrences in the call alone, which are then not
    remembered (``counter_overflows`` occurrences, also in ``forgotten_sightings``)."""

    def __init__(self, config: Admission, device: torch.device, backend) -> None:
        self.threshold = config.threshold
        self.index = HashIndex(*index_geometry(config.counter_capacity, COUNTER_BUCKET), device,
                               backend)
        self._no_scores = _NO_SCORES.to(device)
        self._forgotten = 0
        self._forgotten_on_device = torch.zeros((), dtype=torch.int64, device=device)

    @property
    def forgotten_sightings(self) -> int:
        """Sightings dropped: counts of evicted counters plus ``counter_overflows``."""
        self._forgotten += int(self._forgotten_on_device)  # (a read, when asked)
        self._forgotten_on_device.zero_()
        return self._forgotten

    @forgotten_sightings.setter
    def forgotten_sightings(self, value: int) -> None:
        self._forgotten = value
        self._forgotten_on_device.zero_()

    def forget_on_device(self, sightings: torch.Tensor) -> None:
        """Adds ``sightings`` (a count on the device) to ``forgotten_sightings`` without a read
        (the triton lookup's ``record``)."""
        self._forgotten_on_device += sightings

    def judge(self, keys: torch.Tensor) -> torch.Tensor:
        """The (N,) bool mask of occurrences in ``keys`` (N,) int64 whose key's count (its
        counter plus its occurrences in ``keys``) reaches the threshold. Changes nothing."""
        slots = self.index.find(keys)
        stored = torch.where(slots >= 0, self.index.scores[slots.clamp(min=0)], 0)
        _, inv, occurrences = torch.unique(keys, return_inverse=True, return_counts=True)
        return stored + occurrences[inv] >= self.threshold

    def record(self, keys: torch.Tensor, got_row: torch.Tensor) -> None:
        """After a call: forgets the counters of the keys whose occurrences in ``keys`` (N,)
        got a row (``got_row`` (N,) bool) and counts every other occurrence (an admitted key
        that found no row in a full table stays admissible)."""
        ix, be = self.index, self.index.backend
        if bool(got_row.any()):
            be.erase(ix, torch.unique(keys[got_row]))
        rest = keys[~got_row]
        if rest.numel() == 0:
            return
        slots = be.find(ix, rest, self._no_scores, P_LFU, 0, True, True)
        miss = slots < 0
        if bool(miss.any()):
            new_slots, _, (_, _, ev_scores) = be.insert(ix, rest[miss], self._no_scores, P_LFU, 0)
            slots[miss] = new_slots
            self._forgotten += int(ev_scores.sum()) + int((new_slots < 0).sum())
        be.unpin(ix, slots)

    def export(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys (K,), counts (K,)) int64 of every key being counted."""
        slots = self.index.occupied(0, self.index.num_slots)
        return self.index.keys[slots].clone(), self.index.scores[slots].clone()

    def clear(self) -> None:
        """Forgets every counter."""
        keys, _ = self.export()
        if keys.numel():
            self.index.backend.erase(self.index, keys)

    def load(self, keys: torch.Tensor, counts: torch.Tensor, *, partial: bool = False) -> int:
        """Sets the counts of distinct ``keys`` (K,) to ``counts`` (K,) (e.g. from a checkpoint),
        never evicting a counter. Raises CapacityError, loading nothing, if the counter table
        cannot hold them all; with ``partial`` it keeps what fits, the highest counts first
        (a full bucket drops its lowest), and returns how many keys it dropped."""
        ix, be = self.index, self.index.backend
        if keys.shape != counts.shape or keys.dim() != 1:
            raise InputError(f"admission counters: keys and counts must be matching 1-D "
                             f"tensors, found {tuple(keys.shape)} and {tuple(counts.shape)}.")
        keys, counts = keys.to(ix.keys.device, torch.int64), counts.to(ix.scores)
        if partial:  # insertion order decides who gets a full bucket's last slots
            order = torch.argsort(counts, descending=True, stable=True)
            keys, counts = keys[order], counts[order]
        slots = be.find(ix, keys, self._no_scores, P_NO_EVICTION, 0, False, True)
        miss = slots < 0
        failed = 0
        if bool(miss.any()):  # never evicts: a key without a free slot fails
            overflows = ix.count(C_FAILED)  # (a load's misses are not lookups' overflows)
            new_slots, _, _ = be.insert(ix, keys[miss], self._no_scores, P_NO_EVICTION, 0,
                                        not partial)
            ix.counts[C_FAILED] = overflows
            failed = int((new_slots < 0).sum())
            if failed and not partial:
                be.unpin(ix, slots)
                raise CapacityError(f"admission counters: {failed} keys do not fit the counter "
                                    f"table of {ix.num_slots} slots without evicting; nothing was "
                                    "loaded. Raise Admission.counter_capacity.")
            slots[miss] = new_slots
        be.unpin(ix, slots)
        kept = slots >= 0
        ix.scores[slots[kept]] = counts[kept]
        return failed

    @property
    def counter_evictions(self) -> int:
        """Keys whose counter was evicted to make room for another's."""
        return self.index.count(C_EVICTED)

    @property
    def counter_overflows(self) -> int:
        """Occurrences of keys that found no room in the counter table (not remembered)."""
        return self.index.count(C_FAILED)

    def size(self) -> int:
        return self.index.size()
