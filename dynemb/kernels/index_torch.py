"""Pure-torch, vectorised twins of the hash-index kernels (the reference; also runs on CUDA).

Same layout and same observable behaviour as :mod:`dynemb.kernels.index_numba` (which keys are
found, inserted, evicted or fail; tie-breaks included), though a key may sit in another slot of
its bucket: a key is matched against the whole bucket row at once, so no probe order is needed.
Functions take the index state ``ix`` (keys, scores, digests, pins, counts tensors,
``num_buckets``/``width`` and ``held``, the number of slots held by lookups in flight) and
mutate it in place.
"""

from __future__ import annotations

import torch

from dynemb.kernels.hashing import digest_of, home_bucket, index_hash
from dynemb.kernels.index_numba import (
    C_EVICTED, C_FAILED, C_INSERTED, C_SIZE_DELTA, D_ERASED, EMPTY_KEY, P_CUSTOM, P_LFU, P_LRU,
    P_NO_EVICTION, PIN_FREE, PIN_HELD,
)


def _locate(ix, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bucket of each key, slot of each key or -1)."""
    b = home_bucket(keys, index_hash(keys), ix.num_buckets, ix.split)
    rows = ix.keys.view(ix.num_buckets, ix.width)[b]
    match = rows == keys[:, None]
    col = match.to(torch.int8).argmax(dim=1)
    slots = torch.where(match.any(dim=1), b * ix.width + col, -1)
    return b, slots


def _touch(ix, slots: torch.Tensor, custom: torch.Tensor, policy: int, step: int) -> None:
    if policy == P_LFU:
        ix.scores.index_add_(0, slots, torch.ones_like(slots))
    elif policy in (P_LRU, P_NO_EVICTION):
        ix.scores[slots] = step
    elif policy == P_CUSTOM and custom.numel() > 0:
        # the last occurrence of a slot wins, as in the numba kernels (an indexed write with
        # repeated indices has no defined order on CUDA)
        order = torch.argsort(slots, stable=True)
        s = slots[order]
        last = torch.ones_like(s, dtype=torch.bool)
        last[:-1] = s[1:] != s[:-1]
        ix.scores[s[last]] = custom[order[last]]


def find_pass(ix, keys, custom, policy: int, step: int, touch: bool, pin: bool,
              prev: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """Slot of each key or -1 (touching and pinning as asked). ``prev`` (N,): when given, the
    score each found slot had before this pass is written there (see :func:`restore_scores`).
    ``slots``: the keys' slots, when the caller located them (the Triton backend's probe)."""
    if slots is None:
        _, slots = _locate(ix, keys)
    hit = slots >= 0
    found = slots[hit]
    if touch:
        if prev is not None:
            prev[hit] = ix.scores[found]
        _touch(ix, found, custom[hit] if custom.numel() else custom, policy, step)
    if pin:
        ix.pins[found] = torch.where(ix.pins[found] == PIN_FREE, PIN_HELD, ix.pins[found])
    return slots


def restore_scores(ix, slots: torch.Tensor, prev: torch.Tensor) -> None:
    """Undoes a :func:`find_pass` that touched scores: ``prev`` holds each found slot's score
    from before the pass (the same value for every occurrence of a slot)."""
    hit = slots >= 0
    ix.scores[slots[hit]] = prev[hit]


def _first_occurrence_unique(keys: torch.Tensor):
    """Distinct keys in order of first occurrence: (keys, inverse, counts, first position)."""
    uk, inv, cnt = torch.unique(keys, return_inverse=True, return_counts=True)
    pos = torch.arange(keys.numel(), device=keys.device)
    first = torch.full_like(uk, keys.numel()).scatter_reduce(0, inv, pos, "amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=keys.device)
    return uk[order], rank[inv], cnt[order], first[order]


def _candidates(ix, buckets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each bucket, its slots in the order new keys take them: free slots, then unpinned
    ones by ascending score (ties by slot), then pinned ones. Returns (slots, kind) with kind
    0 free, 1 evictable, 2 pinned; both (len(buckets), width)."""
    w = ix.width
    slots = buckets[:, None] * w + torch.arange(w, device=buckets.device)
    free = ix.digests[slots] <= D_ERASED
    pinned = ix.pins[slots] != PIN_FREE
    kind = torch.where(free, 0, torch.where(pinned, 2, 1))
    # by kind, then score (free and pinned slots by slot alone): two stable sorts, so a row
    # whose score is the int64 minimum still sorts after every free slot
    by_score = torch.sort(torch.where(kind == 1, ix.scores[slots], 0), dim=1, stable=True).indices
    order = by_score.gather(1, torch.sort(kind.gather(1, by_score), dim=1, stable=True).indices)
    return slots.gather(1, order), kind.gather(1, order)


