"""One rank's dynamic table: hash index + row store, scores and eviction, admission, init."""

from dynemb.table.memory import (
    Layout, MemoryUsage, TierMemory, index_geometry, shard_capacity, storage_layout, table_memory,
    working_set_bytes,
)
from dynemb.table.stats import Evicted, ExportBatch, FindResult, InsertResult, TableStats
from dynemb.table.table import DynamicTable, Lookup

__all__ = [
    "DynamicTable", "Evicted", "ExportBatch", "FindResult", "InsertResult", "Lookup",
    "Layout", "MemoryUsage", "TableStats", "TierMemory", "index_geometry", "shard_capacity",
    "storage_layout", "table_memory", "working_set_bytes",
]
