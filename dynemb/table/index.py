"""The hash index of one table: its tensors, geometry and the backend that runs its kernels."""

from __future__ import annotations

import torch

from dynemb.kernels.index_numba import C_SIZE_DELTA, EMPTY_KEY, NUM_COUNTS, PIN_FREE
from dynemb.table.memory import index_geometry


class HashIndex:
    """Buckets of ``width`` slots: keys, scores, digests and pins (see ``kernels.index_numba``).

    Args:
        capacity: minimum number of slots.
        bucket_capacity: slots per bucket (power of two).
        device: where the tensors live.
        backend: a kernel backend from ``dynemb.kernels.backend``.
    """

    def __init__(self, capacity: int, bucket_capacity: int, device: torch.device, backend) -> None:
        self.num_buckets, self.width = index_geometry(capacity, bucket_capacity)
        n = self.num_buckets * self.width
        self.backend = backend
        self.keys = torch.full((n,), EMPTY_KEY, dtype=torch.int64, device=device)
        self.scores = torch.zeros(n, dtype=torch.int64, device=device)
        self.digests = torch.zeros(n, dtype=torch.uint8, device=device)
        self.pins = torch.full((n,), PIN_FREE, dtype=torch.int32, device=device)
        self.counts = torch.zeros(NUM_COUNTS, dtype=torch.int64, device=device)

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

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.scores, self.digests, self.pins))
