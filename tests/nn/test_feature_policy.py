"""feature_policy: a collection built with "ignore" skips batch features none of its tables reads
(as torchrec's collections do) and trains exactly as on the batch of its own features; the
default "strict" refuses them with a message that names the option. Plain and sharded (a world
of one rank in this process)."""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb import SparseBatch
from dynemb.errors import ConfigError, InputError


def tables() -> list[dynemb.TableConfig]:
    return [dynemb.TableConfig(name="t", dim=4, features=["a", "b"], capacity=256,
                               optimizer=dynemb.Adam(lr=0.1))]


def batches(weighted: bool) -> list[SparseBatch]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(4):
        ids = {f: [torch.randint(0, 50, (int(n),), generator=g).tolist()
                   for n in torch.randint(0, 4, (3,), generator=g)] for f in ("x", "a", "y", "b")}
        weights = {f: [[1.0 + 0.5 * i for i in range(len(bag))] for bag in bags]
                   for f, bags in ids.items()} if weighted else None
        out.append(SparseBatch.from_dict(ids, weights=weights))
    return out


def train(module, data: list[SparseBatch], kind: str) -> tuple[list, list]:
    """Trains on ``data``: the outputs, and each batch's weight gradient (as a batch of the
    features ``a`` and ``b``) when it is weighted."""
    outs, grads = [], []
    for batch in data:
        if batch.weights is not None:
            batch.weights.requires_grad_(True)
        out = module(batch)
        value = out.values() if kind == "ebc" else torch.cat([out[f].values for f in ("a", "b")])
        (value * torch.arange(value.numel()).view_as(value)).sum().backward()
        outs.append(value.detach())
        if batch.weights is not None:
            grads.append(SparseBatch(features=batch.features, values=batch.values,
                                     lengths=batch.lengths, weights=batch.weights.grad)
                         .select(["a", "b"]).weights)
    return outs, grads


def rows(module) -> torch.Tensor:
    table = next(iter(module.tables.values()))
    e = table.export_batch(0, table.capacity())
    order = e.keys.argsort()
    return torch.cat([e.keys[order, None].double(), e.embeddings[order].double(),
                      e.optimizer_state[order].double(), e.scores[order, None].double()], 1)


@pytest.mark.parametrize("kind,weighted", [("ebc", False), ("ebc", True), ("ec", False)])
def test_ignore_trains_exactly_as_the_batch_of_its_own_features(kind, weighted):
    cls = dynemb.EmbeddingBagCollection if kind == "ebc" else dynemb.EmbeddingCollection
    data = batches(weighted)
    ignoring = cls(tables(), feature_policy="ignore")
    got = train(ignoring, data, kind)
    plain = cls(tables())
    want = train(plain, [b.select(["a", "b"]) for b in batches(weighted)], kind)
    assert len(got[1]) == (4 if weighted else 0)
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(g, w)
    assert torch.equal(rows(ignoring), rows(plain))


def test_strict_refuses_extra_features_naming_the_option_and_ignore_still_needs_its_own():
    batch = batches(False)[0]
    with pytest.raises(InputError, match=r"unknown \['x', 'y'\].*feature_policy=\"ignore\""):
        dynemb.EmbeddingBagCollection(tables())(batch)
    with pytest.raises(InputError, match=r"missing \['b'\]"):
        dynemb.EmbeddingBagCollection(tables(), feature_policy="ignore")(batch.select(["a", "x"]))
    with pytest.raises(ConfigError, match="feature_policy must be one of"):
        dynemb.EmbeddingBagCollection(tables(), feature_policy="loose")


def test_weight_gradient_of_skipped_features_is_zero():
    batch = batches(True)[1]
    batch.weights.requires_grad_(True)
    ebc = dynemb.EmbeddingBagCollection(tables(), feature_policy="ignore")
    ebc(batch).values().sum().backward()
    for f in ("x", "y"):
        lo = sum(batch.feature(g)[0].numel() for g in batch.features[:batch.features.index(f)])
        n = batch.feature(f)[0].numel()
        assert torch.equal(batch.weights.grad[lo:lo + n], torch.zeros(n))
    assert batch.weights.grad.abs().sum() > 0


@pytest.mark.parametrize("kind,weighted", [("ebc", False), ("ebc", True), ("ec", False)])
def test_sharded_collections_keep_the_policy(group_of_one, kind, weighted):
    cls = dynemb.EmbeddingBagCollection if kind == "ebc" else dynemb.EmbeddingCollection
    sharded = dynemb.distributed.shard(cls(tables(), feature_policy="ignore"))
    assert sharded.feature_policy == "ignore"
    got = train(sharded, batches(weighted), kind)
    want = train(cls(tables()), [b.select(["a", "b"]) for b in batches(weighted)], kind)
    assert len(got[1]) == (4 if weighted else 0)
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    strict = dynemb.distributed.shard(cls(tables()))
    with pytest.raises(InputError, match="unknown"):
        strict(batches(False)[0])
