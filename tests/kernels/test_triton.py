"""The Triton kernels against the numba kernels: compiled on CUDA where there is a GPU, else in
Triton's interpreter on CPU tensors (CI).

The index kernels must leave the index slot for slot as the numba kernels do (every array,
bit for bit, on random operation sequences); pooling and the optimizers must give the numba
kernels' values (bit for bit in the interpreter where the arithmetic is the same; the row sums of
row-wise Adagrad and of weight gradients are summed in another order, and compiled kernels may
fuse multiply-adds: 1e-6); a collection on the triton backend trains as on the numba backend in
every storage mode.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynemb
from dynemb.kernels import triton_index
from dynemb.kernels.backend import NUMBA, backend_for
from dynemb.kernels.index_numba import P_CUSTOM, P_LFU, P_LRU, P_NO_EVICTION, P_STEP
from dynemb.table.index import HashIndex

CPU = torch.device("cpu")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EXACT = DEV.type == "cpu"  # the interpreter computes in numpy, as the numba kernels do
pytestmark = pytest.mark.skipif(not triton_index.available(DEV),
                                reason="no CUDA and Triton's interpreter is off")
ARRAYS = ("keys", "scores", "digests", "pins", "counts")
NONE = torch.empty(0, dtype=torch.int64)


def _triton():
    return backend_for(DEV, "triton")


def _same(a: HashIndex, b: HashIndex, what: str) -> None:
    for name in ARRAYS:
        assert torch.equal(getattr(a, name), getattr(b, name).cpu()), f"{what}: {name} differ"


def _close(dev_result: torch.Tensor, cpu_result: torch.Tensor) -> None:
    if EXACT:
        assert torch.equal(dev_result, cpu_result)
    else:
        torch.testing.assert_close(dev_result.cpu(), cpu_result, rtol=1e-6, atol=1e-6)


def _lookup(be, ix, keys, custom, policy, step, atomic):
    """One training lookup as the staged backends run it (find, insert the misses, finish);
    the results on the CPU."""
    keys, custom = keys.to(ix.keys.device), custom.to(ix.keys.device)
    prev = torch.empty_like(keys) if atomic else None
    slots = be.find(ix, keys, custom, policy, step, True, True, prev)
    miss = torch.nonzero(slots < 0).flatten()
    mc = custom[miss] if custom.numel() else custom
    new, inserted, ev = be.insert(ix, keys[miss], mc, policy, step, atomic)
    if atomic and bool((new < 0).any()):
        be.restore_scores(ix, slots, prev)
        be.unpin(ix, slots)
        return ((new < 0).cpu(),)
    slots[miss] = new
    inverse, unique_slots, unique_pos = be.finish(ix, slots)
    # the order of entries is each backend's own (numba: first occurrence; torch: by slot)
    entries = torch.stack([unique_slots, unique_pos], 1).tolist()
    return tuple(t.cpu() for t in (slots, inserted, *ev, unique_slots[inverse],
                                   torch.tensor(sorted(entries))))


keys_st = st.lists(st.integers(0, 40), min_size=0, max_size=14)
op_st = st.one_of(
    st.tuples(st.just("lookup"), keys_st, st.booleans()),
    st.tuples(st.just("find"), keys_st, st.just(False)),
    st.tuples(st.just("erase"), keys_st.map(lambda ks: sorted(set(ks))), st.just(False)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from([P_LRU, P_LFU, P_STEP, P_CUSTOM, P_NO_EVICTION]),
       split=st.sampled_from([None, 1]), ops=st.lists(op_st, min_size=1, max_size=8),
       seed=st.integers(0, 2**16))
def test_index_kernels_leave_the_index_slot_for_slot_as_numba(policy, split, ops, seed):
    tb = _triton()
    a = HashIndex(2, 8, CPU, NUMBA, split=split)  # 16 slots for 41 keys: buckets fill
    b = HashIndex(2, 8, DEV, tb, split=split)
    g = torch.Generator().manual_seed(seed)
    for step, (op, keys, atomic) in enumerate(ops, start=1):
        k = torch.tensor(keys, dtype=torch.int64) * 7919
        custom = torch.randint(0, 30, k.shape, generator=g) if policy == P_CUSTOM else NONE
        if op == "lookup":
            ra = _lookup(NUMBA, a, k, custom, policy, step, atomic)
            rb = _lookup(tb, b, k, custom, policy, step, atomic)
            for x, y in zip(ra, rb, strict=True):
                assert torch.equal(x, y), f"step {step}: {op} results differ"
        elif op == "find":
            assert torch.equal(NUMBA.find(a, k, NONE, policy, step, False, False),
                               tb.find(b, k.to(DEV), NONE.to(DEV), policy, step, False,
                                       False).cpu())
        else:
            assert torch.equal(NUMBA.erase(a, k), tb.erase(b, k.to(DEV)).cpu())
        _same(a, b, f"step {step} ({op})")


def _fused(be, ix, keys, custom, policy, step, train, atomic):
    """``backend.lookup`` (the numba backend's fused kernels, the triton backend's one-read
    lookup), its entries in a backend-free form, on the CPU."""
    keys, custom = keys.to(ix.keys.device), custom.to(ix.keys.device)
    r = be.lookup(ix, keys, custom, policy, step, touch=train, insert=train, atomic=atomic,
                  admit=None, hbm_rows=ix.split * ix.width)
    if atomic and r.failed:
        return r.failed, r.tiers
    entries = sorted(torch.stack([r.unique_slots, r.unique_pos], 1).tolist())
    return (r.failed, r.tiers, r.unique_slots[r.inverse].cpu(), torch.tensor(entries),
            r.slots.cpu(), r.fresh.cpu(), *(t.cpu() for t in r.evicted),
            None if r.inserted is None else r.inserted.cpu())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from([P_LRU, P_LFU, P_STEP, P_CUSTOM, P_NO_EVICTION]),
       split=st.sampled_from([None, 1]),
       ops=st.lists(st.tuples(keys_st, st.booleans(), st.booleans()), min_size=1, max_size=8),
       seed=st.integers(0, 2**16))
def test_the_one_read_lookup_matches_the_numba_lookup(policy, split, ops, seed):
    """Training and eval lookups through ``backend.lookup``: the same entries, slots, new rows,
    evictions, failures and tier counts, and the same index after each call."""
    tb = _triton()
    a = HashIndex(2, 8, CPU, NUMBA, split=split)
    b = HashIndex(2, 8, DEV, tb, split=split)
    g = torch.Generator().manual_seed(seed)
    for step, (keys, train, atomic) in enumerate(ops, start=1):
        k = torch.tensor(keys, dtype=torch.int64) * 7919
        custom = torch.randint(0, 30, k.shape, generator=g) if policy == P_CUSTOM else NONE
        ra = _fused(NUMBA, a, k, custom, policy, step, train, atomic and train)
        rb = _fused(tb, b, k, custom, policy, step, train, atomic and train)
        assert len(ra) == len(rb)
        for x, y in zip(ra, rb, strict=True):
            assert (x == y) if not isinstance(x, torch.Tensor) else torch.equal(x, y), \
                f"step {step}: results differ"
        _same(a, b, f"step {step}")


def test_the_one_read_lookup_touches_with_the_last_custom_score_and_undoes_a_failure():
    tb = _triton()
    a = HashIndex(1, 8, CPU, NUMBA)
    b = HashIndex(1, 8, DEV, tb)
    calls = [([1, 2, 3], [5, 6, 7], False),
             ([1, 1, 2, 1], [9, 8, 4, 3], False),   # 1 ends at 3: its last occurrence
             (list(range(10, 16)), [9] * 6, False),  # the bucket is full
             ([1, 2, 1, 20, 21], [40, 41, 42, 1, 1], True)]  # 20 and 21 are below every score
    for step, (keys, custom, atomic) in enumerate(calls, start=1):
        k, c = torch.tensor(keys), torch.tensor(custom)
        before = {n: getattr(b, n).clone() for n in ARRAYS}
        ra = _fused(NUMBA, a, k, c, P_CUSTOM, step, True, atomic)
        rb = _fused(tb, b, k, c, P_CUSTOM, step, True, atomic)
        assert all((x == y) if not isinstance(x, torch.Tensor) else torch.equal(x, y)
                   for x, y in zip(ra, rb, strict=True))
        _same(a, b, f"call {step}")
        if step == 2:
            assert sorted(b.scores[b.digests >= 2].tolist()) == [3, 4, 7]
    assert ra[0] == 2 and all(torch.equal(getattr(b, n), before[n]) for n in ARRAYS)


def test_insert_evicts_by_score_and_respects_pins():
    """A full bucket: each new key takes the lowest-score unpinned slot, the first on ties; keys
    the call found or inserted are pinned; NO_EVICTION fails instead; a CUSTOM score below the
    lowest fails."""
    tb = _triton()
    k = torch.tensor([11, 500, 600, 500])
    for policy in (P_LRU, P_LFU, P_NO_EVICTION, P_CUSTOM):
        ixs = [HashIndex(1, 8, d, be) for d, be in ((CPU, NUMBA), (DEV, tb))]
        for ix, be in zip(ixs, (NUMBA, tb), strict=True):
            for step in range(1, 9):  # 8 keys, scores 1..8 (LRU, CUSTOM), 3 each (LFU)
                key = torch.tensor([step * 11] * (3 if policy == P_LFU else 1))
                _lookup(be, ix, key, key // 11 if policy == P_CUSTOM else NONE, policy, step,
                        False)
            custom = torch.tensor([9, 4, 1, 9]) if policy == P_CUSTOM else NONE
            out = _lookup(be, ix, k, custom, policy, 20, False)
            if policy == P_LRU:  # 11 is touched and pinned: 22 and 33 go, first-come
                assert out[2].tolist() == [22, 33] and out[4].tolist() == [2, 3]
            elif policy == P_LFU:  # 500 starts at 1 but is pinned: 600 evicts a key at 3
                assert out[4].tolist() == [3, 3] and not {11, 500} & set(out[2].tolist())
            elif policy == P_CUSTOM:  # 500 (4) evicts 22 (score 2); 600 (1) is below 3: fails
                assert out[2].tolist() == [22] and (out[0] < 0).tolist() == [0, 0, 1, 0]
            else:
                assert (out[0] < 0).tolist() == [False, True, True, True]
        _same(*ixs, f"policy {policy}")


def _pool_case(g, dim, weighted, with_extra):
    batch, feats, rows_n = 5, 2, 12
    lengths = torch.randint(0, 4, (feats * batch,), generator=g)
    n = int(lengths.sum())
    n_u = max(1, n // 2)
    inverse = torch.randint(0, n_u, (n,), generator=g)
    rows = torch.randn(rows_n, dim + 3, generator=g)
    src = torch.randint(0, rows_n, (n_u,), generator=g)
    extra = torch.randn(3, dim, generator=g)
    if with_extra:
        src[::3] = -1 - torch.randint(0, 3, src[::3].shape, generator=g)
    weights = torch.rand(n, generator=g) + 0.5 if weighted else torch.empty(0)
    return rows, extra, src, inverse, lengths, weights, batch, feats


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("dim", [4, 13])
def test_pooling_matches_numba(mean, weighted, dim):
    tb = _triton()
    g = torch.Generator().manual_seed(dim + 2 * mean + weighted)
    rows, extra, src, inverse, lengths, weights, batch, feats = _pool_case(g, dim, weighted, True)
    args = (rows, extra, src, inverse, lengths, weights, batch, dim, mean)
    dargs = tuple(a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args)
    out, dout = torch.full((batch, feats * dim), 7.0), torch.full((batch, feats * dim), 7.0,
                                                                  device=DEV)
    NUMBA.pool(*args, out)
    tb.pool(*dargs, dout)
    _close(dout, out)
    gout = torch.randn(batch, feats * dim, generator=g)
    grads = torch.full((int(inverse.max()) + 1, dim), float("nan"))  # overwritten
    wgrads = torch.zeros(inverse.numel() if weighted else 0)
    dgrads, dwgrads = grads.to(DEV), wgrads.to(DEV)
    NUMBA.pool_backward(gout, *args, grads, wgrads)
    tb.pool_backward(gout.to(DEV), *dargs, dgrads, dwgrads)
    _close(dgrads, grads)  # each entry's ids summed in id order
    torch.testing.assert_close(dwgrads.cpu(), wgrads, rtol=1e-6, atol=1e-6)


OPTIMIZERS = {"sgd": (0.1, 0.01), "adagrad": (0.1, 1e-8, 0.01),
              "rowwise_adagrad": (0.1, 1e-8, 0.01), "adam": (0.01, 0.9, 0.999, 1e-8, 0.01)}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dim", [4, 13])
def test_optimizer_updates_match_numba(name, dim):
    g = torch.Generator().manual_seed(dim)
    width = dim * (3 if name == "adam" else 2 if name == "adagrad" else 1) \
        + (1 if name == "rowwise_adagrad" else 0)
    rows = torch.rand(20, width, generator=g)
    slots = torch.tensor([3, -1, 0, 19, 7, 11])
    grads = torch.randn(slots.numel(), dim, generator=g)
    out, dout = rows.clone(), rows.clone().to(DEV)
    for _ in range(3):
        NUMBA.optimizer(name)(out, slots, grads, *OPTIMIZERS[name])
        _triton().optimizer(name)(dout, slots.to(DEV), grads.to(DEV), *OPTIMIZERS[name])
    assert not torch.equal(out, rows)
    if name == "rowwise_adagrad":  # the row's sum of squares, in another order
        torch.testing.assert_close(dout.cpu(), out, rtol=1e-6, atol=1e-7)
    else:
        _close(dout, out)


def _tier_ids(hbm_rows: int, ddr_rows: int, n: int, seed: int) -> torch.Tensor:
    """n distinct global row ids over both tiers, and some -1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(hbm_rows + ddr_rows, generator=g)[:n]
    return torch.where(torch.rand(n, generator=g) < 0.2, -1, ids)


