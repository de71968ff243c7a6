"""Misuse scenarios run inside the spawned job (after the equivalence cases): every rank must
raise a clear error (none may hang waiting for the others), and the group stays usable after."""

from __future__ import annotations

import torch
import torch.distributed as dist

import dynemb
from _harness import init_group


def _tables(dim_b: int = 3, name_b: str = "b") -> list[dynemb.TableConfig]:
    return [dynemb.TableConfig(name="a", dim=4, features=["fa"], capacity=256),
            dynemb.TableConfig(name=name_b, dim=dim_b, features=["fb"], capacity=256)]


def _batch(features=("fa", "fb")) -> dynemb.SparseBatch:
    return dynemb.SparseBatch.from_dict({f: [[1, 2], [3]] for f in features})


def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the test inspects type and message)
        return type(e).__name__, str(e)
    return "ok", ""


def _shard(tables):
    return dynemb.distributed.shard(dynemb.EmbeddingBagCollection(tables))


def misuse_job(rank: int, world_size: int, ports, results: dict) -> None:
    res = results.setdefault("misuse", {})
    res["different_tables"] = _outcome(
        lambda: _shard(_tables(name_b="b" if rank == 0 else "c")))
    res["different_field"] = _outcome(lambda: _shard(_tables(dim_b=3 if rank == 0 else 5)))

    def filled():
        ebc = dynemb.EmbeddingBagCollection(_tables())
        if rank == world_size - 1:
            ebc.tables["a"].find_or_insert(torch.tensor([7]))
        dynemb.distributed.shard(ebc)

    res["filled_source"] = _outcome(filled)
    m1 = _shard(_tables())
    m2 = _shard(_tables(dim_b=5))
    res["bad_batch"] = _outcome(lambda: m1(_batch(("fa", "other") if rank == 0 else ("fa", "fb"))))
    res["weighted_ec"] = _outcome(lambda: dynemb.distributed.shard(dynemb.EmbeddingCollection(
        _tables()))(dynemb.SparseBatch.from_dict({"fa": [[1]], "fb": [[2]]},
                                                 weights={"fa": [[1.0]], "fb": [[1.0]]})))

    def modes():
        m1.train(rank != 0)
        try:
            m1(_batch())
        finally:
            m1.train(True)

    res["mode_mismatch"] = _outcome(modes)
    res["order_mismatch"] = _outcome(lambda: (m1 if rank == 0 else m2)(_batch()))
    twin = _shard(_tables())  # the same tables as m1: only the build order tells them apart
    res["twin_order_mismatch"] = _outcome(lambda: (m1 if rank == 0 else twin)(_batch()))
    res["owner_full"] = _outcome(lambda: _owner_full(rank))
    # the group and the modules still work after every rank raised together
    res["recovered"] = _outcome(lambda: m1(_batch()).values().sum().backward())
    res["not_a_collection"] = _outcome(lambda: dynemb.distributed.shard(torch.nn.Linear(2, 2)))
    if world_size >= 3:
        res["world_size_changed"] = _world_size_changed(rank, ports, m1)


def _world_size_changed(rank: int, ports, module) -> tuple[str, str]:
    """The default group is rebuilt with one rank fewer; the old module must refuse to run."""
    dist.destroy_process_group()
    if rank == 2:
        return "skipped", "not in the new group"
    init_group(rank, 2, ports[1])
    return _outcome(lambda: module(_batch()))


def _owner_full(rank: int) -> None:
    """Every key is owned by rank 1 (roundrobin, keys = 1 mod 6), whose 8-row shard cannot hold
    them: only rank 1's lookup fails, after the header; every rank must raise, none hang."""
    table = dynemb.TableConfig(name="full", dim=2, features=["f"], capacity=16,
                               routing=dynemb.Routing.ROUNDROBIN,
                               score=dynemb.ScorePolicy.NO_EVICTION)
    m = dynemb.distributed.shard(dynemb.EmbeddingBagCollection([table]))
    keys = torch.arange(40) * 6 + 1 + 6000 * rank
    m(dynemb.SparseBatch(features=["f"], values=keys, lengths=torch.ones(40, dtype=torch.int64)))
