"""Holds: a lookup made with ``hold=True`` keeps every row it resolved in place until
``apply_gradients`` or ``release``, so lookups of later batches (a pipeline running ahead) can
neither evict them nor move them; holds count; a bucket full of held rows fails by ``on_full``.
Both backends; HBM_ONLY, HYBRID and CACHING (cache_load_factor 0.1)."""

from __future__ import annotations

import copy

import pytest
import torch

import dynemb
from dynemb import NonFinite, OnFull, RowWiseAdagrad, SGD, Storage, StorageMode
from dynemb.errors import CapacityError, InputError
from dynemb.kernels.hashing import home_bucket, index_hash
from dynemb.kernels.index_numba import PIN_HELD, PIN_LOCKED
from dynemb.table.stats import Lookup

MODES = {
    "hbm_only": Storage(),
    "hybrid": Storage(mode=StorageMode.HYBRID, cache_load_factor=0.5),
    "caching": Storage(mode=StorageMode.CACHING, cache_load_factor=0.1),
}
LR = 0.5  # a power of two: w - LR * g computed by torch is the kernel's float32 result


def K(ks) -> torch.Tensor:
    return torch.tensor(list(ks), dtype=torch.int64)


def _table(backend: str, mode: str, *, capacity: int = 512, bucket: int = 16,
           optimizer=None, on_full: OnFull = OnFull.RAISE, **kw) -> dynemb.DynamicTable:
    cfg = dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=capacity,
                             bucket_capacity=bucket, storage=MODES[mode], on_full=on_full,
                             optimizer=optimizer or SGD(lr=LR), **kw)
    return dynemb.DynamicTable(cfg, backend=backend)


def _train(t: dynemb.DynamicTable, keys: torch.Tensor, seed: int = 0, **kw) -> Lookup:
    """One eager step over ``keys``: lookup, then gradients applied at once."""
    lk = t.lookup(keys, train=True, **kw)
    g = torch.Generator().manual_seed(seed)
    t.apply_gradients(lk, torch.randn(lk.unique_keys.numel(), t.dim, generator=g))
    return lk


def _churn(t: dynemb.DynamicTable, start: int, batches: int, size: int = 50) -> None:
    """Eager steps over new keys only (never a key below ``start``): enough of them turn every
    unheld row of the table over."""
    for i in range(batches):
        _train(t, K(range(start + i * size, start + (i + 1) * size)), seed=i)


def _rows(t: dynemb.DynamicTable, keys: torch.Tensor) -> dict[int, tuple[torch.Tensor, ...]]:
    """key -> (embedding, optimizer state) of the ``keys`` present."""
    b = t.export_batch(0, t.capacity())
    want = set(keys.tolist())
    return {k: (b.embeddings[i].clone(), b.optimizer_state[i].clone())
            for i, k in enumerate(b.keys.tolist()) if k in want}


def _indexes(t: dynemb.DynamicTable):
    return [t.index] + ([t.cache.index] if t.cache is not None else [])


def _no_pins_left(t: dynemb.DynamicTable) -> None:
    for ix in _indexes(t):
        assert int((ix.pins <= PIN_LOCKED).sum()) == 0 and int((ix.pins == PIN_HELD).sum()) == 0
        assert ix.held == 0


def _same_bucket(t: dynemb.DynamicTable, bucket: int, n: int) -> list[int]:
    """``n`` keys above 10**6 that all live in ``bucket`` of the table's index (CACHING: of its
    backing store)."""
    cand = torch.arange(10**6, 10**6 + 200_000, dtype=torch.int64)
    keys = cand[t.home_buckets(cand) == bucket][:n].tolist()
    assert len(keys) == n
    return keys


