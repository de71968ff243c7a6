"""Config validation: every bad field raises ConfigError naming the field; torch.optim defaults."""

from __future__ import annotations

import dataclasses
import inspect
import math
import re

import pytest
import torch

import dynemb
from dynemb import (
    SGD, Adagrad, Adam, Admission, Initializer, InitKind, OnFull, PoolingMode, RowWiseAdagrad,
    ScorePolicy, TableConfig,
)
from dynemb.errors import ConfigError, DynembError


def table(**kw) -> TableConfig:
    kw.setdefault("name", "t")
    kw.setdefault("dim", 4)
    kw.setdefault("features", ["f"])
    kw.setdefault("capacity", 16)
    return TableConfig(**kw)


def raises_config_error(field: str):
    """ConfigError whose message names ``field`` as ``<owner>.<field>:``."""
    return pytest.raises(ConfigError, match=rf"\.{re.escape(field)}:")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, DynembError)


# ------------------------------------------------------------------ TableConfig


def test_valid_table_config_and_defaults():
    c = table(features=["a", "b"])
    assert c.features == ("a", "b")  # a list becomes a tuple
    assert isinstance(c.optimizer, SGD)
    assert c.score is ScorePolicy.LRU
    assert c.pooling is PoolingMode.SUM
    assert c.on_full is OnFull.RAISE
    assert c.admission is None
    assert c.bucket_capacity == 128
    assert c.eval_initializer.kind is InitKind.CONSTANT and c.eval_initializer.value == 0.0
    assert c.initializer.kind is InitKind.NORMAL


def test_table_config_is_frozen_and_keyword_only():
    c = table()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.dim = 8
    with pytest.raises(TypeError):
        TableConfig("t", 4, ("f",), 16)


@pytest.mark.parametrize("dim", [0, -1, 1.5, "4", None])
def test_bad_dim(dim):
    with raises_config_error("dim"):
        table(dim=dim)


@pytest.mark.parametrize("capacity", [0, -8, 8.0, None])
def test_bad_capacity(capacity):
    with raises_config_error("capacity"):
        table(capacity=capacity)


@pytest.mark.parametrize("b", [0, 1, 2, 4, 12, 100, 129, 2048, 4096, 16.0])
def test_bad_bucket_capacity(b):
    with raises_config_error("bucket_capacity"):
        table(bucket_capacity=b)


@pytest.mark.parametrize("b", [8, 16, 32, 64, 128, 256, 512, 1024])
def test_good_bucket_capacity(b):
    assert table(bucket_capacity=b).bucket_capacity == b


@pytest.mark.parametrize("features", [["a", "a"], ("x", "y", "x")])
def test_duplicate_features(features):
    with raises_config_error("features") as e:
        table(features=features)
    assert "distinct" in str(e.value)


@pytest.mark.parametrize("features", ["item_id", "a"])
def test_features_given_as_one_string(features):
    with raises_config_error("features") as e:
        table(features=features)
    assert "string" in str(e.value)


@pytest.mark.parametrize("features", [[], [""], ["a", 3], [None]])
def test_empty_or_non_string_features(features):
    with raises_config_error("features"):
        table(features=features)


@pytest.mark.parametrize("name", ["", None, 3])
def test_bad_name(name):
    with raises_config_error("name"):
        table(name=name)


def test_table_name_in_table_config_errors():
    with pytest.raises(ConfigError, match="'clicks'"):
        table(name="clicks", dim=0)


@pytest.mark.parametrize("field, value", [
    ("optimizer", "sgd"),
    ("optimizer", torch.optim.SGD),
    ("score", "lru"),
    ("pooling", "sum"),
    ("on_full", "raise"),
    ("initializer", "normal"),
    ("eval_initializer", 0.0),
    ("admission", 3),
])
def test_fields_of_the_wrong_type(field, value):
    with raises_config_error(field):
        table(**{field: value})


# ------------------------------------------------------------------ optimizers


@pytest.mark.parametrize("cls", [SGD, Adagrad, RowWiseAdagrad, Adam])
@pytest.mark.parametrize("lr", [-0.1, -1e-9, math.nan, math.inf, "0.1"])
def test_bad_lr(cls, lr):
    with raises_config_error("lr"):
        cls(lr=lr)


@pytest.mark.parametrize("cls", [SGD, Adagrad, RowWiseAdagrad, Adam])
def test_zero_lr_is_allowed(cls):
    assert cls(lr=0.0).lr == 0.0


@pytest.mark.parametrize("cls", [SGD, Adagrad, RowWiseAdagrad, Adam])
def test_bad_weight_decay_and_max_grad_norm(cls):
    with raises_config_error("weight_decay"):
        cls(weight_decay=-0.01)
    with raises_config_error("max_grad_norm"):
        cls(max_grad_norm=0.0)
    with raises_config_error("max_grad_norm"):
        cls(max_grad_norm=-1.0)
    assert cls(max_grad_norm=1.0).max_grad_norm == 1.0


