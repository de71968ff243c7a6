"""The DLRM: shapes, the pairwise interaction against a loop, and training updates both the
dense layers and the embedding rows."""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb.errors import ConfigError, InputError
from dynemb.models import DLRM, pairwise_dots


def _tables(dim=4, names=("a", "b", "c")):
    return [dynemb.TableConfig(name=n, dim=dim, features=[n], capacity=256,
                               optimizer=dynemb.SGD(lr=0.5), pooling=dynemb.PoolingMode.MEAN)
            for n in names]


def _batch(bsz=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (3 * bsz,), generator=g)
    values = torch.randint(0, 20, (int(lengths.sum()),), generator=g)
    sparse = dynemb.SparseBatch(features=["a", "b", "c"], values=values, lengths=lengths)
    return torch.randn(bsz, 5, generator=g), sparse


def test_pairwise_dots_match_a_loop():
    v = torch.randn(3, 5, 4)
    got = pairwise_dots(v)
    want = torch.stack([torch.stack([v[b, i] @ v[b, j] for i in range(5) for j in range(i + 1, 5)])
                        for b in range(3)])
    assert got.shape == (3, 10)
    torch.testing.assert_close(got, want)


def test_forward_shape_and_layer_sizes():
    torch.manual_seed(0)
    model = DLRM(dense_dim=5, tables=_tables(), bottom_mlp=(8,), top_mlp=(16, 4))
    dense, sparse = _batch()
    assert model(dense, sparse).shape == (6,)
    # 4 vectors (bottom output + 3 features): 6 dots, plus the bottom output (4)
    assert model.top[0].in_features == 6 + 4
    assert model.bottom[-2].out_features == 4


def test_without_dense_features():
    model = DLRM(dense_dim=0, tables=_tables(), top_mlp=(8,))
    _, sparse = _batch()
    assert model.bottom is None
    assert model(torch.zeros(6, 0), sparse).shape == (6,)


def test_a_step_updates_dense_layers_and_rows():
    torch.manual_seed(0)
    model = DLRM(dense_dim=5, tables=_tables(), bottom_mlp=(8,), top_mlp=(8,))
    opt = torch.optim.SGD(model.dense_parameters(), lr=0.1)
    dense, sparse = _batch()
    model(dense, sparse)  # creates the rows
    table = model.embeddings.tables["a"]
    keys = sparse.feature("a")[0].unique()
    before = table.find(keys).values.clone()
    top_before = model.top[0].weight.detach().clone()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        model(dense, sparse), torch.ones(6))
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert not torch.equal(table.find(keys).values, before)
    assert not torch.equal(model.top[0].weight, top_before)
    assert all(isinstance(p, torch.nn.Parameter) for p in model.dense_parameters())


def test_bad_shapes_and_configs():
    model = DLRM(dense_dim=5, tables=_tables())
    dense, sparse = _batch()
    with pytest.raises(InputError, match=r"\(B, 5\)"):
        model(dense[:, :3], sparse)
    with pytest.raises(InputError, match="sparse batch has 6 samples"):
        model(dense[:4], sparse)
    with pytest.raises(ConfigError, match="one embedding dimension"):
        DLRM(dense_dim=5, tables=_tables(4, ("a",)) + _tables(8, ("b",)))
