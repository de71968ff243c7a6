"""Kernels split over threads: a call's work in ``parts`` disjoint parts, one thread each.

The compiled kernels release the GIL (``nogil``), so parts run at once: the calling thread and
``parts - 1`` others each claim the next part not yet taken until none is left. A part never
writes what another part reads or writes (rows by range, pooled bags by range, entries by
number, index buckets by range), and each part does its work in the order one thread would, so
the result is bit-identical for any number of parts, whichever thread runs which; a call too
small to gain runs as one part.

The other threads are torch's own OpenMP threads where torch runs its ops on GNU OpenMP (its
Linux builds; a team of the runtime torch loaded), else a process-wide pool. After
each of torch's parallel ops its OpenMP workers spin on the cores for a while, and a pool of
our own beside them got half a core where they spun: with torch at two threads, a two-thread
step measured 0.80-0.87x of one thread with the pool, 1.37-1.63x on torch's threads. A
forked child (a data-loader worker) and a call made while the interpreter shuts down use the
pool (made again in a child), or the calling thread where the pool takes no more work. (A
child forked before this module was imported cannot be told from its parent: if the parent
had run OpenMP, the child's first split call waits forever, as torch's own first parallel op
there does; such children run torch at one thread, as torch's data loaders do, and tables
that follow torch's count then split nothing.)
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

MIN_PER_PART = 1024
"""Least work (rows, keys or bags) worth a part of its own: handing a part to another thread
costs 25-70 µs here, what a kernel does with about a thousand rows."""

_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None
_HOME = os.getpid()
"""The process that imported this module: a child forked from it inherits OpenMP's threads as
dead records (its first parallel region would wait for them forever), so only here do parts run
on them."""


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
    job = _Job(fn, parts)
    omp = _openmp() if os.getpid() == _HOME and not sys.is_finalizing() else None
    if omp is not None:
        omp.run(job)
        return job.outcome()
    futures: list[Future] = []
    try:
        for _ in range(1, parts):
            futures.append(_executor().submit(job.work))
    except RuntimeError:  # the pool takes no more work (the interpreter is exiting, and an exit
        pass              # hook such as a ddr store's flush runs a kernel): the rest run here
    try:
        job.work()
    finally:
        wait(futures)  # no part may still be running when this returns or raises
    return job.outcome()


def ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``[0, n)``, sizes differing by at most one."""
    return [(n * p // parts, n * (p + 1) // parts) for p in range(parts)]


class _Job:
    """One call's parts, claimed one at a time by whichever thread asks next (so a team with
    fewer threads than parts, or none but the caller, still runs them all)."""

    def __init__(self, fn: Callable[[int], object], parts: int) -> None:
        self.fn, self.parts = fn, parts
        self.claims = itertools.count()  # next() is atomic under the GIL
        self.results: list = [None] * parts
        self.errors: list[BaseException | None] = [None] * parts
        self.lost: BaseException | None = None
        """An error outside any part (an interrupt between two), raised by the call."""

    def work(self) -> None:
        while True:
            p = -1
            try:
                p = next(self.claims)
                if p >= self.parts:
                    return
                self.results[p] = self.fn(p)
            except BaseException as e:  # noqa: BLE001  (raised by the call, in part order)
                if 0 <= p < self.parts:
                    self.errors[p] = e
                else:
                    self.lost = e
                    return

    def outcome(self) -> list:
        """The parts' results, or the first error (an interrupt, else in part order)."""
        if self.lost is not None:
            raise self.lost
        for e in self.errors:
            if e is not None:
                raise e
        return self.results


_BODY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _OpenMP:
    """GNU OpenMP's team start and end (``GOMP_parallel_start`` / ``GOMP_parallel_end``) of
    the runtime torch loaded: the team's other threads work on a call's :class:`_Job` through
    a ctypes callback, the caller in plain Python between start and end (an interrupt raised
    in a ctypes callback would be printed and dropped; the caller's is raised as usual)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.jobs: dict[int, _Job] = {}
        self.keys = itertools.count(1)
        self.body = _BODY(self._body)  # kept: the runtime calls it
        self.start = lib.GOMP_parallel_start
        self.start.argtypes = [_BODY, ctypes.c_void_p, ctypes.c_uint]
        self.start.restype = None
        self.end = lib.GOMP_parallel_end
        self.end.argtypes, self.end.restype = [], None
        self.level = lib.omp_get_level
        self.level.argtypes, self.level.restype = [], ctypes.c_int

    def _body(self, key: int) -> None:
        job = self.jobs.get(key)
        if job is not None:
            job.work()

    def run(self, job: _Job) -> None:
        """Runs every part of ``job`` (its errors kept in it): the caller claims parts until none
        is left, so a team smaller than asked (a call inside a part gets one of one) loses
        none."""
        key = next(self.keys)
        self.jobs[key] = job
        level = self.level()
        try:
            self.start(self.body, key, job.parts)  # ctypes lets go of the GIL meanwhile
            job.work()
        finally:
            if self.level() > level:  # the team started (even if an interrupt came at once)
                self.end()  # waits for the team's threads
            del self.jobs[key]


_omp: list[_OpenMP | None] = []


def _openmp() -> _OpenMP | None:
    """torch's OpenMP runtime where torch's own ops run on GNU OpenMP and it is loaded; else
    None (found once per process)."""
    if not _omp:
        with _lock:
            if not _omp:
                _omp.append(_find_openmp())
    return _omp[0]


def _find_openmp() -> _OpenMP | None:
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    noload = getattr(os, "RTLD_NOLOAD", None)
    if noload is None:
        return None
    base = Path(torch.__file__).resolve().parent
    for path in sorted([*(base / "lib").glob("libgomp*.so*"),
                        *(base.parent / "torch.libs").glob("libgomp*.so*")]):
        try:
            lib = ctypes.CDLL(str(path), mode=noload)  # only if torch loaded it
        except OSError:
            continue
        if all(hasattr(lib, f) for f in
               ("GOMP_parallel_start", "GOMP_parallel_end", "omp_get_level")):
            return _OpenMP(lib)
    return None
