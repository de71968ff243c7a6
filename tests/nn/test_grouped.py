"""Grouped tables (``dynemb.nn.grouped``): a collection whose tables run in one compiled call per
stage trains exactly as the same collection with every table called on its own.

The reference is the same model with its group switched off (``_group = False``: the per-table
path). Random collections (dims, optimizers, SUM and MEAN, several features per table, score
policies, HBM_ONLY and HYBRID, tables that fill up and evict or fail, batches in another feature
order, with or without per-id weights, 1-3 threads with every call split, by tables or inside
each table) must give the same outputs and leave the same rows, optimizer state, index, counters
and eviction logs; so must the rare cases a grouped table hands back to its own code: ids
without a row, rows erased between forward and backward, NaN gradients, a table that cannot
place its ids with ``on_full`` RAISE.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynemb
from dynemb.config import Storage, StorageMode
from dynemb.errors import CapacityError, InputError
from dynemb.kernels import threads
from dynemb.nn import grouped as grouped_module
from dynemb.nn.grouped import TableGroup, splits_well

OPTIMIZERS = (dynemb.SGD(lr=0.1, weight_decay=0.01), dynemb.Adagrad(lr=0.1),
              dynemb.RowWiseAdagrad(lr=0.1), dynemb.Adam(lr=0.01))
POLICIES = (dynemb.ScorePolicy.LRU, dynemb.ScorePolicy.LFU, dynemb.ScorePolicy.STEP,
            dynemb.ScorePolicy.NO_EVICTION)


def _pair(configs: list[dynemb.TableConfig]):
    """(grouped, per-table) collections of the same tables, initialised alike."""
    grouped = dynemb.EmbeddingBagCollection(configs)
    alone = dynemb.EmbeddingBagCollection(configs)
    alone._group = False
    for m in (grouped, alone):
        for t in m.tables.values():
            t.track_evictions()
    return grouped, alone


def _batch(g: torch.Generator, features: list[str], batch: int, span: int,
           max_len: int = 4, weighted: bool = False) -> dynemb.SparseBatch:
    lengths = torch.randint(0, max_len + 1, (len(features) * batch,), generator=g)
    n = int(lengths.sum())
    ids = (torch.rand(n, generator=g) ** 2 * span).long() * 7919 - span
    weights = torch.rand(n, generator=g, dtype=torch.float64) + 0.5 if weighted else None
    return dynemb.SparseBatch(features=features, values=ids, lengths=lengths, weights=weights)


def _step(model, batch: dynemb.SparseBatch, weight: torch.Tensor, between=None):
    out = model(batch)
    if between is not None:
        between(model)
    (out.values() * weight).sum().backward()
    return out.values().detach()


def _same_tables(a, b) -> None:
    for name, ta in a.tables.items():
        tb = b.tables[name]
        for what in ("keys", "scores", "digests", "written", "pins", "counts"):
            assert torch.equal(getattr(ta.index, what), getattr(tb.index, what)), (name, what)
        torch.testing.assert_close(ta.rows, tb.rows, rtol=0, atol=0, equal_nan=True)  # APPLY: NaN
        assert ta.stats() == tb.stats(), name
        assert ta.optimizer.step == tb.optimizer.step, name
        assert ta.step == tb.step, name
        assert torch.equal(ta.evicted_since(0), tb.evicted_since(0)), name


@st.composite
def _collections(draw):
    n = draw(st.integers(1, 4))
    configs, features = [], []
    for i in range(n):
        feats = [f"t{i}f{j}" for j in range(draw(st.integers(1, 2)))]
        features += feats
        policy = draw(st.sampled_from(POLICIES))
        hybrid = Storage(mode=StorageMode.HYBRID,
                         cache_load_factor=draw(st.sampled_from((0.25, 0.5))))
        configs.append(dynemb.TableConfig(
            storage=draw(st.sampled_from((Storage(), hybrid))),
            name=f"t{i}", dim=draw(st.sampled_from((3, 8, 16))), features=feats,
            capacity=draw(st.sampled_from((32, 64, 512))), bucket_capacity=8,
            optimizer=draw(st.sampled_from(OPTIMIZERS)), score=policy,
            pooling=draw(st.sampled_from(tuple(dynemb.PoolingMode))),
            on_full=(dynemb.OnFull.COUNT if policy == dynemb.ScorePolicy.NO_EVICTION
                     else draw(st.sampled_from((dynemb.OnFull.RAISE, dynemb.OnFull.COUNT))))))
    order = draw(st.permutations(features))
    return configs, list(order)


def _split(n_threads: int, by_tables: bool = False, least: int = 1):
    """Every grouped call split over ``n_threads`` parts: by tables, or inside each table that
    has ``least`` ids per part (the others run whole, a run of them in one call)."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(threads, "MIN_PER_PART", least))
    stack.enter_context(mock.patch.object(torch, "get_num_threads", return_value=n_threads))
    stack.enter_context(mock.patch.object(grouped_module, "splits_well",
                                          return_value=by_tables))
    return stack


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_collections(), st.integers(1, 3), st.sampled_from(["tables", "inside", "some inside"]),
       st.integers(0, 2**16), st.booleans())
