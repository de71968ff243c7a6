"""DynamicTable on both backends: HierarchicalKV-style verbs against a dict model, eviction by
score policy, pins, on_full, eval lookups, initializers, bad input and stats."""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from dataclasses import dataclass

import pytest
import torch

import dynemb
from dynemb import (
    EMPTY_KEY, Adagrad, Adam, Initializer, InitKind, OnFull, RowWiseAdagrad, ScorePolicy,
)
from dynemb.errors import CapacityError, InputError

LRU, LFU, STEP, CUSTOM, NOEV = (ScorePolicy.LRU, ScorePolicy.LFU, ScorePolicy.STEP,
                                ScorePolicy.CUSTOM, ScorePolicy.NO_EVICTION)
HALF = Initializer(kind=InitKind.CONSTANT, value=0.5)


def K(*ks: int) -> torch.Tensor:
    return torch.tensor(ks, dtype=torch.int64)


def export_all(t: dynemb.DynamicTable,
               chunk: int = 3) -> dict[int, tuple[torch.Tensor, torch.Tensor, int]]:
    """{key: (embedding, optimizer_state, score)} of the whole table, in chunks of ``chunk``
    slots (not a divisor of the bucket width, so chunks straddle buckets)."""
    out = {}
    for start in range(0, t.capacity(), chunk):
        e = t.export_batch(start, chunk)
        n = e.keys.numel()
        assert e.embeddings.shape[0] == e.optimizer_state.shape[0] == e.scores.numel() == n
        for i, k in enumerate(e.keys.tolist()):
            assert k not in out, f"key {k} exported twice"
            out[k] = (e.embeddings[i].clone(), e.optimizer_state[i].clone(), int(e.scores[i]))
    return out


def fill(t: dynemb.DynamicTable, ks) -> dict[int, torch.Tensor]:
    """find_or_insert each key in its own call (so scores of LRU/STEP are 1, 2, ...); returns
    the rows they got."""
    rows = {}
    for k in ks:
        r = t.find_or_insert(K(k))
        assert bool(r.inserted[0]), k
        rows[k] = r.values[0].clone()
    return rows


def rows_of(t: dynemb.DynamicTable, ks) -> torch.Tensor:
    r = t.find(K(*ks))
    assert bool(r.found.all())
    return r.values


# ====================================================================== basic verbs vs a dict


def test_fresh_table_find_returns_zeros_and_not_found(make_table):
    t = make_table(dim=3)
    r = t.find(K(1, 2, -5))
    assert r.values.shape == (3, 3) and r.values.dtype == torch.float32
    assert torch.equal(r.values, torch.zeros(3, 3))
    assert r.found.tolist() == [False, False, False]
    assert t.size() == 0
    s = t.stats()
    assert (s.size, s.lookups, s.inserted, s.step) == (0, 0, 0, 0)


def test_find_missing_keys_get_a_non_default_eval_initializer(make_table):
    t = make_table(eval_initializer=HALF)
    fill(t, [1])
    r = t.find(K(1, 2))
    assert r.found.tolist() == [True, False]
    assert torch.equal(r.values[1], torch.full((4,), 0.5))
    assert not torch.equal(r.values[0], torch.full((4,), 0.5))


def test_find_or_insert_then_find(make_table):
    t = make_table(capacity=64)
    r = t.find_or_insert(K(5, 7, 5, 9))
    assert r.values.shape == (4, 4)
    assert r.inserted.tolist() == [True, True, False, True]
    assert torch.equal(r.values[0], r.values[2])  # the same row for both occurrences
    assert t.size() == 3
    f = t.find(K(9, 5, 7, 6))
    assert f.found.tolist() == [True, True, True, False]
    assert torch.equal(f.values[0], r.values[3])
    assert torch.equal(f.values[1], r.values[0])
    assert torch.equal(f.values[2], r.values[1])
    assert torch.equal(f.values[3], torch.zeros(4))
    # A second find_or_insert of present keys inserts nothing and returns the same rows.
    r2 = t.find_or_insert(K(7, 5))
    assert r2.inserted.tolist() == [False, False]
    assert torch.equal(r2.values, torch.stack([r.values[1], r.values[0]]))
    assert len(r2.evicted) == 0 and t.size() == 3


def test_find_into_a_given_out_tensor(make_table):
    t = make_table(capacity=64, eval_initializer=HALF)
    rows = fill(t, [1, 2])
    out = torch.full((3, 4), -7.0)
    r = t.find(K(2, 9, 1), out=out)
    assert r.values.data_ptr() == out.data_ptr()
    assert torch.equal(out, torch.stack([rows[2], torch.full((4,), 0.5), rows[1]]))
    assert r.found.tolist() == [True, False, True]
    for bad in (torch.zeros(2, 4), torch.zeros(3, 4, dtype=torch.float64), torch.zeros(4, 3).t()):
        with pytest.raises(InputError, match="out"):
            t.find(K(2, 9, 1), out=bad)


def test_empty_key_tensors(make_table):
    t = make_table()
    empty = K()
    assert t.find(empty).values.shape == (0, 4)
    r = t.find_or_insert(empty)
    assert r.values.shape == (0, 4) and r.inserted.numel() == 0
    assert len(t.insert_or_assign(empty, torch.zeros(0, 4))) == 0
    assert t.erase(empty) == 0
    assert t.size() == 0


def test_insert_or_assign_sets_values_and_keeps_state_unless_given(make_table):
    t = make_table(optimizer=Adagrad(initial_accumulator_value=0.1), capacity=64)
    v = torch.arange(8, dtype=torch.float32).view(2, 4)
    ev = t.insert_or_assign(K(1, 2), v)
    assert len(ev) == 0
    assert torch.equal(rows_of(t, [1, 2]), v)
    rows = export_all(t)
    assert torch.allclose(rows[1][1], torch.full((4,), 0.1))  # a new row: initial state
    # Given state is set.
    s = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    t.insert_or_assign(K(1), -v[:1], optimizer_state=s)
    assert torch.equal(rows_of(t, [1]), -v[:1])
    assert torch.equal(export_all(t)[1][1], s[0])
    # Without state: the embedding changes, the state stays.
    t.insert_or_assign(K(1), v[1:] * 3)
    rows = export_all(t)
    assert torch.equal(rows[1][0], v[1] * 3)
    assert torch.equal(rows[1][1], s[0])
    assert torch.equal(rows[2][0], v[1]) and torch.allclose(rows[2][1], torch.full((4,), 0.1))
    # Existing and new keys together; values of another float dtype are converted.
    t.insert_or_assign(K(2, 3), torch.ones(2, 4, dtype=torch.float64),
                       optimizer_state=torch.full((2, 4), 7.0))
    rows = export_all(t)
    assert set(rows) == {1, 2, 3}
    for k in (2, 3):
        assert torch.equal(rows[k][0], torch.ones(4))
        assert torch.equal(rows[k][1], torch.full((4,), 7.0))