@pytest.mark.parametrize("hold", [True, False], ids=["held", "not_held"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_held_lookup_keeps_its_rows_while_later_lookups_evict(backend, mode, hold):
    """Batch A is looked up on a full, evicting LRU table; 30 batches of new keys follow before
    A's gradients land. Without the hold A's rows are evicted (stale updates); with it none is,
    and A's rows end as exactly "row before + SGD update"."""
    t = _table(backend, mode)
    _churn(t, 1, 12)                                   # 600 keys into 512 slots: evicting
    assert t.stats().evicted > 0
    a_keys = torch.cat([K(range(560, 600)), K(range(5000, 5024))])  # recent rows + new keys
    a = t.lookup(a_keys, train=True, hold=hold)
    assert a.held == hold and t.held_rows() == (a_keys.numel() if hold else 0)
    before = t.find(a.unique_keys).values.clone()
    _churn(t, 10_000, 30)                              # 1500 new keys: A's rows are the oldest
    g = torch.randn(a.unique_keys.numel(), t.dim, generator=torch.Generator().manual_seed(7))
    t.apply_gradients(a, g)
    s = t.stats()
    if not hold:
        assert s.stale_updates > 0
        return
    assert s.stale_updates == 0 and s.evicted > 1000
    found = t.find(a.unique_keys)
    assert bool(found.found.all())
    assert torch.equal(found.values, before - LR * g)
    assert not a.held and t.held_rows() == 0 and s.held_rows == 0
    _no_pins_left(t)


@pytest.mark.parametrize("other", ["train", "eval", "find_or_insert", "prefetch"])
@pytest.mark.parametrize("mode", list(MODES))
def test_rows_stay_held_after_other_calls_use_them(backend, mode, other):
    """Calls that use a held batch's keys without holding them (their pins end when they do)
    leave the rows held: a churn afterwards evicts none of them."""
    t = _table(backend, mode)
    _churn(t, 1, 12)
    a_keys = K(range(560, 600))
    a = t.lookup(a_keys, train=True, hold=True)
    mix = torch.cat([a_keys[::2], K(range(7000, 7010))])
    if other == "train":
        _train(t, mix)
    elif other == "eval":
        t.lookup(mix, train=False)
    elif other == "find_or_insert":
        t.find_or_insert(mix)
    else:
        t.prefetch(mix)
    assert t.held_rows() == 40
    _churn(t, 10_000, 30)
    assert bool(t.find(a_keys).found.all())
    t.apply_gradients(a, torch.ones(40, 4))
    assert t.stats().stale_updates == 0 and t.held_rows() == 0
    _no_pins_left(t)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_held_update_equals_the_eager_update(backend, mode):
    """Rows and optimizer state (row-wise Adagrad) of a held batch updated after 30 other
    batches are bit-identical to those of the same batch updated at once."""
    opt = RowWiseAdagrad(lr=0.1)
    a_keys = torch.cat([K(range(560, 600)), K(range(5000, 5024))])
    grads = torch.randn(a_keys.numel(), 4, generator=torch.Generator().manual_seed(3))
    ref = _table(backend, mode, optimizer=opt)
    _churn(ref, 1, 12)
    ref.apply_gradients(ref.lookup(a_keys, train=True), grads)
    want = _rows(ref, a_keys)
    t = _table(backend, mode, optimizer=opt)
    _churn(t, 1, 12)
    a = t.lookup(a_keys, train=True, hold=True)
    _churn(t, 10_000, 30)
    t.apply_gradients(a, grads)
    got = _rows(t, a_keys)
    assert set(got) == set(want) == set(a_keys.tolist())
    for k, (emb, state) in want.items():
        assert torch.equal(got[k][0], emb) and torch.equal(got[k][1], state), k
    assert t.stats().stale_updates == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_holds_count(backend, mode):
    """Two held lookups share keys: releasing one leaves the shared rows held (they survive a
    churn that evicts the released lookup's own rows); releasing the other makes them
    evictable."""
    t = _table(backend, mode)
    only_a, shared, only_b = K(range(1, 21)), K(range(21, 41)), K(range(41, 61))
    a = t.lookup(torch.cat([only_a, shared]), train=True, hold=True)
    b = t.lookup(torch.cat([shared, only_b]), train=True, hold=True)
    assert t.held_rows() == 60
    t.release(a)
    assert t.held_rows() == 40 and not a.held and b.held
    _churn(t, 10_000, 30)
    assert not bool(t.find(only_a).found.any())        # released: evicted
    assert bool(t.find(torch.cat([shared, only_b])).found.all())
    t.release(b)
    assert t.held_rows() == 0
    _churn(t, 20_000, 30)
    assert not bool(t.find(torch.cat([shared, only_b])).found.any())
    assert t.stats().stale_updates == 0
    _no_pins_left(t)


@pytest.mark.parametrize("mode", list(MODES))
def test_release_is_idempotent_and_apply_gradients_releases(backend, mode):
    t = _table(backend, mode, nonfinite=NonFinite.RAISE)
    a = t.lookup(K(range(1, 11)), train=True, hold=True)
    c = t.lookup(K(range(5, 16)), train=True, hold=True)   # overlaps a
    assert t.held_rows() == 15
    t.apply_gradients(a, torch.ones(10, 4))
    assert not a.held and a.holds is None and t.held_rows() == 11
    t.release(a)                                   # released by apply_gradients: a no-op
    t.release(copy.copy(a))
    assert t.held_rows() == 11 and c.held
    twin, deep = copy.copy(c), copy.deepcopy(c)    # copies share the lookup's record
    t.release(c)
    t.release(twin)                                # must not release c's rows a second time
    t.release(deep)
    assert t.held_rows() == 0
    t.release(t.lookup(K([1, 2]), train=True))     # never held: a no-op
    e = t.lookup(K([1, 2, 99]), train=False, hold=True)   # eval lookups hold what they found
    assert t.held_rows() == 2
    other = _table(backend, mode)
    with pytest.raises(InputError, match="another table"):
        other.release(e)
    t.release(e)
    # apply_gradients that raises (non-finite gradients, nonfinite="raise") releases too.
    d = t.lookup(K(range(1, 5)), train=True, hold=True)
    bad = torch.ones(4, 4)
    bad[1, 2] = float("nan")
    with pytest.raises(InputError, match="NaN or inf"):
        t.apply_gradients(d, bad)
    assert not d.held and t.held_rows() == 0
    _no_pins_left(t)


def _snapshot(t: dynemb.DynamicTable) -> dict:
    b = t.export_batch(0, t.capacity())
    s = t.stats()
    return {"rows": {k: (b.embeddings[i].clone(), int(b.scores[i]))
                     for i, k in enumerate(b.keys.tolist())},
            "stats": (s.size, s.step, s.inserted, s.evicted, s.lookups, s.held_rows)}


def _same(before: dict, after: dict) -> None:
    assert after["stats"] == before["stats"]
    assert set(after["rows"]) == set(before["rows"])
    for k, (emb, score) in before["rows"].items():
        assert torch.equal(after["rows"][k][0], emb) and after["rows"][k][1] == score, k


@pytest.mark.parametrize("on_full", [OnFull.RAISE, OnFull.COUNT])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_bucket_full_of_held_rows_takes_no_new_key(backend, mode, on_full):
    """Every slot of a bucket (8) is held: a new key of that bucket cannot get a row. RAISE:
    CapacityError saying rows are held, nothing changed, nothing more held; COUNT: counted in
    failed_inserts, the key gets no row, the held rows stay."""
    t = _table(backend, mode, capacity=64, bucket=8, on_full=on_full)
    keys = _same_bucket(t, 1, 10)
    other = _same_bucket(t, 5, 1)[0]                   # a key of another bucket
    held = t.lookup(K(keys[:8]), train=True, hold=True)
    assert t.held_rows() == 8
    before = _snapshot(t)
    if on_full == OnFull.RAISE:
        with pytest.raises(CapacityError, match="held by lookups in flight"):
            t.lookup(K([keys[0], keys[8], other]), train=True, hold=True)
        _same(before, _snapshot(t))
        assert t.stats().failed_inserts == 1
    else:
        lk = t.lookup(K([keys[8], other]), train=True, hold=True)
        slot = dict(zip(lk.unique_keys.tolist(), lk.unique_slots.tolist()))
        assert slot[keys[8]] == -1 and slot[other] >= 0
        assert t.stats().failed_inserts == 1 and t.held_rows() == 9
        t.release(lk)
    assert t.held_rows() == 8
    assert bool(t.find(K(keys[:8])).found.all())
    t.release(held)
    t.lookup(K(keys[8:10]), train=True)            # released: the bucket evicts again
    assert bool(t.find(K(keys[8:10])).found.all())
    _no_pins_left(t)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_failed_atomic_held_lookup_holds_nothing(backend, mode):
    t = _table(backend, mode, capacity=64, bucket=8)
    keys = _same_bucket(t, 2, 14)
    t.lookup(K(keys[:8]), train=True)                  # the bucket is full
    with pytest.raises(CapacityError):                 # 4 present + 5 new: one more than fits
        t.lookup(K(keys[:4] + keys[8:13]), train=True, hold=True)
    assert t.held_rows() == 0
    _no_pins_left(t)
    t.lookup(K(keys[8:14]), train=True)                # every row of the bucket is evictable
    assert bool(t.find(K(keys[8:14])).found.all())


@pytest.mark.parametrize("first", ["stale", "new"])
@pytest.mark.parametrize("mode", list(MODES))
def test_an_erased_held_row_whose_slot_is_reused_leaks_no_hold(backend, mode, first):
    """A holds k1; k1 is erased; a held lookup B of a new key k2 takes the freed slot (the only
    free one of the full bucket). Releasing A (counting k1's update as stale) leaves k2 held by
    B; releasing B frees everything. In both orders nothing leaks and k2's row gets exactly B's
    update, never A's."""
    t = _table(backend, mode, capacity=64, bucket=8)
    keys = _same_bucket(t, 3, 9)
    _train(t, K(keys[:8]))                             # the bucket is full
    a = t.lookup(K([keys[0]]), train=True, hold=True)
    assert t.erase(K([keys[0]])) == 1
    b = t.lookup(K([keys[8]]), train=True, hold=True)
    if t.cache is None:
        assert b.unique_slots.tolist() == a.unique_slots.tolist()   # the slot was reused
    k2_before = t.find(K([keys[8]])).values.clone()
    ga, gb = torch.full((1, 4), 3.0), torch.full((1, 4), 0.25)
    if first == "stale":
        t.apply_gradients(a, ga)                       # k1 is gone: stale, k2 untouched
        assert t.stats().stale_updates == 1
        assert torch.equal(t.find(K([keys[8]])).values, k2_before)
        assert t.held_rows() == 1
        _churn(t, 10_000, 10, size=20)
        assert bool(t.find(K([keys[8]])).found.all())  # still held by B
        t.apply_gradients(b, gb)
    else:
        t.apply_gradients(b, gb)
        assert t.held_rows() == 1                      # A's hold on the slot, nothing more
        t.apply_gradients(a, ga)
        assert t.stats().stale_updates == 1
    assert torch.equal(t.find(K([keys[8]])).values, k2_before - LR * gb)
    assert t.held_rows() == 0
    _no_pins_left(t)


def _cache_slots(t: dynemb.DynamicTable, keys: torch.Tensor) -> torch.Tensor:
    return t.cache.index.find(keys)


@pytest.mark.parametrize("hold", [True, False], ids=["held", "not_held"])
def test_held_cached_rows_stay_cached_through_lookups_and_prefetch(backend, hold):
    """CACHING: a held batch's cached rows keep their cache slots while later lookups and a
    prefetch of other keys churn the cache (without the hold they are evicted from it)."""
    t = _table(backend, "caching")
    _train(t, K(range(100, 140)))                      # in the backing store, prefetched later
    a = t.lookup(K(range(1, 21)), train=True, hold=hold)
    slots = _cache_slots(t, K(range(1, 21)))
    assert bool((slots >= 0).all())                    # cached (the cache has 64 slots)
    _churn(t, 10_000, 3, size=40)                      # 120 new keys through a 64-slot cache
    t.prefetch(K(range(100, 140)))
    now = _cache_slots(t, K(range(1, 21)))
    if not hold:
        assert bool((now < 0).any())
        return
    assert torch.equal(now, slots)
    assert t.stats().cache_evictions > 0 and t.stats().prefetched > 0
    t.apply_gradients(a, torch.ones(20, 4))
    assert t.held_rows() == 0 and t.stats().stale_updates == 0
    _no_pins_left(t)


def test_rows_served_from_the_backing_store_stay_there_while_held(backend):
    """CACHING, overflow path: a batch larger than the cache is served partly from the backing
    store; those rows are held there (not evicted, not fetched into the cache by a later lookup
    of the same key, which is served from the same backing row) and get both updates."""
    t = _table(backend, "caching")
    _churn(t, 10_000, 12)                              # the backing store is full, evicting
    a_keys = K(range(1, 101))                          # 100 keys, 64 cache slots
    a = t.lookup(a_keys, train=True, hold=True)
    off = t.row_offset
    away = a.unique_slots >= off
    assert int(away.sum()) >= 36                       # served from the backing store
    b = t.lookup(a.unique_keys[away][:5], train=True, hold=True)  # again, while A holds them
    k = b.unique_keys
    before = t.find(k).values.clone()
    assert bool((b.unique_slots >= off).all())
    assert bool((_cache_slots(t, k) < 0).all())        # not fetched: one copy of each row
    pos = {key: i for i, key in enumerate(a.unique_keys.tolist())}
    assert b.unique_slots.tolist() == [int(a.unique_slots[pos[key]]) for key in k.tolist()]
    _churn(t, 20_000, 30)                              # 1500 new keys: would evict them
    ga = torch.randn(a.unique_keys.numel(), 4, generator=torch.Generator().manual_seed(1))
    gb = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    t.apply_gradients(a, ga)
    t.apply_gradients(b, gb)
    want = before - LR * ga[[pos[key] for key in k.tolist()]] - LR * gb
    assert torch.equal(t.find(k).values, want)
    assert t.stats().stale_updates == 0 and t.held_rows() == 0
    _no_pins_left(t)


def test_a_backing_row_held_there_is_not_fetched_into_the_cache(backend):
    """CACHING: C's held rows fill k's cache bucket, so A is served k from the backing store and
    holds it there. C ends; the cache bucket has room again, yet B's lookup of k (and a
    prefetch) leaves k in the backing store while A holds it: one copy, which gets A's and B's
    updates in turn."""
    t = _table(backend, "caching")
    cx = t.cache.index
    cand = torch.arange(1, 20_000, dtype=torch.int64)
    bucket0 = cand[home_bucket(cand, index_hash(cand), cx.num_buckets, cx.split) == 0]
    fill, k = bucket0[:cx.width], bucket0[cx.width:cx.width + 1]
    c = t.lookup(fill, train=True, hold=True)
    a = t.lookup(k, train=True, hold=True)
    assert int(a.unique_slots[0]) >= t.row_offset      # served from the backing store
    t.release(c)
    b = t.lookup(k, train=True, hold=True)
    t.prefetch(k)
    assert b.unique_slots.tolist() == a.unique_slots.tolist()
    assert int(_cache_slots(t, k)[0]) < 0
    before = t.find(k).values.clone()
    ga, gb = torch.full((1, 4), 2.0), torch.full((1, 4), -0.75)
    t.apply_gradients(a, ga)
    t.apply_gradients(b, gb)
    t.flush()
    assert torch.equal(t.find(k).values, before - LR * ga - LR * gb)
    lk = t.lookup(k, train=True)                       # no longer held: cached as usual
    assert int(lk.unique_slots[0]) < t.row_offset
    assert torch.equal(t.embeddings(lk), before - LR * ga - LR * gb)
    assert t.held_rows() == 0
    _no_pins_left(t)
