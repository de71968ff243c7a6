"""Compiled (numba) hash-index kernels on zero-copy numpy views (one thread per call; the fused
lookup of ``kernels.lookup_numba`` splits its calls over threads by bucket range).

Index layout (HierarchicalKV-style): ``num_buckets`` buckets of ``width`` slots (a power of two).
Per slot: ``keys`` int64, ``scores`` int64, ``digests`` uint8 (0 empty, 1 erased, 2..255 the
key's digest) and ``pins`` int32 (-1 free; -2 pinned by the running lookup; >= 0 the
lookup's unique index; -3 ``PIN_CACHED``; ``PIN_LOCKED`` (-4) and below: held by that many
lookups in flight, see ``dynemb.table.index``). A key lives in bucket ``bucket_of(h)``; inside it, linear probing starts at ``h & (width - 1)`` and
wraps. Digests are compared before keys (a fast negative match).
Erase leaves a tombstone, so a probe stops only at an empty slot, and insertion reuses the first
tombstone it passed. A bucket without a free slot evicts its lowest-score slot whose pin is
free (never a key the same lookup found or inserted; a CACHING backing store also pins, with
PIN_CACHED, the rows its cache holds; held slots carry their hold count, which ``finish`` and
``unpin`` free like any pin and the backend puts back; an insert into a held tombstone keeps it).

``split``: buckets ``[0, split)`` are the hbm tier of a HYBRID table (``home_bucket_nb``); a
single-tier index passes ``split = num_buckets``.

Counts are added to ``counts`` (int64): see the ``C_*`` indices.

All or nothing (a table with ``on_full`` RAISE): :func:`find_pass` can journal the score each
touched slot had (``prev``; :func:`restore_scores` undoes the touches) and :func:`insert_pass`
with ``atomic`` restores every slot it wrote if any key fails, so a failing call changes nothing.
"""

from __future__ import annotations

import numpy as np

from dynemb.batch import EMPTY_KEY
from dynemb.kernels.hashing import digest_of_nb, home_bucket_nb, index_hash_nb
from dynemb.kernels.jit import njit
from dynemb.kernels.prefetch import AHEAD, prefetch, prefetch_cols, prefetch_for_write

D_EMPTY = 0
D_ERASED = 1

P_LRU, P_LFU, P_STEP, P_CUSTOM, P_NO_EVICTION = 0, 1, 2, 3, 4

C_INSERTED, C_EVICTED, C_FAILED, C_SIZE_DELTA = 0, 1, 2, 3
NUM_COUNTS = 4

PIN_FREE = -1
PIN_HELD = -2
PIN_CACHED = -3
PIN_LOCKED = -4
_MAX_SCORE = np.iinfo(np.int64).max
_PUT_AHEAD = 16  # how far ahead :func:`put_where` prefetches the elements it writes


@njit(cache=True, inline="always")
def _probe(ikeys, dig, key, num_buckets, split, bmask):
    """Returns (slot of key or -1, first free slot on the probe path or -1, bucket base, digest).

    Linear probing from the start slot, one slot at a time; a probe stops at an empty slot.
    (Measured here: scanning 8 digests at a time (SWAR) and software prefetching both made the
    common short probes 2x slower, so the loop stays this simple.)
    """
    h = index_hash_nb(key)
    width = bmask + 1
    base = home_bucket_nb(key, h, num_buckets, split) * width
    start = np.int64(h & np.uint64(bmask))
    d = digest_of_nb(h)
    free = -1
    for i in range(width):
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
    return -1, free, base, d


@njit(cache=True, inline="always")
def _prefetch_path(ikeys, dig, key, num_buckets, split, bmask):
    """Prefetches where ``key``'s probe path starts (its digest and key there)."""
    h = index_hash_nb(key)
    t = home_bucket_nb(key, h, num_buckets, split) * (bmask + 1) + np.int64(h & np.uint64(bmask))
    prefetch(dig, t)
    prefetch(ikeys, t)


