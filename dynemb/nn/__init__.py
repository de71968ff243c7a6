"""Single-process embedding modules over dynamic tables."""

from dynemb.nn.modules import (
    EmbeddingBagCollection, EmbeddingCollection, JaggedEmbeddings, KeyedEmbeddings, dense_only,
)

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection", "JaggedEmbeddings", "KeyedEmbeddings",
           "dense_only"]
