"""The all-or-nothing index kernels, bit for bit: a find pass that journals its score touches
plus an atomic insert in which one key fails, undone, leave every array of the index (keys,
scores, digests, pins, write steps, counts) exactly as it was, tombstones included. A
succeeding atomic insert equals the plain one."""

from __future__ import annotations

import pytest
import torch

from dynemb.kernels.backend import backend_for
from dynemb.kernels.hashing import home_bucket, index_hash
from dynemb.kernels.index_numba import P_CUSTOM, P_LFU, P_LRU, P_NO_EVICTION, P_STEP
from dynemb.table.index import HashIndex

POLICIES = {"lru": P_LRU, "lfu": P_LFU, "step": P_STEP, "custom": P_CUSTOM,
            "no_eviction": P_NO_EVICTION}
NB, WIDTH = 4, 8


def _arrays(ix: HashIndex) -> dict[str, torch.Tensor]:
    return {n: getattr(ix, n).clone() for n in ("keys", "scores", "digests", "pins", "written",
                                                "counts")}


def _bucket_keys(bucket: int, n: int) -> torch.Tensor:
    cand = torch.arange(1, 5000, dtype=torch.int64) * 13
    return cand[home_bucket(cand, index_hash(cand), NB, NB) == bucket][:n]


def _index(backend: str, policy: int) -> tuple[HashIndex, torch.Tensor]:
    """Bucket 0 holds 6 keys and 2 tombstones (erased keys); returns (index, its keys)."""
    be = backend_for(torch.device("cpu"), backend)
    ix = HashIndex(NB, WIDTH, torch.device("cpu"), be)
    keys = _bucket_keys(0, 20)
    none = torch.empty(0, dtype=torch.int64)
    custom = torch.arange(10, 18, dtype=torch.int64)
    for i in range(8):   # one call per key: distinct LRU/STEP scores
        k = keys[i:i + 1]
        slots = be.find(ix, k, none, policy, i + 1, True, True)
        be.insert(ix, k, custom[i:i + 1] if policy == P_CUSTOM else none, policy, i + 1)
        be.unpin(ix, torch.cat([slots, be.find(ix, k, none, 0, 0, False, False)]))
    be.erase(ix, keys[[2, 5]])
    return ix, keys


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("backend", ["numba", "torch", "triton"])
def test_a_failing_atomic_call_restores_every_array(backend, policy):
    be, code = backend_for(torch.device("cpu"), backend), POLICIES[policy]
    ix, keys = _index(backend, code)
    before = _arrays(ix)
    # Found keys 0, 1, 3 (one twice) are touched and pinned; the new keys fill both tombstones,
    # evict the 3 unpinned rows (not under NO_EVICTION) and then fail.
    call = torch.cat([keys[[0, 1, 3, 0]], keys[8:14], keys[[8]]])  # key 8 twice
    custom = torch.full_like(call, 100)
    prev = torch.empty_like(call)
    c = custom if code == P_CUSTOM else torch.empty(0, dtype=torch.int64)
    slots = be.find(ix, call, c, code, 50, True, True, prev)
    miss = torch.nonzero(slots < 0).flatten()
    new, inserted, ev = be.insert(ix, call[miss], c[miss] if c.numel() else c, code, 50, True)
    assert bool((new < 0).any()) and not bool(inserted.any()) and ev[0].numel() == 0
    be.restore_scores(ix, slots, prev)
    be.unpin(ix, slots)
    after = _arrays(ix)
    for name, value in before.items():
        assert torch.equal(after[name], value), name


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("backend", ["numba", "torch", "triton"])
def test_a_succeeding_atomic_insert_equals_the_plain_one(backend, policy):
    be, code = backend_for(torch.device("cpu"), backend), POLICIES[policy]
    results = []
    for atomic in (False, True):
        ix, keys = _index(backend, code)
        call = keys[8:10]
        c = torch.full_like(call, 100) if code == P_CUSTOM else torch.empty(0, dtype=torch.int64)
        out = be.insert(ix, call, c, code, 50, atomic)
        results.append((out, _arrays(ix)))
    (a, ia), (b, ib) = results
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(x, y) for x, y in zip(a[2], b[2]))
    assert all(torch.equal(ia[n], ib[n]) for n in ia)
