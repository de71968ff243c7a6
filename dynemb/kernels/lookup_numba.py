"""One compiled lookup (find, insert and numbering) that probes each distinct key once.

The same observable result as ``find_pass`` (touch, pin), ``insert_pass`` on the misses and
``finish`` of ``kernels.index_numba`` run one after another, which is what the torch backend
does (``TorchBackend.lookup``): the same slots found, inserted, evicted or failing, the same
scores, pins, counts and unique numbering. It gets there with less work:

* :func:`probe` deduplicates the call's keys with a batch-local hash set, so each distinct key is
  hashed into the index once (a Zipf batch repeats most of its keys); repeated occurrences of a
  found key touch its slot directly. A missing key keeps where its probe path had its first
  free slot. :func:`number_first` then numbers the distinct keys by first occurrence.
* :func:`place` inserts the missing keys. A missing key was not found, and slots only fill
  during the call (an evicted slot takes its new key at once), so its first free slot is still
  the recorded one, or a later one on its path: the probe resumes there instead of starting
  over. :func:`events` lists the rows inserted and evicted.
* :func:`number` numbers the entries and frees the call's pins.

:func:`probe` and :func:`place` run in parts (``kernels.threads``): a part does the keys whose
home bucket is in its range of buckets (:func:`owners` and :func:`part_order` list their
occurrences first, so a part reads only its own), in the call's order, so no two parts touch
one bucket or one slot and every bucket sees what it would in one part. Each part journals in
its own rows.

The resolver may decide between :func:`probe` and :func:`place` which misses are let in
(admission). ``journal`` (an atomic call: ``on_full`` RAISE) records every slot the call
writes, so a call where a key gets no row is undone slot for slot (:func:`undo`).
"""

from __future__ import annotations

import sys

import numpy as np

from dynemb.kernels.hashing import digest_of_nb, home_bucket_nb, index_hash_nb
from dynemb.kernels.index_numba import (
    C_EVICTED, C_FAILED, C_INSERTED, C_SIZE_DELTA, D_EMPTY, D_ERASED, P_CUSTOM, P_LFU, PIN_FREE,
    PIN_HELD, _touch, claim_slot, new_score, record_eviction, victim,
)
from dynemb.kernels.jit import njit
from dynemb.kernels.prefetch import (
    AHEAD, STREAM, prefetch, prefetch_for_write, prefetch_read, prefetch_write,
)

T_HBM_HITS, T_DDR_HITS, T_HBM_MISSES, T_DDR_MISSES = 0, 1, 2, 3
"""Indices of the per-tier counts :func:`probe` adds to ``tiers`` (a key's occurrences are hits
when it had a row before the call)."""
_SET_SHIFT = np.uint64(24)  # the set's slot comes from bits the index's bucket choice uses less
_RING = 2 * AHEAD  # :func:`probe` keeps the hashes of the occurrences it prefetched for
_JOURNAL_AHEAD = 16  # rows of the journal :func:`_save` prefetches ahead of the one it writes


def set_size(n: int) -> int:
    """Slots of the batch-local set for ``n`` keys: a power of two at least 2n (load <= 0.5).
    The set is a (slots, 2) int64 array: a key and its first occurrence (-1: an empty slot),
    side by side so that one cache line holds both."""
    return 1 << max(4, (2 * n - 1).bit_length())


@njit(cache=True, inline="always")
def set_size_nb(n):
    """:func:`set_size` in compiled code."""
    m = 16
    while m < 2 * n:
        m <<= 1
    return m


@njit(cache=True, nogil=True)
def first_repeat(keys):
    """(i, j): the first position j whose key was at an earlier position, and the first of
    those, i; (-1, -1) when the keys are distinct. One pass over a hash set of positions
    (65,536 keys: 0.6 ms against 1.5-3.3 for ``torch.unique``, a sort)."""
    m = set_size_nb(keys.shape[0])
    mask = np.uint64(m - 1)
    at = np.full(m, -1, np.int64)
    for j in range(keys.shape[0]):
        k = keys[j]
        p = (index_hash_nb(k) >> _SET_SHIFT) & mask
        while at[p] >= 0:
            if keys[at[p]] == k:
                return at[p], j
            p = (p + np.uint64(1)) & mask
        at[p] = j
    return -1, -1


