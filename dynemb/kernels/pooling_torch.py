"""Pure-torch twins of :mod:`dynemb.kernels.pooling_numba` (the reference; also runs on CUDA)."""

from __future__ import annotations

import torch


def _entries(rows, extra, src, dim):
    """(U, dim) embeddings of the unique entries."""
    out = torch.empty(src.numel(), dim, dtype=rows.dtype, device=rows.device)
    have = src >= 0
    out[have] = rows[src[have], :dim]
    out[~have] = extra[-src[~have] - 1]
    return out


def _bag_scale(lengths, mean, n_ids):
    """Each id's bag index, and its bag's factor (1 / length for MEAN, else 1)."""
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths,
                                  output_size=n_ids)
    scale = torch.ones(n_ids, device=lengths.device)
    if mean:
        scale = scale / lengths.clamp(min=1).to(scale.dtype)[bag]
    return bag, scale


def _layout(pooled_by_bag, batch, dim):
    """(F·B, dim) per bag -> (B, F·dim)."""
    return pooled_by_bag.view(-1, batch, dim).transpose(0, 1).reshape(batch, -1)


def pool(rows, extra, src, inverse, lengths, weights, batch, dim, mean, out) -> None:
    e = _entries(rows, extra, src, dim)[inverse]
    bag, scale = _bag_scale(lengths, mean, inverse.numel())
    w = scale * weights if weights.numel() else scale
    sums = torch.zeros(lengths.numel(), dim, dtype=rows.dtype, device=rows.device)
    sums.index_add_(0, bag, e * w[:, None].to(e.dtype))
    out.copy_(_layout(sums, batch, dim))


def pool_backward(gout, rows, extra, src, inverse, lengths, weights, batch, dim, mean, grads,
                  wgrad) -> None:
    grads.zero_()  # (overwritten, as pooling_numba.pool_backward)
    if inverse.numel() == 0:
        return
    bag, scale = _bag_scale(lengths, mean, inverse.numel())
    w = scale * weights if weights.numel() else scale
    g_bag = gout.reshape(batch, -1, dim).transpose(0, 1).reshape(-1, dim)  # (F·B, dim)
    g_id = g_bag[bag]
    grads.index_add_(0, inverse, g_id * w[:, None].to(g_id.dtype))
    if wgrad.numel():
        e = _entries(rows, extra, src, dim)[inverse]
        wgrad.copy_((e * g_id).sum(1) * scale)
