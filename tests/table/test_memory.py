"""The table memory formula (planner side) against a built table's live tensors."""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb import SGD, Adagrad, Adam, Admission, RowWiseAdagrad

OPTIMIZERS = {
    "sgd": (SGD(), lambda d: 0),
    "adagrad": (Adagrad(), lambda d: d),
    "rowwise_adagrad": (RowWiseAdagrad(), lambda d: 1),
    "adam": (Adam(), lambda d: 2 * d),
}


def _live_bytes(t: dynemb.DynamicTable) -> int:
    """Bytes of every tensor the table holds, counted independently of memory_usage()."""
    total = t.rows.numel() * t.rows.element_size()
    for ix in [t.index] + ([t.admission.index] if t.admission is not None else []):
        for name in ("keys", "scores", "digests", "pins"):
            x = getattr(ix, name)
            total += x.numel() * x.element_size()
    return total


def _slots(capacity: int, bucket: int) -> int:
    """Plain-Python capacity rounding: one bucket of the next power of two (>= 8) when the
    table is smaller than a bucket, else whole buckets of ``bucket`` slots."""
    if capacity <= bucket:
        width = 8
        while width < capacity:
            width *= 2
        return width
    return -(-capacity // bucket) * bucket


@pytest.mark.parametrize("admission", [None, Admission(threshold=2, counter_capacity=300)])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("dim, capacity, bucket", [(4, 8, 128), (16, 1000, 128), (3, 70, 32)])
def test_table_memory_equals_memory_usage(backend, table_config, opt, admission, dim, capacity,
                                          bucket):
    optimizer, width = OPTIMIZERS[opt]
    cfg = table_config(dim=dim, capacity=capacity, bucket_capacity=bucket, optimizer=optimizer,
                       admission=admission)
    planned = dynemb.table_memory(cfg)
    t = dynemb.DynamicTable(cfg, backend=backend)
    live = t.memory_usage()
    for field in ("values_bytes", "optimizer_state_bytes", "index_bytes", "admission_bytes"):
        a, b = getattr(planned, field), getattr(live, field)
        assert abs(a - b) <= 0.02 * max(a, b), field
        assert a == b, field
    assert planned.total_bytes == live.total_bytes
    # Both describe what is really allocated.
    assert abs(live.total_bytes - _live_bytes(t)) <= 0.02 * _live_bytes(t)
    slots = t.capacity()
    assert slots == _slots(capacity, bucket) >= capacity
    assert planned.values_bytes == slots * dim * 4
    assert planned.optimizer_state_bytes == slots * width(dim) * 4
    assert planned.index_bytes == slots * (8 + 8 + 1 + 4)
    if admission is None:
        assert planned.admission_bytes == 0
    else:
        assert planned.admission_bytes == _slots(300, 128) * (8 + 8 + 1 + 4) > 0
    assert t.rows.shape == (slots, dim + width(dim))


def test_memory_usage_does_not_change_with_use(make_table):
    t = make_table(capacity=64, optimizer=Adam(),
                   admission=Admission(threshold=2, counter_capacity=64))
    before = t.memory_usage()
    t.find_or_insert(torch.arange(50, dtype=torch.int64))
    t.lookup(torch.arange(100, 130, dtype=torch.int64), train=True)
    assert t.memory_usage() == before


@pytest.mark.parametrize("capacity, bucket", [(1, 8), (5, 128), (8, 8), (9, 8), (100, 16),
                                              (1025, 1024), (3000, 128), (129, 256)])
def test_capacity_is_whole_buckets_and_at_least_requested(backend, table_config, capacity, bucket):
    cfg = table_config(capacity=capacity, bucket_capacity=bucket)
    t = dynemb.DynamicTable(cfg, backend=backend)
    assert t.capacity() == _slots(capacity, bucket) >= capacity
    nb, width = t.index.num_buckets, t.index.width
    assert nb * width == t.capacity()
    assert width & (width - 1) == 0 and 8 <= width <= bucket
    assert (nb - 1) * width < capacity  # no spare bucket
    assert dynemb.table_memory(cfg).values_bytes == t.capacity() * 4 * 4


def test_memory_grows_with_state_width(table_config):
    sizes = {name: dynemb.table_memory(table_config(dim=8, capacity=128, optimizer=o)).total_bytes
             for name, (o, _) in OPTIMIZERS.items()}
    assert sizes["sgd"] < sizes["rowwise_adagrad"] < sizes["adagrad"] < sizes["adam"]
    assert sizes["adam"] - sizes["sgd"] == 128 * 16 * 4
