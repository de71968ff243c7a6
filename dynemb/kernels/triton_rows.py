"""Triton kernels of pooling (forward and backward, straight from the row store) and of the fused
optimizer updates, for CUDA tables: :mod:`dynemb.kernels.pooling_numba` and the optimizers of
:mod:`dynemb.kernels.rows_numba`, with the same arguments and arithmetic.

* Pooling forward: one program per bag sums its ids' rows (``rows[src[u]]``, or ``extra`` for
  entries away from hbm) in the bag's order, as the numba kernel does; no (N, dim)
  intermediate is made.
* Pooling backward: one program per entry sums the gradients of its ids in id order (the ids
  sorted by entry with a stable sort), so no two programs write one row and the sum's order is
  the numba kernel's: no atomics, the same result on every run.
* Optimizers: one program per entry updates its row in place; distinct entries have distinct
  rows (a lookup's entries are its distinct slots), so programs never share a row.
* Rows by global row id over both tiers (:func:`gather_rows`, :func:`scatter_rows`,
  :func:`copy_rows`, and the optimizers given ``ddr``): a row id below ``split`` is an hbm row,
  one above it a row of ``ddr``, host memory that a CUDA kernel reads and writes in place (page
  locked and mapped at its own address: ``dynemb.table.pinned``). No mask of the ids is made,
  so nothing waits for the device.

Rows are float32. Where the arithmetic is the numba kernels' (the interpreter runs it in numpy)
the results are bit-identical; compiled for a GPU, fused multiply-adds and a tree-shaped row sum
may change the last bits (within 1e-6 relative).
"""

from __future__ import annotations

import torch

from dynemb.kernels.triton_index import jit, tl, triton


