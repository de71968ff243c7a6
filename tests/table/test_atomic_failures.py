"""A call that raises CapacityError leaves the table exactly as it was (on_full RAISE); with
on_full WARN/COUNT it completes and returns every row it evicted. Every score policy, every
storage mode, both backends, and the three inserting paths: find_or_insert, insert_or_assign and
a training lookup through a module's forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dynemb
from dynemb import Admission, Adam, OnFull, ScorePolicy, Storage, StorageMode
from dynemb.errors import CapacityError
from dynemb.kernels.index_numba import PIN_HELD

POLICIES = [ScorePolicy.LRU, ScorePolicy.LFU, ScorePolicy.STEP, ScorePolicy.CUSTOM,
            ScorePolicy.NO_EVICTION]
# (storage, which bucket the call's keys share): HYBRID twice, once per tier.
MODES = {
    "hbm_only": (Storage(), 0),
    "hybrid-hbm": (Storage(mode=StorageMode.HYBRID, cache_load_factor=0.5), 0),
    "hybrid-ddr": (Storage(mode=StorageMode.HYBRID, cache_load_factor=0.5), 3),
    "caching": (Storage(mode=StorageMode.CACHING, cache_load_factor=0.25), 1),
}
VERBS = ["find_or_insert", "insert_or_assign", "forward"]
# Tier placement: a failing CACHING call may have written cached rows of a full bucket back to
# the backing store (their contents unchanged), so these may differ there.
PLACEMENT = {"hbm_rows", "ddr_rows", "cache_evictions", "write_backs"}


def K(ks) -> torch.Tensor:
    return torch.tensor(list(ks), dtype=torch.int64)


def _module(policy: ScorePolicy, storage: Storage, on_full: OnFull, backend: str,
            **kw) -> dynemb.EmbeddingBagCollection:
    cfg = dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=32, bucket_capacity=8,
                             score=policy, storage=storage, on_full=on_full,
                             optimizer=Adam(lr=0.1), **kw)
    return dynemb.EmbeddingBagCollection([cfg], backend=backend)


def _same_bucket(t: dynemb.DynamicTable, bucket: int, n: int) -> list[int]:
    """``n`` keys that all live in ``bucket`` of the table's index."""
    cand = torch.arange(1, 50_000, dtype=torch.int64) * 7 - 3
    keys = cand[t.home_buckets(cand) == bucket][:n].tolist()
    assert len(keys) == n
    return keys


def _snapshot(t: dynemb.DynamicTable) -> dict:
    """Everything a failing call must leave as it was."""
    t.flush()
    b = t.export_batch(0, t.capacity())
    rows = {k: (b.embeddings[i].clone(), b.optimizer_state[i].clone(), int(b.scores[i]))
            for i, k in enumerate(b.keys.tolist())}
    skip = {"failed_inserts"} | (PLACEMENT if t.cache is not None else set())
    stats = {k: v for k, v in dataclasses.asdict(t.stats()).items() if k not in skip}
    adm = None if t.admission is None else dict(zip(*(x.tolist() for x in t.admission.export())))
    # Between calls no slot is pinned by a lookup (a left pin would make its row unevictable).
    held = sum(int((ix.pins == PIN_HELD).sum()) for ix in (t.index, t.cache and t.cache.index) if ix)
    return {"rows": rows, "stats": stats, "step": t.step, "optimizer_step": t.optimizer.step,
            "admission": adm, "held": held}


def _assert_same(before: dict, after: dict) -> None:
    assert set(after["rows"]) == set(before["rows"]), "keys changed"
    for k, (emb, state, score) in before["rows"].items():
        e2, s2, sc2 = after["rows"][k]
        assert torch.equal(emb, e2) and torch.equal(state, s2), f"row of key {k} changed"
        assert score == sc2, f"score of key {k} changed: {score} -> {sc2}"
    for name in ("stats", "step", "optimizer_step", "admission", "held"):
        assert after[name] == before[name], name


def _scenario(t: dynemb.DynamicTable, bucket: int, policy: ScorePolicy):
    """Fills one bucket and returns (present keys, the failing call's keys): the call uses some
    present keys (pinned), and its new keys are one more than the bucket can take, so the last
    one fails after the others were placed (by eviction, or in the one free slot)."""
    keys = _same_bucket(t, bucket, 14)
    if policy == ScorePolicy.NO_EVICTION:
        present, call = keys[:7], keys[:2] + keys[8:10]
    else:
        present, call = keys[:8], keys[:4] + keys[8:13]
    scores = K(10 * (i + 1) for i in range(len(present)))
    custom = scores if policy == ScorePolicy.CUSTOM else None
    g = torch.Generator().manual_seed(1)
    t.insert_or_assign(K(present), torch.randn(len(present), 4, generator=g), scores=custom,
                       optimizer_state=torch.rand(len(present), 8, generator=g))
    return present, call