def test_grouped_training_is_the_per_table_training(spec, n_threads, split, seed, weighted):
    configs, order = spec
    grouped, alone = _pair(configs)
    g = torch.Generator().manual_seed(seed)
    width = sum(c.dim * len(c.features) for c in configs)
    with _split(n_threads, split == "tables", 8 if split == "some inside" else 1):
        for _ in range(4):
            batch = _batch(g, order, 6, 300, weighted=weighted)
            w = torch.randn(6, width, generator=g)
            outs = []
            for model in (grouped, alone):  # small tables with on_full RAISE may refuse
                try:
                    outs.append(_step(model, batch, w))
                except CapacityError as e:
                    outs.append(str(e))
            assert type(outs[0]) is type(outs[1])
            assert outs[0] == outs[1] if isinstance(outs[0], str) else torch.equal(*outs)
    assert isinstance(grouped._group, TableGroup)
    _same_tables(grouped, alone)


def _configs(**kw) -> list[dynemb.TableConfig]:
    base = dict(capacity=256, bucket_capacity=8, optimizer=dynemb.Adam(lr=0.01))
    base.update(kw)
    return [dynemb.TableConfig(name="a", dim=4, features=["fa", "fb"], **base),
            dynemb.TableConfig(name="b", dim=8, features=["fc"], **base),
            dynemb.TableConfig(name="c", dim=4, features=["fd"], **base)]


FEATURES = ["fa", "fb", "fc", "fd"]


def _run_both(configs, steps, between=None, weight=None, span=300):
    """Runs ``_run_both_now`` on one thread, then with the grouped calls split inside each
    table over 3 threads; returns the second run's collections."""
    _run_both_now(configs, steps, between, weight, span)
    with _split(3):
        return _run_both_now(configs, steps, between, weight, span)


def _run_both_now(configs, steps, between=None, weight=None, span=300):
    grouped, alone = _pair(configs)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batch = _batch(g, FEATURES, 8, span)
        w = torch.randn(8, 20, generator=g) if weight is None else weight
        assert torch.equal(_step(grouped, batch, w, between), _step(alone, batch, w, between))
    _same_tables(grouped, alone)
    return grouped, alone


def test_ids_without_a_row_fall_back_to_the_table_alone():
    # capacity 16, no eviction: most ids get no row (eval-initializer rows, counted)
    grouped, _ = _run_both(_configs(capacity=16, score=dynemb.ScorePolicy.NO_EVICTION,
                                    on_full=dynemb.OnFull.COUNT), 3)
    assert all(t.stats().failed_inserts > 0 for t in grouped.tables.values())


def test_rows_erased_between_forward_and_backward():
    def erase(model):
        for t in model.tables.values():
            t.erase(t.export_batch(0, t.capacity()).keys[::2])
    grouped, _ = _run_both(_configs(), 3, between=erase)
    assert all(t.stats().stale_updates > 0 for t in grouped.tables.values())


@pytest.mark.parametrize("rule", [dynemb.NonFinite.SKIP, dynemb.NonFinite.APPLY])
def test_non_finite_gradients_follow_the_table_rule(rule):
    w = torch.ones(8, 20)
    w[3, 8:16] = float("nan")  # table b's columns: its gradient holds NaN
    grouped, _ = _run_both(_configs(nonfinite=rule), 2, weight=w)
    stats = {n: t.stats().nonfinite_grads for n, t in grouped.tables.items()}
    assert stats["b"] > 0 and stats["a"] == stats["c"] == 0


@pytest.mark.parametrize("n_threads, by_tables, least",
                         [(1, True, 1), (3, True, 1), (3, False, 1), (3, False, 1000)])