def test_insert_or_assign_duplicate_keys_raise(make_table):
    t = make_table()
    with pytest.raises(InputError, match="distinct keys; key 1 is at positions 0 and 2"):
        t.insert_or_assign(K(1, 2, 1), torch.zeros(3, 4))
    assert t.size() == 0 and t.stats().step == 0


def test_erase(make_table):
    t = make_table(capacity=64)
    first = fill(t, [1, 2, 3])
    assert t.erase(K(2, 2, 99)) == 1
    assert t.size() == 2
    f = t.find(K(1, 2, 3))
    assert f.found.tolist() == [True, False, True]
    assert torch.equal(f.values[1], torch.zeros(4))
    assert t.erase(K(2)) == 0
    assert t.stats().erased == 1
    # Re-inserted after erase: a fresh row, and the initializer is deterministic per key.
    r = t.find_or_insert(K(2))
    assert r.inserted.tolist() == [True]
    assert torch.equal(r.values[0], first[2])
    assert t.size() == 3 and set(export_all(t)) == {1, 2, 3}


def test_erase_then_insert_reuses_space_in_a_full_bucket(make_table):
    t = make_table(score=NOEV)
    fill(t, range(1, 9))
    assert t.erase(K(3, 6)) == 2
    fill(t, [100, 101])
    assert t.size() == 8
    assert set(export_all(t)) == {1, 2, 4, 5, 7, 8, 100, 101}
    assert t.find(K(1, 2, 4, 5, 7, 8, 100, 101)).found.all()


def test_export_batch_returns_every_key_once(make_table):
    t = make_table(capacity=64, bucket_capacity=16,
                   optimizer=RowWiseAdagrad(initial_accumulator_value=0.25))
    assert t.capacity() == 64
    ks = [3 * i - 40 for i in range(30)]
    vals = torch.randn(30, 4, generator=torch.Generator().manual_seed(0))
    t.insert_or_assign(K(*ks), vals)
    rows = export_all(t)
    assert sorted(rows) == sorted(ks)
    for i, k in enumerate(ks):
        assert torch.equal(rows[k][0], vals[i])
        assert rows[k][1].shape == (1,) and rows[k][1].item() == pytest.approx(0.25)
        assert rows[k][2] == 1  # LRU score: the step of the one call
    # One call over the whole range gives the same.
    e = t.export_batch(0, t.capacity())
    assert sorted(e.keys.tolist()) == sorted(ks)
    # Past the end: nothing; bad arguments: InputError.
    assert t.export_batch(t.capacity(), 10).keys.numel() == 0
    assert t.export_batch(t.capacity() + 100, 10).keys.numel() == 0
    assert t.export_batch(0, 0).keys.numel() == 0
    with pytest.raises(InputError):
        t.export_batch(-1, 4)
    with pytest.raises(InputError):
        t.export_batch(0, -4)


@pytest.mark.parametrize("capacity, bucket, expect", [
    (1, 128, 8), (8, 128, 8), (9, 128, 16), (100, 128, 128), (128, 128, 128), (129, 128, 256),
    (1000, 64, 1024), (17, 8, 24),
])
def test_capacity_rounds_up_to_whole_buckets(make_table, capacity, bucket, expect):
    t = make_table(capacity=capacity, bucket_capacity=bucket)
    assert t.capacity() == expect >= capacity
    assert t.stats().capacity == expect


def test_dict_model_without_eviction(make_table):
    """Random find / find_or_insert / insert_or_assign / erase against a dict (no evictions:
    the table has room for the whole key universe)."""
    t = make_table(capacity=256, bucket_capacity=64,
                   optimizer=Adagrad(initial_accumulator_value=0.5))
    rng = random.Random(7)
    universe = [rng.randrange(-10**12, 10**12) for _ in range(60)]
    universe += [(1 << 63) - 1, EMPTY_KEY + 1, 0]
    model: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    gen = torch.Generator().manual_seed(1)
    for _ in range(120):
        op = rng.choice(["find", "foi", "ioa", "erase"])
        ks = [rng.choice(universe) for _ in range(rng.randint(1, 6))]
        if op == "find":
            r = t.find(K(*ks))
            assert r.found.tolist() == [k in model for k in ks]
            for i, k in enumerate(ks):
                want = model[k][0] if k in model else torch.zeros(4)
                assert torch.equal(r.values[i], want)
        elif op == "foi":
            r = t.find_or_insert(K(*ks))
            seen = set()
            for i, k in enumerate(ks):
                new = k not in model
                assert bool(r.inserted[i]) == (new and k not in seen)
                if new:
                    model[k] = (r.values[i].clone(), torch.full((4,), 0.5))
                seen.add(k)
                assert torch.equal(r.values[i], model[k][0])
        elif op == "ioa":
            ks = list(dict.fromkeys(ks))
            v = torch.randn(len(ks), 4, generator=gen)
            with_state = rng.random() < 0.5
            st = torch.rand(len(ks), 4, generator=gen)
            t.insert_or_assign(K(*ks), v, optimizer_state=st if with_state else None)
            for i, k in enumerate(ks):
                old_state = model[k][1] if k in model else torch.full((4,), 0.5)
                model[k] = (v[i], st[i] if with_state else old_state)
        else:
            n = t.erase(K(*ks))
            assert n == len({k for k in ks if k in model})
            for k in ks:
                model.pop(k, None)
        assert t.size() == len(model)
        rows = export_all(t, chunk=37)
        assert set(rows) == set(model)
        for k, (emb, st) in model.items():
            assert torch.equal(rows[k][0], emb), k
            assert torch.allclose(rows[k][1], st), k
    assert t.stats().evicted == 0 and t.stats().failed_inserts == 0


# ====================================================================== eviction


def test_lru_evicts_least_recently_used(make_table):
    t = make_table(score=LRU)
    assert t.capacity() == 8
    rows = fill(t, range(1, 9))           # scores 1..8
    t.find_or_insert(K(1))                # key 1 used at step 9
    t.lookup(K(2, 2), train=True)         # key 2 used at step 10
    t.find(K(3))                          # find does not touch scores
    r = t.find_or_insert(K(100))          # step 11: evicts key 3 (score 3)
    ev = r.evicted
    assert ev.keys.tolist() == [3]
    assert ev.scores.tolist() == [3]
    assert torch.equal(ev.embeddings[0], rows[3])
    assert ev.optimizer_state.shape == (1, 0)
    assert r.inserted.tolist() == [True]
    assert not bool(t.find(K(3)).found[0])
    ev = t.find_or_insert(K(101, 102)).evicted   # then keys 4 and 5
    assert sorted(ev.keys.tolist()) == [4, 5]
    assert sorted(ev.scores.tolist()) == [4, 5]
    for i, k in enumerate(ev.keys.tolist()):
        assert torch.equal(ev.embeddings[i], rows[k])
    assert t.stats().evicted == 3 and t.size() == 8
    assert set(export_all(t)) == {1, 2, 6, 7, 8, 100, 101, 102}
    assert export_all(t)[1][2] == 9 and export_all(t)[2][2] == 10