def _call(verb: str, ebc: dynemb.EmbeddingBagCollection, keys: list[int], policy: ScorePolicy):
    t = ebc.tables["t"]
    custom = K([1000] * len(keys)) if policy == ScorePolicy.CUSTOM else None
    if verb == "find_or_insert":
        return t.find_or_insert(K(keys), scores=custom)
    if verb == "insert_or_assign":
        return t.insert_or_assign(K(keys), torch.ones(len(keys), 4), scores=custom)
    t.lookup_score = 1000 if policy == ScorePolicy.CUSTOM else None
    out = ebc(dynemb.SparseBatch(features=["f"], values=K(keys), lengths=K([len(keys)])))
    out.values().sum().backward()
    return out


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("policy", POLICIES, ids=[p.name for p in POLICIES])
def test_a_call_that_raises_capacity_error_changes_nothing(backend, policy, mode, verb):
    storage, bucket = MODES[mode]
    ebc = _module(policy, storage, OnFull.RAISE, backend)
    t = ebc.tables["t"]
    present, call = _scenario(t, bucket, policy)
    before = _snapshot(t)
    failed = t.stats().failed_inserts
    with pytest.raises(CapacityError, match="changed nothing"):
        _call(verb, ebc, call, policy)
    assert t.stats().failed_inserts == failed + 1   # the failure itself is counted
    _assert_same(before, _snapshot(t))
    # The table still works: the same call without its last new key succeeds.
    _call(verb, ebc, call[:-1], policy)
    assert set(call[:-1]) <= set(_snapshot(t)["rows"])


@pytest.mark.parametrize("verb", ["find_or_insert", "forward"])
def test_a_failing_caching_call_served_from_the_backing_store_changes_nothing(backend, verb):
    """The call's present keys are not cached (ddr hits, which the lookup pins in the backing
    store) and their bucket has no room for its new keys: the failure releases those pins."""
    storage, bucket = MODES["caching"]
    ebc = _module(ScorePolicy.LRU, storage, OnFull.RAISE, backend)
    t = ebc.tables["t"]
    present, call = _scenario(t, bucket, ScorePolicy.LRU)
    t.cache.drop(K(present))  # written back: the present rows now live in the backing store only
    before = _snapshot(t)
    with pytest.raises(CapacityError, match="changed nothing"):
        _call(verb, ebc, call, ScorePolicy.LRU)
    _assert_same(before, _snapshot(t))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("policy", POLICIES, ids=[p.name for p in POLICIES])
def test_with_on_full_count_the_call_completes_and_returns_what_it_evicted(backend, policy,
                                                                           mode):
    storage, bucket = MODES[mode]
    ebc = _module(policy, storage, OnFull.COUNT, backend)
    t = ebc.tables["t"]
    present, call = _scenario(t, bucket, policy)
    before = _snapshot(t)["rows"]
    r = _call("find_or_insert", ebc, call, policy)
    after = _snapshot(t)["rows"]
    assert t.stats().failed_inserts == 1
    new = set(call) - set(present)
    inserted = set(K(call)[r.inserted].tolist())
    assert len(inserted) == len(new) - 1 and inserted <= new
    evicted = r.evicted.keys.tolist()
    assert set(after) == (set(present) - set(evicted)) | inserted
    assert not set(evicted) & set(call)           # never a key the call used
    for i, k in enumerate(evicted):               # every evicted row comes back whole
        emb, state, score = before[k]
        assert torch.equal(r.evicted.embeddings[i], emb)
        assert torch.equal(r.evicted.optimizer_state[i], state)
        assert int(r.evicted.scores[i]) == score
    n_evicted = 0 if policy == ScorePolicy.NO_EVICTION else len(new) - 1
    assert len(evicted) == n_evicted


@pytest.mark.parametrize("mode", list(MODES))
def test_a_failing_training_lookup_counts_no_admission(backend, mode):
    """Admission is only judged until the call has succeeded: a failing lookup neither counts
    its keys' sightings nor consumes the counts of the keys it would have admitted."""
    storage, bucket = MODES[mode]
    ebc = _module(ScorePolicy.NO_EVICTION, storage, OnFull.RAISE, backend,
                  admission=Admission(threshold=2, counter_capacity=256))
    t = ebc.tables["t"]
    keys = _same_bucket(t, bucket, 10)
    t.find_or_insert(K(keys[:7]))                  # bypasses admission; one slot left
    t.lookup(K([keys[7]]), train=True)             # a first sighting: rejected, counted
    assert t.admission.export()[0].tolist() == [keys[7]]
    before = _snapshot(t)
    with pytest.raises(CapacityError):             # both reach 2 sightings; only one fits
        t.lookup(K([keys[7], keys[8], keys[8], keys[9]]), train=True)
    _assert_same(before, _snapshot(t))
    lk = t.lookup(K([keys[7]]), train=True)        # its second sighting: admitted
    assert lk.inserted.tolist() == [True]


def test_load_rows_that_do_not_fit_change_nothing(backend):
    t = dynemb.DynamicTable(dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=8),
                            backend=backend)
    t.find_or_insert(K(range(1, 7)))
    before = _snapshot(t)
    n = 4  # two fit in the free slots, two do not
    with pytest.raises(CapacityError, match="nothing was loaded"):
        t.load_rows(K(range(100, 100 + n)), torch.ones(n, 4), torch.zeros(n, 0),
                    K([5] * n))
    _assert_same(before, _snapshot(t))
    t.load_rows(K([100, 101]), torch.ones(2, 4), torch.zeros(2, 0), K([5, 5]))
    assert t.size() == 8
