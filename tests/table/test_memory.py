"""The table memory formula (planner side) against a built table's live tensors."""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb import SGD, Adagrad, Adam, Admission, RowWiseAdagrad, StorageMode
from dynemb.table.memory import CACHE_BYTES_PER_SLOT, INDEX_BYTES_PER_SLOT

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
        for name in ("keys", "scores", "digests", "pins", "written"):
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
    assert planned.index_bytes == slots * (8 + 8 + 1 + 4 + 8)
    if admission is None:
        assert planned.admission_bytes == 0
    else:
        assert planned.admission_bytes == _slots(300, 128) * (8 + 8 + 1 + 4 + 8) > 0
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


def _tier_tensor_bytes(t: dynemb.DynamicTable) -> tuple[int, int]:
    """(hbm, ddr) bytes of every tensor the table holds, by where it lives, counted without
    memory_usage(): CPU tensors of a CPU table are hbm unless they are the ddr tier's."""
    def nbytes(*xs):
        return sum(x.numel() * x.element_size() for x in xs)

    def index(ix):
        return nbytes(ix.keys, ix.scores, ix.digests, ix.pins, ix.written)

    hbm = nbytes(t.store.hbm) + (index(t.admission.index) if t.admission is not None else 0)
    ddr = nbytes(t.store.ddr) if t.store.ddr is not None else 0
    if t.cache is not None:
        hbm += index(t.cache.index) + nbytes(t.cache.home, t.cache.dirty)
        ddr += index(t.index)
    else:
        hbm += index(t.index)
    return hbm, ddr


MODES = [(StorageMode.HBM_ONLY, 1.0)] + [(m, x) for m in (StorageMode.HYBRID, StorageMode.CACHING)
                                         for x in (0.1, 0.2, 0.5, 0.8, 1.0)]


@pytest.mark.parametrize("mode, x", MODES, ids=[f"{m.name}-{x}" for m, x in MODES])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_tier_memory_formula_matches_the_live_table(table_config, tmp_path, mode, x, opt):
    optimizer, width = OPTIMIZERS[opt]
    storage = dynemb.Storage(mode=mode, cache_load_factor=x)
    cfg = table_config(dim=16, capacity=10_000, optimizer=optimizer, storage=storage,
                       admission=Admission(threshold=2, counter_capacity=1000))
    planned = dynemb.table_memory(cfg)
    t = dynemb.DynamicTable(cfg)
    live = t.memory_usage()
    for tier in ("hbm", "ddr"):
        for field in ("values_bytes", "optimizer_state_bytes", "index_bytes", "admission_bytes"):
            a, b = getattr(getattr(planned, tier), field), getattr(getattr(live, tier), field)
            assert abs(a - b) <= 0.02 * max(a, b), (tier, field)
    hbm, ddr = _tier_tensor_bytes(t)
    assert abs(live.hbm_bytes - hbm) <= 0.02 * hbm and abs(live.ddr_bytes - ddr) <= 0.02 * max(ddr, 1)
    # The formulas: V = values + state of T rows.
    slots = t.capacity()
    v = slots * (16 + width(16)) * 4
    index = slots * INDEX_BYTES_PER_SLOT
    mode_in_force = storage.effective_mode
    if mode_in_force == StorageMode.HBM_ONLY:
        assert planned.ddr_bytes == 0 and planned.hbm.values_bytes + planned.hbm.optimizer_state_bytes == v
    elif mode_in_force == StorageMode.HYBRID:  # hbm = x V + index, ddr = (1 - x) V
        assert abs(planned.hbm_bytes - planned.admission_bytes - (x * v + index)) <= 0.02 * planned.hbm_bytes
        assert abs(planned.ddr_bytes - (1 - x) * v) <= 0.02 * planned.ddr_bytes
    else:  # hbm = x V + cache index, ddr = V + backing index
        cache_rows = t.layout.hbm_rows
        assert abs(cache_rows - x * slots) <= max(0.02 * x * slots, 8)
        assert planned.hbm.index_bytes == cache_rows * (INDEX_BYTES_PER_SLOT + CACHE_BYTES_PER_SLOT)
        assert planned.ddr_bytes == v + index
    # The planner's overrides: another mode and load factor without building a table.
    other = dynemb.table_memory(cfg, rows=20_000, mode=StorageMode.CACHING, cache_load_factor=0.5)
    assert other.ddr.values_bytes == dynemb.table_memory(table_config(
        dim=16, capacity=20_000, optimizer=optimizer)).values_bytes


def test_memory_mapped_ddr_tier_is_a_file_of_the_planned_size(table_config, tmp_path):
    storage = dynemb.Storage(mode=StorageMode.HYBRID, cache_load_factor=0.25, ddr_path=str(tmp_path))
    cfg = table_config(dim=8, capacity=4096, optimizer=Adam(), storage=storage)
    t = dynemb.DynamicTable(cfg)
    rows_file = tmp_path / "t.ddr.rows"
    assert rows_file.stat().st_size == dynemb.table_memory(cfg).ddr.values_bytes * 3