def _custom_victims(which, rank, score_o, cand_slots, cand_kind, scores, slot_o, evict):
    """CUSTOM admission in the numba kernel's order: per bucket, keys past the free slots each
    take the lowest remaining victim if their score is at least its score; a refused key leaves
    that victim to the next key. (A sequential rule: a short Python loop over those keys.)"""
    slot_o, evict = slot_o.clone(), torch.zeros_like(evict)
    nfree = (cand_kind == 0).sum(dim=1).tolist()
    width = cand_slots.shape[1]
    nxt: dict[int, int] = {}
    for j, (b, r, sc) in enumerate(zip(which.tolist(), rank.tolist(), score_o.tolist())):
        if r < nfree[b]:
            continue
        p = nxt.get(b, nfree[b])
        if p < width and int(cand_kind[b, p]) == 1 and sc >= int(scores[cand_slots[b, p]]):
            slot_o[j] = cand_slots[b, p]
            evict[j] = True
            nxt[b] = p + 1
    return slot_o, evict


def insert_pass(ix, keys, custom, policy: int, step: int, atomic: bool = False):
    """Inserts missing keys (duplicates allowed). Returns (slots (N,), inserted (N,) bool,
    evicted keys, evicted slots, evicted scores).

    ``atomic``: if any occurrence would fail, nothing is written or counted: ``inserted`` is all
    False, no evictions, and ``slots`` marks the failing occurrences with -1 (its other entries
    are meaningless). Everything is decided before the first write, so that is a check."""
    dev = keys.device
    uk, inv, cnt, first = _first_occurrence_unique(keys)
    if policy == P_LFU:
        new_score = cnt.clone()
    elif policy == P_CUSTOM and custom.numel() > 0:
        new_score = custom[first]
    else:
        new_score = torch.full_like(uk, step)
    h = index_hash(uk)
    b = home_bucket(uk, h, ix.num_buckets, ix.split)
    order = torch.argsort(b, stable=True)
    tb, per_bucket = torch.unique_consecutive(b[order], return_counts=True)
    starts = torch.cumsum(per_bucket, 0) - per_bucket
    rank = torch.arange(uk.numel(), device=dev) - torch.repeat_interleave(starts, per_bucket)
    which = torch.repeat_interleave(torch.arange(tb.numel(), device=dev), per_bucket)
    cand_slots, cand_kind = _candidates(ix, tb)
    ok_rank = rank < ix.width
    r = rank.clamp(max=ix.width - 1)
    slot_o = cand_slots[which, r]
    kind_o = torch.where(ok_rank, cand_kind[which, r], 2)
    score_o = new_score[order]
    victim = ix.scores[slot_o]
    evict = kind_o == 1
    if policy == P_NO_EVICTION:
        evict = torch.zeros_like(evict)
    elif policy == P_CUSTOM:
        slot_o, evict = _custom_victims(which, rank, score_o, cand_slots, cand_kind, ix.scores,
                                        slot_o, evict)
        victim = ix.scores[slot_o]
    take = (kind_o == 0) | evict
    if atomic and not bool(take.all()):
        slot_u = torch.full_like(uk, -1)
        slot_u[order] = torch.where(take, slot_o, -1)
        none = keys[:0]
        return (slot_u[inv], torch.zeros(keys.numel(), dtype=torch.bool, device=dev),
                (none, none, none))
    ev_slots = slot_o[evict]
    ev = (ix.keys[ev_slots].clone(), ev_slots, victim[evict].clone())
    put = slot_o[take]
    ix.keys[put] = uk[order][take]
    ix.digests[put] = digest_of(h[order][take])
    ix.scores[put] = score_o[take]
    if ix.held:  # a tombstone held by lookups in flight keeps its count
        ix.pins[put] = torch.where(ix.pins[put] == PIN_FREE, PIN_HELD, ix.pins[put])
    else:
        ix.pins[put] = PIN_HELD
    slot_u = torch.full_like(uk, -1)
    slot_u[order] = torch.where(take, slot_o, -1)
    slots = slot_u[inv]
    inserted = torch.zeros(keys.numel(), dtype=torch.bool, device=dev)
    inserted[first] = slot_u >= 0
    if policy == P_CUSTOM and custom.numel() > 0:  # later duplicates re-touch (numba order)
        dup = (slots >= 0) & ~inserted
        ix.scores[slots[dup]] = custom[dup]
    ix.counts[C_INSERTED] += take.sum()  # tensor adds: no device sync on CUDA
    ix.counts[C_EVICTED] += evict.sum()
    ix.counts[C_FAILED] += (slots < 0).sum()
    ix.counts[C_SIZE_DELTA] += (kind_o == 0).sum()
    return slots, inserted, ev