@njit(cache=True, inline="always")
def _save(journal, n_j, s, ikeys, iscores, dig, pins):
    """Appends slot s's state to the journal (an atomic call); returns the new length. The row
    ``_JOURNAL_AHEAD`` rows on is prefetched for writing (see ``prefetch.STREAM``; a row is five
    int64, so the rows reach a new line every other entry: :func:`place` of 65,536 new keys on
    one index state, caches flushed, alternating: 9.75 -> 8.10 ms, against 7.25 with no
    journal)."""
    if journal.shape[0] > 0:
        if n_j + _JOURNAL_AHEAD < journal.shape[0]:
            prefetch_write(journal, n_j + _JOURNAL_AHEAD, 0)
        journal[n_j, 0] = s
        journal[n_j, 1] = ikeys[s]
        journal[n_j, 2] = iscores[s]
        journal[n_j, 3] = dig[s]
        journal[n_j, 4] = pins[s]
        return n_j + 1
    return n_j


@njit(cache=True, inline="always")
def _owner(bucket, num_buckets, parts):
    """The part whose bucket range holds ``bucket``: part p has ``[B·p/parts, B·(p+1)/parts)``."""
    return (bucket * parts) // num_buckets


@njit(cache=True, nogil=True)
def owners(keys, num_buckets, split, parts, owner):
    """``owner[i]`` = the part (of ``parts``) whose bucket range holds key i's home bucket."""
    for i in range(keys.shape[0]):
        k = keys[i]
        owner[i] = _owner(home_bucket_nb(k, index_hash_nb(k), num_buckets, split), num_buckets,
                          parts)


@njit(cache=True, nogil=True)
def part_order(owner, part, order):
    """Writes the occurrences i with ``owner[i] == part``, in order, to ``order``; returns how
    many (a branch-free compaction)."""
    c = 0
    for i in range(owner.shape[0]):
        order[c] = i
        c += owner[i] == part
    return c


_SHORT = 16  # slots a probe reads one by one before it reads words
_ONES = np.uint64(0x0101010101010101)
_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_HIGHS = np.uint64(0x8080808080808080)
_NOT_ERASED = np.uint64(0xFEFEFEFEFEFEFEFE)
_ALL = ~np.uint64(0)
_LITTLE = sys.byteorder == "little"


@njit(cache=True, inline="always")
def _zero_bytes(x):
    """The high bit of each byte of ``x`` that is zero (exact: no carry crosses bytes)."""
    return ~(((x & _LOW7) + _LOW7) | x) & _HIGHS


@njit(cache=True, inline="always")
def _first_byte(m):
    """The index of the lowest byte flagged in ``m`` (not zero)."""
    b = 0
    while (m >> np.uint64(8 * b + 7)) & np.uint64(1) == 0:
        b += 1
    return b


@njit(cache=True, inline="always")
def _probe_words(dig64, ikeys, base, width, start, k, d, free):
    """The probe of :func:`probe` from path offset ``_SHORT`` on, 8 digests a read: (slot of key
    ``k`` (digest ``d``) or -1, the offset of the first free slot on its path, ``free`` if it
    was already found, else ``width`` if none). Reads the bucket's words of digests in path
    order and stops after the word where the path meets an empty slot, as the slot by slot
    probe stops at it (a key is never past one; slots of a word past it hold other keys).
    (A miss in a full bucket of 128 reads all 128 digests. ``benchmarks/train_step.py``, SGD
    dim 64, evicting, alternating: 19.9 / 20.2 -> 19.3 / 19.0 ms per step; ``table_ops.py``'s
    find_or_insert at load 0.9, where most buckets have empty slots, 0-5 % slower.)"""
    nw = width >> 3
    w0 = base >> 3
    pos = (start + _SHORT) & (width - 1)
    wi = pos >> 3
    upper = _ALL << np.uint64(8 * (pos & 7))  # the bytes of word wi from pos on
    pattern = np.uint64(d) * _ONES
    for c in range(nw + 1):
        if c == 0:
            keep = upper
        elif c < nw:
            keep = _ALL
        else:  # back at word wi: its bytes before pos
            keep = ~upper
            if keep == 0:
                break
        w = (wi + c) & (nw - 1)
        word = dig64[w0 + w]
        m = _zero_bytes(word ^ pattern) & keep
        while m != 0:
            b = _first_byte(m)
            q = base + 8 * w + b
            if ikeys[q] == k:
                return q, free
            m &= ~(np.uint64(0xFF) << np.uint64(8 * b))
        if free == width:
            m = _zero_bytes(word & _NOT_ERASED) & keep
            if m != 0:
                free = (8 * w + _first_byte(m) - start) & (width - 1)
        if _zero_bytes(word) & keep != 0:
            break
    return -1, free


