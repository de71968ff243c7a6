"""Non-finite numbers never spread silently: gradient rows with NaN or inf are counted and
skipped (default), refused (RAISE) or applied (APPLY) per table, for every optimizer; clipping
ignores them; insert_or_assign and load_rows refuse non-finite rows and optimizer state."""

from __future__ import annotations

import math

import pytest
import torch

import dynemb
from dynemb import SGD, Adagrad, Adam, NonFinite, RowWiseAdagrad
from dynemb.errors import ConfigError, InputError

OPTIMIZERS = {"sgd": SGD(lr=0.1, weight_decay=0.01), "adagrad": Adagrad(lr=0.1),
              "rowwise": RowWiseAdagrad(lr=0.1), "adam": Adam(lr=0.1)}
BAD = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def K(*ks: int) -> torch.Tensor:
    return torch.tensor(ks, dtype=torch.int64)


def _table(backend: str, opt: str = "adam", **kw) -> dynemb.DynamicTable:
    kw.setdefault("optimizer", OPTIMIZERS[opt])
    kw.setdefault("capacity", 64)
    cfg = dynemb.TableConfig(name="emb", dim=4, features=["f"], **kw)
    return dynemb.DynamicTable(cfg, backend=backend)


def _rows(t: dynemb.DynamicTable, keys: list[int]) -> torch.Tensor:
    """(len(keys), dim + state width): each key's whole row, embedding and optimizer state."""
    b = t.export_batch(0, t.capacity())
    pos = {k: i for i, k in enumerate(b.keys.tolist())}
    full = torch.cat([b.embeddings, b.optimizer_state], dim=1)
    return torch.stack([full[pos[k]] for k in keys])


def _grads(bad_value: float | None = None) -> torch.Tensor:
    g = torch.arange(12, dtype=torch.float32).view(3, 4) / 10 - 0.5
    if bad_value is not None:
        g[0, 2] = bad_value
    return g


def _update(t: dynemb.DynamicTable, keys: list[int], grads: torch.Tensor) -> None:
    """One training step of distinct ``keys`` with gradient ``grads[i]`` for ``keys[i]``."""
    lk = t.lookup(K(*keys), train=True)
    per_entry = torch.empty_like(grads)
    per_entry[lk.inverse] = grads
    t.apply_gradients(lk, per_entry)


def _twin_pair(backend: str, opt: str, **kw):
    """Two equal tables holding keys 1, 2, 3 (one update already applied to each)."""
    pair = []
    for _ in range(2):
        t = _table(backend, opt, **kw)
        _update(t, [1, 2, 3], _grads())
        pair.append(t)
    return pair


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_skip_leaves_the_bad_row_and_updates_the_others_exactly(backend, opt, bad):
    t, twin = _twin_pair(backend, opt)
    before = _rows(t, [1])
    _update(t, [1, 2, 3], _grads(BAD[bad]))    # row 1's gradient is not finite
    _update(twin, [2, 3], _grads()[1:])        # the same update without row 1
    assert torch.equal(_rows(t, [1]), before)  # embedding and optimizer state as they were
    assert torch.equal(_rows(t, [2, 3]), _rows(twin, [2, 3]))
    assert bool(torch.isfinite(_rows(t, [1, 2, 3])).all())
    s = t.stats()
    assert s.nonfinite_grads == 1 and s.optimizer_step == twin.stats().optimizer_step == 2


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_raise_names_table_step_and_count_and_updates_nothing(backend, opt):
    t, _ = _twin_pair(backend, opt, nonfinite="raise")
    before = _rows(t, [1, 2, 3])
    g = _grads(math.nan)
    g[2, 0] = math.inf
    with pytest.raises(InputError, match=r"'emb'.*2 gradient row\(s\).*optimizer step 2"):
        _update(t, [1, 2, 3], g)
    assert torch.equal(_rows(t, [1, 2, 3]), before)
    s = t.stats()
    assert s.nonfinite_grads == 2 and s.optimizer_step == 1
    _update(t, [1, 2, 3], _grads())           # a finite update goes through as step 2
    assert t.stats().optimizer_step == 2


def test_apply_applies_and_counts(backend):
    t, _ = _twin_pair(backend, "sgd", nonfinite=NonFinite.APPLY)
    _update(t, [1, 2, 3], _grads(math.nan))
    rows = _rows(t, [1, 2, 3])
    assert bool(torch.isnan(rows[0]).any()) and bool(torch.isfinite(rows[1:]).all())
    assert t.stats().nonfinite_grads == 1


