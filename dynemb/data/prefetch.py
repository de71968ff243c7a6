"""Building batches off the training thread: :class:`Prefetcher` (a background thread, or the
caller's thread, measuring the time the step waits for data) and :func:`worker_batches` (a
background process).

Measured on the project's 2-core machine: batch building (Python parsing, many small tensor
ops) and the training step both hold the GIL most of the time, so a prefetch thread mostly
moves the cost of a batch into the step instead of hiding it (MovieLens: 7 % waiting and 77 k
samples/s without the thread, 2-3 % and 65-72 k with it). A worker process overlaps for real
when a core is free (Criteo TSV parsing, one rank: 38 k instead of 32 k samples/s), at the
price of a process start and shared-memory transfers.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Generic, TypeVar

import torch

from dynemb.data.base import Batch, DataSource
from dynemb.errors import DynembError

T = TypeVar("T")

_DONE = object()


class _Failure:
    """An exception raised by the producer, re-raised in the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher(Generic[T]):
    """Iterates ``source`` in a daemon thread, keeping up to ``depth`` items ready.

    ``depth=0`` iterates in the caller's thread (no thread; the wait is then the whole cost of
    producing each item). Exceptions of the producer are re-raised by ``__next__``. Use as an
    iterator, and :meth:`close` (or a ``with`` block) when done early.

    Attributes:
        wait_s: seconds the consumer spent blocked in ``__next__`` so far.
        items: items handed out so far.
    """

    def __init__(self, source: Iterator[T], depth: int = 2) -> None:
        if depth < 0:
            raise ValueError(f"Prefetcher: depth must be >= 0, found {depth}.")
        self._source = source
        self.wait_s = 0.0
        self.items = 0
        self._stop = threading.Event()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if depth:
            self._queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._produce, name="dynemb-prefetch",
                                            daemon=True)
            self._thread.start()

    def _produce(self) -> None:
        assert self._queue is not None
        try:
            for item in self._source:
                if not self._put(item):
                    return
            self._put(_DONE)
        except BaseException as error:  # noqa: BLE001  (handed to the consumer)
            self._put(_Failure(error))

    def _put(self, item: object) -> bool:
        """Queues ``item`` unless closed; False once closed."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        start = time.perf_counter()
        try:
            if self._queue is None:
                item = next(self._source)
            else:
                item = self._queue.get()
                if item is _DONE:
                    self._queue.put(_DONE)  # later calls stop too
                    raise StopIteration
                if isinstance(item, _Failure):
                    raise item.error
        finally:
            self.wait_s += time.perf_counter() - start
        self.items += 1
        return item

    def close(self) -> None:
        """Stops the producer thread (items not yet consumed are dropped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _WorkerError:
    """A DynembError raised in the worker process, carried to the trainer as data: a DataLoader
    would re-raise it with the worker's traceback pasted into its message."""

    def __init__(self, error: DynembError) -> None:
        self.kind, self.message = type(error), str(error)

    def reraise(self) -> None:
        raise self.kind(self.message)


class _TrainStream(torch.utils.data.IterableDataset):
    """A source's training batches, for a DataLoader worker process."""

    def __init__(self, source: DataSource, batch_size: int, rank: int, world_size: int,
                 start: int) -> None:
        self.source, self.batch_size = source, batch_size
        self.rank, self.world_size, self.start = rank, world_size, start

    def __iter__(self) -> Iterator[Batch | _WorkerError]:
        torch.set_num_threads(1)
        try:
            yield from self.source.train_batches(self.batch_size, rank=self.rank,
                                                 world_size=self.world_size, start=self.start)
        except DynembError as error:
            yield _WorkerError(error)


def _unwrap(batches: Iterator[Batch | _WorkerError]) -> Iterator[Batch]:
    for item in batches:
        if isinstance(item, _WorkerError):
            item.reraise()
        yield item


def worker_batches(source: DataSource, batch_size: int, *, rank: int = 0, world_size: int = 1,
                   start: int = 0, depth: int = 2) -> Iterator[Batch]:
    """``source.train_batches(...)`` built in one background process (a spawned
    ``DataLoader`` worker; the batches arrive in order through shared memory).

    Python-heavy batch building (parsing text, many small tensor ops) holds the GIL, so a thread
    cannot overlap it with the step; a process can, when a core is free for it. A
    :class:`~dynemb.errors.DynembError` of the source (a malformed data line) is raised here
    as the same type with the same message.
    """
    stream = _TrainStream(source, batch_size, rank, world_size, start)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=1,
                                         prefetch_factor=max(1, depth),
                                         multiprocessing_context="spawn")
    return _unwrap(iter(loader))
