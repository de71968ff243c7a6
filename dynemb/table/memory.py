"""The one memory formula of a table, per storage tier, importable without building one.

The planner calls :func:`table_memory` with any (config, world size, mode, cache_load_factor);
``DynamicTable.memory_usage()`` reports the same breakdown from its live tensors, and a test
checks the two agree. :func:`storage_layout` is the geometry both use: the table builds exactly
the index and row stores it describes. :func:`shard_capacity` is the rows of one rank's shard,
for the planner and for ``dynemb.distributed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dynemb.config import StorageMode, TableConfig
from dynemb.errors import ConfigError
from dynemb.optim.rules import state_width
from dynemb.units import human_bytes

VALUE_BYTES = 4  # float32
INDEX_BYTES_PER_SLOT = 8 + 8 + 1 + 4 + 8  # key, score, digest, pin (lookup scratch), write step
CACHE_BYTES_PER_SLOT = 8 + 1  # a cache slot's backing-store slot and its dirty flag
COUNTER_BUCKET = 128
MIN_BUCKET = 8  # the smallest bucket (TableConfig.bucket_capacity's lower bound)


@dataclass(frozen=True, kw_only=True)
class TierMemory:
    """Bytes of one storage tier by kind."""

    values_bytes: int = 0
    """Embeddings: rows x dim x 4."""
    optimizer_state_bytes: int = 0
    """Optimizer state stored next to the embeddings."""
    index_bytes: int = 0
    """Hash index metadata: key, score, digest, pin and write step per slot (plus, for a cache,
    its backing slot and dirty flag)."""
    admission_bytes: int = 0
    """The admission counter table (0 without admission)."""
    working_bytes: int = 0
    """An estimate of the tensors one training step allocates and frees (see
    :func:`working_set_bytes`); 0 in what a built table reports."""

    @property
    def total_bytes(self) -> int:
        return (self.values_bytes + self.optimizer_state_bytes + self.index_bytes
                + self.admission_bytes + self.working_bytes)

    def __str__(self) -> str:
        parts = [("rows", self.values_bytes), ("optimizer state", self.optimizer_state_bytes),
                 ("index", self.index_bytes), ("admission", self.admission_bytes),
                 ("working set", self.working_bytes)]
        shown = ", ".join(f"{what} {human_bytes(n)}" for what, n in parts if n)
        return f"{human_bytes(self.total_bytes)}" + (f" ({shown})" if shown else "")


@dataclass(frozen=True, kw_only=True)
class MemoryUsage:
    """Bytes of one table (or shard) per tier: ``hbm`` (GPU memory, or RAM on a CPU host) and
    ``ddr`` (host memory or a memory-mapped file). The kind totals sum both tiers."""

    hbm: TierMemory
    ddr: TierMemory

    def _sum(self, name: str) -> int:
        return getattr(self.hbm, name) + getattr(self.ddr, name)

    @property
    def values_bytes(self) -> int:
        return self._sum("values_bytes")

    @property
    def optimizer_state_bytes(self) -> int:
        return self._sum("optimizer_state_bytes")

    @property
    def index_bytes(self) -> int:
        return self._sum("index_bytes")

    @property
    def admission_bytes(self) -> int:
        return self._sum("admission_bytes")

    @property
    def hbm_bytes(self) -> int:
        return self.hbm.total_bytes

    @property
    def ddr_bytes(self) -> int:
        return self.ddr.total_bytes

    @property
    def total_bytes(self) -> int:
        return self.hbm_bytes + self.ddr_bytes

    def __str__(self) -> str:
        return f"hbm {self.hbm}; ddr {self.ddr}"


@dataclass(frozen=True)
class Layout:
    """Where a table's rows live.

    ``num_buckets`` x ``width`` slots form the table's index (HBM_ONLY, HYBRID) or its backing
    store's (CACHING). Global row ids ``[0, hbm_rows)`` are in hbm, ``[hbm_rows, hbm_rows +
    ddr_rows)`` in ddr. HYBRID: index buckets ``[0, split)`` are the hbm rows (slot = row id).
    CACHING: the cache index has ``cache_buckets`` x ``cache_width`` slots = the hbm rows, the
    backing slot s is row ``hbm_rows + s``.
    """

    mode: StorageMode
    num_buckets: int
    width: int
    split: int
    hbm_rows: int
    ddr_rows: int
    cache_buckets: int = 0
    cache_width: int = 0

    @property
    def slots(self) -> int:
        """Slots of the table as a whole (its capacity)."""
        return self.num_buckets * self.width


def index_geometry(capacity: int, bucket_capacity: int) -> tuple[int, int]:
    """(num_buckets, bucket width) for at least ``capacity`` slots; a table smaller than one
    bucket gets a single bucket of the next power of two (at least MIN_BUCKET slots)."""
    width = max(MIN_BUCKET, min(bucket_capacity, 1 << max(0, (capacity - 1).bit_length())))
    return math.ceil(capacity / width), width


def storage_layout(capacity: int, bucket_capacity: int, mode: StorageMode,
                   cache_load_factor: float) -> Layout:
    """The index geometry and rows per tier of a table of ``capacity`` rows.

    ``cache_load_factor`` 1.0 is HBM_ONLY in any mode. HYBRID puts ``round(x * num_buckets)``
    buckets (at least one per tier) in hbm; CACHING caches ``ceil(x * slots)`` rows.
    """
    x = cache_load_factor
    if x is None or (mode == StorageMode.AUTO and x != 1.0):
        raise ConfigError(f"storage_layout: mode {mode.name} with cache_load_factor {x} is left to "
                          "the planner; expected a planned mode and cache_load_factor.")
    nb, width = index_geometry(capacity, bucket_capacity)
    slots = nb * width
    if x == 1.0 or mode == StorageMode.HBM_ONLY:
        return Layout(StorageMode.HBM_ONLY, nb, width, nb, slots, 0)
    if mode == StorageMode.HYBRID:
        if nb < 2:
            raise ConfigError(
                f"Storage: HYBRID splits whole buckets between the tiers and needs at least 2, "
                f"found {nb} (capacity {capacity}, bucket_capacity {bucket_capacity}); raise "
                "capacity or lower bucket_capacity.")
        split = min(nb - 1, max(1, round(x * nb)))
        return Layout(StorageMode.HYBRID, nb, width, split, split * width, slots - split * width)
    cnb, cwidth = index_geometry(math.ceil(x * slots), bucket_capacity)
    return Layout(StorageMode.CACHING, nb, width, nb, cnb * cwidth, slots, cnb, cwidth)


def shard_capacity(capacity: int, world_size: int) -> int:
    """Rows of one rank's shard of a table of global ``capacity``: ``ceil(capacity / W)`` (each
    shard then rounds up to whole buckets, as every table does)."""
    for name, v in (("capacity", capacity), ("world_size", world_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"shard_capacity: expected {name} an int >= 1, found {v!r}.")
    return -(-capacity // world_size)


def working_set_bytes(config: TableConfig, ids_per_step: int, world_size: int = 1,
                      mode: StorageMode | None = None) -> int:
    """An estimate of the bytes one training step of a table's shard allocates on top of its
    tables: ``ids_per_step`` (the ids this rank's shard looks up per step) times, per id, its
    lookup arrays (key, slot, inverse, journal: 32 B), its weight (4 B), and three rows of ``dim``
    float32 (its gradient row, its row gathered for pooling, its pooled partial); with a ddr tier
    (``mode`` HYBRID or CACHING; default: the config's) one row more, the copy of a ddr row on
    its way between the tiers (gathered, copied in, written back); sharded, also the ids and
    partials of the all-to-alls (8 B + one row each way)."""
    if not isinstance(ids_per_step, int) or isinstance(ids_per_step, bool) or ids_per_step < 0:
        raise ConfigError(f"working_set_bytes: expected ids_per_step an int >= 0, found "
                          f"{ids_per_step!r}.")
    mode = config.storage.effective_mode if mode is None else mode
    row = config.dim * VALUE_BYTES
    per_id = 32 + 4 + (4 if mode in (StorageMode.HYBRID, StorageMode.CACHING) else 3) * row
    if world_size > 1:
        per_id += 2 * (8 + row)
    return ids_per_step * per_id


def _rows_bytes(rows: int, dim: int, state: int) -> dict[str, int]:
    return {"values_bytes": rows * dim * VALUE_BYTES,
            "optimizer_state_bytes": rows * state * VALUE_BYTES}


def table_memory(config: TableConfig, *, rows: int | None = None, mode: StorageMode | None = None,
                 cache_load_factor: float | None = None, world_size: int = 1,
                 ids_per_step: int = 0) -> MemoryUsage:
    """Bytes per tier of a table of ``config`` once built (every tensor is allocated up front),
    or of one rank's shard of it over ``world_size`` ranks.

    ``rows``, ``mode`` and ``cache_load_factor`` override the shard's capacity and the storage
    (the planner tries other options with them). ``ids_per_step`` > 0 adds the estimated working
    set of a training step to hbm (``working_bytes``, see :func:`working_set_bytes`).
    """
    storage = config.storage
    mode = storage.mode if mode is None else mode
    x = storage.cache_load_factor if cache_load_factor is None else cache_load_factor
    if mode == StorageMode.AUTO or x is None:
        storage.require_planned(config.name)  # raises: nothing to measure yet
    if rows is None:
        rows = shard_capacity(config.capacity, world_size)
    lay = storage_layout(rows, config.bucket_capacity, mode, x)
    dim, state = config.dim, state_width(config.optimizer, config.dim)
    admission = 0
    if config.admission is not None:
        cnb, cw = index_geometry(config.admission.counter_capacity, COUNTER_BUCKET)
        admission = cnb * cw * INDEX_BYTES_PER_SLOT
    if lay.mode == StorageMode.CACHING:
        hbm_index = lay.hbm_rows * (INDEX_BYTES_PER_SLOT + CACHE_BYTES_PER_SLOT)
        ddr_index = lay.slots * INDEX_BYTES_PER_SLOT
    else:
        hbm_index, ddr_index = lay.slots * INDEX_BYTES_PER_SLOT, 0
    return MemoryUsage(
        hbm=TierMemory(**_rows_bytes(lay.hbm_rows, dim, state), index_bytes=hbm_index,
                       admission_bytes=admission,
                       working_bytes=working_set_bytes(config, ids_per_step, world_size,
                                                       lay.mode)),
        ddr=TierMemory(**_rows_bytes(lay.ddr_rows, dim, state), index_bytes=ddr_index))
