"""Single-process embedding modules over dynamic tables."""

from dynemb.nn.modules import (
    EmbeddingBagCollection, EmbeddingCollection, JaggedEmbeddings, KeyedEmbeddings,
)

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection", "JaggedEmbeddings", "KeyedEmbeddings"]