@njit(cache=True, nogil=True)
def probe(every, order, keys, custom, ikeys, iscores, dig, pins, num_buckets, split, bmask,
          policy, step, touch, hbm_rows, bset, first, slots, slot_at, free_at,
          journal, tiers):
    """Finds the keys (N,) at the occurrences ``order`` (increasing), or at all of them with
    ``every``, each distinct key once; returns the journal's length. A part
    (``kernels.threads``) takes the occurrences whose home bucket is in its range
    (:func:`owners`, :func:`part_order`).

    Writes for each of those occurrences i ``first[i]`` (the first occurrence of its key) and
    ``slots[i]`` (its slot or -1), and at a first occurrence p ``slot_at[p]`` (the slot or -1)
    and for a missing key ``free_at[p]``, the offset on its probe path of the first free slot
    (``width`` if none). Found slots are pinned (``PIN_HELD``, unless held) and, with ``touch``,
    touched per occurrence. ``bset``: the part's batch-local set (``set_size(N)`` slots; filled
    here). ``tiers`` (4,) int64: the part's hits and misses per tier added (a hit is in hbm
    when its slot is below ``hbm_rows``, a miss when its home bucket is below ``split``).
    :func:`number_first` numbers the distinct keys afterwards.

    A found key's pin, score and journal entry are written ``AHEAD`` occurrences after its
    probe, which prefetches their lines (``benchmarks/table_ops.py``'s find_or_insert at load
    0.9, Zipf keys: this kernel 5.3 -> 4.6 ms per 65,536 keys); a slot's writes keep their
    order. The kernel is bound by its instructions about as much as by memory (the same ids
    ordered by bucket, so the index is read in order, still take 3.8-4.1 ms of the 5.2-6.5): so
    each key is hashed once, when its lines are prefetched, the tiers are counted in locals, a
    found occurrence pins its slot with one branch-free store, and a repeated occurrence whose
    touch would change nothing (LRU, NO_EVICTION, STEP) writes nothing to the index (a step's
    65,536 ids, ``train_step.py``'s evicting table, alternating with the code before these four
    changes: 5.07 / 5.22 / 4.68 -> 4.08 / 4.19 / 3.74 ms)."""
    bset[:, 1] = -1
    smask = np.uint64(bset.shape[0] - 1)
    width = bmask + 1
    words = (_LITTLE and width > _SHORT and dig.shape[0] % 8 == 0
             and dig.ctypes.data % 8 == 0)  # (slot 8w + b is byte b of word w)
    dig64 = dig.view(np.uint64) if words else np.empty(0, np.uint64)
    short = _SHORT if words else width  # slots probed one by one
    n_j = 0
    journaled = journal.shape[0] > 0
    # a repeated occurrence of a found key has its slot pinned and, under LRU or NO_EVICTION,
    # touched to this step already: only LFU counts and CUSTOM scores need it to touch again
    every_touch = touch and (policy == P_LFU or policy == P_CUSTOM)
    n = keys.shape[0] if every else order.shape[0]
    later = np.full(AHEAD, -1, np.int64)  # found occurrences waiting for their slot's lines
    # the hash and home bucket of occurrence t, computed AHEAD occurrences early for the
    # prefetch, kept in ring_h / ring_b at t % _RING; the tier counts are added at the end
    ring_h = np.empty(_RING, np.uint64)
    ring_b = np.empty(_RING, np.int64)
    hbm_hits = ddr_hits = hbm_misses = ddr_misses = 0
    line = -1  # the last line of the outputs prefetched ``STREAM`` occurrences ahead
    for t in range(n + AHEAD):
        # a found occurrence's pin, journal entry and touch come AHEAD occurrences after its
        # probe, which prefetched its slot's pin and score (each slot's writes keep their order)
        w = later[t % AHEAD]
        if w >= 0:
            s = slots[w]
            if journaled and first[w] == w:
                # its state before the call, once: :func:`undo` restores the earliest entry of
                # a slot last, so the slot's later writes (repeated occurrences) need none
                if touch or pins[s] == PIN_FREE:
                    n_j = _save(journal, n_j, s, ikeys, iscores, dig, pins)
            # pinned at its key's first occurrence; a repeated one (LFU, CUSTOM) finds it
            # pinned already, so every occurrence takes the same branch-free store
            ps = pins[s]
            pins[s] = PIN_HELD if ps == PIN_FREE else ps
            if touch:
                _touch(iscores, s, policy, step, custom, w)
        later[t % AHEAD] = -1
        if t >= n:
            continue
        if t + AHEAD < n:
            ka = keys[t + AHEAD if every else order[t + AHEAD]]
            ha = index_hash_nb(ka)
            ba = home_bucket_nb(ka, ha, num_buckets, split)
            ring_h[(t + AHEAD) % _RING] = ha
            ring_b[(t + AHEAD) % _RING] = ba
            ta = ba * width + np.int64(ha & np.uint64(bmask))
            prefetch_read(bset, (ha >> _SET_SHIFT) & smask, 0)
            prefetch(dig, ta)
            prefetch(ikeys, ta)
        i = t if every else order[t]
        k = keys[i]
        q = (i + STREAM) & ~7  # (eight int64 to a line)
        if q != line and q < first.shape[0]:  # the outputs' lines, before the stores reach them
            line = q
            prefetch_for_write(first, q)
            prefetch_for_write(slots, q)
            prefetch_for_write(slot_at, q)
            prefetch_for_write(free_at, q)
        if t >= AHEAD:
            h = ring_h[t % _RING]
            bucket = ring_b[t % _RING]
        else:
            h = index_hash_nb(k)
            bucket = home_bucket_nb(k, h, num_buckets, split)
        p = (h >> _SET_SHIFT) & smask
        while True:
            f = bset[p, 1]
            if f < 0 or bset[p, 0] == k:
                break
            p = (p + np.uint64(1)) & smask
        if f < 0:  # the first occurrence: probe the index
            f = i
            bset[p, 0] = k
            bset[p, 1] = i
            base = bucket * width
            start = np.int64(h & np.uint64(bmask))
            d = digest_of_nb(h)
            s = -1
            free = width
            ended = False
            for j in range(short):
                q = base + ((start + j) & bmask)
                ds = dig[q]
                if ds == d:
                    if ikeys[q] == k:
                        s = q
                        ended = True
                        break
                elif ds == D_EMPTY:
                    if free == width:
                        free = j
                    ended = True
                    break
                elif ds == D_ERASED and free == width:
                    free = j
            if not ended and short < width:  # a long probe: the rest by words of 8 digests
                s, free = _probe_words(dig64, ikeys, base, width, start, k, d, free)
            slot_at[i] = s
            free_at[i] = free
            if s >= 0:
                prefetch(pins, s)
                prefetch(iscores, s)
        else:
            s = slot_at[f]
        first[i] = f
        slots[i] = s
        if s < 0:
            if bucket < split:
                hbm_misses += 1
            else:
                ddr_misses += 1
        else:
            if s < hbm_rows:
                hbm_hits += 1
            else:
                ddr_hits += 1
            if f == i or every_touch:
                later[t % AHEAD] = i
    tiers[T_HBM_HITS] += hbm_hits
    tiers[T_DDR_HITS] += ddr_hits
    tiers[T_HBM_MISSES] += hbm_misses
    tiers[T_DDR_MISSES] += ddr_misses
    return n_j


