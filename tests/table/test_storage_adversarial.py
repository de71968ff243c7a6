"""Adversarial tests of the storage tiers: the bugs a review found (a CACHING backing bucket
full of cached rows, flush after load_rows, a failed load_rows, prefetch scores, changes right
after an export, sharding with ddr_path) and coverage the main suite lacks (pins and dirty flags
under random operations, pending lookups, prefetch between forward and backward, the HYBRID tier
hash in both backends)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from numba import njit

import dynemb
from dynemb import (
    SGD, Adam, Admission, Initializer, InitKind, OnFull, ScorePolicy, Storage, StorageMode,
)
from dynemb.errors import CapacityError
from dynemb.kernels.hashing import home_bucket, home_bucket_nb, index_hash, index_hash_nb
from dynemb.kernels.index_numba import PIN_CACHED, PIN_FREE


def _cfg(storage: Storage, **kw) -> dynemb.TableConfig:
    kw.setdefault("optimizer", SGD(lr=0.1))
    kw.setdefault("dim", 4)
    return dynemb.TableConfig(name="t", features=("a",), capacity=kw.pop("capacity", 64),
                              bucket_capacity=kw.pop("bucket_capacity", 8), storage=storage, **kw)


def _caching(x: float, **kw) -> Storage:
    return Storage(mode=StorageMode.CACHING, cache_load_factor=x, **kw)


def _export(t: dynemb.DynamicTable, since: int | None = None):
    b = t.export_batch(0, t.capacity(), since_step=since)
    o = torch.argsort(b.keys)
    return b.keys[o], b.embeddings[o], b.optimizer_state[o], b.scores[o]


def _check_cache(t: dynemb.DynamicTable) -> None:
    """The cache's bookkeeping: no lookup pin left, PIN_CACHED exactly on the backing slots of
    cached rows, homes hold the same keys, free cache slots clean, clean rows equal backing."""
    c, cx, bx = t.cache, t.cache.index, t.index
    assert bool((cx.pins == PIN_FREE).all())
    occ = cx.occupied(0, cx.num_slots)
    home = c.home[occ]
    assert bool((home >= 0).all())
    assert torch.equal(bx.keys[home], cx.keys[occ])
    expect = torch.full_like(bx.pins, PIN_FREE)
    expect[home] = PIN_CACHED
    assert torch.equal(bx.pins, expect)
    free = torch.ones(cx.num_slots, dtype=torch.bool)
    free[occ] = False
    assert bool((c.home[free] == -1).all()) and not bool(c.dirty[free].any())
    clean = occ[~c.dirty[occ]]
    assert torch.equal(t.store.hbm[clean], t.store.read(c.home[clean] + t.row_offset))
    assert cx.size() == occ.numel() and bx.size() == bx.occupied(0, bx.num_slots).numel()


# ---------------------------------------------------------------- bugs (currently FAIL)


@pytest.mark.parametrize("x", [0.9, 0.5])
def test_caching_table_at_capacity_evicts_like_hbm_only(backend, x):
    """An LRU table at capacity evicts; in CACHING it raises CapacityError instead (x=0.9: the
    cache rounds up to the whole table, 64 of 64 slots; x=0.5: a backing bucket fills with rows
    that are all cached)."""
    ref = dynemb.DynamicTable(_cfg(Storage()), backend=backend)
    t = dynemb.DynamicTable(_cfg(_caching(x)), backend=backend)
    for k in range(2000):  # one new key per call: HBM_ONLY always finds a row to evict
        ref.find_or_insert(torch.tensor([k]))
        t.find_or_insert(torch.tensor([k]))
    assert t.stats().evicted == ref.stats().evicted > 0


def test_load_rows_then_flush_then_reopen(backend, tmp_path):
    storage = _caching(0.2, ddr_path=str(tmp_path))
    cfg = _cfg(storage, capacity=256, optimizer=Adam(lr=0.01))
    t = dynemb.DynamicTable(cfg, backend=backend)
    keys = torch.arange(50)
    emb, state = torch.randn(50, 4), torch.rand(50, 8)
    t.load_rows(keys, emb, state, torch.arange(50))  # e.g. restoring a checkpoint
    t.close()  # writes the loaded rows back, marks the store cleanly closed, releases its lock
    reopened = dynemb.DynamicTable(
        dataclasses.replace(cfg, storage=dataclasses.replace(storage, reopen=True)), backend=backend)
    found = reopened.find(keys)
    assert found.found.all() and torch.equal(found.values, emb)


MODES3 = [Storage(), Storage(mode=StorageMode.HYBRID, cache_load_factor=0.5), _caching(0.1)]


@pytest.mark.parametrize("storage", MODES3, ids=["hbm_only", "hybrid", "caching"])
def test_failed_load_rows_changes_nothing(backend, storage):
    cap = 8 if storage.mode == StorageMode.HBM_ONLY else 64
    t = dynemb.DynamicTable(_cfg(storage, capacity=cap, dim=2), backend=backend)
    for k in range(1000, 1200):  # fill the table (one key per call: evictions, no failures)
        t.find_or_insert(torch.tensor([k]))
    held = t.export_batch(0, t.capacity()).keys
    t.insert_or_assign(held, torch.full((held.numel(), 2), 7.0))
    new = torch.arange(50)
    with pytest.raises(CapacityError, match="load_rows"):
        t.load_rows(new, torch.zeros(50, 2), torch.zeros(50, 0), torch.zeros(50, dtype=torch.int64))
    # Either the call is all-or-nothing, or at least no key may hold another key's row.
    assert not t.find(new).found.any(), "new keys got rows holding the evicted rows' values"
    assert torch.equal(torch.sort(t.export_batch(0, t.capacity()).keys).values,
                       torch.sort(held).values), "rows evicted by a load_rows that raised"


def test_prefetch_keeps_the_scores_of_rows_it_does_not_use(backend):
    cfg = _cfg(_caching(0.1), capacity=512, score=ScorePolicy.LRU)
    ref = dynemb.DynamicTable(cfg, backend=backend)
    t = dynemb.DynamicTable(cfg, backend=backend)
    for tab in (ref, t):
        tab.find_or_insert(torch.tensor([5]))
        for k in range(100, 400):  # push key 5 out of the cache (not out of the table)
            tab.find_or_insert(torch.tensor([k]))
    assert t.cache.index.find(torch.tensor([5]))[0] < 0
    t.prefetch(torch.tensor([5]))  # ... then the batch is not looked up (or evicted first)
    assert torch.equal(_export(ref)[3], _export(t)[3])  # key 5: score 1 vs the prefetch step


@pytest.mark.parametrize("storage", MODES3, ids=["hbm_only", "hybrid", "caching"])
def test_changes_right_after_an_export_are_in_the_next_increment(backend, storage):
    t = dynemb.DynamicTable(_cfg(storage), backend=backend)
    t.track_evictions()
    t.find_or_insert(torch.arange(10))
    mark = t.step  # an (incremental) export covers every change up to here
    t.erase(torch.tensor([3]))
    t.load_rows(torch.tensor([100]), torch.ones(1, 4), torch.zeros(1, 0),
                torch.zeros(1, dtype=torch.int64))
    assert t.evicted_since(mark).tolist() == [3]
    assert t.export_batch(0, t.capacity(), since_step=mark).keys.tolist() == [100]



def test_shard_a_collection_with_ddr_path(group_of_one, tmp_path):
    """World size 1: the shard is the whole table, its ddr tier in files in ddr_path; it trains
    exactly like an in-memory CACHING table, and closing it leaves a store that reopens with
    every row. (Over 2 ranks: tests/distributed/test_shard_memory.py.)"""
    cfg = _cfg(_caching(0.25, ddr_path=str(tmp_path)), capacity=256, optimizer=Adam(lr=0.01))
    ref = dynemb.EmbeddingBagCollection([dataclasses.replace(cfg, storage=_caching(0.25))])
    sharded = dynemb.distributed.shard(dynemb.EmbeddingBagCollection([cfg]))
    t = sharded.tables["t"]
    assert t.files is not None and t.files.dir == tmp_path and not t.files.closed
    assert (tmp_path / "t.ddr.rows").stat().st_size == t.store.ddr.numel() * 4
    for step in range(3):
        batch = dynemb.SparseBatch(features=["a"], values=torch.arange(step * 7, step * 7 + 24),
                                   lengths=torch.full((6,), 4))
        out, want = sharded(batch).values(), ref(batch).values()
        assert torch.equal(out, want)
        (out * (step + 1)).sum().backward()
        (want * (step + 1)).sum().backward()
    want = _export(ref.tables["t"])
    sharded.local.close()
    reopened = dynemb.DynamicTable(dataclasses.replace(
        cfg, storage=dataclasses.replace(cfg.storage, reopen=True)))
    got = _export(reopened)
    assert want[0].numel() == 38 and all(torch.equal(a, b) for a, b in zip(want, got))
    reopened.close()


# ---------------------------------------------------------------- regression tests (pass)


def test_hybrid_tier_hash_is_the_same_in_numba_and_torch():
    @njit
    def buckets(keys, nb, split, out):
        for i in range(keys.shape[0]):
            out[i] = home_bucket_nb(keys[i], index_hash_nb(keys[i]), nb, split)

    g = torch.Generator().manual_seed(0)
    keys = torch.cat([torch.randint(-2**63, 2**63 - 1, (4000,), generator=g),
                      torch.arange(-50, 50) * 1024])
    for nb, split in ((10, 3), (7, 1), (1000, 999), (3, 2), (1 << 20, 12345)):
        tb = home_bucket(keys, index_hash(keys), nb, split)
        nbk = torch.empty_like(keys)
        buckets(keys.numpy(), nb, split, nbk.numpy())
        assert torch.equal(tb, nbk)
        assert bool(((tb >= 0) & (tb < nb)).all())
        assert abs(float((tb < split).double().mean()) - split / nb) < 0.03


def test_hybrid_keys_live_in_the_same_bucket_in_both_backends():
    st = Storage(mode=StorageMode.HYBRID, cache_load_factor=0.3)
    keys = torch.arange(3000) * 4096 - 77
    slots = {}
    for be in ("numba", "torch"):
        t = dynemb.DynamicTable(_cfg(st, capacity=8192, bucket_capacity=16), backend=be)
        t.find_or_insert(keys)
        slots[be] = t.locate(keys) // 16
    assert torch.equal(slots["numba"], slots["torch"])


def test_failed_lookup_releases_pins_and_keeps_cached_pins(backend):
    """A lookup that raises CapacityError (NO_EVICTION, admission on) leaves the bookkeeping
    intact (it creates no row: a failing call is atomic), and later lookups work."""
    cfg = _cfg(_caching(0.1), capacity=64, score=ScorePolicy.NO_EVICTION,
               admission=Admission(threshold=1, counter_capacity=256))
    t = dynemb.DynamicTable(cfg, backend=backend)
    raised = 0
    for i in range(20):
        try:
            lk = t.lookup(torch.arange(i * 10, i * 10 + 30), train=True)
            t.apply_gradients(lk, torch.ones(lk.unique_keys.numel(), 4))
        except CapacityError:
            raised += 1
        _check_cache(t)
    assert raised > 0 and 0 < t.size() <= t.capacity()


def test_bypass_then_prefetch_between_forward_and_backward(backend):
    """Keys served from the backing store (cache bucket full of this call's keys), then brought
    into the cache by a prefetch before backward: the update must land on the cached copy."""
    kw = dict(capacity=16384, bucket_capacity=8, optimizer=Adam(lr=0.01))
    ref = dynemb.DynamicTable(_cfg(Storage(), **kw), backend=backend)
    t = dynemb.DynamicTable(_cfg(_caching(0.1), **kw), backend=backend)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        keys = torch.randint(0, 3000, (2000,), generator=g)
        nxt = torch.randint(0, 3000, (2000,), generator=g)
        lks = [tab.lookup(keys, train=True) for tab in (ref, t)]
        if step == 0:
            assert bool((t.current_slots(lks[1]) >= t.layout.hbm_rows).any())  # bypassed
        t.prefetch(keys)
        t.prefetch(nxt)
        for tab, lk in zip((ref, t), lks):
            o = torch.argsort(lk.unique_keys)
            grads = torch.zeros(lk.unique_keys.numel(), 4)
            grads[o] = (lk.unique_keys[o] % 7 + 1).float()[:, None].expand(-1, 4)
            tab.apply_gradients(lk, grads)
        _check_cache(t)
    a, b = _export(ref), _export(t)
    assert ref.stats().evicted == t.stats().evicted == 0
    assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3]))  # scores: see prefetch bug


OPS_POLICIES = [ScorePolicy.LRU, ScorePolicy.LFU, ScorePolicy.STEP, ScorePolicy.CUSTOM,
                ScorePolicy.NO_EVICTION]


def _random_ops(seed: int, n: int = 50, vocab: int = 200):
    rnd = random.Random(seed)
    ops = []
    for i in range(n):
        r = rnd.random()
        keys = [int(vocab ** rnd.random()) * 13 for _ in range(rnd.randint(1, 40))]
        if r < 0.4:
            ops.append(("lookup", keys, rnd.randint(0, 1000)))
        elif r < 0.6:
            ops.append(("backward", rnd.randint(0, 5)))
        elif r < 0.68:
            ops.append(("prefetch", keys))
        elif r < 0.74:
            ops.append(("eval", keys))
        elif r < 0.8:
            ops.append(("find", keys))
        elif r < 0.86:
            ops.append(("assign", sorted(set(keys[:5])), rnd.random()))
        elif r < 0.9:
            ops.append(("erase", keys[:3]))
        elif r < 0.95:
            ops.append(("flush",))
        else:
            ops.append(("since", rnd.randint(0, i)))
    return ops


def _replay(t: dynemb.DynamicTable, ops, with_prefetch: bool):
    """Runs ``ops`` (several lookups may be pending before their backward); returns what every
    read saw, each sorted by key."""
    pend, seen = [], []

    def by_key(keys, values):
        o = torch.argsort(keys, stable=True)
        return keys[o].clone(), values[o].clone()

    for op in ops:
        kind = op[0]
        if kind == "lookup":
            if t.config.score == ScorePolicy.CUSTOM:
                t.lookup_score = op[2]
            lk = t.lookup(torch.tensor(op[1]), train=True)
            t.sources(lk)
            seen.append(by_key(lk.unique_keys, t.embeddings(lk)))
            pend.append(lk)
        elif kind == "backward" and pend:
            lk = pend.pop(op[1] % len(pend))
            g = (1 + lk.unique_keys % 3).float()[:, None].expand(-1, t.dim).contiguous()
            t.apply_gradients(lk, g)
        elif kind == "prefetch" and with_prefetch:
            t.prefetch(torch.tensor(op[1]))
        elif kind == "eval":
            lk = t.lookup(torch.tensor(op[1]), train=False)
            seen.append(by_key(lk.unique_keys, t.embeddings(lk)))
        elif kind == "find":
            r = t.find(torch.tensor(op[1]))
            seen += [r.values, r.found]
        elif kind == "assign":
            ks = torch.tensor(op[1])
            t.insert_or_assign(ks, torch.full((ks.numel(), t.dim), float(op[2])))
        elif kind == "erase":
            seen.append(t.erase(torch.tensor(op[1])))
        elif kind == "flush":
            t.flush()
        elif kind == "since":
            seen.append(_export(t, since=op[1])[0])
        if t.cache is not None:
            _check_cache(t)
    while pend:
        lk = pend.pop()
        t.apply_gradients(lk, torch.ones(lk.unique_keys.numel(), t.dim))
    return seen


def _same(a, b) -> bool:
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("with_prefetch", [False, True])
@pytest.mark.parametrize("storage", [_caching(0.1), _caching(0.3),
                                     Storage(mode=StorageMode.HYBRID, cache_load_factor=0.3)],
                         ids=["caching-0.1", "caching-0.3", "hybrid-0.3"])
@pytest.mark.parametrize("score", OPS_POLICIES, ids=[p.name for p in OPS_POLICIES])
def test_interleaved_ops_match_hbm_only(backend, score, storage, with_prefetch):
    """Pending lookups (two forwards before one backward), prefetch between forward and
    backward, eval lookups, find, assign, erase, flush and incremental exports: every read and
    the final rows, state, scores and write steps equal HBM_ONLY's (no table-level eviction)."""
    kw = dict(capacity=2048, score=score, optimizer=Adam(lr=0.01),
              admission=Admission(threshold=2, counter_capacity=4096) if score == ScorePolicy.LFU
              else None)
    for seed in range(2):
        ops = _random_ops(seed)
        ref = dynemb.DynamicTable(_cfg(Storage(), **kw), backend=backend)
        t = dynemb.DynamicTable(_cfg(storage, **kw), backend=backend)
        want, got = _replay(ref, ops, with_prefetch), _replay(t, ops, with_prefetch)
        assert len(want) == len(got)
        for i, (a, b) in enumerate(zip(want, got)):
            assert _same(a, b), f"seed {seed}: read {i} differs"
        a, b = _export(ref), _export(t)
        scores_comparable = not (with_prefetch and score in (ScorePolicy.LRU,
                                                             ScorePolicy.NO_EVICTION))
        for x, y in zip(a if scores_comparable else a[:3], b):
            assert torch.equal(x, y)
        assert torch.equal(_export(ref, since=ref.step // 2)[0], _export(t, since=t.step // 2)[0])
        assert ref.stats().evicted == t.stats().evicted == 0


@pytest.mark.parametrize("score", OPS_POLICIES, ids=[p.name for p in OPS_POLICIES])
@pytest.mark.parametrize("x", [0.1, 0.5])
def test_no_lost_update_with_table_evictions(backend, score, x):
    """A small CACHING table under random lookups (pending backward), prefetch, eval, assign,
    erase, flush and find_or_insert, with table-level evictions and CapacityErrors: after every
    operation the cache bookkeeping holds and every row a key holds is its initial value minus
    one per update that reached it (SGD lr=1, gradient 1, constant initializer 0)."""
    cfg = _cfg(_caching(x), capacity=64, dim=2, score=score, optimizer=SGD(lr=1.0),
               on_full=OnFull.COUNT if x == 0.5 else OnFull.RAISE,
               initializer=Initializer(kind=InitKind.CONSTANT, value=0.0))
    for seed in range(3):
        t = dynemb.DynamicTable(cfg, backend=backend)
        t.track_evictions()
        rnd, count, pend, logged = random.Random(seed), {}, [], 0
        for i in range(100):
            r = rnd.random()
            kt = torch.tensor([int(150 ** rnd.random()) for _ in range(rnd.randint(1, 12))])
            try:
                if r < 0.35:
                    t.lookup_score = rnd.randint(0, 50) if score == ScorePolicy.CUSTOM else None
                    pend.append(t.lookup(kt, train=True))
                elif r < 0.6 and pend:
                    lk = pend.pop(rnd.randrange(len(pend)))
                    ok = t.current_slots(lk) >= 0
                    t.apply_gradients(lk, torch.ones(lk.unique_keys.numel(), 2))
                    for k in lk.unique_keys[ok].tolist():
                        count[k] = count.get(k, 0) + 1
                elif r < 0.7:
                    t.prefetch(kt)
                elif r < 0.75:
                    t.lookup(kt, train=False)
                elif r < 0.8:
                    u = torch.unique(kt)
                    t.insert_or_assign(u, torch.zeros(u.numel(), 2))
                    for k, f in zip(u.tolist(), t.find(u).found.tolist()):
                        if f:
                            count[k] = 0
                elif r < 0.85:
                    t.erase(kt)
                elif r < 0.9:
                    t.flush()
                else:
                    t.find_or_insert(kt)
            except CapacityError:
                pass
            for _, ks in t.log._entries[logged:]:  # evicted or erased: forget the count
                for k in ks.tolist():
                    count.pop(k, None)
            logged = len(t.log._entries)
            _check_cache(t)
            if count:
                ks = torch.tensor(sorted(count))
                res = t.find(ks)
                want = -torch.tensor([float(count[k]) for k in ks.tolist()])
                assert torch.equal(res.values[res.found, 0], want[res.found]), f"seed {seed} op {i}"
                for k in ks[~res.found].tolist():
                    count.pop(k)


@pytest.mark.parametrize("later", ["lookup", "prefetch"])
def test_a_cache_slot_given_back_leaves_no_stale_copy(backend, later):
    """A call gives a cache slot back (its key J got no backing row: J's backing bucket is full
    of rows the call uses), while it serves one of its keys, X, from the backing store (J took
    the last free slot of X's cache bucket). A later call fetches X into the freed slot without
    evicting anything: the first call's update must still reach the row, as in HBM_ONLY."""
    kw = dict(capacity=64, bucket_capacity=8, optimizer=dynemb.SGD(lr=1.0),
              on_full=dynemb.OnFull.COUNT)
    t = dynemb.DynamicTable(_cfg(_caching(0.3), **kw), backend=backend)
    ref = dynemb.DynamicTable(_cfg(Storage(), **kw), backend=backend)
    cx, bx = t.cache.index, t.index
    ks = torch.arange(1, 3000)
    cb = home_bucket(ks, index_hash(ks), cx.num_buckets, cx.split)
    bb = home_bucket(ks, index_hash(ks), bx.num_buckets, bx.split)
    xs, j = ks[bb == 0][:8], ks[bb == 0][8:9]  # one backing bucket: X fill it, J finds it full
    others = ks[(cb == cb[ks == j]) & (bb != 0)][:8]  # they fill J's cache bucket: X leave it
    for tab in (t, ref):
        tab.find_or_insert(xs)
        tab.find_or_insert(others)
        first = tab.lookup(torch.cat([j, xs]), train=True)
        second = tab.lookup(xs[-1:], train=True) if later == "lookup" else None
        if later == "prefetch":
            tab.prefetch(xs[-1:])
        tab.apply_gradients(first, torch.ones(first.unique_keys.numel(), 4))
        if second is not None:
            tab.apply_gradients(second, torch.ones(1, 4))
    assert t.stats().failed_inserts == 1  # J (the scenario happened)
    _check_cache(t)
    a, b = (tab.export_batch(0, tab.capacity()) for tab in (t, ref))
    oa, ob = torch.argsort(a.keys), torch.argsort(b.keys)
    assert torch.equal(a.keys[oa], b.keys[ob])
    assert torch.equal(a.embeddings[oa], b.embeddings[ob])
    assert torch.equal(t.find(xs).values, ref.find(xs).values)


@pytest.mark.parametrize("on_full", [dynemb.OnFull.RAISE, dynemb.OnFull.COUNT])
def test_the_reserved_key_in_a_changed_batch_never_takes_a_cache_or_backing_slot(backend,
                                                                                 on_full):
    """Checks skipped (``checked=True``, as for a batch validated when it was built and changed
    after): the reserved key is a miss that gets no row; RAISE raises and changes nothing."""
    t = dynemb.DynamicTable(_cfg(_caching(0.3), capacity=64, bucket_capacity=8,
                                 on_full=on_full), backend=backend)
    t.find_or_insert(torch.arange(1, 20))
    keys = torch.tensor([3, dynemb.EMPTY_KEY, 5, dynemb.EMPTY_KEY])
    before = t.stats()
    if on_full == dynemb.OnFull.RAISE:
        with pytest.raises(dynemb.errors.InputError, match="reserved empty key"):
            t.lookup(keys, train=True, checked=True)
        assert t.stats().step == before.step and t.size() == before.size
    else:
        lk = t.lookup(keys, train=True, checked=True)
        assert (lk.unique_slots < 0).sum() == 2  # each occurrence its own entry, no row
        t.apply_gradients(lk, torch.ones(lk.unique_keys.numel(), 4))
        assert t.stats().failed_inserts == before.failed_inserts + 2
    assert dynemb.EMPTY_KEY not in t.export_batch(0, t.capacity()).keys.tolist()
    _check_cache(t)
