"""Pooling backward overwrites its gradient buffer: whatever ``grads`` held before, each entry's
row ends as the sum of its ids' terms in id order (the numba kernel zeroes rows just before
their first id, a block at a time), bit for bit as a plain loop summing into zeros, however
the entries are numbered."""

from __future__ import annotations

import pytest
import torch

from dynemb.kernels import pooling_numba
from dynemb.kernels.backend import NUMBA, TORCH


def _case(seed: int, dim: int, numbering: str, weighted: bool, n_u_extra: int):
    """gout, the arguments of pool_backward after gout, and U (entries)."""
    g = torch.Generator().manual_seed(seed)
    batch, feats = 40, 2
    lengths = torch.randint(0, 7, (feats * batch,), generator=g)
    n = int(lengths.sum())
    keys = torch.randint(0, max(1, n // 3), (n,), generator=g)
    _, inverse = torch.unique(keys, return_inverse=True)
    n_u = int(inverse.max()) + 1 if n else 0
    if numbering == "first":  # as the lookups number entries: by first occurrence
        first = torch.full((n_u,), n, dtype=torch.int64).scatter_reduce(
            0, inverse, torch.arange(n), "amin")
        rank = torch.empty(n_u, dtype=torch.int64)
        rank[torch.argsort(first)] = torch.arange(n_u)
        inverse = rank[inverse]
    elif numbering == "shuffled":
        inverse = torch.randperm(n_u, generator=g)[inverse]
    u = n_u + n_u_extra  # entries past the last id's: rows without ids
    weights = torch.rand(n, generator=g) + 0.5 if weighted else torch.empty(0)
    gout = torch.randn(batch, feats * dim, generator=g)
    rows = torch.empty(0, dim)
    return gout, (rows, rows, torch.empty(0, dtype=torch.int64), inverse, lengths, weights,
                  batch, dim), u


def _reference(gout, args, u, mean):
    """The sum per entry, id by id, into zeros."""
    _, _, _, inverse, lengths, weights, batch, dim = args
    out = torch.zeros(u, dim)
    i = 0
    for bag, n in enumerate(lengths.tolist()):
        f, b = divmod(bag, batch)
        row = gout[b, f * dim:(f + 1) * dim]
        scale = torch.tensor(1.0 / n if mean and n > 1 else 1.0, dtype=torch.float32)
        for _ in range(n):
            w = (weights[i] if weights.numel() else torch.tensor(1.0)) * scale
            out[inverse[i]] += w * row
            i += 1
    return out


@pytest.mark.parametrize("numbering", ["first", "shuffled"])
@pytest.mark.parametrize("dim", [3, 16, 64])
@pytest.mark.parametrize("weighted,mean", [(False, False), (True, True)],
                         ids=["sum", "weighted-mean"])
@pytest.mark.parametrize("backend", [NUMBA, TORCH], ids=["numba", "torch"])
def test_overwrites_garbage(backend, numbering, dim, weighted, mean):
    for seed, extra in ((dim, 0), (dim + 100, 37)):
        gout, args, u = _case(seed, dim, numbering, weighted, extra)
        assert u > 2 * pooling_numba._ZERO_AHEAD  # the zeroing crosses blocks
        grads = torch.full((u, dim), float("nan"))
        backend.pool_backward(gout, *args, mean, grads, torch.empty(0))
        ref = _reference(gout, args, u, mean)
        assert torch.equal(grads.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("backend", [NUMBA, TORCH], ids=["numba", "torch"])
def test_no_ids_zeroes_everything(backend):
    grads = torch.full((5, 4), float("nan"))
    empty = torch.empty(0, dtype=torch.int64)
    backend.pool_backward(torch.empty(0, 4), torch.empty(0, 4), torch.empty(0, 4), empty, empty,
                          torch.zeros(0, dtype=torch.int64), torch.empty(0), 0, 4, False, grads,
                          torch.empty(0))
    assert torch.equal(grads, torch.zeros(5, 4))
