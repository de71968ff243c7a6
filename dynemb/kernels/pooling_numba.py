"""Compiled (numba) pooling straight from the row store, and its backward.

The ids of F features of one table (feature-major, bags of B samples each) were resolved into U
unique entries: ``inverse[i]`` is the entry of id i and ``src[u]`` where entry u's embedding is:
``rows[src[u], :dim]`` when ``src[u] >= 0``, else ``extra[-src[u] - 1, :dim]`` (eval-initializer
rows of keys without a row, or a HYBRID table's ddr rows). Pooled output:
``out[b, f·dim:(f+1)·dim] = Σ_i w_i · e(i) / n`` over the ids i of bag (f, b), n = the bag length
for MEAN, 1 for SUM; w_i = 1 without weights.
"""

from __future__ import annotations

import numpy as np

from dynemb.kernels.jit import njit
from dynemb.kernels.prefetch import AHEAD, prefetch_cols

_kernel = njit(cache=True, nogil=True, error_model="numpy")
_ZERO_AHEAD = 32  # rows of gradients pool_backward zeroes at once (8 rows measured slower)


@_kernel
def pool(rows, extra, src, inverse, lengths, weights, batch, dim, mean, out, col, bag_lo, bag_hi):
    """Forward: fills rows of ``out`` (B, ≥ col + F·dim) float32, columns from ``col``, for bags
    ``[bag_lo, bag_hi)`` (a part: bags are independent). ``weights`` is (N,) or empty. (A
    column offset, not a column slice: a slice's rows are strided views LLVM cannot
    vectorise. For the same reason ``extra`` is whole C-contiguous rows (M, >= dim), never a
    column slice: inlined into a compiled caller, the loop over a row of either array stayed
    scalar, and ``grouped_numba.finish`` took 4.8 ms where this took 2.3.)

    Rows are prefetched ``AHEAD`` entries ahead, not ids: entries are numbered by first
    occurrence, so the next entries are the rows not read yet, where the ids ahead of a Zipf
    batch are mostly repeats, already in the cache (the evicting step's 65,536 ids at dim 64,
    alternating: 1.28 -> 1.12 ms with the rows in the cache, 1.98-2.02 -> 1.69-1.78 with them
    out of it). An entry beyond those prefetched (a part's first ids, entries numbered
    otherwise) restarts the prefetching there."""
    weighted = weights.shape[0] > 0
    n_u = src.shape[0]
    ahead = 0  # entries below it are prefetched
    i = 0
    for bag in range(bag_lo):
        i += lengths[bag]
    for bag in range(bag_lo, bag_hi):
        f = bag // batch
        b = bag - f * batch
        acc = out[b, col + f * dim:col + (f + 1) * dim]
        acc[:] = 0.0
        n = lengths[bag]
        for _ in range(n):
            u = inverse[i]
            if u >= ahead:
                ahead = u
            while ahead <= u + AHEAD and ahead < n_u:
                prefetch_cols(rows, src[ahead], False, 0, dim)
                ahead += 1
            s = src[u]
            e = rows[s] if s >= 0 else extra[-s - 1]
            w = weights[i] if weighted else np.float32(1.0)
            for j in range(dim):
                acc[j] += w * e[j]
            i += 1
        if mean and n > 1:
            scale = np.float32(1.0 / n)
            for j in range(dim):
                acc[j] *= scale


@_kernel
def pool_backward(gout, col, rows, extra, src, inverse, lengths, weights, batch, dim, mean,
                  grads, wgrad):
    """Backward: ``grads`` (U, dim) float32 (any contents: overwritten) receives the summed
    gradient of each entry from ``gout`` (B, ≥ col + F·dim), columns from ``col``; ``wgrad``
    (N,) (or empty) receives d loss / d w_i = <e(i), gout of its bag> / n.

    Rows of ``grads`` are zeroed just before they are first added to, ``_ZERO_AHEAD`` at a
    time: entries are numbered by first occurrence, so the rows zeroed are the next ones met,
    still in the cache when they are (a pass zeroing the whole buffer first wrote it to memory
    and read it back: the evicting step's 65,536 ids, alternating, 1.05 -> 0.94 ms at dim 64,
    3.18 -> 2.42 at dim 128, 0.47 -> 0.41 at dim 16). Entries numbered otherwise are summed
    right too, a row being zeroed before the first id that reaches it.

    One thread: the sum of an entry's ids must keep their order, and splitting the entries
    between threads (each thread reading every id, adding only its own entries') measured no
    faster than one thread here, the work per id being a few vector adds."""
    weighted = weights.shape[0] > 0
    want_w = wgrad.shape[0] > 0
    zeroed = 0  # rows below are zeroed (or summed into)
    i = 0
    for bag in range(lengths.shape[0]):
        f = bag // batch
        b = bag - f * batch
        g = gout[b, col + f * dim:col + (f + 1) * dim]
        n = lengths[bag]
        scale = np.float32(1.0 / n) if (mean and n > 1) else np.float32(1.0)
        for _ in range(n):
            u = inverse[i]
            w = (weights[i] if weighted else np.float32(1.0)) * scale
            if u >= zeroed:
                end = min(max(u + 1, zeroed + _ZERO_AHEAD), grads.shape[0])
                grads[zeroed:end, :] = 0.0
                zeroed = end
            acc = grads[u]
            for j in range(dim):
                acc[j] += w * g[j]
            if want_w:
                s = src[u]
                e = rows[s] if s >= 0 else extra[-s - 1]
                dot = np.float32(0.0)
                for j in range(dim):
                    dot += e[j] * g[j]
                wgrad[i] = dot * scale
            i += 1
    grads[zeroed:, :] = 0.0  # entries without ids