def test_lfu_evicts_least_frequently_used(make_table):
    t = make_table(score=LFU)
    rows = fill(t, range(1, 9))                  # each seen once
    t.find_or_insert(K(1, 1, 2, 3, 4, 6, 7, 8))  # everyone but 5 seen again, 1 twice
    t.lookup(K(5, 6, 6), train=True)             # 5: 2, 6: 4
    t.find_or_insert(K(2, 3, 4, 7, 8))           # 2, 3, 4, 7, 8: 3; 1: 3
    scores = {k: s for k, (_, _, s) in export_all(t).items()}
    assert scores == {1: 3, 2: 3, 3: 3, 4: 3, 5: 2, 6: 4, 7: 3, 8: 3}
    ev = t.find_or_insert(K(100)).evicted
    assert ev.keys.tolist() == [5] and ev.scores.tolist() == [2]
    assert torch.equal(ev.embeddings[0], rows[5])
    assert export_all(t)[100][2] == 1
    # A new key counts its occurrences in the batch: 101 x3 evicts 100 (1) and scores 3.
    ev = t.find_or_insert(K(101, 101, 101)).evicted
    assert ev.keys.tolist() == [100] and ev.scores.tolist() == [1]
    assert export_all(t)[101][2] == 3
    t.find_or_insert(K(1, 2, 3, 4, 6, 7, 8))     # all others to 4 (6 to 5)
    ev = t.find_or_insert(K(102)).evicted
    assert ev.keys.tolist() == [101] and ev.scores.tolist() == [3]


def test_step_evicts_least_recently_written(make_table):
    t = make_table(score=STEP, optimizer=Adagrad(lr=0.1))
    fill(t, range(1, 9))                    # written at steps 1..8
    t.find_or_insert(K(1))                  # a read (step 9): no change for STEP
    t.lookup(K(1, 2), train=True)           # reads (step 10)
    t.insert_or_assign(K(2), torch.ones(1, 4))   # a write at step 11
    lk = t.lookup(K(3), train=True)         # step 12, then an optimizer write
    t.apply_gradients(lk, torch.ones(len(lk.unique_slots), 4))
    scores = {k: s for k, (_, _, s) in export_all(t).items()}
    assert scores == {1: 1, 2: 11, 3: 12, 4: 4, 5: 5, 6: 6, 7: 7, 8: 8}
    ev = t.find_or_insert(K(100)).evicted
    assert ev.keys.tolist() == [1] and ev.scores.tolist() == [1]
    ev = t.find_or_insert(K(101)).evicted
    assert ev.keys.tolist() == [4]


def test_lru_and_step_differ_on_reads(table_config, backend):
    """The same history evicts 1 under STEP (oldest write) and 2 under LRU (oldest use)."""
    out = {}
    for policy in (LRU, STEP):
        t = dynemb.DynamicTable(table_config(score=policy), backend=backend)
        fill(t, range(1, 9))
        t.find_or_insert(K(1, 3, 4, 5, 6, 7, 8))   # read all but 2
        out[policy] = t.find_or_insert(K(100)).evicted.keys.tolist()
    assert out == {LRU: [2], STEP: [1]}


def test_custom_scores_evict_lowest_and_refuse_lower(make_table):
    t = make_table(score=CUSTOM, on_full=OnFull.COUNT, eval_initializer=HALF,
                   optimizer=Adagrad(initial_accumulator_value=0.1))
    ks = list(range(1, 9))
    vals = torch.arange(32, dtype=torch.float32).view(8, 4)
    t.insert_or_assign(K(*ks), vals, scores=K(*[10 * k for k in ks]))
    assert {k: s for k, (_, _, s) in export_all(t).items()} == {k: 10 * k for k in ks}
    # Below every existing score: refused, counted, gets the eval initializer.
    r = t.find_or_insert(K(100), scores=K(5))
    assert r.inserted.tolist() == [False] and len(r.evicted) == 0
    assert torch.equal(r.values[0], torch.full((4,), 0.5))
    assert t.stats().failed_inserts == 1 and t.size() == 8
    assert not bool(t.find(K(100)).found[0])
    # At least the lowest: evicts the lowest (key 1, score 10) and returns its row.
    r = t.find_or_insert(K(101), scores=K(10))
    ev = r.evicted
    assert ev.keys.tolist() == [1] and ev.scores.tolist() == [10]
    assert torch.equal(ev.embeddings[0], vals[0])
    assert torch.allclose(ev.optimizer_state[0], torch.full((4,), 0.1))
    assert t.stats().evicted == 1
    # Scores given for present keys update them.
    t.find_or_insert(K(2), scores=K(95))
    assert export_all(t)[2][2] == 95


def test_custom_refused_key_does_not_block_a_later_key_of_the_same_call(make_table):
    """Bucket scores 10..80; one call inserts 100 (score 5, refused) then 101 (score 15, at least
    the lowest 10): 101 must evict the lowest-score key (1), as one key at a time would."""
    t = make_table(score=CUSTOM, on_full=OnFull.COUNT)
    ks = list(range(1, 9))
    t.insert_or_assign(K(*ks), torch.zeros(8, 4), scores=K(*[10 * k for k in ks]))
    r = t.find_or_insert(K(100, 101), scores=K(5, 15))
    assert r.inserted.tolist() == [False, True]
    assert r.evicted.keys.tolist() == [1] and r.evicted.scores.tolist() == [10]
    assert t.stats().failed_inserts == 1
    assert set(export_all(t)) == {2, 3, 4, 5, 6, 7, 8, 101}


def test_custom_refusal_raises_by_default(make_table):
    t = make_table(score=CUSTOM)
    t.insert_or_assign(K(*range(1, 9)), torch.zeros(8, 4), scores=K(*range(11, 19)))
    with pytest.raises(CapacityError, match="'t'"):
        t.find_or_insert(K(100), scores=K(3))
    assert t.stats().failed_inserts == 1
    assert set(export_all(t)) == set(range(1, 9))


