"""Spawned gloo jobs of the sharded checkpoint tests (one job per world size; every rank writes
its results to ``<out>/rank<r>.pt`` and the parent compares them).

Models: ``Tiny`` with its collection sharded on its own process group and the MLP under
DistributedDataParallel on the default group (as examples/torchrun_sharded.py does).
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import dynemb
from dynemb import checkpoint

import _full as F
import _models as M

HR, RR = dynemb.Routing.HASH_ROUNDROBIN, dynemb.Routing.ROUNDROBIN
STEPS, CUT = 6, 3


def sharded_model(group, routing=HR):
    model = M.Tiny(dynemb.distributed.shard(dynemb.EmbeddingBagCollection(M.tables(routing)),
                                            group=group))
    model.mlp = DistributedDataParallel(model.mlp)
    return model, torch.optim.Adam(model.mlp.parameters(), lr=0.01)


def _error(fn) -> str | None:
    try:
        fn()
    except checkpoint.CheckpointError as e:
        return str(e)
    return None


def job_w2(rank: int, out: Path, group, res: dict) -> None:
    """Resume equivalence; saves "hash" (at CUT) and "rr"; roundrobin → hash_roundrobin
    reshard; a base, delta and full checkpoint for the W = 1 incremental test."""
    ref, ref_opt = sharded_model(group)
    res["ref"] = M.train(ref, ref_opt, range(STEPS), rank)
    res["ref_tables"] = M.snapshot(ref)
    model, opt = sharded_model(group)
    M.train(model, opt, range(CUT), rank)
    checkpoint.save(out / "hash", model=model, dense_optimizer=opt, step=CUT)
    res["saved"] = M.snapshot(model)
    res["saved_dense"] = {k: v.clone() for k, v in model.mlp.module.state_dict().items()}
    model, opt = sharded_model(group)
    res["loaded_step"] = checkpoint.load(out / "hash", model=model, dense_optimizer=opt)
    res["resumed"] = M.train(model, opt, range(CUT, STEPS), rank)
    res["resumed_tables"] = M.snapshot(model)

    rr, rr_opt = sharded_model(group, RR)
    M.train(rr, rr_opt, range(CUT), rank)
    checkpoint.save(out / "rr", model=rr, dense_optimizer=rr_opt, step=CUT)
    res["rr_saved"] = M.snapshot(rr)
    hr, hr_opt = sharded_model(group)
    res["rr_error"] = _error(lambda: checkpoint.load(out / "rr", model=hr))
    checkpoint.load(out / "rr", model=hr, dense_optimizer=hr_opt, reshard=True)
    res["rr_as_hash"] = M.snapshot(hr)

    inc, inc_opt = sharded_model(group)
    M.train(inc, inc_opt, range(2), rank)
    checkpoint.save(out / "base", model=inc, dense_optimizer=inc_opt, step=2)
    M.train(inc, inc_opt, range(2, 4), rank)
    inc.sparse.tables["a"].erase(M.export(inc.sparse.tables["a"])["keys"][:2])
    checkpoint.export_incremental(out / "delta", model=inc, since_step=2, step=4,
                                  dense_optimizer=inc_opt)
    checkpoint.save(out / "full", model=inc, dense_optimizer=inc_opt, step=4)

    full = dynemb.distributed.shard(dynemb.EmbeddingBagCollection(F.configs()), group=group)
    F.fill(full, rank)
    res["at_capacity"] = all(t.size() == t.capacity() for t in full.tables.values())
    checkpoint.save(out / "full_tables", model=full, step=7)
    res["full_saved"] = {n: F.rows(t) for n, t in full.tables.items()}


def job_w3(rank: int, out: Path, group, res: dict) -> None:
    """Loads the W = 2 "hash" checkpoint: refused without reshard, re-routed with it."""
    model, opt = sharded_model(group)
    res["error"] = _error(lambda: checkpoint.load(out / "hash", model=model, dense_optimizer=opt))
    res["untouched"] = all(t.size() == 0 for t in model.sparse.tables.values())
    res["step"] = checkpoint.load(out / "hash", model=model, dense_optimizer=opt, reshard=True)
    res["tables"] = M.snapshot(model)
    res["dense"] = {k: v.clone() for k, v in model.mlp.module.state_dict().items()}
    res["after"] = M.train(model, opt, range(CUT, CUT + 1), rank)  # it trains on

    full = dynemb.distributed.shard(dynemb.EmbeddingBagCollection(F.configs()), group=group)
    dropped: dict = {}
    res["full_step"] = checkpoint.load(out / "full_tables", model=full, reshard=True,
                                       dropped=dropped)
    res["full_kept"] = {n: F.rows(t) for n, t in full.tables.items()}
    res["full_dropped"] = {n: F.batch_rows(b) for n, b in dropped.items()}
    res["full_buckets"] = {n: (t.home_buckets(res["full_kept"][n]["keys"]),
                               t.home_buckets(res["full_dropped"][n]["keys"])
                               if n in dropped else None, t.index.width)
                           for n, t in full.tables.items()}


JOBS = {"w2": job_w2, "w3": job_w3}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out: str, job: str) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    res: dict = {}
    try:
        group = dist.new_group(backend="gloo")  # the embeddings' own collectives
        JOBS[job](rank, Path(out), group, res)
    except Exception:  # the parent reports every rank's traceback
        res["__error__"] = traceback.format_exc()
        raise
    finally:
        torch.save(res, Path(out) / f"{job}-rank{rank}.pt")
        dist.destroy_process_group()


def spawn(job: str, world_size: int, out: Path) -> list[dict]:
    """Runs ``JOBS[job]`` on ``world_size`` gloo ranks sharing ``out``; every rank's results."""
    mp.start_processes(_worker, args=(world_size, _free_port(), str(out), job),
                       nprocs=world_size, start_method="spawn", join=True)
    res = [torch.load(out / f"{job}-rank{r}.pt", weights_only=False) for r in range(world_size)]
    errors = [r["__error__"] for r in res if "__error__" in r]
    assert not errors, "\n".join(errors)
    return res
