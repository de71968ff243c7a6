"""Storage tiers: HYBRID and CACHING train exactly like HBM_ONLY; the cache against an LRU model;
write-back, flush and reopening a memory-mapped backing store; per-tier stats and memory."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import dynemb
from dynemb import SGD, Adagrad, Adam, Admission, RowWiseAdagrad, ScorePolicy, Storage, StorageMode
from dynemb.errors import CapacityError, ConfigError
from dynemb.kernels.hashing import bucket_of, index_hash

OPTIMIZERS = {"sgd": SGD(lr=0.1), "adagrad": Adagrad(lr=0.1), "rowwise": RowWiseAdagrad(lr=0.1),
              "adam": Adam(lr=0.01)}
STEPS = 6


def _storage(mode: StorageMode, x: float, ddr_path=None) -> Storage:
    if x == 1.0 and mode != StorageMode.HBM_ONLY:
        return Storage(mode=mode, cache_load_factor=1.0)
    return Storage(mode=mode, cache_load_factor=x, ddr_path=ddr_path)


def _config(storage: Storage, **kw) -> dynemb.TableConfig:
    kw.setdefault("optimizer", SGD(lr=0.1))
    return dynemb.TableConfig(name="t", dim=4, features=("a", "b"), capacity=kw.pop("capacity", 1024),
                              bucket_capacity=kw.pop("bucket_capacity", 8), storage=storage, **kw)


def _batches(seed: int = 0, steps: int = STEPS, batch: int = 24, vocab: int = 300):
    """Zipf-like ids (hot keys repeat within and across steps), two features."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 5, (2 * batch,), generator=g)
        u = torch.rand(int(lengths.sum()), generator=g)
        ids = (vocab ** u).long() * 7919 - 5  # log-uniform ranks, spread keys, some negative
        out.append(dynemb.SparseBatch(features=["a", "b"], values=ids, lengths=lengths))
    return out


def _train(config: dynemb.TableConfig, backend: str, batches, *, prefetch: bool = False):
    """Pooled outputs per step and the table after training (loss = <pooled, fixed weights>)."""
    ebc = dynemb.EmbeddingBagCollection([config], backend=backend)
    g = torch.Generator().manual_seed(3)
    outs = []
    for i, b in enumerate(batches):
        if prefetch:
            ebc.tables["t"].prefetch(b.values)
        out = ebc(b)["a"]
        w = torch.randn(out.shape, generator=g)
        (out * w).sum().backward()
        outs.append(out.detach())
        if i == len(batches) // 2:  # an eval lookup mid-way: reads every tier, changes nothing
            ebc.eval()
            outs.append(ebc(batches[0])["b"].detach())
            ebc.train()
    return outs, ebc.tables["t"]


def _export(table: dynemb.DynamicTable):
    b = table.export_batch(0, table.capacity())
    order = torch.argsort(b.keys)
    return b.keys[order], b.embeddings[order], b.optimizer_state[order], b.scores[order]


MODES = [(StorageMode.HYBRID, 0.1), (StorageMode.HYBRID, 0.5), (StorageMode.HYBRID, 1.0),
         (StorageMode.CACHING, 0.1), (StorageMode.CACHING, 0.5), (StorageMode.CACHING, 1.0)]


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("mode, x", MODES, ids=[f"{m.name}-{x}" for m, x in MODES])
def test_modes_train_exactly_like_hbm_only(backend, opt, mode, x):
    batches = _batches()
    ref_outs, ref = _train(_config(Storage(), optimizer=OPTIMIZERS[opt]), backend, batches)
    outs, t = _train(_config(_storage(mode, x), optimizer=OPTIMIZERS[opt]), backend, batches)
    for a, b in zip(ref_outs, outs):
        assert torch.equal(a, b)
    for a, b in zip(_export(ref), _export(t)):
        assert torch.equal(a, b)
    s = t.stats()
    assert s.evicted == ref.stats().evicted == 0
    assert s.size == ref.size() and s.lookups == ref.stats().lookups and s.hits == ref.stats().hits
    if t.mode != StorageMode.CACHING:
        assert s.hbm_rows + s.ddr_rows == s.size
    if t.mode == StorageMode.CACHING:
        assert s.hbm_rows <= t.layout.hbm_rows and s.ddr_rows == s.size
        assert s.write_backs > 0
    if t.mode == StorageMode.CACHING and x == 0.1:
        assert s.cache_evictions > 0 and s.ddr_hits > 0  # the cache churned
    if x == 1.0:
        assert t.mode == StorageMode.HBM_ONLY and t.store.ddr is None


