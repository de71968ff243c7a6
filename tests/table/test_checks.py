"""The distinct-keys check of ``insert_or_assign`` and ``load_rows``."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynemb.kernels.backend import NUMBA, TORCH


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-4, 12), max_size=40))
def test_first_repeat_matches_brute_force(keys):
    """The distinct-keys check (a hash set on the host, a sort elsewhere) names the first
    position whose key came before, and where it first came."""
    seen, want = {}, None
    for j, k in enumerate(keys):
        if k in seen:
            want = (seen[k], j)
            break
        seen[k] = j
    t = torch.tensor(keys, dtype=torch.int64)
    assert NUMBA.first_repeat(t) == want
    assert TORCH.first_repeat(t) == want
    assert NUMBA.first_repeat(t[::2]) == TORCH.first_repeat(t[::2].clone())  # (a strided view)