@pytest.mark.parametrize("ddr_rows", [0, 9])
def test_rows_by_global_id_over_both_tiers_match_indexing(ddr_rows):
    """gather, scatter and copy by global row id (``RowStore.in_place``): below the split an
    hbm row, above it a ddr row; -1 left alone."""
    from dynemb.kernels import triton_rows as tr

    g = torch.Generator().manual_seed(ddr_rows)
    hbm, ddr = torch.rand(7, 5, generator=g), torch.rand(ddr_rows, 5, generator=g)
    both = torch.cat([hbm, ddr])
    dhbm, dddr = hbm.to(DEV), (ddr if DEV.type == "cpu" else ddr.pin_memory())
    far = dddr if ddr_rows else None
    ids = _tier_ids(7, ddr_rows, 6, 1)
    ok = ids >= 0
    out = torch.full((6, 8), -3.0, device=DEV)  # a wider out: its row stride is used
    tr.gather_rows(dhbm, far, ids.to(DEV), 4, out, start=1)
    want = torch.full((6, 8), -3.0)
    want[ok, :4] = both[ids[ok], 1:5]
    assert torch.equal(out.cpu(), want)

    values = torch.rand(6, 3, generator=g)
    tr.scatter_rows(dhbm, far, ids.to(DEV), values.to(DEV), start=2)
    both[ids[ok], 2:5] = values[ok]
    src, dst = _tier_ids(7, ddr_rows, 4, 2), _tier_ids(7, ddr_rows, 4, 3)
    tr.copy_rows(dhbm, far, src.to(DEV), dst.to(DEV))
    both[dst[(src >= 0) & (dst >= 0)]] = both[src[(src >= 0) & (dst >= 0)]]
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dhbm.cpu(), both[:7]) and torch.equal(dddr, both[7:])