def test_evicted_rows_carry_optimizer_state(make_table):
    t = make_table(score=LRU, optimizer=Adam(), dim=2)
    t.insert_or_assign(K(*range(1, 9)), torch.arange(16, dtype=torch.float32).view(8, 2),
                       optimizer_state=torch.arange(32, dtype=torch.float32).view(8, 4) + 100)
    ev = t.find_or_insert(K(50)).evicted   # all eight had score 1: a tie, any of them may go
    assert len(ev) == 1
    k = int(ev.keys[0])
    assert 1 <= k <= 8 and ev.scores.tolist() == [1]
    assert ev.embeddings[0].tolist() == [2.0 * (k - 1), 2.0 * (k - 1) + 1]
    assert ev.optimizer_state[0].tolist() == [100.0 + 4 * (k - 1) + j for j in range(4)]
    # The new key's row is freshly initialised (Adam state zeros), not the evicted one's.
    assert torch.equal(export_all(t)[50][1], torch.zeros(4))


# ====================================================================== pins and on_full


def test_lookup_never_evicts_its_own_keys_raise(make_table):
    t = make_table()
    with pytest.raises(CapacityError, match="'t'.*changed nothing"):
        t.lookup(K(*range(1, 10)), train=True)
    s = t.stats()   # the call was atomic: nothing inserted, only the failure counted
    assert s.failed_inserts == 1 and s.evicted == 0 and s.size == 0 and s.step == 0
    # Pins were released: the next calls fill the bucket and can evict.
    t.lookup(K(*range(1, 9)), train=True)
    r = t.find_or_insert(K(500))
    assert len(r.evicted) == 1 and t.size() == 8


def test_lookup_never_evicts_its_own_keys_warn(make_table, caplog):
    t = make_table(on_full=OnFull.WARN, eval_initializer=HALF)
    with caplog.at_level(logging.WARNING):
        lk = t.lookup(K(*range(1, 10)), train=True)
    assert any(r.levelno == logging.WARNING and "'t'" in r.getMessage() for r in caplog.records)
    _check_one_failed(t, lk, list(range(1, 10)))


def test_lookup_never_evicts_its_own_keys_count(make_table, caplog):
    t = make_table(on_full=OnFull.COUNT, eval_initializer=HALF)
    with caplog.at_level(logging.WARNING):
        lk = t.lookup(K(*range(1, 10)), train=True)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    _check_one_failed(t, lk, list(range(1, 10)))


def _check_one_failed(t, lk, ks):
    s = t.stats()
    assert s.failed_inserts == 1 and s.evicted == 0 and s.size == 8 and s.inserted == 8
    emb = t.embeddings(lk)[lk.inverse]
    assert torch.equal(lk.unique_keys[lk.inverse], K(*ks))
    failed = (lk.unique_slots[lk.inverse] < 0).nonzero().flatten().tolist()
    assert len(failed) == 1
    assert torch.equal(emb[failed[0]], torch.full((4,), 0.5))
    ok = [i for i in range(len(ks)) if i != failed[0]]
    assert not torch.isclose(emb[ok], torch.full((4,), 0.5)).all(dim=1).any()
    assert sorted(export_all(t)) == sorted(ks[i] for i in ok)


def test_lookup_keeps_its_found_rows_and_evicts_others(make_table):
    t = make_table(on_full=OnFull.COUNT)
    fill(t, range(1, 9))
    # 4 present keys + 5 new ones: the 4 rows not in the lookup go, the 5th new key fails.
    lk = t.lookup(K(1, 2, 3, 4, 11, 12, 13, 14, 15), train=True)
    s = t.stats()
    assert s.evicted == 4 and s.failed_inserts == 1
    assert sorted(lk.evicted.keys.tolist()) == [5, 6, 7, 8]
    present = set(export_all(t))
    assert {1, 2, 3, 4} <= present and len(present & {11, 12, 13, 14, 15}) == 4
    # Duplicates of present keys in a full bucket: nothing is evicted.
    lk = t.lookup(K(1, 1, 2), train=True)
    assert len(lk.evicted) == 0 and t.stats().failed_inserts == 1


def test_lookup_structure(make_table):
    t = make_table(capacity=64, on_full=OnFull.COUNT)
    ks = K(4, 9, 4, 4, 2, 9)
    lk = t.lookup(ks, train=True)
    assert torch.equal(lk.unique_keys[lk.inverse], ks)
    assert lk.unique_keys.numel() == 3 and lk.unique_slots.unique().numel() == 3
    assert (lk.unique_slots >= 0).all()
    assert lk.inserted.tolist() == [True, True, False, False, True, False]
    emb = t.embeddings(lk)
    assert emb.shape == (3, 4)
    assert torch.equal(emb, t.find(lk.unique_keys).values)


def test_no_eviction_full_table_raises(make_table):
    t = make_table(score=NOEV)
    rows = fill(t, range(1, 9))
    with pytest.raises(CapacityError, match="NO_EVICTION"):
        t.find_or_insert(K(100))
    assert t.stats().failed_inserts == 1 and t.stats().evicted == 0
    assert torch.equal(rows_of(t, range(1, 9)), torch.stack([rows[k] for k in range(1, 9)]))
    with pytest.raises(CapacityError):
        t.insert_or_assign(K(101), torch.ones(1, 4))
    with pytest.raises(CapacityError):
        t.lookup(K(1, 102), train=True)
    assert set(export_all(t)) == set(range(1, 9))


def test_no_eviction_count_keeps_rows_intact(make_table):
    t = make_table(score=NOEV, on_full=OnFull.COUNT, eval_initializer=HALF)
    rows = fill(t, range(1, 9))
    r = t.find_or_insert(K(100, 3, 101, 100))
    assert r.inserted.tolist() == [False, False, False, False]
    assert len(r.evicted) == 0
    assert torch.equal(r.values[1], rows[3])
    for i in (0, 2, 3):
        assert torch.equal(r.values[i], torch.full((4,), 0.5))
    assert t.stats().failed_inserts == 3
    t.insert_or_assign(K(2, 102), torch.ones(2, 4))   # 2 is assigned, 102 fails
    assert t.stats().failed_inserts == 4
    assert torch.equal(rows_of(t, [2])[0], torch.ones(4))
    ex = export_all(t)
    assert set(ex) == set(range(1, 9))
    for k in (1, 3, 4, 5, 6, 7, 8):
        assert torch.equal(ex[k][0], rows[k])
    assert t.stats().evicted == 0 and t.size() == 8


# ====================================================================== eval


