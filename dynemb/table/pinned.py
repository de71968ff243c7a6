"""The ddr tier of a CUDA table: host memory page-locked in chunks.

``torch.zeros(..., pin_memory=True)`` would make one pinned allocation of the whole tier, which
torch's pinned-memory allocator rounds up to a power of two (a 300 GB tier would ask for 512 GB)
and which the driver must lock in one call. Instead the tier is ordinary host memory, one
tensor (every kernel and copy addresses it as before), registered with the CUDA driver
(``cudaHostRegister``) chunk by chunk: no allocation beyond the rows themselves, hundreds of GB
possible, a progress bar while a large tier locks, and the registrations undone when the table
goes (``weakref.finalize``) or when one fails part way (nothing stays locked). On a system with
unified addressing registered memory is also mapped: GPU kernels can read it in place.
"""

from __future__ import annotations

import ctypes
import weakref

import torch
from tqdm import tqdm

from dynemb.errors import ConfigError

CHUNK_BYTES = 1 << 30
"""Bytes page-locked per ``cudaHostRegister`` call."""
_DEVICE_POINTER = 2  # CU_POINTER_ATTRIBUTE_DEVICE_POINTER
_BAR_CHUNKS = 8  # a tier of more chunks than this shows a progress bar while it locks


def _unregister(runtime, ptrs: list[int], rows: torch.Tensor | None = None) -> None:
    """Unlocks the chunks at ``ptrs`` (``rows``, their tensor, is held until then)."""
    for p in reversed(ptrs):
        runtime.cudaHostUnregister(p)
    ptrs.clear()


def pinned_zeros(rows: int, width: int, *, owner: object, name: str,
                 chunk_bytes: int = CHUNK_BYTES, runtime=None) -> torch.Tensor:
    """(rows, width) float32 zeros in host memory page-locked in chunks of ``chunk_bytes``,
    unlocked when ``owner`` is garbage collected. ``runtime``: the CUDA runtime
    (``torch.cuda.cudart()``; tests pass a stand-in). ``name`` names the table in errors."""
    out = torch.zeros(rows, width, dtype=torch.float32)
    runtime = runtime or torch.cuda.cudart()
    base, nbytes = out.data_ptr(), out.numel() * out.element_size()
    starts = range(0, nbytes, chunk_bytes)
    ptrs: list[int] = []
    try:
        for off in tqdm(starts, desc=f"pinning the ddr rows of table {name!r}", unit="GiB",
                        unit_scale=chunk_bytes / (1 << 30), disable=len(starts) <= _BAR_CHUNKS):
            err = runtime.cudaHostRegister(base + off, min(chunk_bytes, nbytes - off), 0)
            if int(err) != 0:
                raise ConfigError(
                    f"table {name!r}: page-locking its ddr rows failed at byte {off} of {nbytes} "
                    f"(cudaHostRegister: {err}); the host may lack that much lockable memory "
                    "(see `ulimit -l`). Choose a smaller ddr tier (capacity, cache_load_factor) "
                    "or Storage(ddr_path=...) for memory-mapped rows.")
            ptrs.append(base + off)
    except BaseException:
        _unregister(runtime, ptrs)
        raise
    done = weakref.finalize(owner, _unregister, runtime, ptrs, out)
    done.atexit = False  # a process that exits gives all its memory back
    return out


def mapped_in_place(rows: torch.Tensor, *, chunk_bytes: int = CHUNK_BYTES, driver=None) -> bool:
    """Whether GPU kernels can read and write ``rows`` (from :func:`pinned_zeros`, same
    ``chunk_bytes``) at its own addresses: every chunk is mapped for the device at its host
    address (unified addressing, where the driver maps registered memory at the host pointer:
    64-bit Linux on current GPUs), so the chunks stay one contiguous tensor to a kernel. False
    otherwise; the table then copies ddr rows through staging buffers. ``driver``: the CUDA
    driver library (``libcuda``; tests pass a stand-in)."""
    if driver is None:
        try:
            driver = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return False
    base, nbytes = rows.data_ptr(), rows.numel() * rows.element_size()
    for off in range(0, nbytes, chunk_bytes):
        dev = ctypes.c_uint64(0)
        err = driver.cuPointerGetAttribute(ctypes.byref(dev), _DEVICE_POINTER,
                                           ctypes.c_uint64(base + off))
        if int(err) != 0 or dev.value != base + off:
            return False
    return True


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``. A copy from host memory does not wait for the device (a blocking
    copy would: torch synchronises the stream first); pageable memory is staged before the call
    returns, page-locked memory from torch's allocator is kept until the copy is done. (Never
    for a copy to the host, which must wait for its data.)"""
    return t.to(device, non_blocking=True)