@pytest.mark.parametrize("mode", [StorageMode.HYBRID, StorageMode.CACHING])
@pytest.mark.parametrize("opt", ["adam", "rowwise"])
def test_memory_mapped_ddr_trains_exactly_like_hbm_only(backend, tmp_path, mode, opt):
    batches = _batches(seed=5)
    ref_outs, ref = _train(_config(Storage(), optimizer=OPTIMIZERS[opt]), backend, batches)
    outs, t = _train(_config(_storage(mode, 0.2, tmp_path), optimizer=OPTIMIZERS[opt]), backend,
                     batches)
    assert all(torch.equal(a, b) for a, b in zip(ref_outs, outs))
    assert all(torch.equal(a, b) for a, b in zip(_export(ref), _export(t)))
    assert (tmp_path / "t.ddr.rows").stat().st_size == t.store.ddr.numel() * 4


@pytest.mark.parametrize("score", [ScorePolicy.LFU, ScorePolicy.STEP, ScorePolicy.NO_EVICTION])
def test_caching_carries_scores_and_admission_like_hbm_only(backend, score):
    """Scores travel between cache and backing store; admission sees the same occurrences.

    The cache (32 rows) is far smaller than the rows trained (about 90), so rows leave it and
    come back: those ddr hits must carry their backing score into the cache (an LFU count, a
    STEP write step), which the exported scores show. A last find_or_insert re-fetches early
    keys without writing them (the STEP score then comes only from the carry)."""
    kw = dict(score=score, admission=Admission(threshold=2, counter_capacity=4096),
              optimizer=Adam(lr=0.01), capacity=256)
    batches = _batches(seed=2)
    ref_outs, ref = _train(_config(Storage(), **kw), backend, batches)
    outs, t = _train(_config(_storage(StorageMode.CACHING, 0.1), **kw), backend, batches)
    assert t.layout.hbm_rows == 32 and t.size() > 2 * t.layout.hbm_rows
    assert all(torch.equal(a, b) for a, b in zip(ref_outs, outs))
    assert all(torch.equal(a, b) for a, b in zip(_export(ref), _export(t)))
    refetch = batches[0].values
    ref.find_or_insert(refetch)
    t.find_or_insert(refetch)
    assert all(torch.equal(a, b) for a, b in zip(_export(ref), _export(t)))
    s = t.stats()
    assert s.ddr_hits > 50 and s.cache_evictions > 50
    assert s.admission_rejected == ref.stats().admission_rejected > 0


def test_caching_serves_keys_the_cache_cannot_hold_from_the_backing_store(backend):
    """A batch with more distinct keys than the cache's buckets hold still trains exactly."""
    batches = _batches(seed=4, steps=3, batch=256, vocab=100_000)
    kw = dict(capacity=4096, bucket_capacity=32, optimizer=Adam(lr=0.01))
    ref_outs, ref = _train(_config(Storage(), **kw), backend, batches)
    outs, t = _train(_config(_storage(StorageMode.CACHING, 0.1), **kw), backend, batches)
    assert batches[0].values.unique().numel() > t.layout.hbm_rows
    assert all(torch.equal(a, b) for a, b in zip(ref_outs, outs))
    assert all(torch.equal(a, b) for a, b in zip(_export(ref), _export(t)))


def test_prefetch_fetches_ahead_and_changes_nothing(backend):
    batches = _batches(seed=6)
    cfg = _config(_storage(StorageMode.CACHING, 0.1), optimizer=Adam(lr=0.01))
    ref_outs, ref = _train(cfg, backend, batches)
    outs, t = _train(cfg, backend, batches, prefetch=True)
    assert all(torch.equal(a, b) for a, b in zip(ref_outs, outs))
    assert all(torch.equal(a, b) for a, b in zip(_export(ref), _export(t)))
    assert t.stats().prefetched > 0
    # After a prefetch, a lookup of keys the table holds is served from the cache.
    keys = batches[-1].values.unique()
    t.prefetch(keys)
    before = t.stats()
    t.lookup(keys, train=True)
    after = t.stats()
    assert after.hbm_hits - before.hbm_hits == keys.numel()
    assert dynemb.DynamicTable(_config(Storage())).prefetch(keys) == 0


class _LruCacheModel:
    """The cache as a set-associative LRU: per bucket (of the cache index) an ordered dict."""

    def __init__(self, num_buckets: int, width: int) -> None:
        self.nb, self.width = num_buckets, width
        self.buckets = collections.defaultdict(collections.OrderedDict)
        self.hits = self.misses = self.evictions = 0

    def access(self, key: int) -> None:
        b = self.buckets[int(bucket_of(index_hash(torch.tensor([key])), self.nb))]
        if key in b:
            self.hits += 1
            b.move_to_end(key)
            return
        self.misses += 1
        if len(b) == self.width:
            b.popitem(last=False)
            self.evictions += 1
        b[key] = True


