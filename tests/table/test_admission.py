"""Frequency admission through DynamicTable.lookup(train=True), against a counting model."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

import dynemb
from dynemb import Admission, Initializer, InitKind, OnFull

HALF = Initializer(kind=InitKind.CONSTANT, value=0.5)


def K(*ks: int) -> torch.Tensor:
    return torch.tensor(ks, dtype=torch.int64)


def has_row(t: dynemb.DynamicTable, k: int) -> bool:
    return bool(t.find(K(k)).found[0])


def lookup_rows(t: dynemb.DynamicTable, ks) -> tuple[torch.Tensor, torch.Tensor]:
    """(has a row per occurrence, embedding per occurrence) of a training lookup."""
    lk = t.lookup(K(*ks), train=True)
    return lk.unique_slots[lk.inverse] >= 0, t.embeddings(lk)[lk.inverse]


@pytest.fixture
def adm_table(make_table):
    def make(threshold=3, counter_capacity=1024, **kw):
        kw.setdefault("capacity", 256)
        kw.setdefault("eval_initializer", HALF)
        adm = Admission(threshold=threshold, counter_capacity=counter_capacity)
        return make_table(admission=adm, **kw)
    return make


def test_key_gets_a_row_on_the_lookup_reaching_the_threshold(adm_table):
    t = adm_table(threshold=3)
    ok, emb = lookup_rows(t, [5])
    assert ok.tolist() == [False]
    assert torch.equal(emb[0], torch.full((4,), 0.5))
    assert not has_row(t, 5) and t.size() == 0
    assert t.stats().admission_rejected == 1
    ok, emb = lookup_rows(t, [5])
    assert ok.tolist() == [False] and not has_row(t, 5)
    assert t.stats().admission_rejected == 2
    lk = t.lookup(K(5), train=True)           # the third occurrence: admitted
    assert lk.inserted.tolist() == [True]
    assert (lk.unique_slots >= 0).all() and has_row(t, 5)
    emb = t.embeddings(lk)
    assert not torch.equal(emb[0], torch.full((4,), 0.5))
    s = t.stats()
    assert (s.admission_rejected, s.inserted, s.size) == (2, 1, 1)
    # From then on it is a hit and never counted again.
    t.lookup(K(5, 5), train=True)
    assert t.stats().admission_rejected == 2 and t.stats().hits == 2


def test_duplicates_in_one_batch_count(adm_table):
    t = adm_table(threshold=3)
    ok, _ = lookup_rows(t, [7, 8, 7])          # 7: 2, 8: 1
    assert ok.tolist() == [False, False, False]
    assert t.stats().admission_rejected == 3
    ok, _ = lookup_rows(t, [9, 9, 9, 7, 8])     # 9: 3 -> row, 7: 3 -> row, 8: 2
    assert ok.tolist() == [True, True, True, True, False]
    assert has_row(t, 9) and has_row(t, 7) and not has_row(t, 8)
    assert t.stats().admission_rejected == 4


def test_admitted_row_is_the_initializer_row(adm_table, make_table):
    t = adm_table(threshold=2)
    lookup_rows(t, [42])
    _, emb = lookup_rows(t, [42])
    plain = make_table(capacity=256)
    assert torch.equal(emb[0], plain.find_or_insert(K(42)).values[0])


def test_find_or_insert_and_insert_or_assign_bypass_admission(adm_table):
    t = adm_table(threshold=5)
    r = t.find_or_insert(K(1, 2))
    assert r.inserted.tolist() == [True, True] and has_row(t, 1) and has_row(t, 2)
    t.insert_or_assign(K(3), torch.ones(1, 4))
    assert has_row(t, 3)
    assert t.stats().admission_rejected == 0 and t.size() == 3


def test_eval_lookups_do_not_count(adm_table):
    t = adm_table(threshold=2)
    for _ in range(3):
        lk = t.lookup(K(11, 11), train=False)
        assert (lk.unique_slots < 0).all()
    assert t.stats().admission_rejected == 0
    ok, _ = lookup_rows(t, [11])                # the first counted occurrence
    assert ok.tolist() == [False]
    ok, _ = lookup_rows(t, [11])
    assert ok.tolist() == [True]


def test_a_key_erased_after_admission_counts_again(adm_table):
    t = adm_table(threshold=2)
    lookup_rows(t, [5])
    assert lookup_rows(t, [5])[0].tolist() == [True]
    assert t.erase(K(5)) == 1
    assert lookup_rows(t, [5])[0].tolist() == [False]   # counting restarts at 1
    assert lookup_rows(t, [5])[0].tolist() == [True]


def test_threshold_one_admits_at_first_sight(adm_table):
    t = adm_table(threshold=1, counter_capacity=1024)
    ok, _ = lookup_rows(t, [1, 2, 2, 3])
    assert ok.all() and t.size() == 3 and t.stats().admission_rejected == 0


def test_threshold_one_admits_more_new_keys_than_the_counter_table_holds(adm_table):
    """threshold=1 means "no filter": a batch with more distinct new keys than the counter
    table has slots must still give every key a row."""
    t = adm_table(threshold=1, counter_capacity=8)
    ks = list(range(100, 120))
    ok, _ = lookup_rows(t, ks)
    assert ok.all(), f"{int((~ok).sum())} of {len(ks)} keys got no row"
    assert t.size() == 20 and t.stats().admission_rejected == 0


def test_key_reaching_threshold_in_one_batch_with_many_other_new_keys(adm_table):
    """Key 7 occurs twice (threshold 2) after 10 other new keys in one batch; the counter table
    has 8 slots. Its occurrences must still be counted and admit it."""
    t = adm_table(threshold=2, counter_capacity=8)
    ks = list(range(100, 110)) + [7, 7]
    ok, _ = lookup_rows(t, ks)
    assert ok[-2:].tolist() == [True, True]
    assert has_row(t, 7)


def test_counter_table_evicts_its_least_counted_key(adm_table):
    t = adm_table(threshold=3, counter_capacity=8)
    assert t.admission.index.num_slots == 8
    others = list(range(101, 108))                 # 7 keys, counted twice each
    lookup_rows(t, others)
    lookup_rows(t, others)
    lookup_rows(t, [1])                            # key 1: count 1; the counter table is full
    assert t.stats().counter_evictions == 0 and t.admission.size() == 8
    lookup_rows(t, [2])                            # evicts the least-counted key: 1
    assert t.stats().counter_evictions == 1
    lookup_rows(t, [1])                            # 1 starts again at 1 (evicting 2)
    assert t.stats().counter_evictions == 2
    assert lookup_rows(t, [1])[0].tolist() == [False]   # 2 < 3: still no row
    assert lookup_rows(t, [1])[0].tolist() == [True]    # 3: admitted
    # The others kept their count of 2: one more occurrence admits each.
    assert lookup_rows(t, others)[0].all()
    assert t.stats().counter_evictions == 2
    assert t.stats().admission_rejected == 7 * 2 + 1 + 1 + 1 + 1


def test_admission_counts_match_a_counting_model(adm_table):
    """Random training lookups: a key without a row gets one on the lookup where its total
    occurrences (since it last had a row) reach the threshold; every other occurrence of a
    key without a row is rejected and counted."""
    thr = 3
    t = adm_table(threshold=thr, capacity=512)
    rng = random.Random(5)
    counts: Counter[int] = Counter()
    rows: set[int] = set()
    rejected = 0
    for _ in range(60):
        ks = [rng.randrange(40) for _ in range(rng.randint(1, 8))]
        ok, _ = lookup_rows(t, ks)
        batch = Counter(k for k in ks if k not in rows)
        want = []
        admitted = set()
        for k, c in batch.items():
            counts[k] += c
            if counts[k] >= thr:
                admitted.add(k)
                del counts[k]
            else:
                rejected += c
        for k in ks:
            want.append(k in rows or k in admitted)
        rows |= admitted
        assert ok.tolist() == want, ks
        assert t.stats().admission_rejected == rejected
        assert t.size() == len(rows)
        if rng.random() < 0.1 and rows:
            k = rng.choice(sorted(rows))
            t.erase(K(k))
            rows.discard(k)
    assert t.stats().counter_evictions == 0
    assert len(rows) > 10 and rejected > 20


def test_admitted_key_into_a_full_no_eviction_table_is_a_failed_insert(adm_table):
    t = adm_table(threshold=1, capacity=8, score=dynemb.ScorePolicy.NO_EVICTION,
                  on_full=OnFull.COUNT)
    lookup_rows(t, range(1, 9))
    ok, emb = lookup_rows(t, [50])
    assert ok.tolist() == [False]
    assert torch.equal(emb[0], torch.full((4,), 0.5))
    s = t.stats()
    assert s.failed_inserts == 1 and s.admission_rejected == 0 and s.size == 8


def test_sightings_lost_to_a_full_counter_table_are_counted(adm_table):
    """The two places sightings vanish: a key that finds no room in the counter table (every
    slot of its bucket holds a key of the same call: judged on the call alone, then forgotten),
    and a counter evicted to make room (its count is lost). Both are counted."""
    t = adm_table(threshold=5, counter_capacity=8)
    assert t.admission.index.num_slots == 8
    ks = list(range(100, 110))                     # 10 distinct new keys, 8 counter slots
    lookup_rows(t, ks + ks[:3])                    # 100..102 seen twice
    s = t.stats()
    assert t.admission.size() == 8
    counted = dict(zip(*(x.tolist() for x in t.admission.export())))
    lost = sum(ks.count(k) + ks[:3].count(k) for k in ks if k not in counted)
    assert s.counter_overflows == lost == 2       # two keys seen once each found no slot
    assert s.forgotten_sightings == 2 and s.counter_evictions == 0
    assert sum(counted.values()) + lost == len(ks) + 3   # every sighting: kept or counted lost
    lookup_rows(t, [999])                          # evicts a least-counted counter
    s = t.stats()
    assert s.counter_evictions == 1 and s.counter_overflows == 2
    gone = set(counted) - set(t.admission.export()[0].tolist())
    assert len(gone) == 1 and counted[min(gone)] == min(counted.values())
    assert s.forgotten_sightings == 2 + counted[gone.pop()]
    assert s.admission_rejected == len(ks) + 3 + 1


def test_admitted_key_that_found_no_row_stays_admissible(adm_table):
    """With on_full COUNT, a key admitted into a full table keeps its count (it is counted,
    not forgotten) and gets its row as soon as there is room."""
    t = adm_table(threshold=2, capacity=8, score=dynemb.ScorePolicy.NO_EVICTION,
                  on_full=OnFull.COUNT)
    t.find_or_insert(K(*range(1, 9)))              # full
    lookup_rows(t, [50])
    assert lookup_rows(t, [50])[0].tolist() == [False]   # admitted (2), but no room
    assert t.stats().failed_inserts == 1
    t.erase(K(1))
    assert lookup_rows(t, [50])[0].tolist() == [True]    # still admissible: gets the row


def test_loading_counters_keeps_the_highest_that_fit_or_refuses_whole(adm_table):
    """Admission.load never evicts a counter: all or nothing, or with ``partial`` (a checkpoint
    resharded onto fewer ranks, whose counter tables are smaller in all) what fits, the highest
    counts first, without counting the misses as lookups' overflows."""
    t = adm_table(threshold=50, counter_capacity=16)  # one bucket of 16 counters
    keys = torch.arange(100, 140)
    counts = torch.arange(40) % 7 + torch.arange(40)
    with pytest.raises(dynemb.errors.CapacityError, match="24 keys do not fit"):
        t.admission.load(keys, counts)
    assert t.admission.size() == 0
    assert t.admission.load(keys, counts, partial=True) == 24
    kept, kept_counts = t.admission.export()
    top = torch.argsort(counts, descending=True, stable=True)[:16]
    assert sorted(kept.tolist()) == sorted(keys[top].tolist())
    assert sorted(kept_counts.tolist()) == sorted(counts[top].tolist())
    assert t.admission.counter_overflows == 0