@njit(cache=True, inline="always")
def _touch(iscores, s, policy, step, custom, i):
    if policy == P_LFU:
        iscores[s] += 1
    elif policy == P_LRU or policy == P_NO_EVICTION:
        iscores[s] = step
    elif policy == P_CUSTOM and custom.shape[0] > 0:
        iscores[s] = custom[i]


@njit(cache=True, nogil=True)
def find_pass(keys, custom, ikeys, iscores, dig, pins, num_buckets, split, bmask, policy, step,
              touch, pin, out_slots, prev):
    """Looks every key up; ``out_slots[i]`` = its slot or -1. With ``touch`` scores are updated
    per occurrence; with ``pin`` found slots are pinned for the rest of the lookup. ``prev``
    (N,) or empty: when given, ``prev[i]`` = the score slot ``out_slots[i]`` had just before
    occurrence i touched it (so :func:`restore_scores` can undo the touches)."""
    journal = prev.shape[0] > 0
    n = keys.shape[0]
    for i in range(n):
        if i + AHEAD < n:
            _prefetch_path(ikeys, dig, keys[i + AHEAD], num_buckets, split, bmask)
        s, _, _, _ = _probe(ikeys, dig, keys[i], num_buckets, split, bmask)
        out_slots[i] = s
        if s >= 0:
            if touch:
                if journal:
                    prev[i] = iscores[s]
                _touch(iscores, s, policy, step, custom, i)
            if pin and pins[s] == PIN_FREE:
                pins[s] = PIN_HELD


@njit(cache=True, nogil=True)
def find_rows(keys, ikeys, dig, num_buckets, split, bmask, hbm, ddr, row_split, dim, out_slots,
              out, out_missing, fill, filled):
    """:func:`find_pass` touching nothing, that also copies each found key's row (slot s: row s
    of ``hbm`` below ``row_split``, else row s - row_split of ``ddr``) into ``out[i, :dim]``;
    returns how many keys were not found, whose positions it writes to ``out_missing``. Their
    ``out`` rows are set to ``fill`` where ``filled`` (a constant eval initializer: written in
    the stream of the copies, where a second pass over the missing positions took 0.3 ms of a
    4.2 ms call; ``table_ops.py``'s find on Zipf keys, six alternating pairs: 13.9-17.7 ->
    16.4-18.2 M keys/s), else left as they are.

    A key's row is prefetched as soon as its probe ends and copied ``AHEAD`` keys later, so the
    row reads of a run of keys overlap their probes (``DynamicTable.find`` against a probe pass
    then a gather, ``benchmarks/table_ops.py`` at load 0.9: 16.0 -> 19.4 M keys/s on Zipf
    keys)."""
    n = keys.shape[0]
    missing = 0
    for i in range(n + AHEAD):
        if i < n:
            if i + AHEAD < n:
                _prefetch_path(ikeys, dig, keys[i + AHEAD], num_buckets, split, bmask)
            s, _, _, _ = _probe(ikeys, dig, keys[i], num_buckets, split, bmask)
            out_slots[i] = s
            if s < 0:
                out_missing[missing] = i
                missing += 1
            elif s < row_split:
                prefetch_cols(hbm, s, False, 0, dim)
            else:
                prefetch_cols(ddr, s - row_split, False, 0, dim)
        j = i - AHEAD
        if j >= 0:
            s = out_slots[j]
            if s >= row_split:
                for c in range(dim):
                    out[j, c] = ddr[s - row_split, c]
            elif s >= 0:
                for c in range(dim):
                    out[j, c] = hbm[s, c]
            elif filled:
                for c in range(dim):
                    out[j, c] = fill
    return missing


@njit(cache=True, nogil=True)
def restore_scores(slots, prev, iscores):
    """Undoes a :func:`find_pass` that touched scores (``prev`` its journal): last occurrence
    first, so each slot ends with the score it had before the pass."""
    for i in range(slots.shape[0] - 1, -1, -1):
        if slots[i] >= 0:
            iscores[slots[i]] = prev[i]


