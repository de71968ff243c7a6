"""torchrec interop: KeyedJaggedTensor in, KeyedTensor / JaggedTensor out, torchrec table configs.

torchrec is optional: it is imported only when one of these is used, and a missing torchrec is
an ImportError naming the package. Layouts are torchrec's:

- a ``KeyedJaggedTensor`` is feature-major like a :class:`~dynemb.SparseBatch` (keys, values,
  lengths or offsets, optional weights); int32 lengths or offsets are accepted, ids of any
  integer dtype become int64;
- a ``KeyedTensor`` of pooled embeddings is ``(B, Σ dim)`` with ``key_dim=1`` and one
  ``length_per_key`` entry (the dim) per feature, in the collection's feature order;
- table configs map ``capacity`` to ``num_embeddings`` (a dynamic table's row budget: its ids
  are raw int64, not indices below it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from dynemb.batch import SparseBatch
from dynemb.config import PoolingMode, TableConfig
from dynemb.errors import InputError

if TYPE_CHECKING:  # pragma: no cover
    from dynemb.nn.modules import JaggedEmbeddings, KeyedEmbeddings


def torchrec() -> Any:
    """The torchrec package, or ImportError saying how to get it."""
    try:
        import torchrec as module  # noqa: PLC0415  (optional dependency, imported lazily)
    except ImportError as e:
        raise ImportError(
            "dynemb's torchrec interop needs the torchrec package (and fbgemm-gpu-cpu), which "
            f"could not be imported ({e}); `make install` installs the pinned versions.") from e
    return module


def is_kjt(obj: object) -> bool:
    """Whether ``obj`` is a torchrec KeyedJaggedTensor (without importing torchrec)."""
    cls = type(obj)
    return cls.__name__ == "KeyedJaggedTensor" and cls.__module__.startswith("torchrec")


def batch_from_kjt(kjt: Any) -> SparseBatch:
    """The :class:`SparseBatch` of a KeyedJaggedTensor (see the module docs)."""
    if not is_kjt(kjt):
        raise InputError(f"SparseBatch.from_kjt: expected a torchrec KeyedJaggedTensor, found "
                         f"{type(kjt).__name__}.")
    if kjt.variable_stride_per_key():
        raise InputError("SparseBatch.from_kjt: the KeyedJaggedTensor has a batch size per "
                         "feature (variable stride); dynemb batches have one batch size for "
                         "every feature.")
    values = kjt.values()
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise InputError(f"SparseBatch.from_kjt: expected integer ids, found {values.dtype}.")
    weights = kjt.weights_or_none()
    return SparseBatch(features=list(kjt.keys()), values=values.to(torch.int64),
                       lengths=kjt.lengths().to(torch.int64),
                       weights=None if weights is None else weights.to(torch.float32))


def batch_to_kjt(batch: SparseBatch) -> Any:
    """The KeyedJaggedTensor of a :class:`SparseBatch` (int64 values and lengths)."""
    kjt_class = torchrec().sparse.jagged_tensor.KeyedJaggedTensor
    return kjt_class(keys=list(batch.features), values=batch.values,
                     lengths=batch.lengths.to(torch.int64), weights=batch.weights,
                     stride=batch.batch_size)


def keyed_tensor(emb: KeyedEmbeddings) -> Any:
    """torchrec's KeyedTensor of pooled embeddings (the same values tensor, ``key_dim=1``)."""
    kt_class = torchrec().sparse.jagged_tensor.KeyedTensor
    return kt_class(keys=list(emb.keys()), length_per_key=list(emb.dims()), values=emb.values(),
                    key_dim=1)


def jagged_tensors(embs: dict[str, JaggedEmbeddings]) -> dict[str, Any]:
    """``{feature: torchrec JaggedTensor}`` of an EmbeddingCollection's output."""
    jt_class = torchrec().sparse.jagged_tensor.JaggedTensor
    return {name: jt_class(values=e.values, lengths=e.lengths) for name, e in embs.items()}


def bag_configs(configs: Sequence[TableConfig]) -> list[Any]:
    """torchrec ``EmbeddingBagConfig`` objects describing pooled tables."""
    modules = torchrec().modules.embedding_configs
    pooling = {PoolingMode.SUM: modules.PoolingType.SUM, PoolingMode.MEAN: modules.PoolingType.MEAN}
    return [modules.EmbeddingBagConfig(name=c.name, embedding_dim=c.dim,
                                       num_embeddings=c.capacity, feature_names=list(c.features),
                                       pooling=pooling[c.pooling]) for c in configs]


def sequence_configs(configs: Sequence[TableConfig]) -> list[Any]:
    """torchrec ``EmbeddingConfig`` objects describing unpooled tables."""
    modules = torchrec().modules.embedding_configs
    return [modules.EmbeddingConfig(name=c.name, embedding_dim=c.dim, num_embeddings=c.capacity,
                                    feature_names=list(c.features)) for c in configs]
