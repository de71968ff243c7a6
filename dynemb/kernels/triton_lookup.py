"""One training or eval lookup on the triton backend with a single host synchronisation.

``backend.staged_lookup`` (find, insert, finish) reads sizes and counts back to the host at
every step: on a GPU each read waits for the device (about 20 per table and lookup). Here every
intermediate result keeps the call's static size N, and one read at the end brings back all the
numbers the host needs (entries, evictions, new rows, failures, per-tier counts, entries away
from hbm):

1. probe every occurrence (``triton_index.probe``; with a journal of the scores it will touch);
2. touch and pin the found slots (``_touch_kernel``: the same value per slot, an atomic add
   for LFU, the last occurrence for CUSTOM);
3. insert the occurrences of missing keys, sorted by bucket with the found ones last
   (``triton_index.insert``; one program per bucket, so slot for slot as the numba kernels);
4. number the entries with a sort of the slots (distinct slots ascending, then each occurrence
   without a slot: the torch backend's order) and free the call's pins (``_release_kernel``);
5. compact evictions and new rows in occurrence order into (N + 1)-long buffers (a cumulative
   sum gives each its place; the rest go to the last, spare element);
6. read the counts once, and cut the buffers to size.

Same observable result as ``staged_lookup`` on either backend (tests/kernels/test_triton.py).
"""

from __future__ import annotations

import torch

from dynemb.batch import EMPTY_KEY
from dynemb.kernels import triton_index as tix
from dynemb.kernels.index_numba import (
    C_EVICTED, C_FAILED, C_INSERTED, C_SIZE_DELTA, D_ERASED, P_CUSTOM, P_LFU, P_LRU,
    P_NO_EVICTION,
)
from dynemb.kernels.index_torch import compact, entries_of, number_by_key, put_where
from dynemb.kernels.triton_index import K_FREE, K_HELD, jit, tl, triton

_BLOCK = 128
_NO_SCORES = torch.empty(0, dtype=torch.int64)


@jit
def _touch_kernel(slot_ptr, last_ptr, custom_ptr, iscores_ptr, pins_ptr, n, step,
                  TKIND: tl.constexpr, BLOCK: tl.constexpr):
    """Touches (``TKIND`` 1: set to ``step``; 2: add one; 3: the key's last occurrence sets its
    custom score) and pins each found occurrence's slot. Occurrences of one slot write the same
    value (or add atomically, which is order-free for integers): any interleaving gives one
    result."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    s = tl.load(slot_ptr + offs, mask=ok, other=-1)
    hit = ok & (s >= 0)
    if TKIND == 1:
        tl.store(iscores_ptr + s, tl.zeros_like(s) + step, mask=hit)
    elif TKIND == 2:
        tl.atomic_add(iscores_ptr + s, tl.zeros_like(s) + 1, mask=hit)
    elif TKIND == 3:
        last = tl.load(last_ptr + offs, mask=ok, other=0) != 0
        tl.store(iscores_ptr + s, tl.load(custom_ptr + offs, mask=ok, other=0), mask=hit & last)
    p = tl.load(pins_ptr + s, mask=hit, other=0)
    tl.store(pins_ptr + s, tl.zeros_like(p) + K_HELD, mask=hit & (p == K_FREE))


@jit
def _release_kernel(slot_ptr, pins_ptr, n, BLOCK: tl.constexpr):
    """Frees the call's pins (a slot pinned by it; hold counts of lookups in flight stay)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    s = tl.load(slot_ptr + offs, mask=ok, other=-1)
    hit = ok & (s >= 0)
    p = tl.load(pins_ptr + s, mask=hit, other=0)
    tl.store(pins_ptr + s, tl.zeros_like(p) + K_FREE, mask=hit & (p == K_HELD))


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


def _last_of_slot(slots: torch.Tensor) -> torch.Tensor:
    """(N,) int8: whether each occurrence is the last one of its slot (slots >= 0)."""
    n = slots.numel()
    order = torch.sort(slots, stable=True).indices
    s = slots[order]
    last = torch.ones(n, dtype=torch.int8, device=slots.device)
    last[:-1] = (s[1:] != s[:-1]).to(torch.int8)
    out = torch.empty_like(last)
    out[order] = last
    return out


