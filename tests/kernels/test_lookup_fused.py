"""The numba backend's fused lookup (``kernels.lookup_numba``) against the same lookup run as its
steps (``backend.staged_lookup``: find, admission, insert, finish), bit for bit.

Random call sequences on a small index whose buckets overflow: every score policy, per-occurrence
custom scores, repeated keys, atomic calls that fail, admission letting in a subset, tombstones
(erase), slots held by lookups in flight, and a two-tier (HYBRID) index, with the fused lookup
split over 1, 2 or 3 threads (each thread takes a range of buckets). After every call both
indexes' arrays and every field of the two results must be equal.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynemb.kernels import lookup_numba as lnb
from dynemb.kernels import threads
from dynemb.kernels.backend import NUMBA, TORCH, NumbaBackend, staged_lookup
from dynemb.kernels.hashing import index_hash
from dynemb.kernels.index_numba import P_CUSTOM, P_LFU, P_LRU, P_NO_EVICTION, P_STEP
from dynemb.table.index import HashIndex

NB, WIDTH = 2, 4
POOL = list(range(1, 22)) + [-1, -(2**63) + 1, 2**63 - 1]
POLICIES = [P_LRU, P_LFU, P_STEP, P_CUSTOM, P_NO_EVICTION]


def calls_of(pool: list[int], most: int):
    return st.tuples(
        st.lists(st.sampled_from(pool), min_size=1, max_size=most),  # keys
        st.booleans(),                                    # touch and insert (else eval)
        st.booleans(),                                    # atomic
        st.sampled_from([None, 2, 3]),                    # admission: keep out key % m == 0
        st.lists(st.sampled_from(pool), max_size=4),      # erased after the call
        st.integers(0, 3),                                # entries held after the call
    )


call_st = calls_of(POOL, 16)


def _arrays(ix: HashIndex) -> dict[str, torch.Tensor]:
    return {n: getattr(ix, n).clone() for n in ("keys", "scores", "digests", "pins", "written",
                                                "counts")}


def _run(ix, fused: NumbaBackend | None, keys, custom, policy, step, touch, atomic, mod):
    admit = None
    if mod is not None:
        def admit(miss):
            return miss[keys[miss] % mod != 0]
    kw = dict(touch=touch, insert=touch, atomic=atomic and touch, admit=admit,
              hbm_rows=ix.split * ix.width)
    if fused is not None:
        return fused.lookup(ix, keys, custom, policy, step, **kw)
    return staged_lookup(NUMBA, ix, keys, custom, policy, step, **kw)


def _equal(a, b) -> None:
    assert a.failed == b.failed and a.tiers == b.tiers
    if a.failed and b.inserted is None:  # an atomic call that failed: nothing else is defined
        return
    for name in ("inverse", "unique_slots", "unique_pos", "slots", "fresh"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.inserted is None) == (b.inserted is None)
    if a.inserted is not None:
        assert torch.equal(a.inserted, b.inserted)
    for x, y in zip(a.evicted, b.evicted):
        assert torch.equal(x, y)
    assert (a.miss is None) == (b.miss is None)
    if a.miss is not None:
        assert torch.equal(a.miss, b.miss)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(POLICIES), st.sampled_from([NB, 1]), st.lists(call_st, max_size=12),
       st.sampled_from([1, 2, 3]), st.randoms(use_true_random=False))
def test_fused_lookup_equals_its_steps(policy, split, calls, n_threads, rnd):
    with mock.patch.object(threads, "MIN_PER_PART", 1):  # split even calls of a few keys
        _check_sequence(policy, split, calls, NumbaBackend(n_threads), rnd)


wide_call_st = calls_of(list(range(1, 140)) + [-1, 2**63 - 1], 96)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(POLICIES), st.sampled_from([NB, 1]), st.lists(wide_call_st, max_size=10),
       st.sampled_from([1, 2]), st.sampled_from([32, 64]), st.randoms(use_true_random=False))
def test_fused_lookup_equals_its_steps_in_wide_buckets(policy, split, calls, n_threads, width,
                                                       rnd):
    """Buckets of 32 or 64 slots, full or nearly, with tombstones: a probe longer than
    ``lookup_numba._SHORT`` (16) slots reads the rest of its bucket 8 digests at a time
    (``_probe_words``), and must find what the slot by slot probe finds."""
    assert width > lnb._SHORT
    with mock.patch.object(threads, "MIN_PER_PART", 1):
        _check_sequence(policy, split, calls, NumbaBackend(n_threads), rnd, width=width)


def _check_sequence(policy, split, calls, fused, rnd, width=WIDTH):
    ixs = [HashIndex(NB, width, torch.device("cpu"), NUMBA, split=split) for _ in range(2)]
    holds: list[torch.Tensor] = []
    for step, (keys, touch, atomic, mod, erased, n_hold) in enumerate(calls, start=1):
        keys = torch.tensor(keys, dtype=torch.int64)
        custom = torch.empty(0, dtype=torch.int64)
        if policy == P_CUSTOM and rnd.random() < 0.8:  # per-occurrence scores, or none
            custom = torch.tensor([rnd.randrange(0, 40) for _ in range(keys.numel())],
                                  dtype=torch.int64)
        results = [_run(ix, be, keys, custom, policy, step, touch, atomic, mod)
                   for ix, be in zip(ixs, (fused, None))]
        _equal(*results)
        if n_hold:  # (a refused atomic call has no entries: nothing to hold)
            placed = results[0].unique_slots[results[0].unique_slots >= 0]
            take = placed[:n_hold]
            if take.numel():
                for ix in ixs:
                    ix.hold(take)
                holds.append(take)
        if holds and rnd.random() < 0.4:
            gone = holds.pop(rnd.randrange(len(holds)))
            for ix in ixs:
                ix.release(gone)
        if erased:
            ek = torch.unique(torch.tensor(erased, dtype=torch.int64))
            for ix in ixs:
                NUMBA.erase(ix, ek)
        a, b = (_arrays(ix) for ix in ixs)
        for name in a:
            assert torch.equal(a[name], b[name]), name
        assert ixs[0].held == ixs[1].held


@pytest.mark.parametrize("atomic", [False, True])
def test_both_backends_resolve_the_same_keys(atomic):
    """The torch backend's lookup (the staged one on its vectorised kernels) places keys in other
    slots and numbers them in another order, but resolves the same keys the same way."""
    keys = torch.tensor([5, 9, 5, 12, 9, 40, 5], dtype=torch.int64)
    none = torch.empty(0, dtype=torch.int64)
    kw = dict(touch=True, insert=True, atomic=atomic, admit=None, hbm_rows=NB * WIDTH)
    for be in (NUMBA, TORCH):
        ix = HashIndex(NB, WIDTH, torch.device("cpu"), be)
        r = be.lookup(ix, keys, none, P_LRU, 1, **kw)
        assert torch.equal(keys[r.unique_pos][r.inverse], keys)
        assert sorted(keys[r.unique_pos].tolist()) == [5, 9, 12, 40]
        assert sorted(keys[r.fresh].tolist()) == [5, 9, 12, 40]
        assert r.inserted.sum() == 4 and r.failed == 0 and r.tiers == [0, 0, 7, 0]
        assert bool((ix.pins == -1).all()) and ix.size() == 4
        r = be.lookup(ix, keys, none, P_LRU, 2, **kw)
        assert r.fresh.numel() == 0 and r.tiers == [7, 0, 0, 0]


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("width", [32, 128])
def test_long_probes_in_full_wide_buckets_find_what_the_steps_find(n_threads, width):
    """Many evicting calls fill wide buckets with keys anywhere on their probe paths (an evicting
    key takes the victim's slot), tombstones among them: each call, fused and staged, leaves the
    same index, and many keys found lie past the slots the probe reads one by one
    (``lookup_numba._SHORT``), where it reads words of 8 digests."""
    gen = torch.Generator().manual_seed(7)
    ixs = [HashIndex(4, width, torch.device("cpu"), NUMBA) for _ in range(2)]
    fused = NumbaBackend(n_threads)
    none = torch.empty(0, dtype=torch.int64)
    far = 0
    with mock.patch.object(threads, "MIN_PER_PART", 1):
        for step in range(1, 80):
            keys = torch.randint(1, 25 * width, (3 * width,), generator=gen)
            results = [_run(ix, be, keys, none, P_LRU, step, True, False, None)
                       for ix, be in zip(ixs, (fused, None))]
            _equal(*results)
            if step % 10 == 0:
                for ix in ixs:
                    NUMBA.erase(ix, torch.unique(keys[:5]))
            a, b = (_arrays(ix) for ix in ixs)
            for name in a:
                assert torch.equal(a[name], b[name]), name
            slots = results[0].slots
            found = slots[slots >= 0]
            start = index_hash(ixs[0].keys[found]) & (width - 1)
            far += int(((((found % width) - start) & (width - 1)) >= lnb._SHORT).sum())
    assert far > 1000  # (the word path found keys, not only missed them)