def test_optimizer_updates_rows_in_either_tier_in_place():
    g = torch.Generator().manual_seed(0)
    hbm, ddr = torch.rand(6, 12, generator=g), torch.rand(5, 12, generator=g)
    ids = torch.tensor([7, -1, 0, 10, 5, 6])
    grads = torch.randn(ids.numel(), 4, generator=g)
    both = torch.cat([hbm, ddr])
    NUMBA.optimizer("adam")(both, ids, grads, *OPTIMIZERS["adam"])
    dhbm, dddr = hbm.to(DEV), (ddr if DEV.type == "cpu" else ddr.pin_memory())
    _triton().optimizer("adam")(dhbm, ids.to(DEV), grads.to(DEV), *OPTIMIZERS["adam"], ddr=dddr)
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    _close(dhbm, both[:6])
    _close(dddr, both[6:])


def _collection(backend, optimizer, storage):
    cfgs = [dynemb.TableConfig(name="t", dim=8, features=["a", "b"], capacity=64,
                               bucket_capacity=8, optimizer=optimizer, storage=storage,
                               pooling=dynemb.PoolingMode.MEAN),
            dynemb.TableConfig(name="u", dim=4, features=["c"], capacity=32, bucket_capacity=8,
                               optimizer=optimizer, score=dynemb.ScorePolicy.LFU,
                               storage=storage)]
    return dynemb.EmbeddingBagCollection(cfgs, backend=backend,
                                         device=CPU if backend == "numba" else DEV)


