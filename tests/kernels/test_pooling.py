"""The compiled pooling kernels against plain loops, bit for bit, however the entries are
numbered (by first occurrence as the lookups number them, descending, shuffled).

Backward overwrites its gradient buffer: whatever ``grads`` held before, each entry's row ends
as the sum of its ids' terms in id order (the numba kernel zeroes rows just before their first
id, a block at a time). Forward, split over 1, 2 and 3 threads by bags, sums each bag's rows in
id order (the torch twin to rounding; the numba kernel prefetches by entry number, restarting
where a part's first ids or another numbering jump ahead), with rows in ``rows`` and in
``extra`` (negative ``src``), weights, MEAN and empty bags."""

from __future__ import annotations

import pytest
import torch

from dynemb.kernels import pooling_numba
from dynemb.kernels.backend import NUMBA, TORCH, NumbaBackend, TorchBackend


def _entries(n: int, numbering: str, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """(the entry of each of ``n`` ids, with repeats, numbered by first occurrence as the lookups
    number them, descending or shuffled; the number of entries)."""
    keys = torch.randint(0, max(1, n // 3), (n,), generator=g)
    _, inverse = torch.unique(keys, return_inverse=True)
    n_u = int(inverse.max()) + 1 if n else 0
    if numbering == "first":
        first = torch.full((n_u,), n, dtype=torch.int64).scatter_reduce(
            0, inverse, torch.arange(n), "amin")
        rank = torch.empty(n_u, dtype=torch.int64)
        rank[torch.argsort(first)] = torch.arange(n_u)
        inverse = rank[inverse]
    elif numbering == "descending":
        inverse = n_u - 1 - inverse
    elif numbering == "shuffled":
        inverse = torch.randperm(n_u, generator=g)[inverse]
    return inverse, n_u


def _case(seed: int, dim: int, numbering: str, weighted: bool, n_u_extra: int):
    """gout, the arguments of pool_backward after gout, and U (entries)."""
    g = torch.Generator().manual_seed(seed)
    batch, feats = 40, 2
    lengths = torch.randint(0, 7, (feats * batch,), generator=g)
    n = int(lengths.sum())
    inverse, n_u = _entries(n, numbering, g)
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


@pytest.mark.parametrize("numbering", ["first", "descending", "shuffled"])
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


def _forward_case(seed: int, dim: int, numbering: str):
    g = torch.Generator().manual_seed(seed)
    batch, feats = 700, 2  # over MIN_PER_PART bags per part at 3 threads
    lengths = torch.randint(0, 5, (feats * batch,), generator=g)
    inverse, n_u = _entries(int(lengths.sum()), numbering, g)
    rows, extra = torch.randn(3 * n_u, dim + 2, generator=g), torch.randn(n_u, dim, generator=g)
    src = torch.randperm(3 * n_u, generator=g)[:n_u]
    ddr = torch.rand(n_u, generator=g) < 0.3
    src[ddr] = -1 - torch.randperm(n_u, generator=g)[:int(ddr.sum())]
    return rows, extra, src, inverse, lengths, batch


def _forward_reference(rows, extra, src, inverse, lengths, weights, batch, dim, mean):
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
    rows, extra, src, inverse, lengths, batch = _forward_case(len(numbering), dim, numbering)
    g = torch.Generator().manual_seed(7)
    weights = torch.rand(inverse.numel(), generator=g) + 0.5 if weighted else torch.empty(0)
    want = _forward_reference(rows, extra, src, inverse, lengths, weights, batch, dim, mean)
    for threads in (1, 2, 3):
        out = torch.full((batch, 2 * dim), float("nan"))
        NumbaBackend(threads).pool(rows, extra, src, inverse, lengths, weights, batch, dim, mean,
                                   out)
        assert torch.equal(out.view(torch.int32), want.view(torch.int32)), threads
    out = torch.full((batch, 2 * dim), float("nan"))  # the torch twin: the same to rounding
    TorchBackend().pool(rows, extra, src, inverse, lengths, weights, batch, dim, mean, out)
    torch.testing.assert_close(out, want)
