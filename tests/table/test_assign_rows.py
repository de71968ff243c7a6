"""insert_or_assign writes every new row's embedding itself: it draws none, and its rows are
the ones a drawn-then-overwritten row would be (every storage mode, numba and torch)."""

from __future__ import annotations

import pytest
import torch

import dynemb

MODES = [dynemb.Storage(),
         dynemb.Storage(mode=dynemb.StorageMode.HYBRID, cache_load_factor=0.5),
         dynemb.Storage(mode=dynemb.StorageMode.CACHING, cache_load_factor=0.3)]


def _table(storage, backend, **kw):
    cfg = dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=32, bucket_capacity=8,
                             storage=storage, optimizer=dynemb.Adam(lr=0.1), **kw)
    return dynemb.DynamicTable(cfg, backend=backend)


def _draws(t, monkeypatch) -> list:
    """The initializer of every call that initialises rows."""
    seen = []
    for be in {id(b): b for b in (t.store.backend, t.store.ddr_backend)}.values():
        original = be.init_rows

        def spy(dst, dst_rows, keys, dim, state_value, init, mix, _f=original):
            seen.append(init.kind)
            return _f(dst, dst_rows, keys, dim, state_value, init, mix)

        monkeypatch.setattr(be, "init_rows", spy)
    return seen


@pytest.mark.parametrize("storage", MODES, ids=["hbm_only", "hybrid", "caching"])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_new_rows_of_insert_or_assign_are_the_values_and_the_initial_state(storage, backend,
                                                                           monkeypatch):
    t = _table(storage, backend)
    keys = torch.arange(20) * 7
    t.find_or_insert(keys[:8])  # some exist, with state of their own after an update
    lk = t.lookup(keys[:8], train=True)
    t.apply_gradients(lk, torch.ones(lk.unique_keys.numel(), 4))
    before = t.export_batch(0, t.capacity())
    old_state = dict(zip(before.keys.tolist(), before.optimizer_state))
    seen = _draws(t, monkeypatch)
    values = torch.randn(20, 4)
    t.insert_or_assign(keys, values)
    assert seen and all(k == dynemb.InitKind.CONSTANT for k in seen), seen
    got = t.export_batch(0, t.capacity())
    rows = dict(zip(got.keys.tolist(), zip(got.embeddings, got.optimizer_state)))
    for i, k in enumerate(keys.tolist()):
        emb, state = rows[k]
        assert torch.equal(emb, values[i])
        want = old_state.get(k, torch.zeros(8))  # Adam's initial state: zeros
        assert torch.equal(state, want), k
    seen.clear()
    t.find_or_insert(torch.tensor([999, 1001]))  # drawing again once the call is over
    assert seen and all(k == dynemb.InitKind.NORMAL for k in seen), seen


def test_a_refused_insert_or_assign_leaves_later_rows_drawn(monkeypatch):
    t = _table(dynemb.Storage(), "numba", score=dynemb.ScorePolicy.NO_EVICTION)
    with pytest.raises(dynemb.errors.CapacityError):
        t.insert_or_assign(torch.arange(40), torch.zeros(40, 4))
    seen = _draws(t, monkeypatch)
    t.find_or_insert(torch.arange(3))
    assert seen == [dynemb.InitKind.NORMAL]