@pytest.mark.parametrize(("optimizer", "storage"), [
    (dynemb.Adam(lr=0.01), dynemb.Storage()),
    (dynemb.RowWiseAdagrad(lr=0.1), dynemb.Storage(mode=dynemb.StorageMode.HYBRID,
                                                   cache_load_factor=0.3)),
    (dynemb.SGD(lr=0.1), dynemb.Storage(mode=dynemb.StorageMode.CACHING,
                                        cache_load_factor=0.3))],
    ids=["adam-hbm_only", "rowwise_adagrad-hybrid", "sgd-caching"])
def test_a_collection_trains_on_triton_as_on_numba(optimizer, storage):
    cols = [_collection(be, optimizer, storage) for be in ("numba", "triton")]
    assert cols[1].tables["t"].backend.name == "triton"
    proj = torch.randn(6, 20, generator=torch.Generator().manual_seed(0))
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        lengths = torch.randint(0, 5, (3 * 6,), generator=g)
        values = torch.randint(-60, 60, (int(lengths.sum()),), generator=g) * 7919
        weights = torch.rand(values.numel(), generator=g) + 0.5
        batch = dynemb.SparseBatch(features=["a", "b", "c"], values=values, lengths=lengths,
                                   weights=weights)
        outs = [c(batch.to(c.device)).values() for c in cols]
        torch.testing.assert_close(outs[1].cpu(), outs[0], rtol=1e-6, atol=1e-6)
        for o in outs:
            (o * proj.to(o.device)).sum().backward()
    for name in ("t", "u"):
        a, b = (c.tables[name] for c in cols)
        assert torch.equal(a.index.keys, b.index.keys.cpu())
        assert a.stats() == b.stats()
        torch.testing.assert_close(b.rows.cpu(), a.rows, rtol=1e-6, atol=1e-6)
        if a.store.ddr is not None:
            assert b.store.in_place  # (the kernels address both tiers)
            torch.testing.assert_close(b.store.settled_ddr(), a.store.ddr, rtol=1e-6, atol=1e-6)
    assert sum(c.tables["t"].stats().evicted for c in cols[:1]) > 0  # the tables were full
    evals = [c.eval() for c in cols]  # rows without a row get the eval initializer
    batch = dynemb.SparseBatch(features=["a", "b", "c"], values=torch.arange(9) * 1013,
                               lengths=torch.ones(18, dtype=torch.int64).index_fill_(
                                   0, torch.arange(9), 0))
    outs = [c(batch.to(c.device)).values() for c in evals]
    torch.testing.assert_close(outs[1].cpu(), outs[0], rtol=1e-6, atol=1e-6)


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(triton_index, "available", lambda device: False)
    with pytest.raises(dynemb.errors.ConfigError, match="TRITON_INTERPRET=1"):
        backend_for(CPU, "triton")


