"""One rank's dynamic table: hash index + row store, scores and eviction, admission, init."""

from dynemb.table.memory import (
    Layout, MemoryUsage, TierMemory, index_geometry, storage_layout, table_memory,
)
from dynemb.table.stats import Evicted, ExportBatch, FindResult, InsertResult, TableStats
from dynemb.table.table import DynamicTable, Lookup

__all__ = [
    "DynamicTable", "Evicted", "ExportBatch", "FindResult", "InsertResult", "Lookup",
    "Layout", "MemoryUsage", "TableStats", "TierMemory", "index_geometry", "storage_layout",
    "table_memory",
]
