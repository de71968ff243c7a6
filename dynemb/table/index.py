"""The hash index of one table: its tensors, geometry and the backend that runs its kernels."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dynemb.kernels.index_numba import C_SIZE_DELTA, EMPTY_KEY, NUM_COUNTS, PIN_FREE

# (name, numel, dtype, fill) -> tensor: where an index keeps its persistent arrays
Alloc = Callable[[str, int, torch.dtype, int], torch.Tensor]


def device_alloc(device: torch.device) -> Alloc:
    """Allocates filled tensors on ``device``."""
    return lambda name, n, dtype, fill: torch.full((n,), fill, dtype=dtype, device=device)


class HashIndex:
    """Buckets of ``width`` slots: keys, scores, digests, pins and write steps (see
    ``kernels.index_numba``).

    Args:
        num_buckets, width: the geometry (``dynemb.table.memory.index_geometry``).
        device: where the tensors live.
        backend: a kernel backend from ``dynemb.kernels.backend``.
        split: buckets ``[0, split)`` are a HYBRID table's hbm tier (default: all, one tier).
        alloc: where keys, scores, digests and write steps live (default: ``device``; a
            memory-mapped backing store passes its files). Pins are lookup scratch, always on
            ``device``.
    """

    def __init__(self, num_buckets: int, width: int, device: torch.device, backend, *,
                 split: int | None = None, alloc: Alloc | None = None) -> None:
        self.num_buckets, self.width = num_buckets, width
        self.split = num_buckets if split is None else split
        n = num_buckets * width
        alloc = alloc or device_alloc(device)
        self.backend = backend
        self.keys = alloc("keys", n, torch.int64, EMPTY_KEY)
        self.scores = alloc("scores", n, torch.int64, 0)
        self.digests = alloc("digests", n, torch.uint8, 0)
        self.written = alloc("written", n, torch.int64, 0)
        """Table step of each slot's last write (insert, optimizer update, assign, load)."""
        self.pins = torch.full((n,), PIN_FREE, dtype=torch.int32, device=device)
        self.counts = torch.zeros(NUM_COUNTS, dtype=torch.int64, device=device)
        self.counts[C_SIZE_DELTA] = int((self.digests >= 2).sum())  # a reopened store has rows

    @property
    def num_slots(self) -> int:
        return self.keys.numel()

    def size(self) -> int:
        """Occupied slots."""
        return int(self.counts[C_SIZE_DELTA])

    def count(self, which: int) -> int:
        return int(self.counts[which])

    def occupied(self, start: int, stop: int) -> torch.Tensor:
        """Slots in [start, stop) that hold a key (int64)."""
        return torch.nonzero(self.digests[start:stop] >= 2).flatten() + start

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slot of each key or -1, touching nothing."""
        return self.backend.find(self, keys, _NO_SCORES.to(keys.device), 0, 0, False, False)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.keys, self.scores, self.digests, self.pins, self.written))


_NO_SCORES = torch.empty(0, dtype=torch.int64)