@njit(cache=True, nogil=True)
def number_first(first, slot_at, free_at, inverse, uslot, ufree, upos):
    """Numbers the distinct keys :func:`probe`'s parts found by first occurrence; returns their
    count U. Writes ``inverse[i]`` (the number of occurrence i's key) and per distinct key u:
    ``uslot[u]``, ``ufree[u]`` and ``upos[u]`` (its first occurrence)."""
    n_u = 0
    for i in range(first.shape[0]):
        f = first[i]
        if f == i:
            uslot[n_u] = slot_at[i]
            ufree[n_u] = free_at[i]
            upos[n_u] = i
            inverse[i] = n_u
            n_u += 1
        else:
            inverse[i] = inverse[f]  # f < i: numbered already
    return n_u


@njit(cache=True, inline="always")
def _prefetch_free(k, off, ikeys, iscores, dig, pins, num_buckets, split, bmask):
    """Prefetches the slot a missing key ``k`` will take (its first free slot at path offset
    ``off``), or the scores of its full bucket."""
    h = index_hash_nb(k)
    width = bmask + 1
    base = home_bucket_nb(k, h, num_buckets, split) * width
    if off < width:
        t = base + ((np.int64(h & np.uint64(bmask)) + off) & bmask)
        prefetch(dig, t)
        prefetch(ikeys, t)
        prefetch(iscores, t)
        prefetch(pins, t)
    else:
        for j in range(0, width, 8):
            prefetch(iscores, base + j)


