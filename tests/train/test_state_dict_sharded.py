"""state_dict of a sharded collection on 2 gloo ranks: each rank's shards, its rank, the world
size and the routing; a reload on the same rank of the same world size trains on exactly as
the saved collection does, and any other rank or world size is refused, naming it and the
checkpoint's reshard."""

from __future__ import annotations

import io

import torch
import torch.distributed as dist

import dynemb
from dynemb.errors import ConfigError
from _pipes import spawn

STEPS = 6


def tables() -> list[dynemb.TableConfig]:
    return [dynemb.TableConfig(name="u", dim=4, features=["u"], capacity=128,
                               optimizer=dynemb.Adam(lr=0.05)),
            dynemb.TableConfig(name="i", dim=4, features=["i"], capacity=64,
                               optimizer=dynemb.RowWiseAdagrad(lr=0.1),
                               routing=dynemb.Routing.ROUNDROBIN)]


def batches(rank: int) -> list[dynemb.SparseBatch]:
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(2 * STEPS):
        ids = torch.randint(0, 300, (32,), generator=g).tolist()
        out.append(dynemb.SparseBatch.from_dict({"u": [[x] for x in ids[:16]],
                                                 "i": [[x, x + 3] for x in ids[16:]]}))
    return out


def model(group=None) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.sparse = dynemb.distributed.shard(dynemb.EmbeddingBagCollection(tables()), group=group)
    m.mlp = torch.nn.Linear(4, 1)
    return m


def train(m: torch.nn.Module, data: list) -> list[float]:
    losses = []
    for b in data:
        out = m.sparse(b)
        loss = m.mlp(out["u"] * out["i"]).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            for p in m.mlp.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        losses.append(loss.item())
    return losses


def cloned(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def job(rank: int, world_size: int) -> dict:
    data = batches(rank)
    a = model()
    train(a, data[:STEPS])
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    mine = buf.getvalue()
    theirs = [None] * world_size
    dist.all_gather_object(theirs, mine)
    other = torch.load(io.BytesIO(theirs[1 - rank]), weights_only=True)
    out = {"keys": sorted(torch.load(io.BytesIO(mine), weights_only=True))}
    out["a"] = train(a, data[STEPS:])

    b = model()
    b.load_state_dict(torch.load(io.BytesIO(mine), weights_only=True))
    out["b"] = train(b, data[STEPS:])
    out["same state"] = all(torch.equal(x, y) for x, y in
                            zip(a.state_dict().values(), b.state_dict().values()))
    out["routing stats"] = (a.sparse.routing_stats().as_dict(),
                            b.sparse.routing_stats().as_dict())

    c = model()
    before = cloned(c.state_dict())
    try:
        c.load_state_dict(other)
    except ConfigError as e:
        out["other rank"] = str(e)
    out["unchanged"] = all(torch.equal(x, y) for x, y in zip(before.values(),
                                                              c.state_dict().values()))
    own = torch.load(io.BytesIO(mine), weights_only=True)
    try:  # no 'sharding': the shards' cut is unknown, so they never load, strict or not
        c.load_state_dict({k: v for k, v in own.items() if k != "sparse.sharding"},
                          strict=False)
    except ConfigError as e:
        out["no sharding"] = str(e)
    bad = {**own, "sparse.local.tables.u.rows.hbm": own["sparse.local.tables.u.rows.hbm"].double()}
    try:  # a shard refused: the load counters stay as they were too
        c.load_state_dict(bad)
    except ConfigError as e:
        out["bad shard"] = (str(e), c.sparse._steps, c.sparse._bytes_sent)
    solo = dist.new_group([0])  # every rank makes it; rank 0 alone shards over it
    if rank == 0:
        try:
            model(solo).load_state_dict(torch.load(io.BytesIO(mine), weights_only=True))
        except ConfigError as e:
            out["other world"] = str(e)
    dist.barrier()
    return out


def test_a_sharded_state_dict_reloads_exactly_on_its_rank_and_nowhere_else(tmp_path):
    results = spawn(job, 2, tmp_path)
    for rank, r in enumerate(results):
        assert "sparse.sharding" in r["keys"] and "sparse.local.tables.u.rows.hbm" in r["keys"]
        assert r["b"] == r["a"] and r["same state"], rank
        assert r["routing stats"][0] == r["routing stats"][1]
        assert f"rank {1 - rank} in the state but {rank} here" in r["other rank"]
        assert "reshard=True" in r["other rank"] and r["unchanged"]
        assert "has no 'sparse.sharding' entry" in r["no sharding"]
        assert "'rows.hbm' is torch.float64" in r["bad shard"][0]
        assert r["bad shard"][1:] == (0, 0)
    assert "world_size 2 in the state but 1 here" in results[0]["other world"]