def _number(slots: torch.Tensor, num_slots: int):
    """Entries of the call's slots: (inverse (N,), unique slots and first occurrences as
    (N + 1,) buffers, U on the device). Distinct slots ascending, then each occurrence without
    a slot, in order."""
    n = slots.numel()
    dev = slots.device
    pos = torch.arange(n, device=dev)
    sk, perm, inverse, at, u = entries_of(torch.where(slots >= 0, slots, num_slots + pos))
    uslots = torch.full((n + 1,), -1, dtype=torch.int64, device=dev)
    uslots.scatter_(0, at, torch.where(sk < num_slots, sk, -1))
    upos = torch.empty(n + 1, dtype=torch.int64, device=dev)
    upos.scatter_(0, at, perm)  # the stable sort puts a slot's first occurrence first
    return inverse, uslots, upos, u


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied to host memory without waiting (page-locked, on the current stream): read
    it only after a later read from the device has returned."""
    if t.device.type != "cuda":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def release(ix, slots: torch.Tensor) -> None:
    """Frees the pins a call left on ``slots`` (N,) of ``ix`` (``lookup(release=False)``)."""
    if slots.numel():
        _release_kernel[_grid(slots.numel())](slots, ix.pins, slots.numel(), BLOCK=_BLOCK)


def _admits(adm, keys: torch.Tensor, miss: torch.Tensor):
    """``AdmissionFilter.judge`` on the device, without a read: (which occurrences ``miss``
    (N,) bool lets in, each occurrence's entry by key, whether it is its key's first). A key's
    occurrences are all misses or none, so its count in the call is its count among them."""
    n = keys.numel()
    cix = adm.index
    _, perm, inverse, at, _ = entries_of(keys)
    occ = torch.zeros(n, dtype=torch.int64, device=keys.device)
    occ.scatter_add_(0, inverse, torch.ones_like(inverse))
    first = torch.zeros(n, dtype=torch.bool, device=keys.device).scatter_(0, perm, at < n)
    cs = tix.probe(cix, keys)
    stored = torch.where(cs >= 0, cix.scores[cs.clamp(min=0)], 0)
    return miss & (stored + occ[inverse] >= adm.threshold), cs, first


def _count_sightings(adm, keys: torch.Tensor, miss: torch.Tensor, got_row: torch.Tensor,
                     cs: torch.Tensor, first: torch.Tensor) -> None:
    """``AdmissionFilter.record`` on the device, without a read, in its order: the counters of
    the missing keys that got a row are erased, then every other missing occurrence is counted
    (found counters add one each and are pinned, so the insert of the new ones evicts none of
    them). ``cs``, ``first``: from :func:`_admits`, before the call's insert."""
    n, cix = keys.numel(), adm.index
    gone = torch.where(miss & got_row & first, cs, -1)  # distinct counter slots
    put_where(cix.keys, gone, EMPTY_KEY)
    put_where(cix.digests, gone, D_ERASED)
    put_where(cix.scores, gone, 0)
    cix.counts[C_SIZE_DELTA] -= (gone >= 0).sum()
    rest = miss & ~got_row
    found = torch.where(rest, cs, -1)
    _touch_kernel[_grid(n)](found, found, found, cix.scores, cix.pins, n, 0, TKIND=2,
                            BLOCK=_BLOCK)
    new, inserted, evicted, _, ev_scores, failed = tix.insert(
        cix, keys, _NO_SCORES.to(keys.device), P_LFU, 0, False, only=rest & (found < 0))
    tix.count_insert(cix, inserted, evicted, failed)
    adm.forget_on_device(torch.where(evicted, ev_scores, 0).sum() + failed.sum())
    release(cix, torch.where(found >= 0, found, new))


