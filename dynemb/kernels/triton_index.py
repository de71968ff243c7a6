"""Triton kernels of the hash index (``kernels.index_numba``'s layout and rules) for CUDA tables.

The index is HierarchicalKV's: buckets of ``width`` slots, a 1-byte digest per slot compared
before the key. Two kernels:

* :func:`probe`: the slot of each key or -1. A program takes ``BLOCK`` keys and loads, for each,
  its bucket's ``width`` digests (one coalesced row of bytes); only the slots whose digest
  matches load their key (a masked load), so a lookup reads about one key, not a bucket of them.
  The index is only read: any number of programs may run at once.
* :func:`insert`: inserts keys that were missing. The keys are sorted by bucket (a stable sort:
  in each bucket, the call's order) and **one program owns one bucket**: it loads the bucket's
  keys, digests, scores and pins into registers, places its keys one after another exactly as
  ``index_numba.insert_pass`` does, and writes the bucket back once. No two programs touch one
  bucket or one slot, so the kernel is race-free without atomics, and its result does not
  depend on the order programs run in.

The slot a new key takes is the one ``insert_pass`` gives it: the first free slot (empty or
erased) on its linear-probe path, which starts at ``h & (width - 1)`` and wraps; in a full
bucket, the lowest-score slot whose pin is free (the first slot on ties). So an index written
by these kernels is slot for slot the numba kernels' index, and either reads the other's.

Hashes (bucket, digest, start slot) are computed by ``kernels.hashing``'s torch functions and
passed in: the kernels stay small and the hashes are bit-identical by construction.

With ``TRITON_INTERPRET=1`` the kernels run in Triton's interpreter on CPU tensors: how CI, which
has no GPU, tests them against the numba kernels (``tests/conftest.py`` sets it on a host
without CUDA).
"""

from __future__ import annotations

import os

import torch

try:  # triton is a dependency, but a host without it still runs every other backend
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the pinned install has it
    triton = tl = None

from dynemb.kernels.hashing import digest_of, home_bucket, index_hash
from dynemb.kernels.index_numba import (
    C_EVICTED, C_FAILED, C_INSERTED, C_SIZE_DELTA, P_CUSTOM, P_LFU, P_LRU, P_NO_EVICTION,
    PIN_FREE, PIN_HELD,
)

MAX_SCORE = torch.iinfo(torch.int64).max


def const(value: int):
    """A module-level constant a kernel may read (compiled Triton refuses other globals; the
    interpreter does not, so ``tests/kernels/test_triton_compiles.py`` compiles every kernel)."""
    return tl.constexpr(value) if triton is not None else value


K_FREE, K_HELD = const(PIN_FREE), const(PIN_HELD)
K_NO_EVICTION, K_CUSTOM = const(P_NO_EVICTION), const(P_CUSTOM)


def interpreted() -> bool:
    """Whether kernels run in Triton's interpreter, on CPU tensors (``TRITON_INTERPRET=1``, which
    must be set before triton is first imported, e.g. by ``torch._dynamo``: Triton's own library
    functions are kernels too, made when it is imported)."""
    return triton is not None and os.environ.get("TRITON_INTERPRET") == "1" \
        and bool(triton.knobs.runtime.interpret)


def available(device: torch.device) -> bool:
    """Whether the kernels run on ``device``: CUDA, or CPU in Triton's interpreter."""
    if triton is None:
        return False
    return interpreted() if device.type == "cpu" else device.type == "cuda"


jit = triton.jit if triton is not None else (lambda fn: fn)