@pytest.mark.parametrize("train", [False, True])
def test_cache_hits_match_an_lru_model_on_a_key_trace(backend, train):
    cfg = _config(_storage(StorageMode.CACHING, 0.1), capacity=2048, optimizer=SGD(lr=0.1))
    t = dynemb.DynamicTable(cfg, backend=backend)
    model = _LruCacheModel(t.cache.index.num_buckets, t.cache.index.width)
    g = torch.Generator().manual_seed(0)
    trace = ((400 ** torch.rand(3000, generator=g)).long() * 31).tolist()
    for key in trace:  # one key per call: LRU order is exact
        k = torch.tensor([key])
        if train:
            lk = t.lookup(k, train=True)
            t.apply_gradients(lk, torch.ones(1, 4))
        else:
            t.find_or_insert(k)
        model.access(key)
    s = t.stats()
    assert (s.hbm_hits, s.hbm_misses, s.cache_evictions) == (model.hits, model.misses,
                                                             model.evictions)
    assert s.lookups == len(trace) and s.ddr_hits + s.ddr_misses == model.misses
    assert model.evictions > 300 and s.evicted == 0
    # Every evicted row was updated while cached (train) or never (find_or_insert).
    assert s.write_backs == (model.evictions if train else 0)
    assert abs(s.hbm_hit_rate - model.hits / len(trace)) < 1e-12


def test_flush_then_reopen_finds_every_row(backend, tmp_path):
    storage = _storage(StorageMode.CACHING, 0.2, tmp_path)
    cfg = _config(storage, optimizer=Adam(lr=0.01))
    _, t = _train(cfg, backend, _batches(seed=8))
    assert t.cache.dirty.any()
    written = t.flush()
    assert written > 0 and not t.cache.dirty.any() and t.flush() == 0
    keys, emb, state, scores = _export(t)
    t.close()  # the clean-shutdown marker reopen=True needs; releases the store's lock
    with pytest.raises(ConfigError, match="already holds"):
        dynemb.DynamicTable(cfg, backend=backend)
    reopened = dynemb.DynamicTable(
        dataclasses.replace(cfg, storage=dataclasses.replace(storage, reopen=True)),
        backend=backend)
    assert reopened.size() == keys.numel() and reopened.step == t.step
    assert reopened.optimizer.step == t.optimizer.step
    found = reopened.find(keys)
    assert found.found.all() and torch.equal(found.values, emb)
    for a, b in zip((keys, emb, state, scores), _export(reopened)):
        assert torch.equal(a, b)
    reopened.close()
    other = dataclasses.replace(cfg, dim=8, storage=dataclasses.replace(storage, reopen=True))
    with pytest.raises(ConfigError, match="expected"):
        dynemb.DynamicTable(other, backend=backend)


def test_backing_store_evictions_are_counted_and_returned(backend):
    t = dynemb.DynamicTable(_config(_storage(StorageMode.CACHING, 0.5), capacity=16), backend=backend)
    rows, evicted = {}, []
    for k in range(60):  # one key per call: each call can evict any unpinned row
        lk = t.lookup(torch.tensor([k]), train=True, keep_evicted=True)
        rows[k] = t.embeddings(lk)[0]
        evicted.append(lk.evicted)
    s = t.stats()
    keys = torch.cat([e.keys for e in evicted])
    assert s.backing_evictions == s.evicted == keys.numel() == 60 - s.size > 0
    assert s.size <= 16 and not t.find(keys).found.any()
    emb = torch.cat([e.embeddings for e in evicted])
    assert torch.equal(emb, torch.stack([rows[k] for k in keys.tolist()]))


def test_erase_removes_cached_and_backing_rows(backend):
    t = dynemb.DynamicTable(_config(_storage(StorageMode.CACHING, 0.5)), backend=backend)
    t.find_or_insert(torch.arange(10))
    assert t.erase(torch.tensor([3, 4, 99])) == 2
    assert t.size() == 8 and t.stats().hbm_rows == 8
    assert t.find(torch.tensor([3, 4, 5])).found.tolist() == [False, False, True]
    t.find_or_insert(torch.tensor([3]))
    assert t.size() == 9


def test_load_rows_round_trip_in_every_mode(backend):
    _, src = _train(_config(Storage(), optimizer=Adam(lr=0.01)), backend, _batches(seed=9))
    keys, emb, state, scores = _export(src)
    for mode, x in MODES:
        t = dynemb.DynamicTable(_config(_storage(mode, x), optimizer=Adam(lr=0.01)),
                                backend=backend)
        t.find_or_insert(keys[:5])  # existing rows are overwritten
        t.load_rows(keys, emb, state, scores)
        for a, b in zip((keys, emb, state, scores), _export(t)):
            assert torch.equal(a, b)
        assert t.stats().lookups == 5
    small = dynemb.DynamicTable(_config(Storage(), capacity=16, optimizer=Adam(lr=0.01)))
    with pytest.raises(CapacityError, match="load_rows"):
        small.load_rows(keys, emb, state, scores)


