"""Data for ``dynemb train``: MovieLens 100K (from the copy inside recbole), Criteo-like
synthetic data with a known best AUC, and a streaming reader of Criteo-format TSV files.

Every source yields :class:`Batch` (dense features, a :class:`~dynemb.SparseBatch`, labels);
:class:`Prefetcher` and :func:`worker_batches` build the next batches off the training thread.
"""

from dynemb.data.base import Batch, DataSource, FeatureInfo, empty_batch, string_id
from dynemb.data.criteo import CriteoTSV, parse_lines
from dynemb.data.movielens import MovieLens100K, Split
from dynemb.data.prefetch import Prefetcher, worker_batches
from dynemb.data.synthetic import SyntheticConfig, SyntheticData, SyntheticIterable

__all__ = [
    "Batch", "CriteoTSV", "DataSource", "FeatureInfo", "MovieLens100K", "Prefetcher", "Split",
    "SyntheticConfig", "SyntheticData", "SyntheticIterable", "empty_batch", "parse_lines",
    "string_id", "worker_batches",
]
