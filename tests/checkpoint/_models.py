"""Models, batches and comparisons shared by the checkpoint tests (single and multi-process).

``Tiny`` is a small CTR-like model: a dynemb collection (plain or sharded) under ``sparse`` and an
MLP under ``mlp`` (optionally DistributedDataParallel). Batches are deterministic per (seed,
step, rank), so a resumed run can be compared with an uninterrupted one exactly.
"""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb import checkpoint

FEATURES = ("fa", "fb1", "fb2")


def tables(routing=dynemb.Routing.HASH_ROUNDROBIN, *, capacity: int = 512, dim_a: int = 4,
           optimizer_a=None, evicting: bool = False) -> list[dynemb.TableConfig]:
    """Table "a" (Adam, SUM) and "b" (Adagrad, MEAN, admission, two features).

    ``evicting``: "b" gets 2 buckets of 8 slots (LRU, failures counted), so training evicts.
    """
    b_kw = dict(capacity=16, bucket_capacity=8, on_full=dynemb.OnFull.COUNT) if evicting else \
        dict(capacity=capacity)
    return [
        dynemb.TableConfig(name="a", dim=dim_a, features=["fa"], capacity=capacity,
                           optimizer=optimizer_a or dynemb.Adam(lr=0.05, weight_decay=0.01),
                           routing=routing, initializer=dynemb.Initializer(std=0.1)),
        dynemb.TableConfig(name="b", dim=3, features=["fb1", "fb2"],
                           optimizer=dynemb.Adagrad(lr=0.1, initial_accumulator_value=0.1),
                           pooling=dynemb.PoolingMode.MEAN, routing=routing,
                           admission=dynemb.Admission(threshold=2, counter_capacity=64),
                           initializer=dynemb.Initializer(std=0.1), **b_kw),
    ]


class Tiny(torch.nn.Module):
    """``sparse`` (a dynemb collection) → concatenated pooled embeddings → ``mlp`` → logit."""

    def __init__(self, sparse: torch.nn.Module, width: int = 4 + 3 + 3, seed: int = 0) -> None:
        super().__init__()
        self.sparse = sparse
        g = torch.Generator().manual_seed(seed)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 1))
        with torch.no_grad():
            for p in self.mlp.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, batch: dynemb.SparseBatch) -> torch.Tensor:
        return self.mlp(self.sparse(batch).values()).squeeze(1)


def batch(step: int, rank: int = 0, *, seed: int = 0, size: int = 6, id_high: int = 60
          ) -> tuple[dynemb.SparseBatch, torch.Tensor]:
    """A deterministic (batch, labels) of ``size`` samples for (seed, step, rank)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step * 1009 + rank * 7)
    lengths = torch.randint(0, 4, (len(FEATURES) * size,), generator=g)
    n = int(lengths.sum())
    pool = torch.cat([torch.arange(-5, id_high), torch.tensor([2**62, -(2**61), 12345678901])])
    values = pool[torch.randint(0, pool.numel(), (n,), generator=g)]
    labels = torch.randint(0, 2, (size,), generator=g).float()
    return dynemb.SparseBatch(features=list(FEATURES), values=values, lengths=lengths), labels


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int = 0, *,
          seed: int = 0, **batch_kw) -> list[tuple[float, torch.Tensor]]:
    """Trains on ``batch(step, rank)`` for each step; returns (loss, logits) per step."""
    out = []
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for step in steps:
        b, labels = batch(step, rank, seed=seed, **batch_kw)
        logits = model(b)
        loss = loss_fn(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append((float(loss.detach()), logits.detach().clone()))
    return out


def export(table: dynemb.DynamicTable) -> dict[str, torch.Tensor]:
    """Every row of a table, sorted by key."""
    e = table.export_batch(0, table.capacity())
    order = torch.argsort(e.keys)
    return {"keys": e.keys[order], "embeddings": e.embeddings[order].clone(),
            "optimizer_state": e.optimizer_state[order].clone(), "scores": e.scores[order]}


def snapshot(model: torch.nn.Module) -> dict:
    """Rows, steps and admission counters of every table of ``model`` (by checkpoint name)."""
    from dynemb.checkpoint.model import view_model  # noqa: PLC0415

    out = {}
    for slot in view_model(model).tables:
        t = slot.table
        rec = export(t)
        rec["step"], rec["optimizer_step"] = t.step, t.optimizer.step
        if t.admission is not None:
            keys, counts = t.admission.export()
            order = torch.argsort(keys)
            rec["admission"] = (keys[order], counts[order])
        out[slot.key] = rec
    return out


def union(snapshots: list[dict]) -> dict:
    """The tables of several ranks' snapshots merged (rows concatenated, sorted by key)."""
    out = {}
    for key in snapshots[0]:
        parts = [s[key] for s in snapshots]
        keys = torch.cat([p["keys"] for p in parts])
        order = torch.argsort(keys)
        rec = {f: torch.cat([p[f] for p in parts])[order]
               for f in ("keys", "embeddings", "optimizer_state", "scores")}
        rec["step"] = max(p["step"] for p in parts)
        rec["optimizer_step"] = max(p["optimizer_step"] for p in parts)
        out[key] = rec
    return out


def assert_same_tables(got: dict, want: dict, *, steps: bool = True,
                       admission: bool = True) -> None:
    """Exact equality of two snapshots (rows, optimizer state, scores; steps and counters)."""
    assert sorted(got) == sorted(want)
    for key in want:
        g, w = got[key], want[key]
        for f in ("keys", "embeddings", "optimizer_state", "scores"):
            assert torch.equal(g[f], w[f]), (key, f)
        if steps:
            assert (g["step"], g["optimizer_step"]) == (w["step"], w["optimizer_step"]), key
        if admission and "admission" in w:
            assert all(torch.equal(a, b) for a, b in zip(g["admission"], w["admission"])), key


def fresh(tables_=None, **kw) -> tuple[Tiny, torch.optim.Optimizer]:
    """A new ``Tiny`` over a plain collection of ``tables_`` (default ``tables(**kw)``) and an
    Adam optimizer of its MLP."""
    model = Tiny(dynemb.EmbeddingBagCollection(tables_ or tables(**kw)))
    return model, torch.optim.Adam(model.mlp.parameters(), lr=0.01)


def trained_other() -> tuple[Tiny, torch.optim.Optimizer]:
    """A model trained on other batches, whose state must survive a failed load untouched."""
    model, opt = fresh()
    train(model, opt, range(2), seed=5)
    return model, opt


def expect_untouched(path, model, opt=None, match: str = "", **load_kw) -> str:
    """``load`` raises CheckpointError matching ``match`` and leaves ``model`` (tables and
    dense state) as it was; returns the message."""
    before = snapshot(model)
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(checkpoint.CheckpointError, match=match) as info:
        checkpoint.load(path, model=model, dense_optimizer=opt, **load_kw)
    assert_same_tables(snapshot(model), before)
    assert all(torch.equal(v, dense[k]) for k, v in model.state_dict().items())
    return str(info.value)