def test_eval_lookup_changes_nothing(make_table):
    t = make_table(capacity=64, eval_initializer=HALF, score=LFU)
    rows = fill(t, [1, 2, 3])
    before = export_all(t)
    stats = t.stats()
    ks = K(2, 77, 2, 1, 78)
    lk = t.lookup(ks, train=False)
    assert t.size() == 3
    after = export_all(t)
    assert {k: v[2] for k, v in after.items()} == {k: v[2] for k, v in before.items()}
    assert t.stats() == stats
    assert torch.equal(lk.unique_keys[lk.inverse], ks)
    emb = t.embeddings(lk)[lk.inverse]
    assert torch.equal(emb[0], rows[2]) and torch.equal(emb[2], rows[2])
    assert torch.equal(emb[3], rows[1])
    assert torch.equal(emb[1], torch.full((4,), 0.5)) and torch.equal(emb[4], torch.full((4,), 0.5))
    assert len(lk.evicted) == 0


def test_eval_lookup_on_a_full_table_does_not_evict(make_table):
    t = make_table()
    fill(t, range(1, 9))
    lk = t.lookup(K(*range(20, 40)), train=False)
    assert set(export_all(t)) == set(range(1, 9))
    assert (lk.unique_slots < 0).all()
    assert torch.equal(t.embeddings(lk), torch.zeros(20, 4))
    assert t.stats().failed_inserts == 0 and t.stats().evicted == 0
    # The eval lookup left no pins behind: the next insert can evict the oldest row.
    ev = t.find_or_insert(K(99)).evicted
    assert ev.keys.tolist() == [1]


def test_eval_initializer_random_kind_is_deterministic(table_config):
    cfg = table_config(
        eval_initializer=Initializer(kind=InitKind.UNIFORM, low=1.0, high=2.0, seed=3))
    a = dynemb.DynamicTable(cfg, backend="numba").find(K(5, 6, 5)).values
    b = dynemb.DynamicTable(cfg, backend="torch").find(K(6, 5)).values
    assert torch.equal(a[0], a[2]) and not torch.equal(a[0], a[1])
    assert torch.allclose(a[1], b[0], atol=1e-6) and torch.allclose(a[0], b[1], atol=1e-6)
    assert ((a >= 1.0) & (a <= 2.0)).all()


# ====================================================================== initializers

INITS = {
    "normal": Initializer(kind=InitKind.NORMAL, mean=0.3, std=2.0, seed=11),
    "truncated_normal": Initializer(kind=InitKind.TRUNCATED_NORMAL, mean=-1.0, std=0.5,
                                    bound=2.0, seed=11),
    "uniform": Initializer(kind=InitKind.UNIFORM, low=-0.5, high=1.5, seed=11),
    "constant": Initializer(kind=InitKind.CONSTANT, value=0.25, seed=11),
}
INIT_KEYS = [0, 1, -1, 17, 10**15, -(10**15), (1 << 63) - 1, EMPTY_KEY + 1] + list(range(100, 140))


def _init_rows(cfg, backend, ks, *, order=None, extra=(), batches=1) -> dict[int, torch.Tensor]:
    t = dynemb.DynamicTable(cfg, backend=backend)
    seq = list(ks) if order is None else [ks[i] for i in order]
    seq = seq + list(extra)
    n = max(1, math.ceil(len(seq) / batches))
    out = {}
    for i in range(0, len(seq), n):
        part = seq[i:i + n]
        r = t.find_or_insert(K(*part))
        for j, k in enumerate(part):
            out[k] = r.values[j].clone()
    return {k: out[k] for k in ks}


@pytest.mark.parametrize("kind", list(INITS))
def test_initial_rows_deterministic_per_seed_name_key(kind, backend, table_config):
    init = INITS[kind]
    cfg = table_config(name="emb", dim=8, capacity=256, initializer=init)
    a = _init_rows(cfg, backend, INIT_KEYS)
    # Another table, other order, other batch composition, several calls: the same rows.
    perm = list(reversed(range(len(INIT_KEYS))))
    b = _init_rows(cfg, backend, INIT_KEYS, order=perm, extra=[555, 556, 557], batches=5)
    for k in INIT_KEYS:
        assert torch.equal(a[k], b[k]), k
    # The other backend: the same to 1e-6.
    other = "torch" if backend == "numba" else "numba"
    c = _init_rows(cfg, other, INIT_KEYS)
    for k in INIT_KEYS:
        assert torch.allclose(a[k], c[k], atol=1e-6, rtol=0), k
    if kind == "constant":
        assert all(torch.equal(v, torch.full((8,), 0.25)) for v in a.values())
        return
    # Distinct keys get distinct rows; another seed or another table name other rows.
    assert len({tuple(v.tolist()) for v in a.values()}) == len(INIT_KEYS)
    for other_cfg in (table_config(name="emb", dim=8, capacity=256,
                                   initializer=dataclasses.replace(init, seed=12)),
                      table_config(name="emb2", dim=8, capacity=256, initializer=init)):
        d = _init_rows(other_cfg, backend, INIT_KEYS)
        same = sum(torch.equal(a[k], d[k]) for k in INIT_KEYS)
        assert same == 0


def _trunc_std(bound: float) -> float:
    phi = math.exp(-bound * bound / 2) / math.sqrt(2 * math.pi)
    mass = math.erf(bound / math.sqrt(2))
    return math.sqrt(1 - 2 * bound * phi / mass)


@pytest.mark.parametrize("kind", ["normal", "truncated_normal", "uniform"])
def test_initializer_statistics(kind, backend, table_config):
    init = INITS[kind]
    dim, n = 16, 2500
    cfg = table_config(name="stats", dim=dim, capacity=4 * n, initializer=init)
    t = dynemb.DynamicTable(cfg, backend=backend)
    v = t.find_or_insert(torch.arange(n, dtype=torch.int64) * 7919 - 10**9).values.double()
    assert t.size() == n
    flat = v.flatten()
    if kind == "normal":
        mean, std = init.mean, init.std
        assert (flat - mean).abs().max() < 6 * std
        assert (flat - mean).abs().max() > 3 * std  # tails are there
    elif kind == "truncated_normal":
        mean, std = init.mean, init.std * _trunc_std(init.bound)
        lo, hi = init.mean - init.bound * init.std, init.mean + init.bound * init.std
        assert flat.min() >= lo - 1e-6 and flat.max() <= hi + 1e-6
        assert flat.min() < lo + 0.05 * init.std and flat.max() > hi - 0.05 * init.std
    else:
        mean, std = (init.low + init.high) / 2, (init.high - init.low) / math.sqrt(12)
        assert flat.min() >= init.low and flat.max() < init.high
        assert flat.min() < init.low + 0.01 and flat.max() > init.high - 0.01
    n_el = flat.numel()
    assert abs(float(flat.mean()) - mean) < 5 * std / math.sqrt(n_el)
    assert float(flat.std()) == pytest.approx(std, rel=0.03)
    # Each column has the same law, and adjacent elements (drawn from one 64-bit hash) are
    # uncorrelated.
    col_means = v.mean(dim=0)
    assert (col_means - mean).abs().max() < 5 * std / math.sqrt(n)
    corr = torch.corrcoef(torch.stack([v[:, 0], v[:, 1], v[:, 2]]))
    assert corr[0, 1].abs() < 0.08 and corr[0, 2].abs() < 0.08


