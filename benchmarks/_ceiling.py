"""What this machine's memory allows, measured in the benchmark's own run: a bare random row
gather, with no index, no hashing and no Python between rows.

Every table verb that returns rows (``find``) and every training step (pooling reads each id's
row, the update writes it) does at least this gather, so its time is a floor under theirs, and
its speed-up from one thread to more is a ceiling over theirs: a step bound by memory cannot
scale better than the memory system does. The gather is compiled as dynemb's row kernels are
(numba, each row prefetched ``AHEAD`` rows ahead, parts split over ``kernels.threads``), so the
comparison is with the same tools. (Not ``rows_numba.gather`` itself: it skips missing slots and
copies a given number of columns, and measured about 10 % slower on the same rows; a ceiling
is the bare copy.)
"""

from __future__ import annotations

import numpy as np

from _common import timed
from dynemb.kernels.jit import njit
from dynemb.kernels.prefetch import AHEAD, prefetch_row
from dynemb.kernels.threads import ranges, run_parts


@njit(cache=True, nogil=True)
def _gather(rows, idx, lo, hi, out):
    """``out[i] = rows[idx[i]]`` for i in [lo, hi)."""
    for i in range(lo, hi):
        if i + AHEAD < hi:
            prefetch_row(rows, idx[i + AHEAD], False)
        r = idx[i]
        for c in range(rows.shape[1]):
            out[i, c] = rows[r, c]


class RowGather:
    """A (num_rows, dim) float32 table (every row written, so no page is untouched) whose rows
    are gathered into a buffer, a batch of row indices per call."""

    def __init__(self, num_rows: int, dim: int, max_batch: int) -> None:
        self.rows = np.random.default_rng(0).random((num_rows, dim), dtype=np.float32)
        self.out = np.empty((max_batch, dim), np.float32)

    def seconds(self, idx: np.ndarray, parts: int) -> float:
        """One gather of the rows ``idx`` (int64, each in [0, num_rows)), split into ``parts``
        contiguous parts run at once (``kernels.threads.run_parts``)."""
        if idx.size > self.out.shape[0] or (idx.size and not 0 <= idx.min() <= idx.max()
                                            < self.rows.shape[0]):
            raise ValueError("RowGather: more rows than the buffer holds, or an index outside "
                             "the table")
        spans = ranges(idx.size, parts)
        return timed(lambda: run_parts(
            lambda p: _gather(self.rows, idx, *spans[p], self.out), parts))

    def times(self, batches: list[np.ndarray], threads: list[int], repeats: int
              ) -> dict[int, list[float]]:
        """{threads: seconds of each call}: ``repeats`` calls per thread count, the batches
        taken in turn and the thread counts alternating call by call (after one untimed call
        each, which loads the kernel and starts the pool's threads)."""
        for t in threads:
            self.seconds(batches[0], t)
        out: dict[int, list[float]] = {t: [] for t in threads}
        for k in range(repeats):
            for t in threads:
                out[t].append(self.seconds(batches[k % len(batches)], t))
        return out