def _table(backend, **kw):
    cfg = dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=64, bucket_capacity=8,
                             **kw)
    return dynemb.DynamicTable(cfg, backend=backend, device=CPU if backend == "numba" else DEV)


def _stored(table) -> list[int]:
    return sorted(table.export_batch(0, table.capacity()).keys.tolist())


def test_strided_and_expanded_keys_are_read_as_the_values_they_show():
    base = torch.arange(1, 17) * 1000
    for keys in (base[::2], torch.tensor([5]).expand(6)):
        tables = [_table(be) for be in ("numba", "triton")]
        for t in tables:
            t.find_or_insert(keys.to(t.device))
        assert _stored(tables[0]) == _stored(tables[1]) == sorted(set(keys.tolist()))
        assert bool(tables[1].find(keys.to(DEV)).found.all())


def test_rows_located_again_are_found_by_pooling_after_an_erase():
    t = _table("triton")
    lk = t.lookup(torch.tensor([1, 2, 3], device=DEV), train=True)
    assert lk.away == 0
    t.erase(torch.tensor([2], device=DEV))
    t.embeddings(lk)  # locates the rows again: one entry lost its row
    src, extra = t.sources(lk)
    assert (src < 0).sum().item() == 1 and extra.shape[0] == 1


@pytest.mark.parametrize("storage", [dynemb.Storage(), dynemb.Storage(
    mode=dynemb.StorageMode.CACHING, cache_load_factor=0.5)], ids=["hbm_only", "caching"])
