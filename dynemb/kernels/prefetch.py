"""``prefetch(array, index)``, ``prefetch_for_write(array, index)`` and ``prefetch_read`` /
``prefetch_write(rows, row, col)``: hints to the CPU to start loading an element into the cache
(LLVM's ``llvm.prefetch``), for numba kernels that know which slots or rows they will touch
next. A prefetch never faults and changes no result."""

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


def _prefetch_1d(rw: int):
    def typer(typingctx, arr, idx):
        def codegen(context, builder, sig, args):
            aryty = sig.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]],
                                           wraparound=False)
            _call_prefetch(builder, ptr, rw)
            return context.get_dummy_value()

        return types.void(arr, idx), codegen

    return typer


prefetch = intrinsic(_prefetch_1d(0))
"""``prefetch(arr, idx)``: prefetches the element ``arr[idx]`` (a read; kept in every cache
level). The index must be in bounds (nothing is checked: a prefetch never faults, but an address
outside the array is a wasted load)."""
prefetch_for_write = intrinsic(_prefetch_1d(1))
"""``prefetch_for_write(arr, idx)``: the same, for writing."""


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

STREAM = 64
"""How many elements ahead the lookup kernels prefetch, for writing, the int64 arrays they fill
in order (per occurrence), one cache line at a time. Stores leave the core in order, so a store
to a line not in the cache holds back every later one, the scattered writes to the index among
them: a kernel interleaving those with output arrays that are not in the cache waits on each
output line as its stores reach it. With this and the journal's prefetch
(``lookup_numba._save``), ``benchmarks/table_ops.py``'s calls at load 0.9, the table restored
before each (so nothing is in the cache), alternating with the code before in one process:
find_or_insert 36.7 -> 32.6 ms on uniform keys, 13.1 -> 12.5 on Zipf ones, insert_or_assign
31.7 -> 28.3 on uniform keys (Zipf: 20.1 / 20.0). The training step's lookup, on the state a
step leaves, was unchanged (8.49 / 8.48 ms; split in two parts over two threads, whose outputs
interleave in the same lines, 5.16 / 5.13): its outputs reuse memory still in the cache. (The
probe alone with the caches flushed: 5.16 -> 3.55 ms; 32 elements ahead 3.71, 128 4.19.)"""


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
