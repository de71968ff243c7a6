"""Property tests: random operation sequences on a small table against a Python dict model.

The model predicts exactly which keys are found, inserted, failed and how many are evicted per
bucket (processing new keys in order of first occurrence, as both backends do), and every score;
among rows of equal score the evicted one is free, so evictions are checked as "the lowest
scores of the bucket's rows not used by this call". Both kernel backends run the same sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import dynemb
from dynemb.errors import CapacityError
from dynemb.kernels import triton_index
from dynemb.kernels.hashing import bucket_of, index_hash

CAPACITY, WIDTH, DIM = 16, 8, 2  # two buckets: the 40-key pool overflows them
POOL = [0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, -1, -7, 2**62, -(2**63) + 1, 2**63 - 1,
        *range(100, 124)]

keys_st = st.lists(st.sampled_from(POOL), min_size=0, max_size=24)
op_st = st.one_of(
    st.tuples(st.just("find_or_insert"), keys_st),
    st.tuples(st.just("find"), keys_st),
    st.tuples(st.just("assign"), keys_st.map(lambda ks: list(dict.fromkeys(ks)))),
    st.tuples(st.just("erase"), keys_st),
    st.tuples(st.just("eval"), keys_st),
)


def bucket(key: int) -> int:
    return int(bucket_of(index_hash(torch.tensor([key])), CAPACITY // WIDTH)[0])


@dataclass
class Model:
    policy: dynemb.ScorePolicy
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    scores: dict[int, int] = field(default_factory=dict)
    step: int = 0

    def in_bucket(self, b: int) -> list[int]:
        return [k for k in self.values if bucket(k) == b]

    def touch(self, keys: list[int]) -> None:
        for k in keys:
            if k in self.values:
                if self.policy == dynemb.ScorePolicy.LFU:
                    self.scores[k] += 1
                else:
                    self.scores[k] = self.step

    def plan_inserts(self, keys: list[int]):
        """Which new keys get a row, which fail, and how many rows each bucket evicts."""
        pinned = {k for k in keys if k in self.values}
        new = [k for k in dict.fromkeys(keys) if k not in self.values]
        by_bucket: dict[int, list[int]] = {}
        for k in new:
            by_bucket.setdefault(bucket(k), []).append(k)
        inserted, failed, evictions = [], [], {}
        for b, ks in by_bucket.items():
            here = self.in_bucket(b)
            free = WIDTH - len(here)
            evictable = 0 if self.policy == dynemb.ScorePolicy.NO_EVICTION else \
                len([k for k in here if k not in pinned])
            take = min(len(ks), free + evictable)
            inserted += ks[:take]
            failed += ks[take:]
            evictions[b] = max(0, take - free)
        return pinned, inserted, failed, evictions

    def apply_insert(self, keys, result_values, evicted_keys, pinned, inserted, evictions):
        for b, n in evictions.items():
            ev = [k for k in evicted_keys if bucket(k) == b]
            assert len(ev) == n, f"bucket {b}: evicted {len(ev)}, expected {n}"
            unpinned = [k for k in self.in_bucket(b) if k not in pinned]
            assert set(ev) <= set(unpinned), "evicted a key the call itself used"
            rest = [self.scores[k] for k in unpinned if k not in ev]
            if ev and rest:
                assert max(self.scores[k] for k in ev) <= min(rest), "did not evict lowest scores"
        assert len(evicted_keys) == sum(evictions.values())
        for k in evicted_keys:
            del self.values[k], self.scores[k]
        for k in inserted:
            self.values[k] = result_values[keys.index(k)].clone()
            self.scores[k] = keys.count(k) if self.policy == dynemb.ScorePolicy.LFU else self.step


def check_contents(table: dynemb.DynamicTable, model: Model) -> None:
    exp = table.export_batch(0, table.capacity())
    got = dict(zip(exp.keys.tolist(), range(exp.keys.numel())))
    assert set(got) == set(model.values), "table keys differ from the model"
    assert table.size() == len(model.values)
    for k, i in got.items():
        assert torch.equal(exp.embeddings[i], model.values[k]), f"row of {k} changed"
        assert int(exp.scores[i]) == model.scores[k], f"score of {k}"


def run_ops(backend: str, policy: dynemb.ScorePolicy, ops, report=lambda _: None,
            on_full: dynemb.OnFull = dynemb.OnFull.COUNT) -> None:
    """Runs ``ops`` on a table and the model. With ``on_full`` RAISE a call in which the model
    predicts a failed key must raise and leave the table exactly as it was (the model is not
    advanced: ``check_contents`` compares every key, row and score)."""
    cfg = dynemb.TableConfig(name="p", dim=DIM, features=["f"], capacity=CAPACITY,
                             bucket_capacity=WIDTH, score=policy, on_full=on_full)
    table = dynemb.DynamicTable(cfg, backend=backend)
    model = Model(policy)
    zeros = torch.zeros(DIM)
    for op, keys in ops:
        t = torch.tensor(keys, dtype=torch.int64)
        if op in ("find", "eval"):
            if op == "find":
                res = table.find(t)
                vals, found = res.values, res.found
            else:
                vals, found = _eval(table, t)
            for i, k in enumerate(keys):
                assert bool(found[i]) == (k in model.values)
                assert torch.equal(vals[i], model.values.get(k, zeros))
        elif op == "erase":
            n = table.erase(t)
            gone = set(keys) & set(model.values)
            assert n == len(gone)
            model.step += bool(gone)  # an erase that removes rows is a write: a table step
            for k in gone:
                del model.values[k], model.scores[k]
        else:
            pinned, inserted, failed, evictions = model.plan_inserts(keys)
            before = table.stats().failed_inserts
            if failed and on_full == dynemb.OnFull.RAISE:
                step = table.step
                with pytest.raises(CapacityError, match="changed nothing"):
                    if op == "find_or_insert":
                        table.find_or_insert(t)
                    else:
                        table.insert_or_assign(t, torch.randn(len(keys), DIM))
                report("raised")
                assert table.stats().failed_inserts - before == sum(keys.count(k) for k in failed)
                assert table.step == step
                check_contents(table, model)
                continue
            model.step += 1
            model.touch(keys)
            if op == "find_or_insert":
                res = table.find_or_insert(t)
                evicted, values = res.evicted, res.values
                for i, k in enumerate(keys):
                    if k in model.values:
                        assert torch.equal(values[i], model.values[k])
                assert sorted(t[res.inserted].tolist()) == sorted(inserted)
            else:
                values = torch.randn(len(keys), DIM)
                evicted = table.insert_or_assign(t, values)
            for i, k in enumerate(evicted.keys.tolist()):
                assert torch.equal(evicted.embeddings[i], model.values[k])
                assert int(evicted.scores[i]) == model.scores[k]
            model.apply_insert(keys, values, evicted.keys.tolist(), pinned, inserted, evictions)
            if op == "assign":
                for i, k in enumerate(keys):
                    if k in model.values:
                        model.values[k] = values[i].clone()
            n_failed = sum(keys.count(k) for k in failed)
            report(f"evicted={len(evicted) > 0}, failed={n_failed > 0}")
            assert table.stats().failed_inserts - before == n_failed
        check_contents(table, model)


def _eval(table, t):
    lk = table.lookup(t, train=False)
    vals = table.embeddings(lk)[lk.inverse]
    return vals, (lk.unique_slots >= 0)[lk.inverse]


@pytest.mark.parametrize("policy", [dynemb.ScorePolicy.LRU, dynemb.ScorePolicy.LFU,
                                    dynemb.ScorePolicy.NO_EVICTION])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op_st, min_size=1, max_size=25))
def test_random_operations_match_dict_model(backend, policy, ops):
    run_ops(backend, policy, ops, report=event)


@pytest.mark.parametrize("policy", [dynemb.ScorePolicy.LRU, dynemb.ScorePolicy.LFU,
                                    dynemb.ScorePolicy.NO_EVICTION])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op_st, min_size=1, max_size=25))
def test_random_operations_with_on_full_raise_are_atomic(backend, policy, ops):
    """Every call either does exactly what the model predicts or, when a key would fail,
    raises CapacityError and changes no key, row or score (and not the step)."""
    run_ops(backend, policy, ops, report=event, on_full=dynemb.OnFull.RAISE)


@pytest.mark.skipif(not triton_index.available(torch.device("cpu")),
                    reason="Triton's interpreter is off (tests/test_gpu.py runs it on CUDA)")
@pytest.mark.parametrize("on_full", [dynemb.OnFull.COUNT, dynemb.OnFull.RAISE])
@pytest.mark.parametrize("policy", [dynemb.ScorePolicy.LRU, dynemb.ScorePolicy.LFU])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_st, min_size=1, max_size=12))
def test_random_operations_on_the_triton_backend_match_dict_model(policy, on_full, ops):
    """The same model for the Triton kernels (in its interpreter: fewer, shorter sequences)."""
    run_ops("triton", policy, ops, report=event, on_full=on_full)


def test_model_sees_evictions():
    """The sequences above do reach full buckets: a fixed sequence that must evict."""
    keys = list(range(200, 200 + 3 * CAPACITY))
    ops = [("find_or_insert", keys[i:i + 8]) for i in range(0, len(keys), 8)]
    for backend in ("numba", "torch"):
        run_ops(backend, dynemb.ScorePolicy.LRU, ops)
        table = dynemb.DynamicTable(dynemb.TableConfig(
            name="p", dim=DIM, features=["f"], capacity=CAPACITY, bucket_capacity=WIDTH),
            backend=backend)
        for _, ks in ops:
            table.find_or_insert(torch.tensor(ks))
        assert table.stats().evicted > 0