@njit(cache=True, nogil=True)
def place(every, order, keys, custom, ikeys, iscores, dig, pins, num_buckets, split, bmask,
          policy, step, allowed, inverse, slots, uslot, ufree, journal, n_j, inserted, ev_keys,
          ev_slots, ev_scores, out):
    """Inserts the missing keys at the occurrences ``order`` (a part's, as :func:`probe` takes
    them), or at all of them with ``every``, after :func:`number_first`, occurrence by
    occurrence, as ``insert_pass`` would: the first allowed occurrence of a missing key inserts
    it (evicting the lowest-score unpinned slot of a full bucket), later ones touch its slot; one
    that cannot get a slot fails (and a later occurrence tries again). ``allowed`` (N,) bool or
    empty (all): the occurrences admission lets in. Updates ``slots``, ``uslot`` and
    ``inserted`` (the occurrences that inserted); an occurrence i that evicted writes the row it
    evicted to ``ev_keys[i]``, ``ev_slots[i]`` (-1 for none; filled by the caller) and
    ``ev_scores[i]``; :func:`events` lists both in order. ``out`` (5,) int64 gets the part's
    (inserted, evicted, failed, new slots taken, journal length); :func:`count` adds them to the
    index's counts once the call stands."""
    width = bmask + 1
    n_ins = 0
    n_ev = 0
    n_fail = 0
    n_new = 0
    admit_all = allowed.shape[0] == 0
    n = keys.shape[0] if every else order.shape[0]
    todo = np.empty(n, np.int64)  # the occurrences to place, in order
    n_todo = 0
    for t in range(n):
        i = t if every else order[t]
        if slots[i] < 0 and (admit_all or allowed[i]):
            todo[n_todo] = i
            n_todo += 1
    for t in range(n_todo):
        if t + AHEAD < n_todo:
            a = todo[t + AHEAD]
            if uslot[inverse[a]] < 0:
                _prefetch_free(keys[a], ufree[inverse[a]], ikeys, iscores, dig, pins,
                               num_buckets, split, bmask)
        i = todo[t]
        u = inverse[i]
        s = uslot[u]
        if s >= 0:  # inserted by an earlier occurrence of this call
            n_j = _save(journal, n_j, s, ikeys, iscores, dig, pins)
            _touch(iscores, s, policy, step, custom, i)
            slots[i] = s
            continue
        k = keys[i]
        h = index_hash_nb(k)
        base = home_bucket_nb(k, h, num_buckets, split) * width
        start = np.int64(h & np.uint64(bmask))
        free = -1
        for j in range(ufree[u], width):  # slots before the recorded one are still occupied
            t = base + ((start + j) & bmask)
            ds = dig[t]
            if ds == D_EMPTY or ds == D_ERASED:
                free = t
                break
        score = new_score(policy, custom, i, step)
        if free < 0:
            ufree[u] = width
            best, best_score = victim(iscores, pins, base, width, policy, step, score)
            if best < 0:
                n_fail += 1
                continue
            record_eviction(ev_keys, ev_slots, ev_scores, i, ikeys, best, best_score)
            n_ev += 1
            free = best
        else:
            n_new += 1
        n_j = _save(journal, n_j, free, ikeys, iscores, dig, pins)
        claim_slot(ikeys, iscores, dig, pins, free, k, digest_of_nb(h), score)
        uslot[u] = free
        slots[i] = free
        inserted[i] = True
        n_ins += 1
    out[0] = n_ins
    out[1] = n_ev
    out[2] = n_fail
    out[3] = n_new
    out[4] = n_j