@pytest.mark.parametrize("on_full", [dynemb.OnFull.RAISE, dynemb.OnFull.COUNT])
def test_a_batch_changed_to_hold_the_reserved_key_never_makes_it_a_row(on_full, storage):
    """The triton backend does not check a batch again (that would wait for the GPU)."""
    ebc = dynemb.EmbeddingBagCollection(
        [dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=64, on_full=on_full,
                            storage=storage)], backend="triton", device=DEV)
    batch = dynemb.SparseBatch(features=["f"], values=torch.tensor([1, 2]),
                               lengths=torch.tensor([1, 1])).to(DEV)
    batch.values[1] = dynemb.EMPTY_KEY
    t = ebc.tables["t"]
    if on_full == dynemb.OnFull.RAISE:
        with pytest.raises(dynemb.errors.InputError, match="reserved empty key.*changed after"):
            ebc(batch)
        assert t.size() == 0 and t.step == 0
        assert t.cache is None or t.cache.index.size() == 0
    else:
        ebc(batch)
        assert _stored(t) == [1] and t.stats().failed_inserts == 1


@pytest.mark.parametrize("storage", [dynemb.Storage()] + [dynemb.Storage(
    mode=dynemb.StorageMode.CACHING, cache_load_factor=x) for x in (0.5, 0.2)],
    ids=["hbm_only", "caching", "caching-some-served-from-ddr"])
