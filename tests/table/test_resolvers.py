"""The table's structure: one shared state, one row life cycle, and a resolver per storage mode
that never reaches into the table (docs/architecture.md, "Structure")."""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb import SGD, Storage, StorageMode
from dynemb.table.caching import CachedResolver
from dynemb.table.resolver import SingleIndexResolver

MODES = {
    "hbm_only": (Storage(), SingleIndexResolver),
    "hybrid": (Storage(mode=StorageMode.HYBRID, cache_load_factor=0.5), SingleIndexResolver),
    "caching": (Storage(mode=StorageMode.CACHING, cache_load_factor=0.1), CachedResolver),
}


def _table(backend: str, mode: str) -> dynemb.DynamicTable:
    cfg = dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=512, bucket_capacity=16,
                             storage=MODES[mode][0], optimizer=SGD(lr=0.5))
    return dynemb.DynamicTable(cfg, backend=backend)


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_gets_its_resolver_and_cache_tells_a_caching_table(backend, mode):
    t = _table(backend, mode)
    assert type(t.resolver) is MODES[mode][1]
    assert t.index is t.resolver.table_index
    assert (t.cache is t.resolver) if mode == "caching" else t.cache is None
    want = (t.cache.index, t.index) if mode == "caching" else (t.index,)
    assert t.resolver.hold_indexes == want


@pytest.mark.parametrize("mode", list(MODES))
def test_the_resolver_life_cycle_and_state_hold_no_reference_to_the_table(backend, mode):
    """What the table delegates to works on the shared state and the life cycle only: none of
    it points back to the table (the cache used to reach nine of its private members)."""
    t = _table(backend, mode)
    lk = t.lookup(torch.arange(100), train=True, hold=True)
    t.apply_gradients(lk, torch.ones(lk.unique_keys.numel(), 4))
    for part in (t.resolver, t.life, t.state):
        assert all(v is not t for v in vars(part).values()), type(part).__name__
    assert lk.holds is None and t.held_rows() == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_the_table_step_is_the_shared_state_s(backend, mode):
    """Setting ``table.step`` (as a checkpoint load does) sets the clock every part reads: the
    next lookup scores and stamps its rows with the step after it."""
    t = _table(backend, mode)
    t.step = 41
    assert t.state.step == 41
    lk = t.lookup(torch.tensor([7]), train=True)
    assert t.stats().step == 42 and lk.unique_slots.numel() == 1
    b = t.export_batch(0, t.capacity(), since_step=41)
    assert b.keys.tolist() == [7]
