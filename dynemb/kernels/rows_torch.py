"""Pure-torch twins of :mod:`dynemb.kernels.rows_numba` (the reference; also runs on CUDA).

Same signatures with tensors in place of arrays; same values up to float rounding.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from dynemb.kernels.hashing import element_bits, fmix64, to_signed
from dynemb.kernels.rows_numba import INIT_CONSTANT, INIT_UNIFORM, QUANTILE_BITS


@functools.lru_cache(maxsize=16)
def quantile_table(bound: float, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """(2**16 + 1,) float32: for each i <= 2**16 the quantile of the standard normal truncated
    at ±bound at probability i / 2**16 of its mass, which the init kernels interpolate; 256 KiB,
    so it stays in L2 cache beside the rows being written. Cached per (bound, device)."""
    if device.type != "cpu":
        return quantile_table(bound).to(device)
    lo = torch.special.ndtr(torch.tensor(-bound, dtype=torch.float64))
    n = 2**QUANTILE_BITS
    p = lo + (1.0 - 2.0 * lo) * torch.arange(n + 1, dtype=torch.float64) / n
    return torch.special.ndtri(p).clamp(-bound, bound).to(torch.float32)


def init_rows(dst, dst_rows, keys, dim, state_value, kind, a, b, quantiles, table_mix) -> None:
    if keys.numel() == 0:
        return
    key_mix = fmix64(keys ^ to_signed(table_mix))[:, None]
    j = torch.arange(dim, device=keys.device, dtype=torch.int64)[None, :]
    if kind == INIT_CONSTANT:
        v = torch.full((keys.numel(), dim), a, dtype=torch.float64, device=keys.device)
    elif kind == INIT_UNIFORM:
        v = a + (b - a) * ((element_bits(key_mix, j).to(torch.float64) + 0.5) * 2.0**-32)
    else:  # float32 throughout, one rounding per operation, as the numba kernel
        bits = element_bits(key_mix, j)
        i = bits >> QUANTILE_BITS
        f = (bits & (2**QUANTILE_BITS - 1)).to(torch.float32) * 2.0**-QUANTILE_BITS
        a32, b32 = float(np.float32(a)), float(np.float32(b))
        q = quantiles[i]
        v = a32 + b32 * (q + f * (quantiles[i + 1] - q))
    dst[dst_rows, :dim] = v.to(dst.dtype)
    if dst.shape[1] > dim:
        dst[dst_rows, dim:] = state_value


def gather(rows, slots, dim, out) -> None:
    ok = slots >= 0
    out[ok] = rows[slots[ok], :dim]


def scatter(rows, slots, values, start) -> None:
    ok = slots >= 0
    rows[slots[ok], start:start + values.shape[1]] = values[ok]


def copy_rows(src, src_rows, dst, dst_rows) -> None:
    dst[dst_rows] = src[src_rows]


def _valid(rows, slots, grads):
    ok = slots >= 0
    s = slots[ok]
    return s, grads[ok], rows[s]


def sgd(rows, slots, grads, lr, wd) -> None:
    s, g, r = _valid(rows, slots, grads)
    w = r
    rows[s] = w - lr * (g + wd * w)


def adagrad(rows, slots, grads, clr, eps, wd) -> None:
    s, g, r = _valid(rows, slots, grads)
    dim = g.shape[1]
    w, acc = r[:, :dim], r[:, dim:]
    g = g + wd * w
    acc = acc + g * g
    rows[s] = torch.cat([w - clr * (g / (acc.sqrt() + eps)), acc], dim=1)


def rowwise_adagrad(rows, slots, grads, clr, eps, wd) -> None:
    s, g, r = _valid(rows, slots, grads)
    dim = g.shape[1]
    w, acc = r[:, :dim], r[:, dim:]
    g = g + wd * w
    acc = acc + (g * g).mean(dim=1, keepdim=True)
    rows[s] = torch.cat([w - (clr / (acc.sqrt() + eps)) * g, acc], dim=1)


def adam(rows, slots, grads, step_size, beta1, beta2, eps, wd) -> None:
    s, g, r = _valid(rows, slots, grads)
    dim = g.shape[1]
    w, m, v = r[:, :dim], r[:, dim:2 * dim], r[:, 2 * dim:]
    g = g + wd * w
    m = m + (g - m) * (1.0 - beta1)
    v = v + (g * g - v) * (1.0 - beta2)
    rows[s] = torch.cat([w - step_size * (m / (v.sqrt() + eps)), m, v], dim=1)
