"""SparseBatch: layout, from_dict, feature(), to(), and every malformed input."""

from __future__ import annotations

import math

import pytest
import torch

import dynemb
from dynemb import EMPTY_KEY, SparseBatch
from dynemb.errors import DynembError, InputError


def i64(*xs):
    return torch.tensor(xs, dtype=torch.int64)


def f32(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def _reference_split(ids: dict[str, list[list[int]]]):
    """Plain-Python feature-major flattening: {name: (flat ids, lengths)}."""
    return {name: ([i for bag in bags for i in bag], [len(bag) for bag in bags])
            for name, bags in ids.items()}


# ------------------------------------------------------------------ construction


def test_construction_feature_major_layout():
    # F = 2 features, B = 3 samples; lengths[f * B + b].
    b = SparseBatch(features=["a", "b"], values=i64(10, 11, 12, 20, 21, 22),
                    lengths=i64(2, 0, 1, 1, 2, 0))
    assert b.features == ("a", "b")
    assert b.batch_size == 3
    v, l, w = b.feature("a")
    assert v.tolist() == [10, 11, 12] and l.tolist() == [2, 0, 1] and w is None
    v, l, w = b.feature("b")
    assert v.tolist() == [20, 21, 22] and l.tolist() == [1, 2, 0] and w is None
    assert "batch_size=3" in repr(b) and "num_ids=6" in repr(b)


def test_construction_with_weights_and_int32_lengths():
    b = SparseBatch(features=["a", "b"], values=i64(1, 2, 3),
                    lengths=torch.tensor([1, 0, 0, 2], dtype=torch.int32),
                    weights=f32(0.5, 1.5, -2.0))
    assert b.batch_size == 2
    v, l, w = b.feature("a")
    assert v.tolist() == [1] and l.tolist() == [1, 0] and w.tolist() == [0.5]
    v, l, w = b.feature("b")
    assert v.tolist() == [2, 3] and l.tolist() == [0, 2] and w.tolist() == [1.5, -2.0]


def test_feature_with_an_empty_feature_in_the_middle():
    b = SparseBatch(features=["a", "b", "c"], values=i64(1, 2, 3), lengths=i64(1, 0, 0, 0, 1, 1))
    assert b.feature("a")[0].tolist() == [1]
    assert b.feature("b")[0].tolist() == []
    assert b.feature("b")[1].tolist() == [0, 0]
    assert b.feature("c")[0].tolist() == [2, 3]


def test_from_dict_matches_plain_python_flattening():
    ids = {"user": [[1, 2], [], [3]], "item": [[7], [8, 9, 10], []], "ctx": [[], [], [5]]}
    b = SparseBatch.from_dict(ids)
    ref = _reference_split(ids)
    assert b.features == ("user", "item", "ctx")
    assert b.batch_size == 3
    assert b.values.dtype == torch.int64
    assert b.values.tolist() == [i for name in ids for i in ref[name][0]]
    assert b.lengths.tolist() == [n for name in ids for n in ref[name][1]]
    assert b.weights is None
    for name in ids:
        v, l, w = b.feature(name)
        assert v.tolist() == ref[name][0]
        assert l.tolist() == ref[name][1]
        assert w is None


def test_from_dict_with_weights():
    ids = {"a": [[1, 2], [3]], "b": [[], [4]]}
    weights = {"b": [[], [0.25]], "a": [[1.0, 2.0], [3.0]]}  # key order need not match
    b = SparseBatch.from_dict(ids, weights)
    assert b.weights is not None and b.weights.dtype.is_floating_point
    assert b.weights.tolist() == [1.0, 2.0, 3.0, 0.25]
    assert b.feature("a")[2].tolist() == [1.0, 2.0, 3.0]
    assert b.feature("b")[2].tolist() == [0.25]
    assert "weighted=True" in repr(b)


def test_from_dict_extreme_int64_ids():
    lo, hi = -(1 << 63) + 1, (1 << 63) - 1
    b = SparseBatch.from_dict({"a": [[lo, hi, -1, 0]]})
    assert b.values.tolist() == [lo, hi, -1, 0]


def test_from_dict_empty_batch_and_empty_bags():
    b = SparseBatch.from_dict({"a": [], "b": []})
    assert b.batch_size == 0 and b.values.numel() == 0
    assert b.feature("b")[0].numel() == 0
    b = SparseBatch.from_dict({"a": [[], []]})
    assert b.batch_size == 2 and b.values.dtype == torch.int64
    assert b.feature("a")[1].tolist() == [0, 0]


def test_to_cpu_keeps_contents():
    b = SparseBatch.from_dict({"a": [[1, 2], [3]], "b": [[4], []]},
                              {"a": [[0.1, 0.2], [0.3]], "b": [[0.4], []]})
    c = b.to("cpu")
    assert isinstance(c, SparseBatch) and c is not b
    assert c.features == b.features and c.batch_size == b.batch_size
    assert torch.equal(c.values, b.values)
    assert torch.equal(c.lengths, b.lengths)
    assert torch.equal(c.weights, b.weights)
    assert c.values.device.type == "cpu"
    assert torch.equal(c.feature("b")[0], i64(4))
    unweighted = SparseBatch.from_dict({"a": [[1]]}).to(torch.device("cpu"))
    assert unweighted.weights is None


def test_feature_unknown_name_raises():
    b = SparseBatch.from_dict({"a": [[1]]})
    with pytest.raises(InputError, match="'zzz'"):
        b.feature("zzz")


def test_input_error_is_a_value_error():
    assert issubclass(InputError, ValueError)
    assert issubclass(InputError, DynembError)
    assert dynemb.errors.InputError is InputError


# ------------------------------------------------------------------ bad input


def _raises(match: str | None = None):
    """pytest.raises for InputError; also checks it can be caught as a ValueError."""
    return pytest.raises(ValueError, match=match)


def _check_input_error(excinfo):
    assert isinstance(excinfo.value, InputError), type(excinfo.value)


def test_lengths_not_summing_to_n():
    with _raises("sum to 3") as e:
        SparseBatch(features=["a"], values=i64(1, 2, 3, 4), lengths=i64(1, 2))
    _check_input_error(e)
    with _raises() as e:
        SparseBatch(features=["a"], values=i64(1), lengths=i64(1, 2))
    _check_input_error(e)


def test_negative_length_names_feature_and_sample():
    # lengths sum to N (3), so only the sign is wrong: feature "b", sample 1.
    with _raises(r"'b'.*sample 1") as e:
        SparseBatch(features=["a", "b"], values=i64(1, 2, 3), lengths=i64(1, 1, 2, -1))
    _check_input_error(e)
    assert "-1" in str(e.value)


@pytest.mark.parametrize("lengths, culprit", [
    ([2**62, 2**62, 2**62, 2**62 + 3], "'a', sample 0: length 4611686018427387904"),
    ([-(2**63), 2**63 - 1, 4], "'a', sample 0: length -9223372036854775808"),
    ([1, 4, -2], "'a', sample 1: length 4"),
    ([3, 2**63 - 1, 2**63 - 1, 2], "'a', sample 1: length 9223372036854775807"),
])
def test_lengths_whose_sum_wraps_around_to_n_are_refused(lengths, culprit):
    """int64 lengths summing to N only modulo 2**64 once crashed the process (SIGSEGV) in the
    kernels that trust them: every length must be in [0, N] before anything is summed."""
    with _raises(culprit + r"; expected a length in \[0, 3\]") as e:
        SparseBatch(features=["a"], values=i64(1, 2, 3), lengths=i64(*lengths))
    _check_input_error(e)


def test_check_lengths_catches_a_wrapped_sum_of_in_range_lengths():
    """Lengths each within [0, n] can still wrap around when n is huge (checked with an n no
    real batch reaches: five lengths of 2**62 sum to 2**62 modulo 2**64)."""
    from dynemb.batch import check_lengths

    n = 2**62
    with _raises("about 2.306e") as e:
        check_lengths(i64(*[n] * 5), n, "here")
    _check_input_error(e)
    check_lengths(i64(n // 2, n // 2), n, "here")


def test_a_module_refuses_lengths_changed_after_construction():
    """The module re-checks a batch's lengths against its ids (a SparseBatch is mutable)."""
    ebc = dynemb.EmbeddingBagCollection(
        [dynemb.TableConfig(name="t", dim=2, features=["a"], capacity=16)])
    b = SparseBatch(features=["a"], values=i64(1, 2, 3), lengths=i64(1, 1, 1, 0))
    b.lengths.copy_(i64(2**62, 2**62, 2**62, 2**62 + 3))
    with _raises("no longer match") as e:
        ebc(b)
    _check_input_error(e)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.float32, torch.float64,
                                   torch.bool])
def test_non_int64_ids(dtype):
    with _raises("int64") as e:
        SparseBatch(features=["a"], values=torch.tensor([1, 0], dtype=dtype), lengths=i64(2))
    _check_input_error(e)


def test_ids_not_a_tensor_or_not_1d():
    with _raises() as e:
        SparseBatch(features=["a"], values=[1, 2], lengths=i64(2))
    _check_input_error(e)
    with _raises("1-D") as e:
        SparseBatch(features=["a"], values=i64(1, 2).view(1, 2), lengths=i64(2))
    _check_input_error(e)


@pytest.mark.parametrize("pos", [2, 3])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_weight_names_the_feature(bad, pos):
    # The bad weight belongs to feature "c" (its first or second id; feature "b" is empty,
    # which must not confuse it).
    values = i64(1, 2, 3, 4)
    lengths = i64(1, 1, 0, 0, 1, 1)
    weights = f32(1.0, 1.0, 1.0, 1.0)
    weights[pos] = bad
    with _raises("'c'") as e:
        SparseBatch(features=["a", "b", "c"], values=values, lengths=lengths, weights=weights)
    _check_input_error(e)
    assert "'a'" not in str(e.value) and "'b'" not in str(e.value)
    # ... and in the first feature.
    with _raises("'a'") as e:
        SparseBatch(features=["a", "b"], values=i64(1, 2), lengths=i64(1, 1), weights=f32(bad, 1.0))
    _check_input_error(e)


def test_nan_weight_in_from_dict_names_the_feature():
    with _raises("'b'") as e:
        SparseBatch.from_dict({"a": [[1], [2]], "b": [[3], [4, 5]]},
                              {"a": [[1.0], [1.0]], "b": [[1.0], [1.0, math.nan]]})
    _check_input_error(e)


@pytest.mark.parametrize("weights", [
    f32(1.0, 2.0),                   # too short
    f32(1.0, 2.0, 3.0, 4.0),         # too long
    f32(1.0, 2.0, 3.0).view(3, 1),   # 2-D
])
def test_weights_of_wrong_shape(weights):
    with _raises("shape") as e:
        SparseBatch(features=["a"], values=i64(1, 2, 3), lengths=i64(3), weights=weights)
    _check_input_error(e)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_weights_of_non_float_dtype(dtype):
    with _raises("float") as e:
        SparseBatch(features=["a"], values=i64(1, 2), lengths=i64(2),
                    weights=torch.tensor([1, 0], dtype=dtype))
    _check_input_error(e)


@pytest.mark.parametrize("big", [1e300, -1e39, 3.5e38])
def test_float64_weights_that_overflow_float32_are_refused(big):
    """The kernels use float32 weights: a float64 weight finite only in float64 would become
    inf there."""
    with _raises(r"'b'.*finite as float32") as e:
        SparseBatch(features=["a", "b"], values=i64(1, 2), lengths=i64(1, 1),
                    weights=torch.tensor([0.5, big], dtype=torch.float64))
    _check_input_error(e)
    ok = torch.tensor([0.5, 3.4e38], dtype=torch.float64)  # rounds to float32's largest
    SparseBatch(features=["a", "b"], values=i64(1, 2), lengths=i64(1, 1), weights=ok)


def test_finite_weights_whose_sum_overflows_are_accepted():
    """The finiteness check sums first (a NaN or inf makes the sum non-finite); finite weights
    whose float32 sum overflows must still pass, and a bad one among them still be found."""
    big = f32(3e38, 3e38, -3e38, -3e38)
    SparseBatch(features=["a"], values=i64(1, 2, 3, 4), lengths=i64(4), weights=big)
    assert dynemb.batch.all_finite(big) and not dynemb.batch.all_finite(f32(math.inf, -math.inf))
    big[3] = math.nan
    with _raises(r"weight 3 is nan"):
        SparseBatch(features=["a"], values=i64(1, 2, 3, 4), lengths=i64(4), weights=big)


def test_float64_weights_are_accepted():
    b = SparseBatch(features=["a"], values=i64(1, 2), lengths=i64(2),
                    weights=torch.tensor([0.5, 2.0], dtype=torch.float64))
    assert b.feature("a")[2].tolist() == [0.5, 2.0]


def test_lengths_count_not_a_multiple_of_features():
    with _raises("multiple") as e:
        SparseBatch(features=["a", "b"], values=i64(1, 2, 3), lengths=i64(1, 1, 1))
    _check_input_error(e)


@pytest.mark.parametrize("lengths", [
    torch.tensor([1.0, 1.0]),
    torch.tensor([True, True]),
    torch.tensor([[1, 1]]),
])
def test_lengths_of_wrong_dtype_or_shape(lengths):
    with _raises("lengths") as e:
        SparseBatch(features=["a"], values=i64(1, 2), lengths=lengths)
    _check_input_error(e)


@pytest.mark.parametrize("features", [["a", "a"], ["a", ""], [], [""], ["a", 3]])
def test_duplicate_or_empty_feature_names(features):
    n = max(len(features), 1)
    with _raises() as e:
        SparseBatch(features=features, values=i64(), lengths=torch.zeros(n, dtype=torch.int64))
    _check_input_error(e)


def test_duplicate_feature_name_message():
    with _raises("distinct") as e:
        SparseBatch(features=["x", "y", "x"], values=i64(), lengths=i64(0, 0, 0))
    _check_input_error(e)


def test_reserved_empty_key_among_ids():
    assert EMPTY_KEY == -(1 << 63) == torch.iinfo(torch.int64).min
    with _raises("reserved") as e:
        SparseBatch(features=["a"], values=i64(5, EMPTY_KEY), lengths=i64(2))
    _check_input_error(e)
    with _raises("reserved") as e:
        SparseBatch.from_dict({"a": [[1], [EMPTY_KEY]]})
    _check_input_error(e)


def test_from_dict_unequal_batch_sizes():
    with _raises("batch size") as e:
        SparseBatch.from_dict({"a": [[1], [2]], "b": [[3]]})
    _check_input_error(e)
    assert "'a'" in str(e.value) and "'b'" in str(e.value)


@pytest.mark.parametrize("bad", [1.5, 2.0, "3", True, None])
def test_from_dict_non_integer_ids_name_feature_and_sample(bad):
    with _raises(r"'b'.*sample 1") as e:
        SparseBatch.from_dict({"a": [[1], [2]], "b": [[3], [4, bad]]})
    _check_input_error(e)


def test_from_dict_weights_with_other_features():
    with _raises("weights") as e:
        SparseBatch.from_dict({"a": [[1]], "b": [[2]]}, {"a": [[1.0]]})
    _check_input_error(e)
    with _raises("weights") as e:
        SparseBatch.from_dict({"a": [[1]]}, {"a": [[1.0]], "zzz": [[1.0]]})
    _check_input_error(e)


def test_from_dict_weight_count_differs_from_ids_in_a_bag():
    with _raises(r"'a'.*sample 1") as e:
        SparseBatch.from_dict({"a": [[1], [2, 3]]}, {"a": [[1.0], [1.0]]})
    _check_input_error(e)


@pytest.mark.parametrize("weight_bags", [[[1.0]], [[1.0], [1.0], [1.0]]])
def test_from_dict_weights_with_another_batch_size(weight_bags):
    """``weights`` must have the same shape as ``ids``: a different number of bags is an
    InputError naming the feature (neither an IndexError nor silently ignored)."""
    with _raises("'a'") as e:
        SparseBatch.from_dict({"a": [[1], [2]]}, {"a": weight_bags})
    _check_input_error(e)


def test_from_dict_id_outside_int64_range():
    with _raises("'a'") as e:
        SparseBatch.from_dict({"a": [[1], [1 << 63]]})
    _check_input_error(e)


def test_features_given_as_one_string_are_refused():
    with pytest.raises(InputError, match="string"):
        SparseBatch(features="ab", values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))