def test_a_table_that_cannot_place_its_ids_raises_and_the_next_ones_are_untouched(n_threads,
                                                                                  by_tables,
                                                                                  least):
    # with 3 threads, table c's lookup runs beside b's and is undone when b fails; split inside
    # each table, c is never looked up
    configs = [dataclasses.replace(c, threads=n_threads) for c in _configs()]
    configs[1] = dataclasses.replace(configs[1], capacity=16,
                                     score=dynemb.ScorePolicy.NO_EVICTION)
    grouped, alone = _pair(configs)
    g = torch.Generator().manual_seed(2)
    lengths = torch.cat([torch.randint(1, 4, (24,), generator=g), torch.full((8,), 6)])
    ids = torch.randint(0, 10**6, (int(lengths.sum()),), generator=g)
    batch = dynemb.SparseBatch(features=FEATURES, values=ids, lengths=lengths)
    with _split(n_threads, by_tables, least):
        for model in (grouped, alone):
            with pytest.raises(CapacityError, match="table 'b'"):
                model(batch)
        if least == 1:
            assert len(grouped._group.spans(grouped._group.ids(batch)[-1])) == n_threads
    _same_tables(grouped, alone)
    assert grouped.tables["a"].step == 1 and grouped.tables["c"].step == 0
    assert grouped.tables["c"].size() == 0


def test_threads_split_the_group_by_tables():
    configs = [dynemb.TableConfig(name=f"t{i}", dim=8, features=[f"f{i}"], capacity=4096,
                                  optimizer=dynemb.RowWiseAdagrad(lr=0.1), threads=3)
               for i in range(5)]
    grouped, alone = _pair(configs)
    g = torch.Generator().manual_seed(3)
    feats = [f"f{i}" for i in range(5)]
    for _ in range(3):
        batch = _batch(g, feats, 600, 5000)  # 5 x ~1200 ids: split over 3 parts
        w = torch.randn(600, 40, generator=g)
        assert torch.equal(_step(grouped, batch, w), _step(alone, batch, w))
    spans = grouped._group.spans(torch.arange(0, 7000, 1200).numpy()[:6])
    assert len(spans) == 3 and spans[0][0] == 0 and spans[-1][1] == 5
    _same_tables(grouped, alone)


def test_a_table_too_big_to_share_threads_is_split_inside():
    # one table holds most ids: 2 threads gain more inside it than across tables
    configs = [dynemb.TableConfig(name=f"t{i}", dim=8, features=[f"f{i}"], capacity=1 << 14,
                                  optimizer=dynemb.SGD(lr=0.1), threads=2) for i in range(3)]
    grouped, alone = _pair(configs)
    g = torch.Generator().manual_seed(8)
    lengths = torch.cat([torch.full((1000,), 3), torch.ones(2000, dtype=torch.int64)])
    batch = dynemb.SparseBatch(features=["f0", "f1", "f2"], lengths=lengths,
                               values=torch.randint(0, 10**6, (5000,), generator=g))
    calls = []
    split, whole = grouped_module.gnb.probe_part, grouped_module.gnb.lookup

    def probe_part(t, p, *args):
        calls.append(("part", t, p))
        return split(t, p, *args)

    def lookup(lo, hi, *args):
        calls.append(("whole", lo, hi))
        return whole(lo, hi, *args)

    w = torch.randn(1000, 24, generator=g)
    with mock.patch.object(grouped_module.gnb, "probe_part", probe_part), \
            mock.patch.object(grouped_module.gnb, "lookup", lookup):
        assert torch.equal(_step(grouped, batch, w), _step(alone, batch, w))
    # tables 1 and 2 (1000 ids each) are not worth two parts: one call looks both up
    assert sorted(calls) == [("part", 0, 0), ("part", 0, 1), ("whole", 1, 3)]
    _same_tables(grouped, alone)
    assert splits_well(np.array([0, 3000, 4000]), 1)
    assert not splits_well(np.array([0, 3000, 4000]), 2)
    assert splits_well(np.array([0, 2000, 4000]), 2)


def test_tables_outside_the_group_keep_their_columns():
    caching = Storage(mode=StorageMode.CACHING, cache_load_factor=0.5)
    configs = _configs()
    configs[1] = dynemb.TableConfig(name="b", dim=8, features=["fc"], capacity=256,
                                    bucket_capacity=8, optimizer=dynemb.Adam(lr=0.01),
                                    storage=caching)
    grouped, _ = _run_both(configs, 3)
    assert [t.name for t in grouped._group.tables] == ["a", "c"]


def test_steps_that_do_not_train_and_weights_that_learn_run_per_table():
    grouped, alone = _pair(_configs())
    g = torch.Generator().manual_seed(4)
    batch = _batch(g, FEATURES, 8, 300)
    with torch.no_grad():
        assert torch.equal(grouped(batch).values(), alone(batch).values())
    assert grouped._group is None  # never needed
    wgrads = []
    for model in (grouped, alone):  # the weights' gradient comes from the per-table path
        weights = torch.rand(batch.values.numel(), generator=torch.Generator().manual_seed(5),
                             requires_grad=True)
        weighted = dynemb.SparseBatch(features=FEATURES, values=batch.values,
                                      lengths=batch.lengths, weights=weights)
        _step(model, weighted, torch.ones(8, 20))
        wgrads.append(weights.grad)
    assert torch.equal(*wgrads)
    assert grouped._group is None
    _same_tables(grouped, alone)