def hashes(ix, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bucket, digest (uint8), start slot in the bucket) of each key, as ``_probe`` has them."""
    h = index_hash(keys)
    b = home_bucket(keys, h, ix.num_buckets, ix.split)
    return b, digest_of(h), h & (ix.width - 1)


_PROBE_BLOCK = 16


@jit
def _probe_kernel(key_ptr, bucket_ptr, digest_ptr, ikeys_ptr, idig_ptr, iscores_ptr, out_ptr,
                  prev_ptr, n, W: tl.constexpr, JOURNAL: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    k = tl.load(key_ptr + offs, mask=ok, other=0)
    base = tl.load(bucket_ptr + offs, mask=ok, other=0) * W
    d = tl.load(digest_ptr + offs, mask=ok, other=0)
    cols = tl.arange(0, W)
    slot = base[:, None] + cols[None, :]
    dig = tl.load(idig_ptr + slot, mask=ok[:, None], other=0)
    cand = (dig == d[:, None]) & ok[:, None]  # a key's digest is >= 2: never empty or erased
    ks = tl.load(ikeys_ptr + slot, mask=cand, other=0)
    col = tl.min(tl.where(cand & (ks == k[:, None]), cols[None, :], W), axis=1)
    slot = tl.where(col < W, base + col, -1)
    tl.store(out_ptr + offs, slot, mask=ok)
    if JOURNAL:  # the score each found slot has before the call touches it
        tl.store(prev_ptr + offs, tl.load(iscores_ptr + slot, mask=ok & (slot >= 0), other=0),
                 mask=ok)


def probe(ix, keys: torch.Tensor, prev: torch.Tensor | None = None,
          hashed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The slot of each key (N,) or -1; reads the index only. ``prev`` (N,): receives each found
    slot's score. ``hashed``: the keys' (bucket, digest) when the caller has them."""
    n = keys.numel()
    out = torch.empty_like(keys)
    if n:
        b, d = hashed or hashes(ix, keys)[:2]
        grid = (triton.cdiv(n, _PROBE_BLOCK),)
        _probe_kernel[grid](keys, b, d, ix.keys, ix.digests, ix.scores, out,
                            out if prev is None else prev, n, W=ix.width,
                            JOURNAL=prev is not None, BLOCK=_PROBE_BLOCK)
    return out


@jit
def _insert_kernel(order_ptr, sorted_ptr, end_ptr, key_ptr, digest_ptr, start_ptr, score_ptr,
                   touch_ptr, ikeys_ptr, iscores_ptr, idig_ptr, pins_ptr, slot_ptr, ins_ptr,
                   evk_ptr, evs_ptr, evflag_ptr, fail_ptr, veto_ptr, policy, tkind, num_buckets,
                   W: tl.constexpr, MAX: tl.constexpr):
    """Program p owns the bucket of sorted key p if p starts that bucket's run ``[p, end[p])``;
    it places the run's keys in order (bucket ``num_buckets``: keys not to insert). ``tkind``:
    how a key found again is touched (0 not, 1 set to ``touch[i]``, 2 add one). ``veto`` (a
    device count): when non-zero, nothing is written back (the commit launch of an atomic
    insert that failed)."""
    p = tl.program_id(0)
    b = tl.load(sorted_ptr + p)
    prev_b = tl.load(sorted_ptr + tl.maximum(p - 1, 0))
    if ((p == 0) | (prev_b != b)) & (b < num_buckets):  # p starts its bucket's run
        cols = tl.arange(0, W)
        slots = b * W + cols
        bkeys = tl.load(ikeys_ptr + slots)
        bsc = tl.load(iscores_ptr + slots)
        bdig = tl.load(idig_ptr + slots)
        bpin = tl.load(pins_ptr + slots)
        j = p
        hi = tl.load(end_ptr + p)
        while j < hi:  # (not ``for j in range``: the interpreter cannot index with a tensor)
            i = tl.load(order_ptr + j)
            k = tl.load(key_ptr + i)
            d = tl.load(digest_ptr + i)
            start = tl.load(start_ptr + i)
            score = tl.load(score_ptr + i)
            # one reduction ranks the slots: the key's own (an earlier occurrence of this call
            # inserted it), else free ones (empty or erased) by distance on the probe path
            dist = (cols - start) & (W - 1)
            m = tl.min(tl.where((bdig == d) & (bkeys == k), cols,
                                tl.where(bdig <= 1, W + dist, 2 * W))).to(tl.int64)
            found = m < W
            place = ~found & (m < 2 * W)
            col = tl.where(found, m, (start + m - W) & (W - 1))
            evict = m < 0
            best = score * 0 + MAX
            ev_key = k * 0
            if m >= 2 * W:  # a full bucket: the lowest-score unpinned slot, the first on ties
                best = tl.min(tl.where(bpin == K_FREE, bsc, MAX))
                col = tl.min(tl.where((bpin == K_FREE) & (bsc == best), cols, W)).to(tl.int64)
                evict = (col < W) & (policy != K_NO_EVICTION)
                evict = evict & ((policy != K_CUSTOM) | (score >= best))
                place = evict
                ev_key = tl.sum(tl.where(cols == col, bkeys, 0))
            at = cols == col
            touched = tl.where(tkind == 2, bsc + 1, tl.load(touch_ptr + i))
            bsc = tl.where(at & found & (tkind != 0), touched, tl.where(at & place, score, bsc))
            bkeys = tl.where(at & place, k, bkeys)
            bdig = tl.where(at & place, d, bdig)
            bpin = tl.where(at & place & (bpin == K_FREE), K_HELD, bpin)
            tl.store(slot_ptr + i, tl.where(found | place, b * W + col, -1))
            tl.store(ins_ptr + i, place)
            tl.store(evflag_ptr + i, evict)
            tl.store(evk_ptr + i, ev_key)
            tl.store(evs_ptr + i, best)
            tl.store(fail_ptr + i, ~found & ~place)
            j += 1
        if tl.load(veto_ptr) == 0:
            tl.store(ikeys_ptr + slots, bkeys)
            tl.store(iscores_ptr + slots, bsc)
            tl.store(idig_ptr + slots, bdig)
            tl.store(pins_ptr + slots, bpin)


