"""Compiled (numba, single-threaded) hash-index kernels on zero-copy numpy views.

Index layout (HierarchicalKV-style): ``num_buckets`` buckets of ``width`` slots (a power of two).
Per slot: ``keys`` int64, ``scores`` int64, ``digests`` uint8 (0 empty, 1 erased, 2..255 the
key's digest) and ``pins`` int32 scratch (-1 free; -2 pinned by the running lookup; >= 0 the
lookup's unique index). A key lives in bucket ``bucket_of(h)``; inside it, linear probing starts
at ``h & (width - 1)`` and wraps. Digests are compared before keys (a fast negative match).
Erase leaves a tombstone, so a probe stops only at an empty slot, and insertion reuses the first
tombstone it passed. A bucket without a free slot evicts its lowest-score slot that the running
lookup has not pinned (never a key the same lookup found or inserted).

Counts are added to ``counts`` (int64): see the ``C_*`` indices.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from dynemb.batch import EMPTY_KEY
from dynemb.kernels.hashing import bucket_of_nb, digest_of_nb, index_hash_nb

D_EMPTY = 0
D_ERASED = 1

P_LRU, P_LFU, P_STEP, P_CUSTOM, P_NO_EVICTION = 0, 1, 2, 3, 4

C_FOUND, C_INSERTED, C_EVICTED, C_FAILED, C_SIZE_DELTA = 0, 1, 2, 3, 4
NUM_COUNTS = 5

PIN_FREE = -1
PIN_HELD = -2
_MAX_SCORE = np.iinfo(np.int64).max


PREFETCH_DISTANCE = 8  # keys ahead whose start slot is prefetched (1.5x on large tables)


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Hints the CPU to load the cache line of ``arr[idx]`` (llvm.prefetch, read, high locality)."""
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i8p = ir.IntType(8).as_pointer()
        ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), i8p)
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def _prefetch_start(keys, i, ikeys, dig, num_buckets, bmask):
    """Prefetches the start slot (digest and key) of ``keys[i]`` if it exists."""
    if i < keys.shape[0]:
        h = index_hash_nb(keys[i])
        s = bucket_of_nb(h, num_buckets) * (bmask + 1) + np.int64(h & np.uint64(bmask))
        _prefetch(dig, s)
        _prefetch(ikeys, s)


_LO7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_ONES = np.uint64(0x0101010101010101)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_BYTE_INDEX = np.uint64(0x0001020304050607)
_U7 = np.uint64(7)
_U56 = np.uint64(56)
PREFIX = 8  # slots probed one by one before the 8-at-a-time scan (MIN_BUCKET)


@njit(cache=True, inline="always")
def _zero_bytes(x):
    """High bit of every byte of ``x`` that is zero (exact, no false positives)."""
    y = (x & _LO7) + _LO7
    return ~(y | x | _LO7)


@njit(cache=True, inline="always")
def _first_byte(mask):
    """Index (0..7) of the lowest byte whose high bit is set in ``mask`` (mask != 0)."""
    low = mask & (~mask + np.uint64(1))
    return np.int64(((low >> _U7) * _BYTE_INDEX) >> _U56)


@njit(cache=True)
def _probe_words(ikeys, dig64, key, base, start, d, bmask):
    """The long probe: scans the bucket's digests 8 at a time (SWAR) in probe order from the
    start slot, stopping after the first 8-byte word that holds an empty slot.
    Returns (slot of key or -1, first free slot or -1)."""
    pattern = np.uint64(d) * _ONES
    nwords = (bmask + 1) >> 3
    first_word = start >> 3
    shift = np.uint64(8 * (start & 7))
    free = -1
    for i in range(nwords + 1):
        if i == 0:
            valid = _ALL << shift
        elif i == nwords:
            if shift == 0:
                break
            valid = ~(_ALL << shift)
        else:
            valid = _ALL
        w = (first_word + i) & (nwords - 1)
        word = dig64[(base >> 3) + w]
        match = _zero_bytes(word ^ pattern) & valid
        while match:
            s = base + 8 * w + _first_byte(match)
            if ikeys[s] == key:
                return s, free
            match &= match - np.uint64(1)
        empty = _zero_bytes(word) & valid
        if free < 0:
            vacant = (empty | _zero_bytes(word ^ _ONES)) & valid
            if vacant:
                free = base + 8 * w + _first_byte(vacant)
        if empty:
            break
    return -1, free