@pytest.mark.parametrize("nonfinite", ["skip", "apply"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_clipping_norm_ignores_a_non_finite_row(backend, opt, nonfinite):
    """max_grad_norm clips by the norm of the finite rows it updates: an inf row must neither
    make the norm inf or NaN (which switched clipping off, or zeroed every row) nor count in
    it, whether it is skipped or applied."""
    base = OPTIMIZERS[opt]
    clipped = type(base)(**{**base.__dict__, "max_grad_norm": 0.1})
    t = _table(backend, optimizer=clipped, nonfinite=nonfinite)
    twin = _table(backend, optimizer=clipped)
    for table in (t, twin):
        _update(table, [1, 2, 3], _grads())
    _update(t, [1, 2, 3], _grads(math.inf) * 10)
    _update(twin, [2, 3], _grads()[1:] * 10)
    assert torch.equal(_rows(t, [2, 3]), _rows(twin, [2, 3]))
    unclipped = _table(backend, optimizer=base)
    _update(unclipped, [1, 2, 3], _grads())
    _update(unclipped, [2, 3], _grads()[1:] * 10)
    assert not torch.allclose(_rows(t, [2, 3]), _rows(unclipped, [2, 3]))


def test_float64_gradients_are_judged_as_float32(backend):
    t, _ = _twin_pair(backend, "sgd")
    before = _rows(t, [1])
    g = _grads().double()
    g[0, 0] = 1e300                             # finite in float64, inf in float32
    _update(t, [1, 2, 3], g)
    assert torch.equal(_rows(t, [1]), before) and t.stats().nonfinite_grads == 1


def test_rows_without_a_gradient_are_not_counted(backend):
    """Entries without a row (eval initializer, failed insert) never count as non-finite."""
    t = _table(backend, on_full=dynemb.OnFull.COUNT, capacity=8,
               score=dynemb.ScorePolicy.NO_EVICTION)
    t.find_or_insert(torch.arange(100, 108))
    lk = t.lookup(K(1), train=True)             # the table is full: no row
    assert (lk.unique_slots < 0).all()
    t.apply_gradients(lk, torch.full((1, 4), math.nan))
    assert t.stats().nonfinite_grads == 0


def test_nonfinite_config_accepts_strings_and_refuses_others():
    cfg = dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=8, nonfinite="apply")
    assert cfg.nonfinite is NonFinite.APPLY
    assert dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=8).nonfinite \
        is NonFinite.SKIP
    with pytest.raises(ConfigError, match="nonfinite"):
        dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=8, nonfinite="ignore")


# ---------------------------------------------------------------- values written directly


@pytest.mark.parametrize("what", ["values", "optimizer_state"])
@pytest.mark.parametrize("value", [math.nan, math.inf, 1e300])
def test_insert_or_assign_refuses_non_finite_rows(backend, what, value):
    t = _table(backend, "adagrad")
    t.insert_or_assign(K(1, 2), torch.ones(2, 4), optimizer_state=torch.ones(2, 4))
    before, step = _rows(t, [1, 2]), t.step
    given = {"values": torch.zeros(3, 4, dtype=torch.float64),
             "optimizer_state": torch.zeros(3, 4, dtype=torch.float64)}
    given[what][2, 1] = value                    # 1e300: finite in float64, inf as float32
    with pytest.raises(InputError, match=f"{what}.*row 2, column 1"):
        t.insert_or_assign(K(1, 2, 3), given["values"], optimizer_state=given["optimizer_state"])
    assert torch.equal(_rows(t, [1, 2]), before) and t.size() == 2 and t.step == step


def test_finite_rows_and_gradients_whose_sum_overflows_are_accepted(backend):
    """The finiteness checks sum first: finite values near float32's largest, whose sum
    overflows, are still finite (rows assigned, a gradient applied and not counted)."""
    t = _table(backend, "sgd")
    big = torch.full((3, 4), 3e38)
    big[1] = -3e38
    t.insert_or_assign(K(1, 2, 3), big)
    assert torch.equal(t.find(K(1, 2, 3)).values, big)
    lk = t.lookup(K(1, 2, 3), train=True)
    t.apply_gradients(lk, torch.full((3, 4), 3e38))
    assert t.stats().nonfinite_grads == 0 and t.stats().optimizer_step == 1


@pytest.mark.parametrize("what", ["embeddings", "optimizer_state"])
def test_load_rows_refuses_non_finite_rows(backend, what):
    t = _table(backend, "rowwise")
    args = {"embeddings": torch.ones(2, 4), "optimizer_state": torch.ones(2, 1)}
    args[what][1, 0] = math.nan
    with pytest.raises(InputError, match=what):
        t.load_rows(K(5, 6), args["embeddings"], args["optimizer_state"], K(1, 1))
    assert t.size() == 0