def test_incremental_export_and_eviction_log(backend):
    t = dynemb.DynamicTable(_config(_storage(StorageMode.CACHING, 0.5), capacity=16,
                                    score=ScorePolicy.LRU), backend=backend)
    t.track_evictions()
    t.find_or_insert(torch.arange(10))
    mark = t.step
    t.insert_or_assign(torch.tensor([2, 3]), torch.ones(2, 4))
    t.find_or_insert(torch.tensor([50]))
    changed = t.export_batch(0, t.capacity(), since_step=mark)
    assert sorted(changed.keys.tolist()) == [2, 3, 50]
    t.erase(torch.tensor([7]))
    assert t.evicted_since(mark).tolist() == [7]
    t.trim_eviction_log(t.step)
    assert t.evicted_since(t.step).numel() == 0
    with pytest.raises(dynemb.errors.InputError, match="eviction log"):
        t.evicted_since(0)


def test_storage_config_validation(tmp_path):
    for unplanned in (Storage(mode=StorageMode.CACHING), Storage(mode=StorageMode.AUTO),
                      Storage(mode=StorageMode.AUTO, cache_load_factor=0.3)):
        assert not unplanned.planned  # the planner chooses the rest; building refuses it
        with pytest.raises(ConfigError, match="'t'.*left to the planner.*planner.plan"):
            dynemb.DynamicTable(_config(unplanned))
        with pytest.raises(ConfigError, match="left to the planner"):
            dynemb.EmbeddingBagCollection([_config(unplanned)])
        with pytest.raises(ConfigError, match="left to the planner"):
            dynemb.table_memory(_config(unplanned))
    assert Storage(mode=StorageMode.AUTO, cache_load_factor=1.0).planned
    with pytest.raises(ConfigError, match="cache_load_factor"):
        Storage(mode=StorageMode.HYBRID, cache_load_factor=0.05)
    with pytest.raises(ConfigError, match="HBM_ONLY"):
        Storage(cache_load_factor=0.5)
    with pytest.raises(ConfigError, match="ddr_path"):
        Storage(mode=StorageMode.CACHING, cache_load_factor=1.0, ddr_path=str(tmp_path))
    with pytest.raises(ConfigError, match="reopen"):
        Storage(mode=StorageMode.HYBRID, cache_load_factor=0.5, ddr_path=str(tmp_path), reopen=True)
    for reopen in ("yes", "AUTO", 1, None):  # True, False or "auto" only
        with pytest.raises(ConfigError, match="reopen"):
            Storage(mode=StorageMode.CACHING, cache_load_factor=0.5, ddr_path=str(tmp_path),
                    reopen=reopen)
    with pytest.raises(ConfigError, match="reopen"):
        dynemb.DynamicTable(_config(Storage(mode=StorageMode.CACHING, cache_load_factor=0.5,
                                            ddr_path=str(tmp_path / "none"), reopen=True)))
    with pytest.raises(ConfigError, match="at least 2"):
        dynemb.DynamicTable(_config(_storage(StorageMode.HYBRID, 0.5), capacity=8))
    assert Storage(mode=StorageMode.CACHING, cache_load_factor=1.0).effective_mode == StorageMode.HBM_ONLY
    with pytest.raises(ConfigError, match="storage"):
        _config("caching")


def test_hybrid_splits_keys_by_hash_near_the_load_factor(backend):
    t = dynemb.DynamicTable(_config(_storage(StorageMode.HYBRID, 0.3), capacity=1 << 14,
                                    bucket_capacity=128), backend=backend)
    t.find_or_insert(torch.arange(8000) * 1024)  # strided ids: the tier hash is not the key
    s = t.stats()
    assert s.hbm_rows + s.ddr_rows == 8000
    assert abs(s.hbm_rows / 8000 - t.layout.split / t.layout.num_buckets) < 0.03
    assert s.hbm_misses == s.hbm_rows and s.ddr_misses == s.ddr_rows


def test_sharded_tables_get_their_own_ddr_directory(tmp_path):
    from dynemb.distributed import shard_config
    cfg = _config(_storage(StorageMode.CACHING, 0.5, tmp_path))
    assert shard_config(cfg, 2, 1).storage.ddr_path == str(tmp_path / "rank1")
    assert shard_config(cfg, 1).storage.ddr_path == str(tmp_path)
    with pytest.raises(ConfigError, match="rank"):
        shard_config(cfg, 2)
