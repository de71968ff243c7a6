"""Kernels split over threads: a call's work in ``parts`` disjoint parts, one thread each.

The compiled kernels release the GIL (``nogil``), so parts run at once on Python threads: the
calling thread runs part 0, a process-wide pool the others. A part never writes what another
part reads or writes (rows by range, pooled bags by range, entries by number, index buckets by
range), and each part does its work in the order one thread would, so the result is
bit-identical for any number of parts; a call too small to gain runs as one part.

Plain threads, not numba's parallel layers: no OpenMP runtime beside torch's, safe to call from
several threads at once (the training pipelines do) and in a forked child (a data-loader worker;
the pool is made again there).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

MIN_PER_PART = 1024
"""Least work (rows, keys or bags) worth a part of its own: handing a part to another thread
costs about 40 µs here, what a kernel does with about a thousand rows."""

_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None


def resolve(threads: int | None) -> int:
    """A table's thread count: ``threads``, or torch's (``torch.get_num_threads()``) for None."""
    return torch.get_num_threads() if threads is None else threads


def parts_for(threads: int, work: int) -> int:
    """How many parts ``work`` items are split into with ``threads`` threads."""
    return max(1, min(threads, work // MIN_PER_PART))


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid():  # none yet, or inherited by a fork
            _pool = (os.getpid(), ThreadPoolExecutor(max(1, (os.cpu_count() or 1) * 2),
                                                     thread_name_prefix="dynemb-kernel"))
        return _pool[1]


def run_parts(fn: Callable[[int], object], parts: int) -> list:
    """``[fn(0), ..., fn(parts - 1)]``, run at once; returns when every part has ended, and
    raises the first part's error if any failed."""
    if parts <= 1:
        return [fn(0)]
    futures: list[Future] = []
    try:
        for p in range(1, parts):
            futures.append(_executor().submit(fn, p))
    except RuntimeError:  # the pool takes no more work (the interpreter is exiting, and an exit
        pass              # hook such as a ddr store's flush runs a kernel): the rest run here
    try:
        first = fn(0)
        futures += [_here(fn, p) for p in range(len(futures) + 1, parts)]
    finally:
        wait(futures)  # no part may still be running when this returns or raises
    return [first, *(f.result() for f in futures)]


def _here(fn: Callable[[int], object], p: int) -> Future:
    """``fn(p)`` run on this thread, its result or error kept as a pool's part would keep it
    (so the first part's error is the one raised)."""
    done: Future = Future()
    try:
        done.set_result(fn(p))
    except BaseException as e:  # noqa: BLE001  (raised by result(), in part order)
        done.set_exception(e)
    return done


def ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``[0, n)``, sizes differing by at most one."""
    return [(n * p // parts, n * (p + 1) // parts) for p in range(parts)]