@njit(cache=True, inline="always")
def _probe(ikeys, dig, dig64, key, num_buckets, bmask):
    """Returns (slot of key or -1, first free slot on the probe path or -1, bucket base, digest).

    Linear probing from the start slot; a probe stops at an empty slot. The first PREFIX slots
    are probed one by one (most probes end there); a longer probe continues 8 slots at a time.
    """
    h = index_hash_nb(key)
    width = bmask + 1
    base = bucket_of_nb(h, num_buckets) * width
    start = np.int64(h & np.uint64(bmask))
    d = digest_of_nb(h)
    free = -1
    for i in range(PREFIX):
        s = base + ((start + i) & bmask)
        ds = dig[s]
        if ds == d:
            if ikeys[s] == key:
                return s, free, base, d
        elif ds == D_EMPTY:
            if free < 0:
                free = s
            return -1, free, base, d
        elif ds == D_ERASED and free < 0:
            free = s
    s, free_long = _probe_words(ikeys, dig64, key, base, start, d, bmask)
    return s, (free if free >= 0 else free_long), base, d


@njit(cache=True, inline="always")
def _touch(iscores, s, policy, step, custom, i):
    if policy == P_LFU:
        iscores[s] += 1
    elif policy == P_LRU or policy == P_NO_EVICTION:
        iscores[s] = step
    elif policy == P_CUSTOM and custom.shape[0] > 0:
        iscores[s] = custom[i]


@njit(cache=True)
def find_pass(keys, custom, ikeys, iscores, dig, pins, num_buckets, bmask, policy, step,
              touch, pin, out_slots, counts):
    """Looks every key up; ``out_slots[i]`` = its slot or -1. With ``touch`` scores are updated
    per occurrence; with ``pin`` found slots are pinned for the rest of the lookup."""
    dig64 = dig.view(np.uint64)
    found = 0
    for i in range(keys.shape[0]):
        _prefetch_start(keys, i + PREFETCH_DISTANCE, ikeys, dig, num_buckets, bmask)
        s, _, _, _ = _probe(ikeys, dig, dig64, keys[i], num_buckets, bmask)
        out_slots[i] = s
        if s >= 0:
            found += 1
            if touch:
                _touch(iscores, s, policy, step, custom, i)
            if pin and pins[s] == PIN_FREE:
                pins[s] = PIN_HELD
    counts[C_FOUND] += found


@njit(cache=True, inline="always")
def _lowest_unpinned(iscores, pins, base, width, policy, step):
    """(slot, score) of the lowest-score slot of the bucket not pinned by the running lookup
    (the first such slot on ties), or (-1, MAX) if all are pinned. Two passes: a branch-free
    minimum (vectorisable), then the first slot holding it. Under LRU every pinned slot has the
    current step as its score, so a minimum below the step is unpinned and the pins need not be
    read."""
    best_score = _MAX_SCORE
    if policy == P_LRU:
        for j in range(width):
            best_score = min(best_score, iscores[base + j])
        if best_score < step:  # else fall back to reading pins (e.g. scores loaded from elsewhere)
            for j in range(width):
                if iscores[base + j] == best_score:
                    return base + j, best_score
        best_score = _MAX_SCORE
    for j in range(width):
        sc = iscores[base + j]
        best_score = min(best_score, sc if pins[base + j] == PIN_FREE else _MAX_SCORE)
    for j in range(width):
        t = base + j
        if pins[t] == PIN_FREE and iscores[t] == best_score:
            return t, best_score
    return -1, best_score


