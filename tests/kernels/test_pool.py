"""Pooling forward on the compiled backend, split over 1, 2 and 3 threads by bags, bit for bit
as a plain loop summing each bag's rows in id order (the torch twin to rounding), however the
entries are numbered (the kernel prefetches by entry number, restarting where a part's first
ids or another numbering jump ahead), with rows in ``rows`` and in ``extra`` (negative
``src``), weights, MEAN and empty bags."""

from __future__ import annotations

import pytest
import torch

from dynemb.kernels.backend import NumbaBackend, TorchBackend


def _case(seed: int, dim: int, numbering: str):
    g = torch.Generator().manual_seed(seed)
    batch, feats = 700, 2  # over MIN_PER_PART bags per part at 3 threads
    lengths = torch.randint(0, 5, (feats * batch,), generator=g)
    n = int(lengths.sum())
    keys = torch.randint(0, n // 3, (n,), generator=g)
    _, inverse = torch.unique(keys, return_inverse=True)
    n_u = int(inverse.max()) + 1
    if numbering == "first":  # as the lookups number entries
        first = torch.full((n_u,), n, dtype=torch.int64).scatter_reduce(
            0, inverse, torch.arange(n), "amin")
        rank = torch.empty(n_u, dtype=torch.int64)
        rank[torch.argsort(first)] = torch.arange(n_u)
        inverse = rank[inverse]
    elif numbering == "descending":
        inverse = n_u - 1 - inverse
    else:
        inverse = torch.randperm(n_u, generator=g)[inverse]
    rows, extra = torch.randn(3 * n_u, dim + 2, generator=g), torch.randn(n_u, dim, generator=g)
    src = torch.randperm(3 * n_u, generator=g)[:n_u]
    ddr = torch.rand(n_u, generator=g) < 0.3
    src[ddr] = -1 - torch.randperm(n_u, generator=g)[:int(ddr.sum())]
    return rows, extra, src, inverse, lengths, batch


def _reference(rows, extra, src, inverse, lengths, weights, batch, dim, mean):
    out = torch.zeros(batch, 2 * dim)
    i = 0
    for bag, n in enumerate(lengths.tolist()):
        f, b = divmod(bag, batch)
        acc = torch.zeros(dim)
        for _ in range(n):
            s = int(src[inverse[i]])
            e = rows[s, :dim] if s >= 0 else extra[-s - 1, :dim]
            w = weights[i] if weights.numel() else torch.tensor(1.0)
            acc += w * e
            i += 1
        if mean and n > 1:
            acc *= torch.tensor(1.0 / n, dtype=torch.float32)
        out[b, f * dim:(f + 1) * dim] = acc
    return out


@pytest.mark.parametrize("numbering", ["first", "descending", "shuffled"])
@pytest.mark.parametrize("weighted,mean", [(False, False), (True, True)],
                         ids=["sum", "weighted-mean"])
def test_any_numbering_and_thread_count_pools_bit_for_bit(numbering, weighted, mean):
    dim = 5
    rows, extra, src, inverse, lengths, batch = _case(len(numbering), dim, numbering)
    g = torch.Generator().manual_seed(7)
    weights = torch.rand(inverse.numel(), generator=g) + 0.5 if weighted else torch.empty(0)
    want = _reference(rows, extra, src, inverse, lengths, weights, batch, dim, mean)
    for threads in (1, 2, 3):
        out = torch.full((batch, 2 * dim), float("nan"))
        NumbaBackend(threads).pool(rows, extra, src, inverse, lengths, weights, batch, dim, mean,
                                   out)
        assert torch.equal(out.view(torch.int32), want.view(torch.int32)), threads
    out = torch.full((batch, 2 * dim), float("nan"))  # the torch twin: the same to rounding
    TorchBackend().pool(rows, extra, src, inverse, lengths, weights, batch, dim, mean, out)
    torch.testing.assert_close(out, want)