@pytest.mark.parametrize("cls", [Adagrad, RowWiseAdagrad])
def test_bad_adagrad_fields(cls):
    with raises_config_error("lr_decay"):
        cls(lr_decay=-0.1)
    with raises_config_error("eps"):
        cls(eps=0.0)
    with raises_config_error("eps"):
        cls(eps=-1e-10)
    with raises_config_error("initial_accumulator_value"):
        cls(initial_accumulator_value=-0.1)


@pytest.mark.parametrize("betas", [
    (1.0, 0.999), (0.9, 1.0), (-0.1, 0.999), (0.9, -0.5), (1.5, 0.5), (math.nan, 0.9),
])
def test_adam_betas_out_of_range(betas):
    with raises_config_error("betas"):
        Adam(betas=betas)


@pytest.mark.parametrize("betas", [(0.9,), (0.9, 0.99, 0.999)])
def test_adam_betas_of_the_wrong_length(betas):
    with raises_config_error("betas"):
        Adam(betas=betas)


def test_adam_bad_eps_and_edge_betas():
    with raises_config_error("eps"):
        Adam(eps=0.0)
    assert Adam(betas=(0.0, 0.0)).betas == (0.0, 0.0)


def _torch_defaults(cls) -> dict[str, object]:
    return {name: p.default for name, p in inspect.signature(cls).parameters.items()
            if p.default is not inspect.Parameter.empty}


def test_adagrad_defaults_follow_torch_optim():
    a, ref = Adagrad(), _torch_defaults(torch.optim.Adagrad)
    assert a.eps == 1e-10 and a.initial_accumulator_value == 0.0
    for name in ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"):
        assert getattr(a, name) == ref[name], name
    r = RowWiseAdagrad()
    for name in ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"):
        assert getattr(r, name) == ref[name], name


def test_adam_defaults_follow_torch_optim():
    a, ref = Adam(), _torch_defaults(torch.optim.Adam)
    assert a.lr == 1e-3 and a.betas == (0.9, 0.999) and a.eps == 1e-8 and a.weight_decay == 0.0
    for name in ("lr", "eps", "weight_decay"):
        assert getattr(a, name) == ref[name], name
    assert tuple(a.betas) == tuple(ref["betas"])
    # SparseAdam, whose rule the table follows, has the same defaults.
    sparse = _torch_defaults(torch.optim.SparseAdam)
    assert (a.lr, tuple(a.betas), a.eps) == (sparse["lr"], tuple(sparse["betas"]), sparse["eps"])


def test_sgd_defaults_follow_torch_optim():
    """README: "Optimizers follow torch.optim names, defaults and rules"."""
    ref = _torch_defaults(torch.optim.SGD)
    assert SGD().weight_decay == ref["weight_decay"]
    assert SGD().lr == ref["lr"]


# ------------------------------------------------------------------ Admission


@pytest.mark.parametrize("threshold", [0, -1, 1.5, "2", None])
def test_bad_admission_threshold(threshold):
    with raises_config_error("threshold"):
        Admission(threshold=threshold)


@pytest.mark.parametrize("counter_capacity", [0, -1, 8.0])
def test_bad_admission_counter_capacity(counter_capacity):
    with raises_config_error("counter_capacity"):
        Admission(counter_capacity=counter_capacity)


def test_admission_defaults_and_threshold_one():
    assert Admission().threshold == 2
    assert Admission(threshold=1).threshold == 1


# ------------------------------------------------------------------ Initializer


def test_initializer_high_below_low():
    with raises_config_error("high"):
        Initializer(kind=InitKind.UNIFORM, low=0.5, high=0.1)
    assert Initializer(kind=InitKind.UNIFORM, low=0.1, high=0.1).high == 0.1


@pytest.mark.parametrize("field, value", [
    ("std", -0.1), ("std", math.nan), ("bound", 0.0), ("bound", -1.0), ("bound", math.inf),
    ("mean", math.nan), ("mean", math.inf), ("low", -math.inf), ("high", math.nan),
    ("value", math.inf), ("seed", -1), ("seed", 1 << 63), ("seed", 1.5), ("kind", "normal"),
])
def test_bad_initializer_field(field, value):
    with raises_config_error(field):
        Initializer(**{field: value})


def test_initializer_defaults():
    i = Initializer()
    assert i.kind is InitKind.NORMAL and i.std == 0.01 and i.bound == 2.0 and i.seed == 0
    assert Initializer(std=0.0).std == 0.0


def test_enums_have_string_values():
    assert ScorePolicy("lru") is ScorePolicy.LRU
    assert {p.value for p in ScorePolicy} == {"lru", "lfu", "step", "custom", "no_eviction"}
    assert {p.value for p in OnFull} == {"raise", "warn", "count"}
    assert dynemb.PoolingMode("mean") is PoolingMode.MEAN


@pytest.mark.parametrize("make", [
    lambda: dynemb.TableConfig(name="t", dim=True, features=["f"], capacity=8),
    lambda: dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=True),
    lambda: dynemb.Admission(threshold=True),
    lambda: dynemb.SGD(lr=True),
    lambda: dynemb.Initializer(seed=True),
])
def test_bools_are_not_numbers_here(make):
    with pytest.raises(dynemb.errors.ConfigError):
        make()