def test_held_lookups_keep_their_rows_as_on_numba(storage):
    """Holds taken and released on the device (``HashIndex.hold_where``; CACHING: in the cache
    where every entry is cached) against the checked host path: the same rows survive later
    lookups, the same hold counts, the same pins."""
    tables = [_table(be, score=dynemb.ScorePolicy.LFU, on_full=dynemb.OnFull.COUNT,
                     storage=storage) for be in ("numba", "triton")]
    held = torch.arange(1, 21) * 7
    for t in tables:
        dev = t.device
        lk1 = t.lookup(held.to(dev), train=True, hold=True)
        lk2 = t.lookup(held[:5].to(dev), train=True, hold=True)  # five rows held twice
        if storage.cache_load_factor == 0.2:  # (a cache bucket overflows: held in both)
            assert lk1.away > 0
        for step in range(6):  # a full table: every later key wants a victim
            t.lookup((torch.arange(40) + 1000 * (step + 1)).to(dev), train=True)
        assert t.held_rows() == 20
        assert set(held.tolist()) <= set(_stored(t))
        t.apply_gradients(lk1, torch.ones(lk1.unique_keys.numel(), 4, device=dev))
        assert t.held_rows() == 5
        t.release(lk2)
        assert t.held_rows() == 0
    a, b = tables
    assert torch.equal(a.index.pins, b.index.pins.cpu())
    if a.cache is not None:
        assert torch.equal(a.cache.index.pins, b.cache.index.pins.cpu())
    assert _stored(a) == _stored(b) and a.stats() == b.stats()


caching_op_st = st.one_of(
    st.tuples(st.just("train"), keys_st), st.tuples(st.just("eval"), keys_st),
    st.tuples(st.just("find_or_insert"), keys_st),
    st.tuples(st.just("assign"), keys_st.map(lambda ks: sorted(set(ks)))),
    st.tuples(st.just("erase"), keys_st.map(lambda ks: sorted(set(ks)))),
    st.tuples(st.just("prefetch"), keys_st), st.tuples(st.just("flush"), st.just([])))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from([dynemb.ScorePolicy.LRU, dynemb.ScorePolicy.LFU,
                               dynemb.ScorePolicy.STEP, dynemb.ScorePolicy.CUSTOM]),
       on_full=st.sampled_from([dynemb.OnFull.COUNT, dynemb.OnFull.RAISE]),
       ops=st.lists(caching_op_st, min_size=1, max_size=8))
def test_a_caching_table_on_triton_matches_numba_on_random_calls(policy, on_full, ops):
    """The cache-first lookup (``table.cached_once``: one read on the triton backend, free
    reads on numba) with every other verb between: the same values, rows, scores and stats."""
    storage = dynemb.Storage(mode=dynemb.StorageMode.CACHING, cache_load_factor=0.3)
    tables = [dynemb.DynamicTable(
        dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=32, bucket_capacity=8,
                           storage=storage, score=policy, on_full=on_full,
                           optimizer=dynemb.Adagrad(lr=0.1)),
        backend=be, device=CPU if be == "numba" else DEV) for be in ("numba", "triton")]
    for i, (op, ks) in enumerate(ops):
        keys = torch.tensor(ks, dtype=torch.int64) * 977
        got = []
        for t in tables:
            k = keys.to(t.device)
            t.lookup_score = 5 * i if policy == dynemb.ScorePolicy.CUSTOM else None
            try:
                if op in ("train", "eval"):
                    lk = t.lookup(k, train=op == "train")
                    values = t.embeddings(lk)[lk.inverse]
                    if op == "train":
                        grads = torch.ones(lk.unique_keys.numel(), 4, device=t.device)
                        t.apply_gradients(lk, grads * (lk.unique_keys[:, None] % 5))
                    got.append(values.cpu())
                elif op == "find_or_insert":
                    scores = torch.full_like(k, i) if policy == dynemb.ScorePolicy.CUSTOM else None
                    got.append(t.find_or_insert(k, scores).values.cpu())
                elif op == "assign":
                    t.insert_or_assign(k, torch.ones(k.numel(), 4, device=t.device) * i)
                elif op == "erase":
                    got.append(t.erase(k))
                elif op == "prefetch":
                    got.append(t.prefetch(k))
                else:
                    got.append(t.flush())
            except dynemb.errors.CapacityError:
                got.append("refused")
        assert not got or _same_results(*got), (op, ks)
        a, b = tables
        assert a.stats() == b.stats(), (op, ks)
    ea, eb = (t.export_batch(0, t.capacity()) for t in tables)
    assert torch.equal(ea.keys, eb.keys.cpu()) and torch.equal(ea.scores, eb.scores.cpu())
    _close(eb.embeddings.contiguous(), ea.embeddings)
    _close(eb.optimizer_state.contiguous(), ea.optimizer_state)