def _block(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


@jit
def _pool_kernel(rows_ptr, row_stride, extra_ptr, src_ptr, inv_ptr, off_ptr, len_ptr, w_ptr,
                 out_ptr, out_stride, col, batch, dim, n_ids, MEAN: tl.constexpr,
                 WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
    bag = tl.program_id(0)
    f = bag // batch
    b = bag - f * batch
    j = tl.arange(0, BLOCK)
    inside = j < dim
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    i = tl.load(off_ptr + bag)
    n = tl.load(len_ptr + bag)
    end = tl.minimum(tl.maximum(i + n, 0), n_ids)  # (lengths that no longer match the ids:
    i = tl.minimum(tl.maximum(i, 0), n_ids)  # wrong sums, never a read outside them)
    while i < end:
        s = tl.load(src_ptr + tl.load(inv_ptr + i))
        e = tl.load(rows_ptr + s * row_stride + j, mask=inside & (s >= 0), other=0.0) \
            + tl.load(extra_ptr + (-s - 1) * dim + j, mask=inside & (s < 0), other=0.0)
        if WEIGHTED:
            acc += tl.load(w_ptr + i) * e
        else:
            acc += e
        i += 1
    if MEAN:
        if n > 1:
            acc = acc * (1.0 / n.to(tl.float64)).to(tl.float32)
    tl.store(out_ptr + b * out_stride + col + f * dim + j, acc, mask=inside)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    """Each bag's first id (exclusive cumulative sum; no host read)."""
    return torch.cumsum(lengths, 0) - lengths


def pool(rows, extra, src, inverse, lengths, weights, batch, dim, mean, out, col=0) -> None:
    """``pooling_numba.pool`` over every bag (``out`` (B, >= col + F·dim))."""
    bags = lengths.numel()
    if bags == 0:
        return
    _pool_kernel[(bags,)](rows, rows.stride(0), extra, src, inverse, _offsets(lengths), lengths,
                          weights, out, out.stride(0), col, batch, dim, inverse.numel(),
                          MEAN=bool(mean), WEIGHTED=weights.numel() > 0, BLOCK=_block(dim))


@jit
def _pool_backward_kernel(gout_ptr, gout_stride, col, order_ptr, lo_ptr, hi_ptr, bag_ptr,
                          len_ptr, w_ptr, grads_ptr, batch, dim, MEAN: tl.constexpr,
                          WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
    u = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    inside = j < dim
    acc = tl.zeros([BLOCK], tl.float32)
    t = tl.load(lo_ptr + u)
    end = tl.load(hi_ptr + u)
    while t < end:
        i = tl.load(order_ptr + t)
        bag = tl.load(bag_ptr + i)
        f = bag // batch
        b = bag - f * batch
        w = tl.full([], 1.0, tl.float32)
        if WEIGHTED:
            w = tl.load(w_ptr + i)
        if MEAN:
            n = tl.load(len_ptr + bag)
            if n > 1:
                w = w * (1.0 / n.to(tl.float64)).to(tl.float32)
        g = tl.load(gout_ptr + b * gout_stride + col + f * dim + j, mask=inside, other=0.0)
        acc += w * g
        t += 1
    tl.store(grads_ptr + u * dim + j, acc, mask=inside)


@jit
def _weight_grad_kernel(gout_ptr, gout_stride, col, rows_ptr, row_stride, extra_ptr, src_ptr,
                        inv_ptr, bag_ptr, len_ptr, wgrad_ptr, batch, dim, MEAN: tl.constexpr,
                        BLOCK: tl.constexpr):
    i = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    inside = j < dim
    bag = tl.load(bag_ptr + i)
    f = bag // batch
    b = bag - f * batch
    s = tl.load(src_ptr + tl.load(inv_ptr + i))
    e = tl.load(rows_ptr + s * row_stride + j, mask=inside & (s >= 0), other=0.0) \
        + tl.load(extra_ptr + (-s - 1) * dim + j, mask=inside & (s < 0), other=0.0)
    g = tl.load(gout_ptr + b * gout_stride + col + f * dim + j, mask=inside, other=0.0)
    dot = tl.sum(e * g)
    if MEAN:
        n = tl.load(len_ptr + bag)
        if n > 1:
            dot = dot * (1.0 / n.to(tl.float64)).to(tl.float32)
    tl.store(wgrad_ptr + i, dot)


def pool_backward(gout, rows, extra, src, inverse, lengths, weights, batch, dim, mean, grads,
                  wgrad, col=0) -> None:
    """``pooling_numba.pool_backward``: ``grads`` (U, dim) (overwritten) receives each entry's
    summed gradient, ``wgrad`` (N,) (or empty) the gradient of each id's weight."""
    n = inverse.numel()
    if n == 0:
        grads.zero_()
        return
    dev = inverse.device
    # each id's bag (a search, not repeat_interleave: lengths that no longer match the ids give
    # wrong sums, never a read outside them)
    bag_of = torch.searchsorted(torch.cumsum(lengths, 0), torch.arange(n, device=dev),
                                right=True).clamp_(max=max(lengths.numel() - 1, 0))
    entry, order = torch.sort(inverse, stable=True)
    u = torch.arange(grads.shape[0], device=dev)
    lo = torch.searchsorted(entry, u)
    hi = torch.searchsorted(entry, u, right=True)
    blk = _block(dim)
    if grads.shape[0]:
        _pool_backward_kernel[(grads.shape[0],)](
            gout, gout.stride(0), col, order, lo, hi, bag_of, lengths, weights, grads, batch, dim,
            MEAN=bool(mean), WEIGHTED=weights.numel() > 0, BLOCK=blk)
    if wgrad.numel():
        _weight_grad_kernel[(n,)](gout, gout.stride(0), col, rows, rows.stride(0), extra, src,
                                  inverse, bag_of, lengths, wgrad, batch, dim, MEAN=bool(mean),
                                  BLOCK=blk)


# ---------------------------------------------------------------- optimizers

SGD, ADAGRAD, ROWWISE_ADAGRAD, ADAM = 0, 1, 2, 3


@jit
def _row(hbm_ptr, ddr_ptr, split, stride, r):
    """The address of global row ``r``: hbm row r below ``split``, else ddr row r - split."""
    return tl.where(r < split, hbm_ptr + r * stride, ddr_ptr + (r - split) * stride)


@jit
def _rows_kernel(hbm_ptr, ddr_ptr, split, stride, src_ptr, dst_ptr, buf_ptr, buf_stride, ncols,
                 start, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """For item ``u`` (skipped where a row id is -1), columns ``[start, start + ncols)``:
    MODE 0 gathers row ``src[u]`` into ``buf[u]``; 1 scatters ``buf[u]`` into row ``dst[u]``;
    2 copies row ``src[u]`` to row ``dst[u]``."""
    u = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    inside = j < ncols
    if MODE == 1:
        r = tl.load(dst_ptr + u)
        if r >= 0:
            v = tl.load(buf_ptr + u * buf_stride + j, mask=inside)
            tl.store(_row(hbm_ptr, ddr_ptr, split, stride, r) + start + j, v, mask=inside)
    else:
        r = tl.load(src_ptr + u)
        if r >= 0:
            v = tl.load(_row(hbm_ptr, ddr_ptr, split, stride, r) + start + j, mask=inside)
            if MODE == 0:
                tl.store(buf_ptr + u * buf_stride + j, v, mask=inside)
            else:
                d = tl.load(dst_ptr + u)
                tl.store(_row(hbm_ptr, ddr_ptr, split, stride, d) + start + j, v,
                         mask=inside & (d >= 0))


def _tiers(hbm: torch.Tensor, ddr: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """(ddr rows, split) for the kernels (without a ddr tier, ``hbm`` stands in: every valid
    row id is below the split)."""
    return (hbm if ddr is None else ddr), hbm.shape[0]


def gather_rows(hbm, ddr, ids, ncols, out, start=0) -> None:
    """``out[u, :ncols] = row(ids[u])[start:start + ncols]`` for ids >= 0 (``out`` (U, >= ncols),
    rows contiguous); rows of -1 are left as they are."""
    if ids.numel():
        d, split = _tiers(hbm, ddr)
        _rows_kernel[(ids.numel(),)](hbm, d, split, hbm.stride(0), ids, ids, out, out.stride(0),
                                     ncols, start, MODE=0, BLOCK=_block(ncols))


def scatter_rows(hbm, ddr, ids, values, start=0) -> None:
    """``row(ids[u])[start:start + C] = values[u]`` for ids >= 0 (``values`` (U, C))."""
    if ids.numel():
        d, split = _tiers(hbm, ddr)
        values = values.contiguous()
        _rows_kernel[(ids.numel(),)](hbm, d, split, hbm.stride(0), ids, ids, values,
                                     values.shape[1], values.shape[1], start, MODE=1,
                                     BLOCK=_block(values.shape[1]))


def copy_rows(hbm, ddr, src, dst) -> None:
    """Row ``dst[u]`` = row ``src[u]`` (global row ids, distinct ``dst``) where both >= 0."""
    if src.numel():
        d, split = _tiers(hbm, ddr)
        _rows_kernel[(src.numel(),)](hbm, d, split, hbm.stride(0), src, dst, hbm, 0,
                                     hbm.shape[1], 0, MODE=2, BLOCK=_block(hbm.shape[1]))


@jit
def _update_kernel(rows_ptr, ddr_ptr, split, row_stride, slot_ptr, grads_ptr, n, dim, a, b, c,
                   d, e, RULE: tl.constexpr, BLOCK: tl.constexpr):
    """The row of entry ``u`` (global row id >= 0: see ``_row``) updated by ``RULE`` with
    scalars (a..e): SGD (lr, wd), ADAGRAD (clr, eps, wd), ROWWISE_ADAGRAD (clr, eps, wd,
    1 / dim), ADAM (step_size, 1 - beta1, 1 - beta2, eps, wd)."""
    u = tl.program_id(0)
    s = tl.load(slot_ptr + u)
    if s >= 0:
        j = tl.arange(0, BLOCK)
        inside = j < dim
        row = _row(rows_ptr, ddr_ptr, split, row_stride, s)
        w = tl.load(row + j, mask=inside, other=0.0)
        gu = tl.load(grads_ptr + u * dim + j, mask=inside, other=0.0)
        if RULE == 0:
            tl.store(row + j, w - a * (gu + b * w), mask=inside)
        elif RULE == 1:
            g = gu + c * w
            acc = tl.load(row + dim + j, mask=inside, other=0.0) + g * g
            tl.store(row + dim + j, acc, mask=inside)
            tl.store(row + j, w - a * tl.div_rn(g, tl.sqrt_rn(acc) + b), mask=inside)
        elif RULE == 2:
            g = gu + c * w
            acc = tl.load(row + dim) + tl.sum(tl.where(inside, g * g, 0.0)) * d
            tl.store(row + dim, acc)
            scale = tl.div_rn(a, tl.sqrt_rn(acc) + b)
            tl.store(row + j, w - scale * (gu + c * w), mask=inside)
        else:
            g = gu + e * w
            m = tl.load(row + dim + j, mask=inside, other=0.0)
            v = tl.load(row + 2 * dim + j, mask=inside, other=0.0)
            m = m + (g - m) * b
            v = v + (g * g - v) * c
            tl.store(row + dim + j, m, mask=inside)
            tl.store(row + 2 * dim + j, v, mask=inside)
            tl.store(row + j, w - a * tl.div_rn(m, tl.sqrt_rn(v) + d), mask=inside)


RULES = {"sgd": SGD, "adagrad": ADAGRAD, "rowwise_adagrad": ROWWISE_ADAGRAD, "adam": ADAM}


def optimizer(name: str):
    """``rows_numba.<name>`` as a Triton launch: ``run(rows, slots, grads, *scalars, ddr=None)``
    (with ``ddr``, slots are global row ids over ``rows`` (hbm) and ``ddr``)."""
    rule = RULES[name]

    def run(rows, slots, grads, *scalars, ddr=None):
        n = slots.numel()
        if n == 0:
            return
        dim = grads.shape[1]
        args = [float(x) for x in scalars]
        if rule == ADAM:  # as rows_numba: 1 - beta in float64, then rounded to float32
            args[1], args[2] = 1.0 - args[1], 1.0 - args[2]
        elif rule == ROWWISE_ADAGRAD:
            args.append(1.0 / dim)
        args += [0.0] * (5 - len(args))
        far, split = _tiers(rows, ddr)
        _update_kernel[(n,)](rows, far, split, rows.stride(0), slots, grads.contiguous(), n, dim,
                             *args, RULE=rule, BLOCK=_block(dim))

    return run
