"""The compiled input distribution (``kernels.group_numba``, the CPU path of
``distributed.input_dist._group``) against the torch path (any device), element for element:
every routing mode, world sizes 1-5, pooled and sequence tables, repeated, negative and extreme
ids, empty bags and empty batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dynemb
from dynemb.distributed.input_dist import _group, _group_torch
from dynemb.kernels.group_numba import _sorted_by_key

POOL = [0, 1, 2, 3, 7, 8, 9, 63, 64, 99, 1000, -1, -2, -1000, 2**62, 2**63 - 1, -(2**63)]


@st.composite
def tables(draw):
    keys = draw(st.lists(st.sampled_from(POOL) | st.integers(-(2**63), 2**63 - 1),
                         max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(keys)), max_size=12)))
    bounds = [0, *cuts, len(keys)]
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    routing = draw(st.sampled_from(list(dynemb.Routing)))
    id_range = draw(st.sampled_from([1, 10, 100, 2**63])) if routing == dynemb.Routing.CONTINUOUS \
        else None
    config = dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=64, routing=routing,
                                id_range=id_range)
    return (torch.tensor(keys, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64),
            config, draw(st.integers(1, 5)), draw(st.booleans()))


@settings(max_examples=300, deadline=None)
@given(tables())
def test_compiled_grouping_equals_the_torch_one(case):
    keys, lengths, config, world_size, pooled = case
    got = _group(keys, lengths if pooled else None, config, world_size)
    want = _group_torch(keys, lengths if pooled else None, config, world_size)
    for name, a, b in zip(got._fields, got, want):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), name
        else:
            assert a == b, name


@pytest.mark.parametrize("keys", [[], [5], [3, -3, 3, 0, -(2**63), 2**63 - 1, 256, 255, -256]])
def test_the_radix_sort_orders_signed_keys(keys):
    x = torch.tensor(keys, dtype=torch.int64).numpy()
    order = _sorted_by_key(x)
    assert list(x[order]) == sorted(keys)


def test_a_large_batch_groups_alike():
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(-(2**40), 2**40, (20_000,), generator=g) % 5_000
    lengths = torch.full((2_000,), 10, dtype=torch.int64)
    config = dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=64)
    for w in (1, 2, 3):
        got, want = _group(keys, lengths, config, w), _group_torch(keys, lengths, config, w)
        for name, a, b in zip(got._fields, got, want):
            assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), name
