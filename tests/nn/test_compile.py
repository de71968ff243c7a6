"""torch.compile(model) on a model holding collections works from its first call: each
collection call is a graph break (``torch.compiler.disable``), the dense part around it is
compiled, and training gives exactly the eager losses and rows."""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb import SparseBatch


class Model(torch.nn.Module):
    """A pooled and a sequence collection (plain or sharded), a dense MLP around them."""

    def __init__(self, ebc, ec) -> None:
        super().__init__()
        self.ebc, self.ec = ebc, ec
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(self, batch: SparseBatch) -> torch.Tensor:
        pooled = self.ebc(batch.select(["a", "b"])).values()
        seq = self.ec(batch.select(["s"]))["s"]
        per_sample = torch.zeros(pooled.shape[0], 4).index_add(
            0, torch.repeat_interleave(torch.arange(pooled.shape[0]), seq.lengths), seq.values)
        return self.mlp(torch.cat([pooled, per_sample], 1)[:, :8] + per_sample.sum(1, True)).mean()


def tables(names, dim):
    return [dynemb.TableConfig(name=n, dim=dim, features=[n], capacity=512,
                               optimizer=dynemb.Adagrad(lr=0.1)) for n in names]


def build(sharded: bool = False) -> Model:
    torch.manual_seed(0)
    ebc = dynemb.EmbeddingBagCollection(tables(["a", "b"], 4))
    ec = dynemb.EmbeddingCollection(tables(["s"], 4))
    if sharded:
        ebc, ec = dynemb.distributed.shard(ebc), dynemb.distributed.shard(ec)
    return Model(ebc, ec)


def batches(n: int = 5) -> list[SparseBatch]:
    g = torch.Generator().manual_seed(1)
    return [SparseBatch.from_dict({f: [torch.randint(0, 40, (int(k),), generator=g).tolist()
                                       for k in torch.randint(0, 4, (6,), generator=g)]
                                   for f in ("a", "b", "s")}) for _ in range(n)]


def run(model: Model, forward, data: list[SparseBatch]) -> tuple[list[float], dict]:
    opt = torch.optim.SGD(model.mlp.parameters(), lr=0.05)
    losses = []
    for batch in data:
        opt.zero_grad()
        loss = forward(batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    rows = {}
    for coll in (model.ebc, model.ec):
        for name, t in coll.tables.items():
            e = t.export_batch(0, t.capacity())
            order = e.keys.argsort()
            rows[name] = (e.keys[order], e.embeddings[order], e.optimizer_state[order])
    return losses, rows


def check_same(got, want) -> None:
    assert got[0] == want[0]
    for name, parts in want[1].items():
        for g, w in zip(got[1][name], parts):
            assert torch.equal(g, w), name


def test_compiled_model_trains_exactly_as_eager_from_the_first_call():
    """aot_eager: dynamo and autograd tracing, without code generation (seconds)."""
    torch._dynamo.reset()
    eager, compiled = build(), build()  # the same seed: the same dense weights
    want = run(eager, eager, batches(3))
    got = run(compiled, torch.compile(compiled, backend="aot_eager"), batches(3))
    check_same(got, want)


def test_the_default_compiler_compiles_the_dense_part():
    """inductor (the default) on the first call; fullgraph on the dense part alone."""
    torch._dynamo.reset()
    eager, compiled = build(), build()
    compiled.mlp = torch.compile(compiled.mlp, fullgraph=True)
    want = run(eager, eager, batches(2))
    got = run(compiled, torch.compile(compiled), batches(2))
    assert got[0] == pytest.approx(want[0], rel=1e-5, abs=1e-6)  # inductor may fuse differently
    for name, parts in want[1].items():
        assert torch.equal(got[1][name][0], parts[0])
        for g, w in zip(got[1][name][1:], parts[1:]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_sharded_collections_are_graph_breaks_too(group_of_one):
    torch._dynamo.reset()
    eager, compiled = build(sharded=True), build(sharded=True)
    want = run(eager, eager, batches(3))
    got = run(compiled, torch.compile(compiled, backend="aot_eager"), batches(3))
    check_same(got, want)