@pytest.mark.parametrize("opt, width, value", [
    (dynemb.SGD(), 0, 0.0),
    (Adagrad(initial_accumulator_value=0.1), 4, 0.1),
    (RowWiseAdagrad(initial_accumulator_value=0.1), 1, 0.1),
    (Adam(), 8, 0.0),
])
def test_initial_optimizer_state(make_table, opt, width, value):
    t = make_table(optimizer=opt, capacity=64)
    t.find_or_insert(K(1, 2))
    t.lookup(K(3), train=True)
    t.insert_or_assign(K(4), torch.ones(1, 4))
    ex = export_all(t)
    assert set(ex) == {1, 2, 3, 4}
    for k in ex:
        assert ex[k][1].shape == (width,)
        assert torch.allclose(ex[k][1], torch.full((width,), value)), k


# ====================================================================== bad input

BAD_KEYS = {
    "int32": torch.tensor([1, 2], dtype=torch.int32),
    "float": torch.tensor([1.0, 2.0]),
    "bool": torch.tensor([True, False]),
    "2-D": torch.tensor([[1, 2]], dtype=torch.int64),
    "empty key": torch.tensor([3, EMPTY_KEY], dtype=torch.int64),
    "list": [1, 2],
}


def _verbs(t):
    return {
        "find": lambda ks: t.find(ks),
        "find_or_insert": lambda ks: t.find_or_insert(ks),
        "insert_or_assign": lambda ks: t.insert_or_assign(ks, torch.zeros(2, 4)),
        "erase": lambda ks: t.erase(ks),
        "lookup_train": lambda ks: t.lookup(ks, train=True),
        "lookup_eval": lambda ks: t.lookup(ks, train=False),
    }


@pytest.mark.parametrize("verb", ["find", "find_or_insert", "insert_or_assign", "erase"])
@pytest.mark.parametrize("bad", list(BAD_KEYS))
def test_bad_keys_raise_input_error(make_table, verb, bad):
    t = make_table(capacity=64)
    fill(t, [3])
    with pytest.raises(InputError, match="'t'"):
        _verbs(t)[verb](BAD_KEYS[bad])
    assert set(export_all(t)) == {3} and t.stats().step == 1


@pytest.mark.parametrize("verb", ["lookup_train", "lookup_eval"])
def test_reserved_key_in_lookup_raises_input_error(make_table, verb):
    """The module path (DynamicTable.lookup) rejects the reserved empty key like the other
    verbs; it must never become a row (numba) or match an empty slot (torch)."""
    t = make_table(capacity=64)
    fill(t, [3])
    with pytest.raises(InputError, match="'t'"):
        _verbs(t)[verb](BAD_KEYS["empty key"])
    assert set(export_all(t)) == {3} and t.size() == 1
    assert t.stats().hits == 0


@pytest.mark.parametrize("verb", ["lookup_train", "lookup_eval"])
@pytest.mark.parametrize("bad", ["int32", "float", "bool", "2-D", "list"])
def test_bad_keys_raise_input_error_in_lookup(table_config, verb, bad):
    """DynamicTable.lookup validates keys like the other verbs. (Torch backend only: the check
    belongs to the table, and numba would compile a kernel for each wrong dtype first.)"""
    t = dynemb.DynamicTable(table_config(capacity=64), backend="torch")
    fill(t, [3])
    with pytest.raises(InputError, match="'t'"):
        _verbs(t)[verb](BAD_KEYS[bad])
    assert set(export_all(t)) == {3}


def test_scores_without_custom_policy_raise(make_table):
    t = make_table(score=LRU)
    with pytest.raises(InputError, match="CUSTOM"):
        t.find_or_insert(K(1, 2), scores=K(5, 6))
    with pytest.raises(InputError, match="CUSTOM"):
        t.insert_or_assign(K(1, 2), torch.zeros(2, 4), scores=K(5, 6))
    assert t.size() == 0 and t.stats().step == 0


@pytest.mark.parametrize("scores", [K(1), K(1, 2, 3), K(1, 2).view(2, 1), [1, 2]])
def test_scores_of_wrong_shape_raise(make_table, scores):
    t = make_table(score=CUSTOM)
    with pytest.raises(InputError, match="scores"):
        t.find_or_insert(K(1, 2), scores=scores)
    with pytest.raises(InputError, match="scores"):
        t.insert_or_assign(K(1, 2), torch.zeros(2, 4), scores=scores)
    assert t.size() == 0 and t.stats().step == 0


@pytest.mark.parametrize("values", [torch.zeros(2, 3), torch.zeros(3, 4), torch.zeros(8), "x"])
def test_values_of_wrong_shape_raise(make_table, values):
    t = make_table()
    with pytest.raises(InputError, match="values"):
        t.insert_or_assign(K(1, 2), values)
    assert t.size() == 0 and t.stats().step == 0


def test_optimizer_state_of_wrong_shape_raises(make_table):
    t = make_table(optimizer=Adagrad())
    with pytest.raises(InputError, match="optimizer_state"):
        t.insert_or_assign(K(1, 2), torch.zeros(2, 4), optimizer_state=torch.zeros(2, 1))
    t = make_table()  # SGD: state width 0
    with pytest.raises(InputError, match="optimizer_state"):
        t.insert_or_assign(K(1, 2), torch.zeros(2, 4), optimizer_state=torch.zeros(2, 4))
    assert t.size() == 0


def test_unknown_backend_raises_config_error(table_config):
    with pytest.raises(dynemb.errors.ConfigError, match="backend"):
        dynemb.DynamicTable(table_config(), backend="cuda-magic")


# ====================================================================== stats


