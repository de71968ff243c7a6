"""The spawned job of test_nonfinite_sharded.py: two tables sharded over W gloo ranks, a step
whose gradient is NaN in a RAISE table (every rank must raise, no rank may update), then a step
whose gradient is NaN in a SKIP table with max_grad_norm (the rest trains, clipped by the norm of
the finite rows over all shards)."""

from __future__ import annotations

import traceback

import torch

import dynemb
from _harness import export, init_group

BAGS = {"fa": [[5], [1, 2], [3], [4, 6], [7], [2, 8]],
        "fb": [[9], [1], [2, 3], [4], [5, 6], [7]]}
NAN_AT = 0  # sample 0 (on rank 0): fa = [5], fb = [9], a single id each, so one owner


def tables() -> list[dynemb.TableConfig]:
    return [dynemb.TableConfig(name="a", dim=4, features=["fa"], capacity=256,
                               optimizer=dynemb.SGD(lr=0.1), nonfinite="raise"),
            dynemb.TableConfig(name="b", dim=4, features=["fb"], capacity=256,
                               optimizer=dynemb.Adam(lr=0.1, max_grad_norm=0.5))]


def batch(lo: int, hi: int) -> dynemb.SparseBatch:
    return dynemb.SparseBatch.from_dict({f: bags[lo:hi] for f, bags in BAGS.items()})


def weights(lo: int, hi: int, feature_col: int | None) -> torch.Tensor:
    """(hi - lo, 8) loss weights of samples ``lo..hi`` (of the global batch); NaN in column
    ``feature_col`` of sample NAN_AT."""
    n = len(BAGS["fa"])
    w = torch.linspace(0.5, 1.5, n * 8).view(n, 8)
    if feature_col is not None:
        w[NAN_AT, feature_col] = float("nan")
    return w[lo:hi]


STEPS = [None, 0, 4]  # NaN column per step: none, table a (RAISE), table b (SKIP)


def step(module, rank_batch, w) -> None:
    (module(rank_batch).values() * w).sum().backward()


def run(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_group(rank, world_size, port)
    res: dict = {}
    try:
        per = len(BAGS["fa"]) // world_size
        lo, hi = rank * per, (rank + 1) * per
        sharded = dynemb.distributed.shard(dynemb.EmbeddingBagCollection(tables()))
        res["exports"], res["errors"] = [], []
        for col in STEPS:
            try:
                step(sharded, batch(lo, hi), weights(lo, hi, col))
                res["errors"].append(None)
            except dynemb.errors.DynembError as e:
                res["errors"].append((type(e).__name__, str(e)))
            res["exports"].append({n: export(t) for n, t in sharded.tables.items()})
        res["nonfinite"] = {n: t.stats().nonfinite_grads for n, t in sharded.tables.items()}
    except Exception:  # noqa: BLE001  (the parent reports it)
        res["__error__"] = traceback.format_exc()
    torch.save(res, f"{out_dir}/rank{rank}.pt")