def insert(ix, keys, custom, policy: int, step: int, atomic: bool,
           only: torch.Tensor | None = None,
           hashed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """``index_numba.insert_pass`` on ``keys`` (N,) (``only``: on the occurrences where it is
    True): returns (slots, inserted (N,) bool, evicted (N,) bool, the evicted key and score at
    each evicting occurrence, failed (N,) bool) per occurrence (-1 and False elsewhere).
    ``atomic``: the keys are placed in a first launch that writes nothing back, and a second
    launch writes only if no key failed (decided on the device, no host read). ``hashed``:
    the keys' ``hashes`` when the caller has them."""
    n = keys.numel()
    dev = keys.device
    b, d, start = hashed or hashes(ix, keys)
    if policy == P_CUSTOM and custom.numel() > 0:
        score = touch = custom
        tkind = 1
    else:
        score = torch.full_like(keys, 1 if policy == P_LFU else step)
        touch = torch.full_like(keys, step)
        tkind = 2 if policy == P_LFU else int(policy in (P_LRU, P_NO_EVICTION))
    sb, order = torch.sort(b if only is None else torch.where(only, b, ix.num_buckets),
                           stable=True)
    end = torch.searchsorted(sb, sb, right=True)
    slots = torch.full_like(keys, -1)
    ev_keys, ev_scores = torch.empty_like(keys), torch.empty_like(keys)
    inserted, evicted, failed = (torch.zeros(n, dtype=torch.bool, device=dev) for _ in range(3))
    veto = torch.zeros(1, dtype=torch.int64, device=dev)

    def launch(veto):
        _insert_kernel[(n,)](order, sb, end, keys, d, start, score, touch, ix.keys, ix.scores,
                             ix.digests, ix.pins, slots, inserted, ev_keys, ev_scores, evicted,
                             failed, veto, policy, tkind, ix.num_buckets, W=ix.width,
                             MAX=MAX_SCORE)

    if n:
        if atomic:
            launch(torch.ones(1, dtype=torch.int64, device=dev))  # plan: writes nothing back
            veto = failed.sum(dtype=torch.int64).reshape(1)
        launch(veto)
    return slots, inserted, evicted, ev_keys, ev_scores, failed


def count_insert(ix, inserted: torch.Tensor, evicted: torch.Tensor, failed: torch.Tensor) -> None:
    """Adds what :func:`insert` did (its per-occurrence flags) to ``ix.counts``: tensor adds on
    the device, no read."""
    c = ix.counts
    c[C_INSERTED] += inserted.sum()
    c[C_EVICTED] += evicted.sum()
    c[C_FAILED] += failed.sum()
    c[C_SIZE_DELTA] += (inserted & ~evicted).sum()


__all__ = ["available", "count_insert", "hashes", "insert", "interpreted", "jit", "probe"]