def test_stats_follow_what_happened(make_table):
    t = make_table(on_full=OnFull.COUNT)
    t.find_or_insert(K(1, 2, 3, 1))            # step 1: 4 lookups, 0 hits, 3 inserted
    t.lookup(K(1, 4, 4), train=True)          # step 2: 3 lookups, 1 hit, 1 inserted
    t.find(K(1, 2, 99))                       # no step, not a lookup
    t.lookup(K(1, 50), train=False)           # eval: nothing
    t.insert_or_assign(K(2, 5), torch.zeros(2, 4))  # step 3: 2 lookups, 1 hit, 1 inserted
    assert t.erase(K(3, 98)) == 1                 # step 4: an erase is a write
    s = t.stats()
    assert (s.step, s.lookups, s.hits, s.inserted, s.evicted, s.failed_inserts, s.erased) == \
        (4, 9, 2, 5, 0, 0, 1)
    assert s.size == 4 == t.size() and s.capacity == 8
    assert s.load_factor == pytest.approx(4 / 8)
    assert s.admission_rejected == 0 and s.counter_evictions == 0 and s.stale_updates == 0
    # Fill, then evict and fail.
    t.find_or_insert(K(10, 11, 12, 13))        # step 5: size 8
    assert t.stats().load_factor == 1.0
    t.lookup(K(20, 21), train=True)             # step 6: 2 evictions
    t.lookup(K(*range(30, 39)), train=True)     # step 7: 9 new keys, 8 evict, 1 fails
    s = t.stats()
    assert (s.step, s.inserted, s.evicted, s.failed_inserts, s.size) == (7, 5 + 4 + 2 + 8, 10, 1, 8)
    assert s.lookups == 9 + 4 + 2 + 9 and s.hits == 2


# ====================================================================== randomised policy model


@dataclass
class _Row:
    emb: torch.Tensor
    state: torch.Tensor
    score: int


class BucketModel:
    """A one-bucket table as a dict: find pass (touch, pin), then inserts one occurrence at a
    time, evicting the lowest-score unpinned key (ties: the one the table chose, if it is among
    the tied ones)."""

    def __init__(self, width: int, policy: ScorePolicy, state0: torch.Tensor, init_rows):
        self.width, self.policy, self.state0, self.init_rows = width, policy, state0, init_rows
        self.rows: dict[int, _Row] = {}
        self.step = 0
        self.counts = dict(lookups=0, hits=0, inserted=0, evicted=0, failed_inserts=0, erased=0)

    def _touch(self, k, c):
        r = self.rows[k]
        if self.policy == LFU:
            r.score += 1
        elif self.policy in (LRU, NOEV):
            r.score = self.step
        elif self.policy == CUSTOM and c is not None:
            r.score = c

    def resolve(self, ks, custom, actual_evicted: set[int]):
        """Returns (ok per occurrence, inserted per occurrence, {evicted key: row})."""
        self.step += 1
        self.counts["lookups"] += len(ks)
        present = [k in self.rows for k in ks]
        self.counts["hits"] += sum(present)
        pinned = set()
        for i, k in enumerate(ks):
            if present[i]:
                self._touch(k, None if custom is None else custom[i])
                pinned.add(k)
        ok, inserted, evicted = list(present), [False] * len(ks), {}
        for i, k in enumerate(ks):
            if present[i]:
                continue
            c = None if custom is None else custom[i]
            if k in self.rows:
                self._touch(k, c)
                ok[i] = True
                continue
            if self.policy == LFU:
                score = 1
            elif self.policy == CUSTOM and c is not None:
                score = c
            else:
                score = self.step
            if len(self.rows) >= self.width:
                cands = [q for q in self.rows if q not in pinned]
                low = min((self.rows[q].score for q in cands), default=None)
                if self.policy == NOEV or not cands or (self.policy == CUSTOM and score < low):
                    self.counts["failed_inserts"] += 1
                    continue
                tied = [q for q in cands if self.rows[q].score == low]
                chosen = [q for q in tied if q in actual_evicted and q not in evicted]
                assert chosen, f"table evicted {sorted(actual_evicted)}; expected one of {tied}"
                evicted[chosen[0]] = self.rows.pop(chosen[0])
                self.counts["evicted"] += 1
            self.rows[k] = _Row(self.init_rows[k].clone(), self.state0.clone(), score)
            self.counts["inserted"] += 1
            pinned.add(k)
            ok[i] = inserted[i] = True
        return ok, inserted, evicted

    def mark_written(self, ks):
        if self.policy == STEP:
            for k in ks:
                self.rows[k].score = self.step


def _check_evicted(ev: dynemb.Evicted, expect: dict[int, _Row], *, rows: bool = True):
    """Evicted keys and scores always; rows unless the call did not copy them (``lookup``
    without ``keep_evicted``, where they are None)."""
    got = {k: i for i, k in enumerate(ev.keys.tolist())}
    assert set(got) == set(expect)
    if not rows:
        assert ev.embeddings is None and ev.optimizer_state is None
    for k, row in expect.items():
        i = got[k]
        if rows:
            assert torch.equal(ev.embeddings[i], row.emb), k
            assert torch.allclose(ev.optimizer_state[i], row.state), k
        assert int(ev.scores[i]) == row.score, k


@pytest.mark.parametrize("policy", [LRU, LFU, STEP, CUSTOM, NOEV])
def test_random_operations_match_bucket_model(make_table, policy):
    dim = 3
    t = make_table(dim=dim, score=policy, on_full=OnFull.COUNT,
                   optimizer=Adagrad(initial_accumulator_value=0.2))
    assert t.capacity() == 8
    rng = random.Random(list(ScorePolicy).index(policy))
    universe = list(range(1, 15))
    ref_cfg = dynemb.TableConfig(**{**t.config.__dict__, "capacity": 64, "score": LRU})
    ref = dynemb.DynamicTable(ref_cfg, backend=t.backend.name)
    init_rows = dict(zip(universe, ref.find_or_insert(K(*universe)).values.clone()))
    model = BucketModel(8, policy, torch.full((dim,), 0.2), init_rows)
    gen = torch.Generator().manual_seed(3)
    for step in range(150):
        op = rng.choice(["foi", "foi", "train", "ioa", "find", "erase", "eval"])
        ks = [rng.choice(universe) for _ in range(rng.randint(1, 4))]
        custom, per_key = None, None
        if policy == CUSTOM and op in ("foi", "ioa") and rng.random() < 0.8:
            per_key = {k: rng.randrange(0, 200) for k in ks}
            custom = [per_key[k] for k in ks]
        where = f"step {step}: {op} {ks} scores={custom}"
        if op in ("foi", "train"):
            if op == "foi":
                r = t.find_or_insert(K(*ks), scores=None if custom is None else K(*custom))
                values, inserted, ev = r.values, r.inserted, r.evicted
            else:
                keep = rng.random() < 0.5
                lk = t.lookup(K(*ks), train=True, keep_evicted=keep)
                values, inserted, ev = t.embeddings(lk)[lk.inverse], lk.inserted, lk.evicted
            ok, ins, evicted = model.resolve(ks, custom, set(ev.keys.tolist()))
            assert inserted.tolist() == ins, where
            _check_evicted(ev, evicted, rows=op == "foi" or keep or not evicted)
            for i, k in enumerate(ks):
                want = model.rows[k].emb if ok[i] else torch.zeros(dim)
                assert torch.equal(values[i], want), where
        elif op == "ioa":
            ks = list(dict.fromkeys(ks))
            custom = None if per_key is None else [per_key[k] for k in ks]
            v = torch.randn(len(ks), dim, generator=gen)
            st = torch.rand(len(ks), dim, generator=gen) if rng.random() < 0.5 else None
            ev = t.insert_or_assign(K(*ks), v, scores=None if custom is None else K(*custom),
                                    optimizer_state=st)
            ok, _, evicted = model.resolve(ks, custom, set(ev.keys.tolist()))
            _check_evicted(ev, evicted)
            for i, k in enumerate(ks):
                if ok[i]:
                    model.rows[k].emb = v[i].clone()
                    if st is not None:
                        model.rows[k].state = st[i].clone()
            model.mark_written([k for i, k in enumerate(ks) if ok[i]])
        elif op == "find":
            r = t.find(K(*ks))
            assert r.found.tolist() == [k in model.rows for k in ks], where
        elif op == "eval":
            lk = t.lookup(K(*ks), train=False)
            has_row = (lk.unique_slots[lk.inverse] >= 0).tolist()
            assert has_row == [k in model.rows for k in ks], where
        else:
            n = t.erase(K(*ks))
            gone = {k for k in ks if k in model.rows}
            assert n == len(gone), where
            model.step += bool(gone)  # an erase that removes rows advances the table step
            for k in gone:
                del model.rows[k]
            model.counts["erased"] += n
        ex = export_all(t)
        assert set(ex) == set(model.rows), where
        for k, row in model.rows.items():
            assert torch.equal(ex[k][0], row.emb), (where, k)
            assert torch.allclose(ex[k][1], row.state), (where, k)
            assert ex[k][2] == row.score, (where, k)
        s = t.stats()
        got = {name: getattr(s, name) for name in model.counts}
        assert got == model.counts, where
        assert s.size == len(model.rows) and s.step == model.step
    assert model.counts["evicted"] + model.counts["failed_inserts"] > 0  # the bucket was full