def test_select_keeps_the_chosen_features_in_the_order_given():
    batch = SparseBatch.from_dict({"a": [[1, 2], []], "b": [[3], [4, 5, 6]], "c": [[7], [8]]},
                                  weights={"a": [[0.5, 1.5], []], "b": [[2.0], [1.0, 1.0, 3.0]],
                                           "c": [[4.0], [5.0]]})
    sub = batch.select(["c", "a"])
    assert sub.features == ("c", "a") and sub.batch_size == 2
    for f in ("c", "a"):
        for got, want in zip(sub.feature(f), batch.feature(f)):
            assert torch.equal(got, want)
    assert batch.select(["a", "b", "c"]) is batch
    with pytest.raises(InputError, match=r"no feature\(s\) \['z'\]"):
        batch.select(["a", "z"])
    with pytest.raises(InputError, match="distinct"):
        batch.select(["a", "a"])
    with pytest.raises(InputError, match="list of feature names"):
        batch.select("a")


def test_select_passes_gradients_to_the_original_weights():
    w = torch.tensor([0.5, 1.5, 2.0, 3.0], requires_grad=True)
    batch = SparseBatch(features=["a", "b"], values=torch.tensor([1, 2, 3, 4]),
                        lengths=torch.tensor([2, 0, 1, 1]), weights=w)
    (batch.select(["b"]).weights * torch.tensor([10.0, 20.0])).sum().backward()
    assert w.grad.tolist() == [0.0, 0.0, 10.0, 20.0]