@njit(cache=True, inline="always")
def _lowest_unpinned(iscores, pins, base, width, policy, step):
    """(slot, score) of the lowest-score slot of the bucket not pinned by the running lookup
    (the first such slot on ties), or (-1, MAX) if all are pinned. Under LRU a slot pinned by
    the running lookup has the current step as its score, so a minimum below the step is
    usually unpinned. The fast path finds the lowest score and the first slot holding it in one
    branch-free (vectorised) pass, over score·width + slot: scores are steps, far below
    2**(63 - log2 width); a bucket holding any score outside [0, that) takes the next path.
    If that slot is pinned, the next path reads the pins of the slots holding the minimum only,
    and takes the first free one; if all of them are pinned (held by lookups in flight, cached
    rows of a backing store, scores loaded from elsewhere), the full scan decides. (One pass
    instead of a minimum, then a scan for the first slot holding it: 125-133 -> 85-90 ns per
    bucket of 128 in cache.)"""
    best_score = _MAX_SCORE
    if policy == P_LRU:
        shift = 0
        while (1 << shift) < width:
            shift += 1
        packed = _MAX_SCORE
        high = np.int64(0)
        for j in range(width):
            sc = iscores[base + j]
            high |= sc >> (63 - shift)
            packed = min(packed, (sc << shift) | j)
        if high == 0:
            best_score = packed >> shift
            t = base + (packed & (width - 1))
            if best_score < step and pins[t] == PIN_FREE:
                return t, best_score
        else:
            for j in range(width):
                best_score = min(best_score, iscores[base + j])
        if best_score < step:  # else fall back to reading pins (e.g. scores loaded from elsewhere)
            for j in range(width):
                if iscores[base + j] == best_score and pins[base + j] == PIN_FREE:
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


@njit(cache=True, inline="always")
def new_score(policy, custom, i, step):
    """The score a key inserted by occurrence ``i`` starts with."""
    if policy == P_LFU:
        return np.int64(1)
    if policy == P_CUSTOM and custom.shape[0] > 0:
        return custom[i]
    return np.int64(step)


@njit(cache=True, inline="always")
def victim(iscores, pins, base, width, policy, step, score):
    """(slot, its score) that a new key of ``score`` evicts from its full bucket at ``base``;
    slot -1 when it may evict none (NO_EVICTION, every slot pinned, or a CUSTOM score below
    the lowest)."""
    if policy == P_NO_EVICTION:
        return -1, _MAX_SCORE
    best, best_score = _lowest_unpinned(iscores, pins, base, width, policy, step)
    if best < 0 or (policy == P_CUSTOM and score < best_score):
        return -1, best_score
    return best, best_score


@njit(cache=True, nogil=True)
def put_where(dst, idx, value):
    """``dst[idx] = value`` where ``idx >= 0`` (``index_torch.put_where`` on the host). Each
    element is prefetched for writing ``_PUT_AHEAD`` places before its store (``prefetch.STREAM``:
    a store that misses holds back the later ones; 65,536 random elements of a 2^20 array,
    caches flushed, alternating: 0.96 -> 0.64 ms)."""
    n = idx.shape[0]
    for i in range(n):
        if i + _PUT_AHEAD < n and idx[i + _PUT_AHEAD] >= 0:
            prefetch_for_write(dst, idx[i + _PUT_AHEAD])
        if idx[i] >= 0:
            dst[idx[i]] = value


@njit(cache=True, inline="always")
def claim_slot(ikeys, iscores, dig, pins, s, key, d, score):
    """Slot ``s`` takes ``key`` (digest ``d``) with ``score``, pinned by the running lookup (a
    tombstone held by lookups in flight keeps its hold count)."""
    ikeys[s] = key
    dig[s] = d
    iscores[s] = score
    if pins[s] == PIN_FREE:
        pins[s] = PIN_HELD


@njit(cache=True, inline="always")
def record_eviction(ev_keys, ev_slots, ev_scores, n_ev, ikeys, best, best_score):
    """Writes eviction ``n_ev`` (the key in slot ``best``, the slot, its score); returns
    ``n_ev + 1``."""
    ev_keys[n_ev] = ikeys[best]
    ev_slots[n_ev] = best
    ev_scores[n_ev] = best_score
    return n_ev + 1