def put_where(dst: torch.Tensor, idx: torch.Tensor, value: int) -> None:
    """``dst[idx] = value`` where ``idx >= 0`` (those distinct), without a boolean mask (which
    on a GPU reads its count back): the others add 0 to element 0 in the same accumulating
    write, which an exact integer sum leaves as the valid writes make it."""
    ok = idx >= 0
    at = torch.where(ok, idx, 0)
    dst.index_put_((at,), torch.where(ok, value - dst[at], 0), accumulate=True)


def first_repeat(keys: torch.Tensor) -> tuple[int, int] | None:
    """(i, j) for the first position j of ``keys`` (N,) whose key was at an earlier position, i
    the first of those; None when the keys are distinct (a sort; ``lookup_numba.first_repeat``
    is a hash set)."""
    _, inv, _, first = _first_occurrence_unique(keys)
    later = torch.nonzero(first[inv] != torch.arange(keys.numel(), device=keys.device)).flatten()
    if later.numel() == 0:
        return None
    j = int(later[0])
    return int(first[inv[j]]), j


def dedup(slots: torch.Tensor):
    """(inverse (N,), unique_slots (U,), unique_pos (U,)) of ``slots`` (N,): distinct slots >= 0
    in ascending order, then every occurrence without a slot (-1) as its own entry."""
    dev = slots.device
    valid = slots >= 0
    us, inv = torch.unique(slots[valid], return_inverse=True)
    pos = torch.arange(slots.numel(), device=dev)
    miss = pos[~valid]
    inverse = torch.empty_like(slots)
    inverse[valid] = inv
    inverse[~valid] = us.numel() + torch.arange(miss.numel(), device=dev)
    first = torch.full_like(us, slots.numel()).scatter_reduce(0, inv, pos[valid], "amin")
    unique_slots = torch.cat([us, torch.full_like(miss, -1)])
    return inverse, unique_slots, torch.cat([first, miss])


def finish(ix, slots: torch.Tensor):
    """:func:`dedup` of one lookup's slots; releases its pins."""
    inverse, unique_slots, unique_pos = dedup(slots)
    ix.pins[unique_slots[unique_slots >= 0]] = PIN_FREE
    return inverse, unique_slots, unique_pos


def unpin(ix, slots: torch.Tensor) -> None:
    ix.pins[slots[slots >= 0]] = PIN_FREE


def erase(ix, keys: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
    """Erases ``keys`` (distinct) that are present; returns the slot each had or -1."""
    if slots is None:
        _, slots = _locate(ix, keys)
    hit = slots[slots >= 0]
    ix.keys[hit] = EMPTY_KEY
    ix.digests[hit] = D_ERASED
    ix.scores[hit] = 0
    ix.counts[C_SIZE_DELTA] -= hit.numel()
    return slots


def compact(flags: torch.Tensor, *values: torch.Tensor) -> tuple[list[torch.Tensor],
                                                                 torch.Tensor]:
    """(a buffer (N + 1,) per tensor of ``values``, the count on the device): each tensor's
    elements where ``flags``, in order, at its buffer's start (cut to the count once it is
    read). One cumulative sum places them all."""
    n = flags.numel()
    at = torch.where(flags, torch.cumsum(flags, 0) - 1, n)
    bufs = []
    for v in values:
        buf = torch.empty(n + 1, dtype=v.dtype, device=v.device)
        bufs.append(buf.scatter_(0, at, v))
    return bufs, flags.sum()


def entries_of(values: torch.Tensor):
    """Entries of ``values`` (N,), one per distinct value, ascending, without a host read:
    (the values sorted (stable), the sort's permutation, each element's entry (N,), each
    sorted element's place in an (N + 1)-long buffer of entries (N, the spare, for repeats),
    the number of entries on the device)."""
    n = values.numel()
    sk, perm = torch.sort(values, stable=True)
    new = torch.ones(n, dtype=torch.bool, device=values.device)
    new[1:] = sk[1:] != sk[:-1]
    entry = torch.cumsum(new, 0) - 1
    inverse = torch.empty_like(entry)
    inverse[perm] = entry
    return sk, perm, inverse, torch.where(new, entry, n), new.sum()


def number_by_key(keys: torch.Tensor, slots: torch.Tensor):
    """(inverse (N,), each entry's slot and first occurrence as (N + 1,) buffers, U on the
    device) with one entry per distinct key, ascending (its occurrences share a slot, or all
    have none), for a caller that gives entries their rows later."""
    n, dev = keys.numel(), keys.device
    _, perm, inverse, at, u = entries_of(keys)
    uslots = torch.empty(n + 1, dtype=torch.int64, device=dev).scatter_(0, at, slots[perm])
    upos = torch.empty(n + 1, dtype=torch.int64, device=dev).scatter_(0, at, perm)
    return inverse, uslots, upos, u
