"""The host row scatter (``rows_numba.scatter``: what ``insert_or_assign``, ``load_rows`` and the
tier moves write rows with) against numpy, on both of its paths: rows of 32 columns or more
copied through row slices, narrower ones element by element."""

from __future__ import annotations

import numpy as np
import pytest

from dynemb.kernels import rows_numba


@pytest.mark.parametrize("width,start,ncols", [(64, 0, 64), (100, 30, 70), (40, 8, 32),
                                               (16, 0, 16), (65, 64, 1), (40, 9, 31)])
def test_scatter_writes_the_columns_of_the_rows_given(width, start, ncols):
    rng = np.random.default_rng(width + start)
    rows = rng.standard_normal((50, width)).astype(np.float32)
    slots = rng.permutation(50)[:30].astype(np.int64)
    slots[::4] = -1  # no row: skipped
    values = rng.standard_normal((30, ncols)).astype(np.float32)
    want = rows.copy()
    ok = slots >= 0
    want[slots[ok], start:start + ncols] = values[ok]
    rows_numba.scatter(rows, slots, values, start)
    assert np.array_equal(rows, want)
