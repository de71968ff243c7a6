"""Compiled (numba) row kernels: initialisation, gathers and fused optimizer updates; each row
is independent, so the backend splits a call into ranges of rows, one thread each. A row is
``[embedding (dim) | optimizer state]`` in a float32 ``rows`` array.

Optimizer kernels take per-unique-key gradients ``grads`` (U, dim) float32 and the slots (U,)
of those keys; a slot < 0 (a key without a row) is skipped. They follow the torch.optim rules
in float32 so results match torch to rounding.
"""

from __future__ import annotations

import numpy as np

from dynemb.kernels.hashing import element_bits_nb, fmix64_nb
from dynemb.kernels.jit import njit
from dynemb.kernels.prefetch import AHEAD, prefetch_cols, prefetch_row

INIT_NORMAL, INIT_TRUNCATED_NORMAL, INIT_UNIFORM, INIT_CONSTANT = 0, 1, 2, 3
QUANTILE_BITS = 16
"""Normal draws interpolate a table of the 2**16 + 1 quantiles of the standard normal truncated
at ±bound (NORMAL uses bound 6, a cut of 2e-9 of the mass), in float32: 32 random bits per
element (``hashing.element_bits``), no transcendental functions, identical values in both
backends. An element reads quantiles i and i + 1 (neighbours: one cache line, but for one pair
in sixteen) and interpolates with their float32 difference, which is exact. (A table of
(quantile, difference) pairs, 512 KiB, filled this machine's L2 cache: initialising 65,536 rows
of 64 with it took 11.5-14.4 ms against 10.8-13.0 with this 256 KiB one, the same values.)"""
NORMAL_BOUND = 6.0
_Q_SHIFT = np.uint32(QUANTILE_BITS)
_LO32 = np.uint64(0xFFFFFFFF)
_U32 = np.uint64(32)
_Q_FRACTION = np.uint32((1 << QUANTILE_BITS) - 1)
_Q_STEP = np.float32(2.0**-QUANTILE_BITS)


@njit(cache=True, nogil=True, error_model="numpy")
def init_rows(dst, dst_rows, keys, dim, state_value, kind, a, b, quantiles, table_mix):
    """Writes ``dst[dst_rows[m], :dim]`` = initial embedding of ``keys[m]`` and the rest of that
    row = ``state_value``.

    ``kind``: INIT_*; ``(a, b)``: (mean, std) for the normals with ``quantiles`` (2**16 + 1,)
    float32 (``rows_torch.quantile_table``), (low, high) for UNIFORM, (value, -) for CONSTANT.
    Element j of key k takes the 32 bits ``element_bits(fmix64(k ^ table_mix), j)``; a normal
    element is ``a + b·(q_i + f·(q_{i+1} - q_i))`` in float32, with i the high 16 bits and f
    the low 16 bits / 2**16 (against 64-bit hashes and float64 arithmetic, per row of 64: 167
    -> 138 ns normal, 88 -> 52 ns uniform).
    """
    width = dst.shape[1]
    tmix = np.uint64(table_mix)
    span = b - a
    a32, b32 = np.float32(a), np.float32(b)
    bits = np.empty(dim, np.uint32)
    n = keys.shape[0]
    for m in range(n):
        if m + AHEAD < n:
            prefetch_row(dst, dst_rows[m + AHEAD], True)
        row = dst[dst_rows[m]]
        if kind == INIT_CONSTANT:
            for j in range(dim):
                row[j] = a
        else:
            key_mix = fmix64_nb(np.uint64(keys[m]) ^ tmix)
            element_bits_nb(np.uint32(key_mix & _LO32), np.uint32(key_mix >> _U32), bits)
            if kind == INIT_UNIFORM:
                for j in range(dim):
                    row[j] = a + span * ((np.float64(bits[j]) + 0.5) * 2.0**-32)
            else:
                for j in range(dim):
                    x = bits[j]
                    i = np.int64(x >> _Q_SHIFT)
                    f = np.float32(np.int32(x & _Q_FRACTION)) * _Q_STEP
                    q = quantiles[i]
                    row[j] = a32 + b32 * (q + f * (quantiles[i + 1] - q))
        for j in range(dim, width):
            row[j] = state_value


@njit(cache=True, nogil=True)
def gather(rows, slots, dim, out):
    """``out[u] = rows[slots[u], :dim]`` for slots >= 0 (others are left as they are)."""
    n = slots.shape[0]
    for u in range(n):
        if u + AHEAD < n:
            prefetch_cols(rows, slots[u + AHEAD], False, 0, dim)
        s = slots[u]
        if s >= 0:
            for j in range(dim):
                out[u, j] = rows[s, j]


@njit(cache=True, nogil=True)
def scatter(rows, slots, values, start):
    """``rows[slots[u], start:start + values.shape[1]] = values[u]`` for slots >= 0. (Rows of
    32 columns or more are copied through row slices, which LLVM vectorises: 65,536 random
    rows of 64, alternating, 6.3-8.4 -> 3.0-4.4 ms, of 128 9.6-12.6 -> 6.0-7.6. Narrower ones
    pay more for the slices than they gain, and are indexed by (row, column).)"""
    n, ncols = slots.shape[0], values.shape[1]
    wide = ncols >= 32
    for u in range(n):
        if u + AHEAD < n:
            prefetch_cols(rows, slots[u + AHEAD], True, start, start + ncols)
        s = slots[u]
        if s < 0:
            continue
        if wide:
            dst = rows[s, start:start + ncols]
            src = values[u]
            for j in range(ncols):
                dst[j] = src[j]
        else:
            for j in range(ncols):
                rows[s, start + j] = values[u, j]