# ---------------------------------------------------------------- review follow-ups


def test_custom_lookup_score_is_used_by_training_lookups(make_table):
    t = make_table(score=dynemb.ScorePolicy.CUSTOM, on_full=dynemb.OnFull.COUNT)
    t.lookup_score = 1000
    t.lookup(torch.tensor([1, 2]), train=True)
    exp = t.export_batch(0, t.capacity())
    assert exp.scores.tolist() == [1000, 1000]
    t.lookup_score = 5  # a lower score: existing keys touched get it, no refusal of new ones
    t.lookup(torch.tensor([1, 3]), train=True)
    got = dict(zip(*(x.tolist() for x in (t.export_batch(0, t.capacity()).keys,
                                             t.export_batch(0, t.capacity()).scores))))
    assert got == {1: 5, 2: 1000, 3: 5}


def test_custom_scores_must_agree_for_a_repeated_key(make_table):
    t = make_table(score=dynemb.ScorePolicy.CUSTOM)
    t.find_or_insert(torch.tensor([7, 7]), scores=torch.tensor([3, 3]))  # agreeing: fine
    with pytest.raises(InputError, match="different scores"):
        t.find_or_insert(torch.tensor([8, 8]), scores=torch.tensor([3, 4]))
    with pytest.raises(InputError, match="integer scores"):
        t.find_or_insert(torch.tensor([9]), scores=torch.tensor([1.5]))


def test_insert_or_assign_does_not_record_autograd_history(make_table):
    t = make_table()
    p = torch.nn.Parameter(torch.ones(2, 4))
    t.insert_or_assign(torch.tensor([1, 2]), p)
    assert not t.rows.requires_grad and t.rows.grad_fn is None
    assert not t.find(torch.tensor([1])).values.requires_grad


def test_export_batch_refuses_non_int_ranges(make_table):
    t = make_table()
    for bad in ((0.5, 3), ("0", 3), (0, True), (-1, 2)):
        with pytest.raises(InputError, match="export_batch"):
            t.export_batch(*bad)


def test_apply_gradients_refuses_grads_of_another_shape_and_another_tables_lookup(make_table):
    """A gradient of the wrong shape once crashed the compiled kernels (they trust U rows), and
    another table's lookup updated this table's rows at its slot numbers: both are refused
    before anything changes."""
    t, other = make_table(capacity=64), make_table(capacity=64)
    keys = K(1, 2, 3)
    other.insert_or_assign(keys, torch.ones(3, 4))
    lk = t.lookup(keys, train=True, hold=True)
    rows, other_rows = t.find(keys).values.clone(), other.find(keys).values.clone()
    for bad in (torch.zeros(1, 4), torch.zeros(4, 4), torch.zeros(3, 3), torch.zeros(12),
                torch.zeros(3, 4, dtype=torch.int64), "grads"):
        spent = t.lookup(keys, train=True, hold=True)
        with pytest.raises(InputError, match=r"apply_gradients expects grads .* \(3, 4\)"):
            t.apply_gradients(spent, bad)
        assert not spent.held  # spent either way, as documented
    with pytest.raises(InputError, match="made by another table"):
        other.apply_gradients(lk, torch.ones(3, 4))
    assert torch.equal(t.find(keys).values, rows)
    assert torch.equal(other.find(keys).values, other_rows) and lk.held
    t.apply_gradients(lk, torch.ones(3, 4))  # its own table takes it
    assert not torch.equal(t.find(keys).values, rows) and t.held_rows() == 0


def test_a_row_scored_int64_min_is_a_row_not_a_free_slot(make_table):
    """The torch reference once sorted free slots by the int64 minimum, so a row holding that
    (valid CUSTOM) score tied with them and was taken for free: new keys failed where numba
    placed them. load_rows takes integer scores only (a NaN became that minimum)."""
    t = make_table(capacity=16, bucket_capacity=16, score=CUSTOM)
    t.find_or_insert(K(1), scores=K(-(2**63)))
    t.find_or_insert(K(*range(2, 17)), scores=torch.zeros(15, dtype=torch.int64))
    assert t.size() == 16 and bool(t.find(K(*range(1, 17))).found.all())
    r = t.find_or_insert(K(99), scores=K(0))  # full: evicts the lowest score, key 1
    assert r.evicted.keys.tolist() == [1] and t.size() == 16
    for bad in (torch.tensor([float("nan")]), torch.tensor([1.7]), torch.tensor([True])):
        with pytest.raises(InputError, match="load_rows expects integer scores"):
            t.load_rows(K(500), torch.ones(1, 4), torch.zeros(1, t.optimizer.state_width), bad)
    assert not bool(t.find(K(500)).found.any())