def test_a_mutated_batch_is_refused_as_the_table_refuses_it():
    grouped, alone = _pair(_configs())
    g = torch.Generator().manual_seed(5)
    batch = _batch(g, FEATURES, 8, 300)
    batch.lengths[0] += 1  # no longer matches the ids
    for model in (grouped, alone):
        with pytest.raises(InputError, match="table 'a'.*no longer match"):
            model(batch).values().sum().backward()


def test_a_copied_collection_makes_its_own_group():
    import copy

    grouped, _ = _run_both(_configs(), 1)
    twin = copy.deepcopy(grouped)
    assert twin._group is None
    batch = _batch(torch.Generator().manual_seed(6), FEATURES, 8, 300)
    twin(batch).values().sum().backward()
    assert twin._group.tables[0] is twin.tables["a"]


def test_a_loaded_state_trains_grouped_as_per_table():
    # loading copies into the tables' arrays: the group's views of them stay valid
    grouped, alone = _run_both(_configs(), 2)
    state = {k: v.clone() for k, v in alone.state_dict().items()}
    alone.load_state_dict(state)
    grouped.load_state_dict(state)
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        batch = _batch(g, FEATURES, 8, 300)
        w = torch.randn(8, 20, generator=g)
        assert torch.equal(_step(grouped, batch, w), _step(alone, batch, w))
    _same_tables(grouped, alone)


@pytest.mark.parametrize("bad_columns", [slice(8, 16), slice(0, 20)])
def test_a_raising_nonfinite_rule_stops_where_the_tables_one_by_one_stop(bad_columns):
    # backwards run last table first: the tables after the one that raises are updated, the
    # ones before it not, whichever path runs them
    configs = _configs(nonfinite=dynemb.NonFinite.RAISE)
    grouped, alone = _pair(configs)
    batch = _batch(torch.Generator().manual_seed(9), FEATURES, 8, 300)
    w = torch.ones(8, 20)
    w[2, bad_columns] = float("inf")
    errors = []
    for model in (grouped, alone):
        out = model(batch).values()
        with pytest.raises(InputError) as e:
            (out * w).sum().backward()
        errors.append(str(e.value))
    assert errors[0] == errors[1]
    _same_tables(grouped, alone)


def test_a_batch_changed_between_forward_and_backward_changes_nothing():
    # the step keeps its own copies of the ids and lengths, as a table's lookup does
    grouped, alone = _pair(_configs())
    for model in (grouped, alone):
        batch = _batch(torch.Generator().manual_seed(10), FEATURES, 8, 300)
        out = model(batch).values()
        batch.lengths[0] = 1 << 40
        batch.values.zero_()
        out.sum().backward()
    _same_tables(grouped, alone)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_second_order_backward_trains_as_per_table():
    grouped, alone = _pair(_configs())
    batch = _batch(torch.Generator().manual_seed(11), FEATURES, 8, 300)
    for model in (grouped, alone):
        (model(batch).values() ** 2).sum().backward(create_graph=True)
    _same_tables(grouped, alone)


def test_the_reserved_key_is_refused_naming_its_table():
    batch = _batch(torch.Generator().manual_seed(12), FEATURES, 8, 300)
    batch.values[-1] = dynemb.EMPTY_KEY  # table c's last id
    for model in _pair(_configs()):
        with pytest.raises(InputError, match="table 'c': lookup: found the reserved empty key"):
            model(batch)


def test_an_interrupt_inside_a_split_table_leaves_the_tables_before_it_done():
    # split inside, the tables run one after another: those done before the interrupt are
    # looked up, finished and counted, as table by table; the ones after it are untouched
    grouped, alone = _pair(_configs())
    batch = _batch(torch.Generator().manual_seed(13), FEATURES, 8, 300)
    owners = grouped_module.gnb.owners

    def interrupted(t, *args):
        if t == 1:
            raise KeyboardInterrupt
        return owners(t, *args)

    with _split(2):
        with mock.patch.object(grouped_module.gnb, "owners", interrupted), \
                pytest.raises(KeyboardInterrupt):
            grouped(batch)
        with mock.patch.object(alone.tables["b"], "lookup", side_effect=KeyboardInterrupt), \
                pytest.raises(KeyboardInterrupt):
            alone(batch)
    assert grouped.tables["a"].step == 1 and grouped.tables["a"].size() > 0
    _same_tables(grouped, alone)
