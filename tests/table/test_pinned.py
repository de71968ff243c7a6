"""The ddr tier of a CUDA table is page-locked in chunks (``dynemb.table.pinned``).

CI has no CUDA runtime: a stand-in records the driver calls (tests/test_gpu.py runs the real
one). Checked: the chunks tile the rows exactly, none is larger than asked, they are unlocked
when the owner goes, and a failure part way unlocks what was locked and names the table.
"""

from __future__ import annotations

import gc

import pytest

from dynemb.errors import ConfigError
from dynemb.table.pinned import mapped_in_place, pinned_zeros


class Runtime:
    """Records cudaHostRegister / cudaHostUnregister; fails the registration numbered ``fail``."""

    def __init__(self, fail: int | None = None) -> None:
        self.locked: dict[int, int] = {}
        self.calls = 0
        self.fail = fail

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls += 1
        if self.calls == self.fail:
            return 2  # cudaErrorMemoryAllocation
        assert flags == 0 and ptr not in self.locked
        self.locked[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        del self.locked[ptr]
        return 0


class Owner:
    pass


@pytest.mark.parametrize(("rows", "chunk"), [(1000, 4096), (1024, 4096), (3, 1 << 20), (0, 64)])
def test_chunks_tile_the_rows_and_are_unlocked_with_their_owner(rows, chunk):
    rt, owner = Runtime(), Owner()
    t = pinned_zeros(rows, 8, owner=owner, name="t", chunk_bytes=chunk, runtime=rt)
    assert t.shape == (rows, 8) and not t.any()
    spans = sorted(rt.locked.items())
    assert all(size <= chunk for _, size in spans)
    assert sum(size for _, size in spans) == rows * 8 * 4
    pos = t.data_ptr()
    for ptr, size in spans:  # contiguous, in order, from the first byte
        assert ptr == pos
        pos += size
    del owner
    gc.collect()
    assert rt.locked == {}


def test_a_failure_part_way_unlocks_what_was_locked_and_names_the_table():
    rt = Runtime(fail=3)
    with pytest.raises(ConfigError, match="table 'big'.*cudaHostRegister"):
        pinned_zeros(1000, 8, owner=Owner(), name="big", chunk_bytes=4096, runtime=rt)
    assert rt.calls == 3 and rt.locked == {}


class Driver:
    """``cuPointerGetAttribute`` of the CUDA driver: the device address of each registered chunk
    (``shift`` moves the chunks from ``moved`` on to another address, as a driver that cannot
    use host pointers would)."""

    def __init__(self, shift: int = 0, moved: int = 0) -> None:
        self.asked: list[int] = []
        self.shift, self.moved = shift, moved

    def cuPointerGetAttribute(self, out, attribute, ptr) -> int:  # noqa: N802
        assert attribute == 2  # CU_POINTER_ATTRIBUTE_DEVICE_POINTER
        self.asked.append(ptr.value)
        out._obj.value = ptr.value + (self.shift if len(self.asked) > self.moved else 0)
        return 0


def test_rows_are_used_in_place_only_where_every_chunk_is_mapped_at_its_own_address():
    owner = Owner()
    t = pinned_zeros(1000, 8, owner=owner, name="t", chunk_bytes=4096, runtime=Runtime())
    drv = Driver()
    assert mapped_in_place(t, chunk_bytes=4096, driver=drv)
    assert drv.asked == list(range(t.data_ptr(), t.data_ptr() + 32000, 4096))  # every chunk
    assert not mapped_in_place(t, chunk_bytes=4096, driver=Driver(shift=64, moved=3))
    assert not mapped_in_place(t, chunk_bytes=4096, driver=Driver(shift=64))
