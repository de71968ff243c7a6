"""``prefetch(array, index)`` and ``prefetch_write(rows, row, col)``: hints to the CPU to start
loading an element into the cache (LLVM's ``llvm.prefetch``), for numba kernels that know which
slots or rows they will touch next. A prefetch never faults and changes no result."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from dynemb.kernels.jit import njit


def _call_prefetch(builder, ptr, rw: int) -> None:
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(ptr, i8p), i32(rw), i32(3), i32(1)])


@intrinsic
def prefetch(typingctx, arr, idx):
    """Prefetches the element ``arr[idx]`` (a read; kept in every cache level). The index must be
    in bounds (nothing is checked: a prefetch never faults, but an address outside the array is
    a wasted load)."""

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        _call_prefetch(builder, ptr, 0)
        return context.get_dummy_value()

    return types.void(arr, idx), codegen


def _prefetch_2d(rw: int):
    def typer(typingctx, rows, row, col):
        def codegen(context, builder, sig, args):
            aryty = sig.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1], args[2]],
                                           wraparound=False)
            _call_prefetch(builder, ptr, rw)
            return context.get_dummy_value()

        return types.void(rows, row, col), codegen

    return typer


prefetch_read = intrinsic(_prefetch_2d(0))
"""``prefetch_read(rows, row, col)``: prefetches ``rows[row, col]`` of a 2-D array."""
prefetch_write = intrinsic(_prefetch_2d(1))
"""``prefetch_write(rows, row, col)``: the same, for writing."""


AHEAD = 8
"""How many rows ahead the row kernels prefetch (measured: 4 to 16 are alike)."""


@njit(cache=True, inline="always")
def prefetch_cols(rows, r, write, start, stop):
    """Prefetches the cache lines of columns ``[start, stop)`` of row ``r`` of a 2-D float32 array
    (``r`` < 0: nothing), for writing when ``write``. (A kernel reading a row's embedding only
    prefetches those columns: a row with Adam's state is three times as long.)"""
    if r >= 0:
        for j in range(start, stop, 16):
            if write:
                prefetch_write(rows, r, j)
            else:
                prefetch_read(rows, r, j)


@njit(cache=True, inline="always")
def prefetch_row(rows, r, write):
    """Prefetches every cache line of row ``r`` of a 2-D float32 array (``r`` < 0: nothing), for
    writing when ``write``."""
    prefetch_cols(rows, r, write, 0, rows.shape[1])
