"""Each backend's ``all_finite`` (the check a gradient passes before the fused update) against
``torch.isfinite(t).all()``: one NaN or infinity anywhere, at the edges of every thread's range
too, is found; finite values whose sum overflows pass."""

from __future__ import annotations

import math

import pytest
import torch

from dynemb.kernels.backend import NumbaBackend, TorchBackend
from dynemb.kernels.threads import ranges

N = 5000  # (over MIN_PER_PART per thread at 3 threads: every count splits the work)


def _backends():
    return [NumbaBackend(threads=k) for k in (1, 2, 3)] + [TorchBackend()]


def _positions() -> list[int]:
    edges = {p for k in (2, 3) for lo, hi in ranges(N, k) for p in (lo, hi - 1)}
    return sorted(edges | {1, 17, N // 2 + 5})


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: f"{b.name}-{b.__dict__}")
def test_one_bad_element_anywhere_is_found(backend):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(N, generator=g)
    assert backend.all_finite(t)
    for pos in _positions():
        for bad in (math.nan, math.inf, -math.inf):
            u = t.clone()
            u[pos] = bad
            assert not backend.all_finite(u), (pos, bad)


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: f"{b.name}-{b.__dict__}")
def test_shapes_dtypes_and_overflowing_sums(backend):
    big = torch.full((N,), 3e38)  # finite, but their float32 sum is not
    big[N - 1] = torch.finfo(torch.float32).max
    assert backend.all_finite(big) and backend.all_finite(big.view(50, 100))
    assert backend.all_finite(torch.empty(0)) and backend.all_finite(torch.empty(0, 4))
    t = torch.randn(100, 50)
    t[7, 3] = math.nan
    assert not backend.all_finite(t) and not backend.all_finite(t.t())  # not contiguous
    assert backend.all_finite(t[:7]) and backend.all_finite(t[8:].t())
    d = torch.randn(N, dtype=torch.float64)
    assert backend.all_finite(d)
    d[N - 1] = math.inf
    assert not backend.all_finite(d)
    assert not backend.all_finite(torch.tensor([1e300], dtype=torch.float64).float())
