"""torchrec interop against the real torchrec (installed by `make install`): KeyedJaggedTensor
round trips, collections fed a KJT, KeyedTensor / JaggedTensor outputs equal to torchrec's own
collections holding the same rows, torchrec table configs, and torchrec's DLRM training with a
dynemb collection as its sparse arch."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dynemb
from dynemb import SparseBatch

trec = pytest.importorskip("torchrec")
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

FEATURES = ["f1", "f2", "f3"]


@st.composite
def kjts(draw):
    names = draw(st.lists(st.sampled_from(FEATURES + ["g"]), min_size=1, max_size=4, unique=True))
    batch = draw(st.integers(0, 5))
    lengths = draw(st.lists(st.integers(0, 4), min_size=len(names) * batch,
                            max_size=len(names) * batch))
    n = sum(lengths)
    values = draw(st.lists(st.integers(-2**63 + 1, 2**63 - 1), min_size=n, max_size=n))
    weighted = draw(st.booleans())
    weights = torch.tensor(draw(st.lists(st.floats(-4, 4, width=32), min_size=n, max_size=n)),
                           dtype=torch.float32) if weighted else None
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    lengths_t = torch.tensor(lengths, dtype=dtype)
    if draw(st.booleans()):
        offsets = torch.cat([torch.zeros(1, dtype=dtype), torch.cumsum(lengths_t, 0).to(dtype)])
        return KeyedJaggedTensor(keys=names, values=torch.tensor(values, dtype=torch.int64),
                                 offsets=offsets, weights=weights)
    return KeyedJaggedTensor(keys=names, values=torch.tensor(values, dtype=torch.int64),
                             lengths=lengths_t, weights=weights)


@settings(max_examples=60, deadline=None)
@given(kjt=kjts())
def test_kjt_round_trips_through_a_sparse_batch(kjt):
    batch = SparseBatch.from_kjt(kjt)
    assert list(batch.features) == list(kjt.keys())
    jagged = kjt.to_dict()
    for name in kjt.keys():
        values, lengths, weights = batch.feature(name)
        assert torch.equal(values, jagged[name].values().to(torch.int64))
        assert torch.equal(lengths, jagged[name].lengths().to(torch.int64))
        if weights is not None:
            assert torch.equal(weights, jagged[name].weights())
    back = batch.to_kjt()
    assert back.keys() == kjt.keys() and torch.equal(back.values(), kjt.values())
    assert torch.equal(back.lengths(), kjt.lengths().to(torch.int64))
    assert (back.weights_or_none() is None) == (kjt.weights_or_none() is None)


def twins(pooled: bool = True):
    """A torchrec collection (from the dynemb one's table configs) and the dynemb one, holding
    the same rows for ids 0..63."""
    cfgs = [dynemb.TableConfig(name="t1", dim=4, features=["f1", "f2"], capacity=64,
                               optimizer=dynemb.SGD(lr=0.1)),
            dynemb.TableConfig(name="t2", dim=4, features=["f3"], capacity=64,
                               optimizer=dynemb.SGD(lr=0.1),
                               pooling=dynemb.PoolingMode.MEAN if pooled else
                               dynemb.PoolingMode.SUM)]
    ours = (dynemb.EmbeddingBagCollection if pooled else dynemb.EmbeddingCollection)(cfgs)
    torch.manual_seed(0)
    if pooled:
        theirs = trec.EmbeddingBagCollection(tables=ours.embedding_bag_configs())
    else:
        theirs = trec.EmbeddingCollection(tables=ours.embedding_configs())
    weights = dict(theirs.state_dict())
    for name, table in ours.tables.items():
        key = next(k for k in weights if f".{name}." in k)
        table.insert_or_assign(torch.arange(64), weights[key][:64].float())
    return ours, theirs


def kjt_of_small_ids(weighted: bool = False) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 4, (3 * 5,), generator=g)
    values = torch.randint(0, 64, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths.to(torch.int32),
                             weights=torch.rand(values.numel(), generator=g) if weighted else None)


def test_pooled_output_is_torchrecs_keyed_tensor_of_the_same_rows():
    ours, theirs = twins()
    kjt = kjt_of_small_ids()
    got = ours(kjt)
    kt = got.to_keyed_tensor()
    want = theirs(kjt)
    assert kt.keys() == want.keys() == FEATURES
    assert kt.length_per_key() == want.length_per_key() == got.length_per_key()
    torch.testing.assert_close(kt.values(), want.values(), rtol=1e-6, atol=1e-6)
    for f in FEATURES:
        torch.testing.assert_close(kt[f], want[f], rtol=1e-6, atol=1e-6)


def test_sequence_output_is_torchrecs_jagged_tensors_of_the_same_rows():
    ours, theirs = twins(pooled=False)
    kjt = kjt_of_small_ids()
    got = dynemb.interop.jagged_tensors(ours(kjt))
    want = theirs(kjt)
    for f in FEATURES:
        assert torch.equal(got[f].lengths(), want[f].lengths().to(torch.int64))
        torch.testing.assert_close(got[f].values(), want[f].values())
        assert torch.equal(ours(kjt)[f].to_jagged_tensor().values(), got[f].values())


def test_table_configs_describe_the_tables():
    ours, _ = twins()
    (t1, t2) = ours.embedding_bag_configs()
    assert (t1.name, t1.embedding_dim, t1.num_embeddings, t1.feature_names) == \
        ("t1", 4, 64, ["f1", "f2"])
    assert t2.pooling == trec.PoolingType.MEAN


def test_torchrecs_dlrm_trains_with_dynemb_tables_as_its_sparse_arch(group_of_one):
    """torchrec's own DLRM, unmodified: plain and sharded (a world of one) dynemb collections."""
    from torchrec.models.dlrm import DLRM

    for shard in (False, True):
        cfgs = [dynemb.TableConfig(name=f"t{i}", dim=8, features=[f], capacity=256,
                                   optimizer=dynemb.Adagrad(lr=0.1))
                for i, f in enumerate(FEATURES)]
        ebc = dynemb.EmbeddingBagCollection(cfgs)
        if shard:
            ebc = dynemb.distributed.shard(ebc)
        model = DLRM(embedding_bag_collection=ebc, dense_in_features=4,
                     dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(30):
            kjt = kjt_of_small_ids()
            dense = torch.randn(5, 4, generator=g)
            labels = (kjt.values()[:5] % 2).float() if kjt.values().numel() >= 5 else \
                torch.zeros(5)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                model(dense, kjt).squeeze(1), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert all(map(torch.isfinite, map(torch.tensor, losses)))
        assert sum(losses[-5:]) < sum(losses[:5])  # it learns the same batch again
        assert sum(t.size() for t in ebc.tables.values()) > 0


def test_kjts_dynemb_cannot_take_are_refused_clearly():
    vbe = KeyedJaggedTensor(keys=["f1", "f2"], values=torch.arange(3), lengths=torch.tensor([1, 1, 1]),
                            stride_per_key_per_rank=[[1], [2]])
    with pytest.raises(dynemb.errors.InputError, match="batch size per feature"):
        SparseBatch.from_kjt(vbe)
    floats = KeyedJaggedTensor(keys=["f1"], values=torch.tensor([1.5]), lengths=torch.tensor([1]))
    with pytest.raises(dynemb.errors.InputError, match="integer ids"):
        SparseBatch.from_kjt(floats)
    with pytest.raises(dynemb.errors.InputError, match="KeyedJaggedTensor"):
        SparseBatch.from_kjt({"f1": [1]})


def test_without_torchrec_the_error_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchrec", None)
    batch = SparseBatch.from_dict({"f": [[1]]})
    with pytest.raises(ImportError, match="needs the torchrec package"):
        batch.to_kjt()
