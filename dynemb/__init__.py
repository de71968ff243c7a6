"""dynemb: dynamic embedding tables for recommendation models in PyTorch.

Tables keyed by raw int64 ids with no vocabulary: rows are created on first sight, carry their
optimizer state, and are evicted by score when the table is full. Importing dynemb has no side
effects (no logging setup, no environment changes, no CUDA initialisation).
"""

from dynemb import errors
from dynemb.batch import EMPTY_KEY, SparseBatch
from dynemb.config import (
    SGD, Adagrad, Adam, Admission, Initializer, InitKind, NonFinite, OnFull, OptimizerConfig,
    PoolingMode, Routing, RowWiseAdagrad, ScorePolicy, Storage, StorageMode, TableConfig,
)
from dynemb.nn import EmbeddingBagCollection, EmbeddingCollection, JaggedEmbeddings, KeyedEmbeddings
from dynemb.table import (
    DynamicTable, Evicted, ExportBatch, FindResult, InsertResult, MemoryUsage, TableStats,
    TierMemory, table_memory,
)
from dynemb import distributed  # after nn: the sharded collections build on the modules
from dynemb import checkpoint  # after distributed: it saves and reshards sharded collections

__version__ = "0.1.0"


def __getattr__(name: str):  # noqa: ANN202  (PEP 562)
    """``dynemb.train`` (the pipelines, the training job) without importing it up front."""
    if name == "train":
        import importlib  # noqa: PLC0415

        return importlib.import_module("dynemb.train")
    raise AttributeError(f"module 'dynemb' has no attribute {name!r}")

__all__ = [
    "EMPTY_KEY", "SGD", "Adagrad", "Adam", "Admission", "DynamicTable", "EmbeddingBagCollection",
    "EmbeddingCollection", "Evicted", "ExportBatch", "FindResult", "InitKind", "Initializer",
    "InsertResult", "JaggedEmbeddings", "KeyedEmbeddings", "MemoryUsage", "NonFinite",
    "OnFull",
    "OptimizerConfig", "PoolingMode", "Routing", "RowWiseAdagrad", "ScorePolicy", "SparseBatch",
    "Storage", "StorageMode", "TableConfig", "TableStats", "TierMemory", "checkpoint",
    "distributed", "errors",
    "table_memory",
]