@njit(cache=True, nogil=True)
def insert_pass(keys, custom, ikeys, iscores, dig, pins, num_buckets, split, bmask, policy, step,
                atomic, out_slots, inserted, ev_keys, ev_slots, ev_scores, counts):
    """Inserts keys that were missing (duplicates allowed: later ones find the first).

    ``out_slots[i]`` = the key's slot, or -1 when it could not get one (no free slot and nothing
    evictable, or a CUSTOM score below the bucket's lowest). Evicted (key, slot, score) triples
    are written to ``ev_*``; returns how many.

    ``atomic``: if any occurrence fails, every slot the pass wrote is restored (key, digest,
    score, pin, in reverse order), nothing is counted, ``inserted`` is all False and 0 is
    returned; ``out_slots`` then marks the failing occurrences with -1 (its other entries are
    meaningless). Keys are processed exactly as without ``atomic`` until then.
    """
    width = bmask + 1
    n = keys.shape[0]
    n_ev = 0
    n_ins = 0
    n_fail = 0
    n_new = 0
    nj = n if atomic else 0
    j_slot = np.empty(nj, np.int64)
    j_key = np.empty(nj, np.int64)
    j_score = np.empty(nj, np.int64)
    j_dig = np.empty(nj, np.uint8)
    j_pin = np.empty(nj, np.int32)
    n_j = 0
    for i in range(n):
        k = keys[i]
        s, free, base, d = _probe(ikeys, dig, k, num_buckets, split, bmask)
        if s >= 0:
            out_slots[i] = s
            if atomic:
                j_slot[n_j], j_key[n_j], j_score[n_j] = s, ikeys[s], iscores[s]
                j_dig[n_j], j_pin[n_j] = dig[s], pins[s]
                n_j += 1
            _touch(iscores, s, policy, step, custom, i)
            continue
        score = new_score(policy, custom, i, step)
        if free < 0:
            best, best_score = victim(iscores, pins, base, width, policy, step, score)
            if best < 0:
                out_slots[i] = -1
                n_fail += 1
                continue
            n_ev = record_eviction(ev_keys, ev_slots, ev_scores, n_ev, ikeys, best, best_score)
            free = best
        else:
            n_new += 1
        if atomic:
            j_slot[n_j], j_key[n_j], j_score[n_j] = free, ikeys[free], iscores[free]
            j_dig[n_j], j_pin[n_j] = dig[free], pins[free]
            n_j += 1
        claim_slot(ikeys, iscores, dig, pins, free, k, d, score)
        out_slots[i] = free
        inserted[i] = True
        n_ins += 1
    if atomic and n_fail > 0:
        for j in range(n_j - 1, -1, -1):
            s = j_slot[j]
            ikeys[s], iscores[s], dig[s], pins[s] = j_key[j], j_score[j], j_dig[j], j_pin[j]
        for i in range(n):
            inserted[i] = False
        return 0
    counts[C_INSERTED] += n_ins
    counts[C_EVICTED] += n_ev
    counts[C_FAILED] += n_fail
    counts[C_SIZE_DELTA] += n_new
    return n_ev


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
def unpin(slots, pins):
    """Releases pins of ``slots`` (>= 0), e.g. after a lookup failed part-way."""
    for i in range(slots.shape[0]):
        if slots[i] >= 0:
            pins[slots[i]] = PIN_FREE


@njit(cache=True, nogil=True)
def erase(keys, ikeys, iscores, dig, num_buckets, split, bmask, out_slots, counts):
    """Erases keys present; ``out_slots[i]`` = the slot it had or -1. Returns how many."""
    n = 0
    for i in range(keys.shape[0]):
        s, _, _, _ = _probe(ikeys, dig, keys[i], num_buckets, split, bmask)
        out_slots[i] = s
        if s >= 0:
            ikeys[s] = EMPTY_KEY
            dig[s] = D_ERASED
            iscores[s] = 0
            n += 1
    counts[C_SIZE_DELTA] -= n
    return n
