"""A CPU table's large arrays in transparent huge pages, where the kernel offers them.

Every lookup, gather and update of a big table lands on random rows and slots. With 4 KiB pages
each of those accesses also misses the TLB (a 1 GiB table spans 262,144 pages; the TLB holds a
few thousand), so the CPU walks the page tables first. Linux backs memory with 2 MiB pages
where the program asks (``madvise(MADV_HUGEPAGE)``, when transparent huge pages are set to
``madvise``, the common default) or everywhere (``always``). :func:`host_full` asks for its
2 MiB-aligned interior before the first write, so the pages come huge from the start. It is
a hint: where the kernel has no huge pages to give, or is not Linux, memory is as before.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 1 << 21
_MADV_HUGEPAGE = 14  # (Linux)


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - every Linux libc has it
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def advise_huge(t: torch.Tensor) -> int:
    """Asks for huge pages under the 2 MiB-aligned interior of CPU tensor ``t``'s memory, before
    it is first written; returns the bytes asked for (0: too small, not Linux, or refused)."""
    lo = (t.data_ptr() + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    hi = (t.data_ptr() + t.numel() * t.element_size()) & ~(HUGE_PAGE - 1)
    if _MADVISE is None or hi <= lo or _MADVISE(lo, hi - lo, _MADV_HUGEPAGE) != 0:
        return 0
    return hi - lo


def host_full(shape: tuple[int, ...], fill: float | int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.full(shape, fill, dtype=dtype)`` in host memory, in huge pages where given."""
    t = torch.empty(shape, dtype=dtype, device="cpu")  # (whatever torch's default device)
    advise_huge(t)
    return t.fill_(fill)