@njit(cache=True, nogil=True)
def copy_rows(src, src_rows, dst, dst_rows):
    """``dst[dst_rows[i]] = src[src_rows[i]]`` (whole rows; all indices valid; ``src`` and
    ``dst`` are different arrays: the backend copies ranges of ``i`` at once)."""
    n = src_rows.shape[0]
    for i in range(n):
        if i + AHEAD < n:
            prefetch_row(src, src_rows[i + AHEAD], False)
            prefetch_row(dst, dst_rows[i + AHEAD], True)
        a = src[src_rows[i]]
        b = dst[dst_rows[i]]
        for j in range(a.shape[0]):
            b[j] = a[j]


_F32_MAX = np.float32(np.finfo(np.float32).max)


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def all_finite(a):
    """Whether every element of ``a`` (1-D float32) is finite, allocating nothing (an and of
    comparisons: LLVM vectorises it; NaN compares false)."""
    ok = True
    for i in range(a.shape[0]):
        ok &= abs(a[i]) <= _F32_MAX
    return ok


# Kernels take per-row views (w, state, g) so LLVM can vectorise the inner loop over j;
# error_model="numpy" removes Python's division-by-zero checks, which would block that.
_row_kernel = njit(cache=True, nogil=True, error_model="numpy")


@_row_kernel
def sgd(rows, slots, grads, lr, wd):
    lr = np.float32(lr)
    wd = np.float32(wd)
    dim = grads.shape[1]
    n = slots.shape[0]
    for u in range(n):
        if u + AHEAD < n:
            prefetch_row(rows, slots[u + AHEAD], True)
        s = slots[u]
        if s < 0:
            continue
        w = rows[s, :dim]
        g = grads[u]
        for j in range(dim):
            w[j] = w[j] - lr * (g[j] + wd * w[j])


@_row_kernel
def adagrad(rows, slots, grads, clr, eps, wd):
    clr = np.float32(clr)
    eps = np.float32(eps)
    wd = np.float32(wd)
    dim = grads.shape[1]
    n = slots.shape[0]
    for u in range(n):
        if u + AHEAD < n:
            prefetch_row(rows, slots[u + AHEAD], True)
        s = slots[u]
        if s < 0:
            continue
        w = rows[s, :dim]
        acc = rows[s, dim:2 * dim]
        gu = grads[u]
        for j in range(dim):
            g = gu[j] + wd * w[j]
            a = acc[j] + g * g
            acc[j] = a
            w[j] = w[j] - clr * (g / (np.sqrt(a) + eps))


# fastmath "reassoc" lets LLVM vectorise the row sum (3.5x)
@njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})
def rowwise_adagrad(rows, slots, grads, clr, eps, wd):
    clr = np.float32(clr)
    eps = np.float32(eps)
    wd = np.float32(wd)
    dim = grads.shape[1]
    inv_dim = np.float32(1.0 / dim)
    n = slots.shape[0]
    for u in range(n):
        if u + AHEAD < n:
            prefetch_row(rows, slots[u + AHEAD], True)
        s = slots[u]
        if s < 0:
            continue
        w = rows[s, :dim]
        gu = grads[u]
        sq = np.float32(0.0)
        for j in range(dim):
            g = gu[j] + wd * w[j]
            sq += g * g
        acc = rows[s, dim] + sq * inv_dim
        rows[s, dim] = acc
        scale = clr / (np.sqrt(acc) + eps)
        for j in range(dim):
            w[j] = w[j] - scale * (gu[j] + wd * w[j])


@_row_kernel
def adam(rows, slots, grads, step_size, beta1, beta2, eps, wd):
    """SparseAdam: ``m += (g - m)(1 - b1)``, ``v += (g² - v)(1 - b2)``,
    ``w -= step_size * m / (sqrt(v) + eps)`` with step_size = lr·sqrt(1 - b2^t)/(1 - b1^t)."""
    step_size = np.float32(step_size)
    one_b1 = np.float32(1.0 - beta1)
    one_b2 = np.float32(1.0 - beta2)
    eps = np.float32(eps)
    wd = np.float32(wd)
    dim = grads.shape[1]
    n = slots.shape[0]
    for u in range(n):
        if u + AHEAD < n:
            prefetch_row(rows, slots[u + AHEAD], True)
        s = slots[u]
        if s < 0:
            continue
        w = rows[s, :dim]
        m = rows[s, dim:2 * dim]
        v = rows[s, 2 * dim:3 * dim]
        gu = grads[u]
        for j in range(dim):
            g = gu[j] + wd * w[j]
            mj = m[j] + (g - m[j]) * one_b1
            vj = v[j] + (g * g - v[j]) * one_b2
            m[j] = mj
            v[j] = vj
            w[j] = w[j] - step_size * (mj / (np.sqrt(vj) + eps))
