"""Frequency admission: a bounded counter table decides which new keys get a row."""

from __future__ import annotations

import torch

from dynemb.config import Admission
from dynemb.kernels.index_numba import C_EVICTED, P_LFU, P_NO_EVICTION
from dynemb.errors import CapacityError, InputError
from dynemb.table.index import HashIndex
from dynemb.table.memory import COUNTER_BUCKET, index_geometry

_NO_SCORES = torch.empty(0, dtype=torch.int64)


class AdmissionFilter:
    """Counts occurrences of keys without a row; admits a key once its count reaches the
    threshold (and forgets it then). When the counter table is full, its least-counted key that
    this call did not touch is evicted (counted in ``counter_evictions``); a key that finds no
    room at all is judged on its occurrences in the call alone."""

    def __init__(self, config: Admission, device: torch.device, backend) -> None:
        self.threshold = config.threshold
        self.index = HashIndex(*index_geometry(config.counter_capacity, COUNTER_BUCKET), device,
                               backend)
        self._no_scores = _NO_SCORES.to(device)

    def admit(self, keys: torch.Tensor) -> torch.Tensor:
        """Counts every occurrence in ``keys`` (N,) int64; returns the (N,) bool mask of
        occurrences whose key reached the threshold."""
        ix, be = self.index, self.index.backend
        slots = be.find(ix, keys, self._no_scores, P_LFU, 0, True, True)
        miss = slots < 0
        if bool(miss.any()):
            new_slots, _, _ = be.insert(ix, keys[miss], self._no_scores, P_LFU, 0)
            slots[miss] = new_slots
        be.unpin(ix, slots)
        counted = slots >= 0
        counts = torch.zeros_like(keys)
        counts[counted] = ix.scores[slots[counted]]
        if not bool(counted.all()):  # no room in the counter table: count this call's occurrences
            _, inv, occurrences = torch.unique(keys[~counted], return_inverse=True,
                                               return_counts=True)
            counts[~counted] = occurrences[inv]
        admitted = counts >= self.threshold
        if bool(admitted.any()):
            be.erase(ix, torch.unique(keys[admitted]))
        return admitted

    def export(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys (K,), counts (K,)) int64 of every key being counted."""
        slots = self.index.occupied(0, self.index.num_slots)
        return self.index.keys[slots].clone(), self.index.scores[slots].clone()

    def clear(self) -> None:
        """Forgets every counter."""
        keys, _ = self.export()
        if keys.numel():
            self.index.backend.erase(self.index, keys)

    def load(self, keys: torch.Tensor, counts: torch.Tensor) -> None:
        """Sets the counts of distinct ``keys`` (K,) to ``counts`` (K,) (e.g. from a checkpoint);
        raises CapacityError if the counter table cannot hold them all without evicting."""
        ix, be = self.index, self.index.backend
        if keys.shape != counts.shape or keys.dim() != 1:
            raise InputError(f"admission counters: keys and counts must be matching 1-D "
                             f"tensors, found {tuple(keys.shape)} and {tuple(counts.shape)}.")
        keys = keys.to(ix.keys.device, torch.int64)
        slots = be.find(ix, keys, self._no_scores, P_NO_EVICTION, 0, False, True)
        miss = slots < 0
        if bool(miss.any()):  # never evicts: a key without a free slot fails
            new_slots, fresh, _ = be.insert(ix, keys[miss], self._no_scores, P_NO_EVICTION, 0)
            slots[miss] = new_slots
        be.unpin(ix, slots)
        if bool(miss.any()) and bool((new_slots < 0).any()):
            be.erase(ix, keys[miss][fresh])  # roll back
            raise CapacityError(f"admission counters: {int((new_slots < 0).sum())} keys do not "
                                f"fit the counter table of {ix.num_slots} slots without evicting; "
                                "nothing was loaded. Raise Admission.counter_capacity.")
        ix.scores[slots] = counts.to(ix.scores)

    @property
    def counter_evictions(self) -> int:
        return self.index.count(C_EVICTED)

    def size(self) -> int:
        return self.index.size()