def lookup(be, ix, keys, custom, policy, step, *, touch: bool, insert: bool, atomic: bool,
           hbm_rows: int, prev: torch.Tensor | None = None, release_pins: bool = True,
           carry=None, admission=None):
    """``staged_lookup``'s :class:`~dynemb.kernels.backend.Resolved` on the triton backend
    ``be`` with one read from the device; its ``away`` counts the entries without an hbm row,
    ``rowless`` those without a row. ``admission``: the table's ``AdmissionFilter``, judged
    and counted on the device (``Resolved.rejected``: the occurrences it kept out).

    For a caller that finishes the call's work itself (a CACHING table's cache): ``prev``, a
    journal of the scores the call touches; ``release_pins=False`` leaves the call's slots
    pinned (:func:`release` frees them); ``carry(slots, hit, ins)`` (``ins``: the insert's
    ``(new, inserted, evicted, evicted scores)``, or None) returns (N + 1)-long int64 buffers
    and their counts, brought to the host with the one read (``Resolved.carried``: the
    buffers stacked, and the counts); entries are then numbered by key."""
    from dynemb.kernels.backend import _EMPTY, Resolved, staged_lookup  # noqa: PLC0415

    n = keys.numel()
    dev = keys.device
    if n == 0:
        none = staged_lookup(be, ix, keys, custom, policy, step, touch=touch, insert=insert,
                             atomic=atomic, admit=None, hbm_rows=hbm_rows)
        return none._replace(away=0, rowless=0)
    b, d, start = tix.hashes(ix, keys)
    if prev is None and atomic and touch:
        prev = torch.empty_like(keys)
    found = tix.probe(ix, keys, prev, hashed=(b, d))
    has_custom = policy == P_CUSTOM and custom.numel() > 0
    if touch or insert:  # (pins keep an insert from evicting the call's own rows)
        tkind = 0
        if touch:
            tkind = {P_LRU: 1, P_NO_EVICTION: 1, P_LFU: 2}.get(policy, 3 if has_custom else 0)
        last = _last_of_slot(found) if tkind == 3 else found
        _touch_kernel[_grid(n)](found, last, custom if has_custom else found, ix.scores,
                                ix.pins, n, step, TKIND=tkind, BLOCK=_BLOCK)
    hit = found >= 0
    miss_hbm = ~hit & (b < ix.split)
    counts = [hit & (found < hbm_rows), hit & (found >= hbm_rows), miss_hbm, ~hit & ~miss_hbm]
    slots, inserted, fresh_n, nums_insert, ins = found, None, None, [], None
    ev_n = failed = torch.zeros((), dtype=torch.int64, device=dev)
    if insert:
        # (the reserved empty key, in a batch changed after it was checked, never gets a row:
        # it fails, counted, instead of corrupting the index)
        reserved = keys == EMPTY_KEY
        miss = ~hit & ~reserved
        admitted = miss
        if admission is not None:
            admitted, cs, first = _admits(admission, keys, miss)
        new, inserted, evicted, ev_keys, ev_scores, fails = tix.insert(
            ix, keys, custom, policy, step, atomic, only=admitted, hashed=(b, d, start))
        slots = torch.where(hit, found, new)
        failed = fails.sum() + reserved.sum()
        nums_insert = [reserved.sum(), (miss & ~admitted).sum()]  # (reserved, rejected)
        (ev_k, ev_s, ev_sc), ev_n = compact(evicted, ev_keys, new, ev_scores)
        (fresh,), fresh_n = compact(inserted, torch.arange(n, device=dev))
        ins = (new, inserted, evicted, ev_scores)
    carried = None
    if carry is None:
        inverse, uslots, upos, u = _number(slots, ix.num_slots)
    else:
        inverse, uslots, upos, u = number_by_key(keys, slots)
        bufs, carried_n = carry(slots, hit, ins)
        carried = to_host(torch.stack(bufs))
    entry = torch.arange(n, device=dev) < u
    rowless = (uslots[:n] < 0) & entry
    away = rowless | ((uslots[:n] >= hbm_rows) & entry)
    nums = [u, ev_n, failed, away.sum(), rowless.sum(), *(c.sum() for c in counts),
            *nums_insert]
    if fresh_n is not None:
        nums.append(fresh_n)
    if carried is not None:
        nums += carried_n
    got = torch.stack(nums).tolist()  # the one read of the call
    n_u, n_ev, n_failed, n_away, n_rowless = got[:5]
    tiers = got[5:9]
    n_reserved, n_rejected = got[9:11] if insert else (0, 0)
    if insert and n_failed and atomic:  # nothing was inserted: undo the touches and pins
        if prev is not None:
            ix.scores.index_put_((found[hit],), prev[hit])
        _release_kernel[_grid(n)](found, ix.pins, n, BLOCK=_BLOCK)
        return Resolved(_EMPTY, _EMPTY, _EMPTY, slots, None, _EMPTY, (_EMPTY,) * 3, n_failed,
                        tiers, None, reserved=n_reserved, rejected=n_rejected)
    if (touch or insert) and release_pins:
        release(ix, slots)
    ev, fresh_out = (_EMPTY.to(dev),) * 3, _EMPTY.to(dev)
    if insert:
        c = ix.counts  # tensor adds: no host read
        c[C_INSERTED] += inserted.sum()
        c[C_EVICTED] += ev_n
        c[C_FAILED] += failed
        c[C_SIZE_DELTA] += inserted.sum() - ev_n
        ev = (ev_k[:n_ev], ev_s[:n_ev], ev_sc[:n_ev])
        fresh_out = fresh[:got[11]]
        if admission is not None:  # the call succeeded: what it saw is counted
            _count_sightings(admission, keys, miss, slots >= 0, cs, first)
    if carried is not None:
        carried = (carried, got[len(got) - len(carried_n):])
    return Resolved(inverse, uslots[:n_u], upos[:n_u], slots, inserted, fresh_out, ev, n_failed,
                    tiers, None, away=n_away, rowless=n_rowless, reserved=n_reserved,
                    rejected=n_rejected, carried=carried)

