"""A CPU table's big arrays ask for transparent huge pages (``table.hostmem``)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import dynemb
from dynemb.table import hostmem

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_offered() -> bool:
    if not sys.platform.startswith("linux") or not os.path.exists(THP):
        return False
    return "[never]" not in open(THP).read()


@pytest.mark.parametrize(("shape", "fill", "dtype"), [
    ((3, 5), 0.0, torch.float32), ((1 << 20,), -1, torch.int64), ((1 << 21,), 7, torch.uint8)])
def test_host_full_is_torch_full(shape, fill, dtype):
    assert torch.equal(hostmem.host_full(shape, fill, dtype), torch.full(shape, fill, dtype=dtype))


def test_only_the_aligned_interior_of_a_large_tensor_is_advised():
    assert hostmem.advise_huge(torch.empty(1000)) == 0  # no whole huge page inside
    t = torch.empty(8 * hostmem.HUGE_PAGE, dtype=torch.uint8)
    asked = hostmem.advise_huge(t)
    if not _thp_offered():
        pytest.skip("this kernel offers no transparent huge pages")
    lo = -t.data_ptr() % hostmem.HUGE_PAGE
    assert asked == (t.numel() - lo) // hostmem.HUGE_PAGE * hostmem.HUGE_PAGE >= 7 * hostmem.HUGE_PAGE


def test_a_cpu_table_keeps_its_rows_and_index_in_huge_pages_where_offered():
    if not _thp_offered():
        pytest.skip("this kernel offers no transparent huge pages")
    t = dynemb.DynamicTable(dynemb.TableConfig(name="t", dim=16, features=["f"],
                                               capacity=1 << 20))
    # (rows of 64 MiB: fresh memory from the kernel, above glibc's largest mmap threshold;
    # smaller arrays may reuse heap pages already made small, which the kernel merges later)
    start = t.rows.data_ptr()
    assert _huge_bytes(start, start + t.rows.numel() * 4) >= 16 * hostmem.HUGE_PAGE


def _huge_bytes(start: int, end: int) -> int:
    """AnonHugePages of this process's mappings overlapping [start, end), in bytes."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and hi > start
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


def test_a_cpu_table_is_on_the_host_under_another_default_device():
    """``with torch.device(...)`` around model construction must not move a CPU table."""
    with torch.device("meta"):
        assert hostmem.host_full((4,), 0, torch.float32).device.type == "cpu"
        t = dynemb.DynamicTable(dynemb.TableConfig(name="t", dim=4, features=["f"],
                                                   capacity=64, bucket_capacity=8,
                                                   storage=dynemb.Storage(
                                                       mode=dynemb.StorageMode.HYBRID,
                                                       cache_load_factor=0.5)),
                                device=torch.device("cpu"))
    assert t.rows.device.type == "cpu" and t.index.keys.device.type == "cpu"
    assert t.store.ddr.device.type == "cpu"
    t.lookup(torch.tensor([1, 2, 3]), train=True)
    assert t.size() == 3
