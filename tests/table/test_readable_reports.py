"""TableStats and MemoryUsage print readably: occupancy, load factor, both hit rates and what
they measure, every non-zero counter; bytes per tier in binary units."""

from __future__ import annotations

import torch

import dynemb
from dynemb.units import human_bytes


def test_stats_and_memory_print_readably():
    table = dynemb.DynamicTable(dynemb.TableConfig(
        name="t", dim=8, features=["a"], capacity=1000,
        storage=dynemb.Storage(mode=dynemb.StorageMode.CACHING, cache_load_factor=0.5)))
    table.lookup(torch.arange(600), train=True)
    table.lookup(torch.arange(300), train=True)
    text = str(table.stats())
    assert text.startswith("600 of 1,024 rows (load factor 0.586)")
    assert "900 lookups: hit rate 0.3333 (key had a row), hbm hit rate 0.3333" in text
    assert "inserted 600" in text and "evicted" not in text  # zero counters are left out
    mem = str(table.memory_usage())
    assert mem.startswith("hbm 35.00 KiB (rows 16.00 KiB, index 19.00 KiB); ddr 61.00 KiB")
    assert "TierMemory(" in repr(table.memory_usage())  # repr keeps the exact fields


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 512, 1536, 3 << 30, 5 << 40)] == \
        ["0 B", "512 B", "1.50 KiB", "3.00 GiB", "5.00 TiB"]