@njit(cache=True, nogil=True)
def events(inserted, ev_keys, ev_slots, ev_scores, fresh_pos, ev_out):
    """Lists what :func:`place`'s parts did, in occurrence order: ``fresh_pos`` the occurrences
    that inserted; ``ev_out`` (3, N) the evicted rows' keys, slots and scores. Returns
    (inserted, evicted)."""
    n_ins = 0
    n_ev = 0
    for i in range(inserted.shape[0]):
        if inserted[i]:
            fresh_pos[n_ins] = i
            n_ins += 1
        if ev_slots[i] >= 0:
            ev_out[0, n_ev] = ev_keys[i]
            ev_out[1, n_ev] = ev_slots[i]
            ev_out[2, n_ev] = ev_scores[i]
            n_ev += 1
    return n_ins, n_ev


@njit(cache=True, nogil=True)
def count(counts, out):
    """Adds what :func:`place`'s parts did (their ``out`` rows) to the index's counts."""
    for p in range(out.shape[0]):
        counts[C_INSERTED] += out[p, 0]
        counts[C_EVICTED] += out[p, 1]
        counts[C_FAILED] += out[p, 2]
        counts[C_SIZE_DELTA] += out[p, 3]


@njit(cache=True, nogil=True)
def undo(journal, n_j, ikeys, iscores, dig, pins):
    """Restores every slot the journal recorded, last write first: the index is as it was before
    :func:`probe`."""
    for j in range(n_j - 1, -1, -1):
        s = journal[j, 0]
        ikeys[s] = journal[j, 1]
        iscores[s] = journal[j, 2]
        dig[s] = journal[j, 3]
        pins[s] = journal[j, 4]


@njit(cache=True, nogil=True)
def number(slots, inverse, uslot, upos, n_u, pins, unique_slots, unique_pos):
    """Numbers the entries as ``finish`` does and frees the call's pins; returns their count.

    Every occurrence without a slot is an entry of its own; the others are numbered by the
    first occurrence of their slot. When every occurrence has a slot that is the numbering of
    :func:`probe` (a key's occurrences share its slot), kept as it is."""
    n = slots.shape[0]
    whole = True
    for i in range(n):
        if slots[i] < 0:
            whole = False
            break
    if whole:
        m = n_u
        for u in range(n_u):
            unique_slots[u] = uslot[u]
            unique_pos[u] = upos[u]
    else:
        remap = np.full(n_u, -1, np.int64)
        m = 0
        for i in range(n):
            s = slots[i]
            if s < 0:
                unique_slots[m] = -1
                unique_pos[m] = i
                inverse[i] = m
                m += 1
                continue
            u = inverse[i]
            if remap[u] < 0:
                remap[u] = m
                unique_slots[m] = s
                unique_pos[m] = i
                m += 1
            inverse[i] = remap[u]
    for u in range(m):
        s = unique_slots[u]
        if s >= 0 and pins[s] == PIN_HELD:
            pins[s] = PIN_FREE
    return m
