"""DLRM (Naumov et al., 2019): a bottom MLP on dense features, dynamic embedding tables for the
sparse ones, pairwise dot-product interaction of all the vectors, and a top MLP.

::

    dense (B, D) ──bottom MLP──> x (B, d) ─┐
    sparse ids ──EmbeddingBagCollection──> e_1 … e_F (B, d each)
                                           └─> pairwise dots <v_i, v_j>, i < j, over [x, e_1 … e_F]
    top MLP([x, dots]) ──> logit (B,)

The embedding collection may be swapped for its sharded twin (``dynemb.distributed.shard``): the
model only calls it on a :class:`~dynemb.SparseBatch` and reads ``values()``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dynemb.batch import SparseBatch
from dynemb.config import TableConfig
from dynemb.errors import ConfigError, InputError
from dynemb.nn.modules import EmbeddingBagCollection


def mlp(sizes: Sequence[int], *, last_activation: bool) -> nn.Sequential:
    """Linear layers ``sizes[0] -> sizes[1] -> ...`` with ReLU between them (and after the last
    one if ``last_activation``)."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(sizes) - 2 or last_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def pairwise_dots(vectors: torch.Tensor) -> torch.Tensor:
    """The dot products of every pair of distinct vectors.

    Args:
        vectors: (B, n, d) float.
    Returns:
        (B, n·(n−1)/2): ``<v_i, v_j>`` for i < j, in row-major order of the upper triangle.
    """
    n = vectors.shape[1]
    gram = torch.bmm(vectors, vectors.transpose(1, 2))
    rows, cols = torch.triu_indices(n, n, offset=1, device=vectors.device)
    return gram[:, rows, cols]


class DLRM(nn.Module):
    """The DLRM click model.

    Args:
        dense_dim: D, the number of dense features (0: no bottom MLP).
        tables: one or more dynamic tables; their features, in order, are the sparse inputs.
            The interaction takes dot products of vectors of one dimension: without
            ``interaction_dim`` every table must have the same dim.
        interaction_dim: the vectors' dimension; a table of another dim is projected to it by a
            linear layer without bias (``projections[str(i)]`` for the i-th feature, keyed by
            position: a feature name may hold a dot), as DLRM variants with mixed dims do.
            None: the tables' one dim.
        bottom_mlp: hidden sizes of the bottom MLP; its output has ``dim`` units (ReLU).
        top_mlp: hidden sizes of the top MLP; its output is one logit.
        device: where the tables and the dense layers live.
        backend: the tables' kernel backend (None: numba on CPU, triton on CUDA).
    """

    def __init__(self, *, dense_dim: int, tables: Sequence[TableConfig],
                 bottom_mlp: Sequence[int] = (64,), top_mlp: Sequence[int] = (64, 32),
                 device: torch.device | str | None = None, backend: str | None = None,
                 interaction_dim: int | None = None) -> None:
        super().__init__()
        dims = {t.dim for t in tables}
        if interaction_dim is None and len(dims) != 1:
            raise ConfigError(f"DLRM: the dot interaction needs one embedding dimension for all "
                              f"tables, found {sorted(dims)} ({[t.name for t in tables]}); "
                              "give interaction_dim= to project them to one.")
        if dense_dim < 0:
            raise ConfigError(f"DLRM: dense_dim expected >= 0, found {dense_dim}.")
        self.dim = dims.pop() if interaction_dim is None else interaction_dim
        self.dense_dim = dense_dim
        self.embeddings: nn.Module = EmbeddingBagCollection(tables, device=device,
                                                            backend=backend)
        self.feature_names = tuple(f for t in tables for f in t.features)
        dims_of = [t.dim for t in tables for _ in t.features]
        self.projections = nn.ModuleDict({str(i): nn.Linear(d, self.dim, bias=False)
                                          for i, d in enumerate(dims_of) if d != self.dim})
        self.bottom = (mlp([dense_dim, *bottom_mlp, self.dim], last_activation=True)
                       if dense_dim else None)
        n = len(self.feature_names) + (1 if dense_dim else 0)
        top_in = n * (n - 1) // 2 + (self.dim if dense_dim else 0)
        self.top = mlp([top_in, *top_mlp, 1], last_activation=False)
        self.to(device or "cpu")

    def dense_parameters(self) -> list[nn.Parameter]:
        """The parameters a dense optimizer trains (the tables train themselves in backward)."""
        return list(self.parameters())

    def forward(self, dense: torch.Tensor, sparse: SparseBatch) -> torch.Tensor:
        """Click logits.

        Args:
            dense: (B, D) float32 dense features.
            sparse: ids of every feature of the tables, batch size B.
        Returns:
            (B,) float32 logits.
        """
        if dense.dim() != 2 or dense.shape[1] != self.dense_dim:
            raise InputError(f"DLRM: expected dense features of shape (B, {self.dense_dim}), "
                             f"found {tuple(dense.shape)}.")
        if sparse.batch_size != dense.shape[0]:
            raise InputError(f"DLRM: the sparse batch has {sparse.batch_size} samples, the dense "
                             f"features {dense.shape[0]}; expected them equal.")
        out = self.embeddings(sparse)
        if self.projections:
            vectors = torch.stack([self.projections[str(i)](out[f]) if str(i) in self.projections
                                   else out[f] for i, f in enumerate(self.feature_names)], dim=1)
        else:
            emb = out.values()
            vectors = emb.view(emb.shape[0], len(self.feature_names), self.dim)
        if self.bottom is None:
            return self.top(pairwise_dots(vectors)).squeeze(1)
        x = self.bottom(dense)
        dots = pairwise_dots(torch.cat([x[:, None, :], vectors], dim=1))
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)
