"""One rank's dynamic table: hash index + row store, scores and eviction, admission, init."""

from dynemb.table.memory import MemoryUsage, index_geometry, table_memory
from dynemb.table.stats import Evicted, ExportBatch, FindResult, InsertResult, TableStats
from dynemb.table.table import DynamicTable, Lookup

__all__ = [
    "DynamicTable", "Evicted", "ExportBatch", "FindResult", "InsertResult", "Lookup",
    "MemoryUsage", "TableStats", "index_geometry", "table_memory",
]
