"""The one memory formula of a table, importable without building one.

The planner calls :func:`table_memory`; ``DynamicTable.memory_usage()`` reports the same
breakdown from the live tensors, and a test checks the two agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dynemb.config import TableConfig
from dynemb.optim.rules import state_width

VALUE_BYTES = 4  # float32
INDEX_BYTES_PER_SLOT = 8 + 8 + 1 + 4  # key, score, digest, pin (lookup scratch)
COUNTER_BUCKET = 128
MIN_BUCKET = 8  # the smallest bucket (TableConfig.bucket_capacity's lower bound)


@dataclass(frozen=True, kw_only=True)
class MemoryUsage:
    """Bytes of one table (or shard) by kind."""

    values_bytes: int
    """Embeddings: slots x dim x 4."""
    optimizer_state_bytes: int
    """Optimizer state stored next to the embeddings."""
    index_bytes: int
    """Hash index metadata: key, score, digest and pin per slot."""
    admission_bytes: int
    """The admission counter table (0 without admission)."""

    @property
    def total_bytes(self) -> int:
        return self.values_bytes + self.optimizer_state_bytes + self.index_bytes + self.admission_bytes


def index_geometry(capacity: int, bucket_capacity: int) -> tuple[int, int]:
    """(num_buckets, bucket width) for at least ``capacity`` slots; a table smaller than one
    bucket gets a single bucket of the next power of two (at least MIN_BUCKET slots)."""
    width = max(MIN_BUCKET, min(bucket_capacity, 1 << max(0, (capacity - 1).bit_length())))
    return math.ceil(capacity / width), width


def table_memory(config: TableConfig) -> MemoryUsage:
    """Bytes the table of ``config`` takes once built (all tensors are allocated up front)."""
    nb, width = index_geometry(config.capacity, config.bucket_capacity)
    slots = nb * width
    admission = 0
    if config.admission is not None:
        cnb, cw = index_geometry(config.admission.counter_capacity, COUNTER_BUCKET)
        admission = cnb * cw * INDEX_BYTES_PER_SLOT
    return MemoryUsage(
        values_bytes=slots * config.dim * VALUE_BYTES,
        optimizer_state_bytes=slots * state_width(config.optimizer, config.dim) * VALUE_BYTES,
        index_bytes=slots * INDEX_BYTES_PER_SLOT,
        admission_bytes=admission,
    )