@njit(cache=True)
def insert_pass(keys, custom, ikeys, iscores, dig, pins, num_buckets, bmask, policy, step,
                out_slots, inserted, ev_keys, ev_slots, ev_scores, counts):
    """Inserts keys that were missing (duplicates allowed: later ones find the first).

    ``out_slots[i]`` = the key's slot, or -1 when it could not get one (no free slot and nothing
    evictable, or a CUSTOM score below the bucket's lowest). Evicted (key, slot, score) triples
    are written to ``ev_*``; returns how many.
    """
    dig64 = dig.view(np.uint64)
    width = bmask + 1
    n_ev = 0
    n_ins = 0
    n_fail = 0
    n_new = 0
    for i in range(keys.shape[0]):
        k = keys[i]
        _prefetch_start(keys, i + PREFETCH_DISTANCE, ikeys, dig, num_buckets, bmask)
        s, free, base, d = _probe(ikeys, dig, dig64, k, num_buckets, bmask)
        if s >= 0:
            out_slots[i] = s
            _touch(iscores, s, policy, step, custom, i)
            continue
        if policy == P_LFU:
            score = 1
        elif policy == P_CUSTOM:
            score = custom[i] if custom.shape[0] > 0 else step
        else:
            score = step
        if free < 0:
            if policy == P_NO_EVICTION:
                out_slots[i] = -1
                n_fail += 1
                continue
            best, best_score = _lowest_unpinned(iscores, pins, base, width, policy, step)
            if best < 0 or (policy == P_CUSTOM and score < best_score):
                out_slots[i] = -1
                n_fail += 1
                continue
            ev_keys[n_ev] = ikeys[best]
            ev_slots[n_ev] = best
            ev_scores[n_ev] = best_score
            n_ev += 1
            free = best
        else:
            n_new += 1
        ikeys[free] = k
        dig[free] = d
        iscores[free] = score
        pins[free] = PIN_HELD
        out_slots[i] = free
        inserted[i] = True
        n_ins += 1
    counts[C_INSERTED] += n_ins
    counts[C_EVICTED] += n_ev
    counts[C_FAILED] += n_fail
    counts[C_SIZE_DELTA] += n_new
    return n_ev


@njit(cache=True)
def finish(slots, pins, inverse, unique_slots, unique_pos):
    """Numbers the distinct slots of one lookup and releases its pins.

    Every occurrence without a slot (-1) gets its own unique index. Writes ``inverse[i]`` (the
    unique index of occurrence i), ``unique_slots[u]`` and ``unique_pos[u]`` (first occurrence);
    returns the number of unique entries U.
    """
    n_unique = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        if s < 0:
            u = n_unique
            unique_slots[u] = -1
            unique_pos[u] = i
            n_unique += 1
        else:
            u = pins[s]
            if u < 0:
                u = n_unique
                pins[s] = u
                unique_slots[u] = s
                unique_pos[u] = i
                n_unique += 1
        inverse[i] = u
    for u in range(n_unique):
        s = unique_slots[u]
        if s >= 0:
            pins[s] = PIN_FREE
    return n_unique


@njit(cache=True)
def unpin(slots, pins):
    """Releases pins of ``slots`` (>= 0), e.g. after a lookup failed part-way."""
    for i in range(slots.shape[0]):
        if slots[i] >= 0:
            pins[slots[i]] = PIN_FREE


@njit(cache=True)
def erase(keys, ikeys, iscores, dig, num_buckets, bmask, out_slots, counts):
    """Erases keys present; ``out_slots[i]`` = the slot it had or -1. Returns how many."""
    dig64 = dig.view(np.uint64)
    n = 0
    for i in range(keys.shape[0]):
        s, _, _, _ = _probe(ikeys, dig, dig64, keys[i], num_buckets, bmask)
        out_slots[i] = s
        if s >= 0:
            ikeys[s] = EMPTY_KEY
            dig[s] = D_ERASED
            iscores[s] = 0
            n += 1
    counts[C_SIZE_DELTA] -= n
    return n