def _same_results(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-6, atol=1e-6))
    return a == b


admission_op_st = st.one_of(
    st.tuples(st.just("train"), keys_st), st.tuples(st.just("eval"), keys_st),
    st.tuples(st.just("find_or_insert"), keys_st))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(storage=st.sampled_from([dynemb.Storage(), dynemb.Storage(
           mode=dynemb.StorageMode.HYBRID, cache_load_factor=0.5)]),
       on_full=st.sampled_from([dynemb.OnFull.COUNT, dynemb.OnFull.RAISE]),
       threshold=st.integers(1, 3), counters=st.sampled_from([8, 64]),
       ops=st.lists(admission_op_st, min_size=1, max_size=8))
def test_admission_judged_on_the_device_matches_numba(storage, on_full, threshold, counters,
                                                       ops):
    """The triton lookup judges and counts admission on the device (no read): the same rows,
    counters (slot for slot), rejections and forgotten sightings as numba, whose judge runs
    between its probe and its insert; 8 counters overflow and evict."""
    cfg = dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=16, bucket_capacity=8,
                             storage=storage, on_full=on_full, optimizer=dynemb.SGD(lr=0.1),
                             admission=dynemb.Admission(threshold=threshold,
                                                        counter_capacity=counters))
    tables = [dynemb.DynamicTable(cfg, backend=be, device=CPU if be == "numba" else DEV)
              for be in ("numba", "triton")]
    for op, ks in ops:
        keys = torch.tensor(ks, dtype=torch.int64) * 977
        got = []
        for t in tables:
            k = keys.to(t.device)
            try:
                if op == "find_or_insert":  # (not judged: admission filters training lookups)
                    got.append(t.find_or_insert(k).values.cpu())
                    continue
                lk = t.lookup(k, train=op == "train")
                got.append(t.embeddings(lk)[lk.inverse].cpu())
                if op == "train":
                    t.apply_gradients(lk, torch.ones(lk.unique_keys.numel(), 4, device=t.device))
            except dynemb.errors.CapacityError:
                got.append("refused")
        assert _same_results(*got), (op, ks)
        a, b = tables
        assert a.stats() == b.stats(), (op, ks)
        _same(a.admission.index, b.admission.index, f"counters after {op} {ks}")
        _same(a.index, b.index, f"index after {op} {ks}")


def test_admission_counters_overflow_and_evict_on_the_device_as_on_numba():
    """8 counters in one bucket: a call with more new keys overflows it (those occurrences are
    judged alone and forgotten), the next evicts the least-counted counters it did not touch."""
    cfg = dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=64, bucket_capacity=8,
                             optimizer=dynemb.SGD(lr=0.1),
                             admission=dynemb.Admission(threshold=4, counter_capacity=8))
    tables = [dynemb.DynamicTable(cfg, backend=be, device=CPU if be == "numba" else DEV)
              for be in ("numba", "triton")]
    calls = [list(range(12)) * 2, [0, 1, 2] + list(range(20, 27)), [0, 1, 20, 20, 40] + [50] * 4]
    for ks in calls:
        for t in tables:
            t.lookup(torch.tensor(ks, device=t.device) * 31, train=True)
        a, b = tables
        assert a.stats() == b.stats(), ks
        _same(a.admission.index, b.admission.index, f"counters after {ks}")
    st_ = a.stats()
    assert st_.counter_overflows > 0 and st_.counter_evictions > 0, st_
    assert st_.forgotten_sightings > st_.counter_overflows and st_.admission_rejected > 0, st_
    assert a.size() == b.size() == 3  # keys seen four times got rows: 0, 1, 50
