"""Shared by the pipeline tests: a small model over an EmbeddingBagCollection (SUM and MEAN
tables) and an EmbeddingCollection, deterministic batches in which batch i+1 reuses exactly
the keys batch i updated plus new ones, the eager reference loop, a pipeline loop, and the
spawned gloo job that runs them on 2 ranks."""

from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dynemb
from dynemb.train import PIPELINES, pipeline

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoint"))
import _models as M  # noqa: E402  (snapshot / union / assert_same_tables)

OPTIMIZERS = {
    "sgd": dynemb.SGD(lr=0.1),
    "adagrad": dynemb.Adagrad(lr=0.1),
    "rowwise_adagrad": dynemb.RowWiseAdagrad(lr=0.1),
    "adam": dynemb.Adam(lr=0.05),
}


@dataclass
class Batch:
    sparse: dynemb.SparseBatch
    labels: torch.Tensor


def tables(optimizer, *, capacity: int = 64, caching: bool = False, seq: bool = True):
    """Table "a" (SUM, feature fa) full and evicting, "b" (MEAN, fb1 and fb2), and the sequence
    table "s" (feature fs); ``caching``: "b" is CACHING at x = 0.1 over a larger capacity."""
    common = dict(optimizer=optimizer, bucket_capacity=16)
    b_storage = (dynemb.Storage(mode=dynemb.StorageMode.CACHING, cache_load_factor=0.1)
                 if caching else dynemb.Storage())
    bag = [dynemb.TableConfig(name="a", dim=4, features=["fa"], capacity=capacity,
                              pooling=dynemb.PoolingMode.SUM, **common),
           dynemb.TableConfig(name="b", dim=3, features=["fb1", "fb2"],
                              capacity=4096 if caching else 4 * capacity,
                              pooling=dynemb.PoolingMode.MEAN, storage=b_storage, **common)]
    seqt = [dynemb.TableConfig(name="s", dim=2, features=["fs"], capacity=capacity, **common)]
    return bag, (seqt if seq else [])


class Net(torch.nn.Module):
    """An MLP over the pooled features, plus a small term of the sequence rows."""

    def __init__(self, ebc, ec=None, seed: int = 0) -> None:
        super().__init__()
        self.ebc, self.ec = ebc, ec
        torch.manual_seed(seed)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(4 + 3 + 3, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 1))

    def forward(self, batch: Batch):
        logits = self.mlp(self.ebc(batch.sparse).values()).squeeze(-1)
        seq = None
        if self.ec is not None:
            seq = self.ec(batch.sparse)["fs"].values
        return logits, seq


def loss_fn(output, batch: Batch) -> torch.Tensor:
    logits, seq = output
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
    if seq is not None:
        loss = loss + 0.01 * (seq ** 2).sum()
    return loss


def batches(n: int, *, rank: int = 0, size: int = 6, seed: int = 0, reuse: bool = True,
            distinct: bool = False) -> list[Batch]:
    """``n`` batches; with ``reuse`` batch i+1's fa keys are exactly batch i's plus new ones
    (and the other features draw from a small range, so keys repeat); ``distinct``: no key
    twice within a batch's feature and one id per bag (for exact hand-written oracles)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    out, prev = [], torch.empty(0, dtype=torch.int64)
    for i in range(n):
        if distinct:
            base = 10_000 * (rank + 1) + 100 * i
            fa = torch.arange(base, base + size)
            if reuse and i:
                fa[: size // 2] = prev[: size // 2]
            prev = fa
            vals = [fa, fa + 1_000_000, fa + 2_000_000, fa + 3_000_000, fa + 4_000_000]
            lengths = [torch.ones(size, dtype=torch.int64)] * 5
        else:
            new = torch.randint(0, 1 << 40, (size,), generator=g) + 1_000 * rank
            fa = torch.cat([prev, new]) if reuse else new
            prev = fa[-2 * size:]
            la = _split(fa.numel(), size, g)
            vals, lengths = [fa], [la]
            for hi in (40, 40, 30):
                ln = torch.randint(0, 3, (size,), generator=g)
                vals.append(torch.randint(0, hi, (int(ln.sum()),), generator=g))
                lengths.append(ln)
            ln = torch.randint(1, 3, (size,), generator=g)
            vals.append(torch.randint(0, 50, (int(ln.sum()),), generator=g))
            lengths.append(ln)
        sparse = dynemb.SparseBatch(features=["fa", "fb1", "fb2", "x", "fs"],
                                    values=torch.cat(vals), lengths=torch.cat(lengths))
        labels = (torch.rand(size, generator=g) > 0.5).float()
        out.append(Batch(sparse=sparse, labels=labels))
    return out


def _split(total: int, bags: int, g: torch.Generator) -> torch.Tensor:
    """Lengths of ``bags`` bags summing to ``total``."""
    cuts = torch.sort(torch.randint(0, total + 1, (bags - 1,), generator=g)).values
    edges = torch.cat([torch.tensor([0]), cuts, torch.tensor([total])])
    return edges[1:] - edges[:-1]


def build(optimizer_name: str, *, group=None, caching: bool = False, seq: bool = True,
          capacity: int = 64):
    """(model, dense optimizer): sharded over ``group`` when a process group is initialised
    (each shard as large as the one-process table, full and evicting alike)."""
    if dist.is_initialized():
        capacity *= dist.get_world_size(group)
    bag, seqt = tables(OPTIMIZERS[optimizer_name], caching=caching, seq=seq, capacity=capacity)
    if dist.is_initialized():
        from dynemb.distributed import ShardedEmbeddingBagCollection, ShardedEmbeddingCollection
        ebc = ShardedEmbeddingBagCollection(bag, group=group, feature_policy="ignore")
        ec = ShardedEmbeddingCollection(seqt, group=group, feature_policy="ignore") if seq else None
    else:
        ebc = dynemb.EmbeddingBagCollection(bag, feature_policy="ignore")
        ec = dynemb.EmbeddingCollection(seqt, feature_policy="ignore") if seq else None
    model = Net(ebc, ec)
    return model, torch.optim.Adam(model.mlp.parameters(), lr=0.01)


def swap_stash(params: list[torch.Tensor], stashed: list | None) -> list:
    """The oracle of stash_gradients: the parameters take the stashed gradients (none at
    first); returns the current ones, stashed for the next step."""
    current = [p.grad for p in params]
    for p, g in zip(params, stashed or [None] * len(params)):
        p.grad = g
    return current


def eager(model, opt, data: list[Batch]) -> list[torch.Tensor]:
    """The plain loop: forward, backward, dense step; the detached losses."""
    losses = []
    for b in data:
        loss = loss_fn(model(b), b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def piped(kind: str, model, opt, data: list[Batch], **kw) -> list[torch.Tensor]:
    """The same batches through ``pipeline(kind)``; the detached losses in batch order."""
    pipe = pipeline(kind, model=model, optimizer=opt, loss_fn=loss_fn, **kw)
    losses = []
    it = iter(data)
    with pipe:
        while True:
            try:
                step = pipe.progress(it)
            except StopIteration:
                break
            assert step.index == len(losses)
            losses.append(step.loss)
    return losses


def state(model) -> dict:
    """Tables (by checkpoint name) and the dense parameters."""
    return {"tables": M.snapshot(model),
            "dense": {k: v.detach().clone() for k, v in model.mlp.state_dict().items()}}


def assert_same(got: dict, want: dict) -> None:
    M.assert_same_tables(got["tables"], want["tables"])
    for k, v in want["dense"].items():
        assert torch.equal(got["dense"][k], v), k


# ---------------------------------------------------------------------- spawned jobs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world_size: int, out: Path, *args) -> list:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns each rank's
    result (a rank's exception is re-raised here with its traceback)."""
    port = free_port()
    mp.start_processes(_entry, args=(fn, world_size, port, str(out), args), nprocs=world_size,
                       start_method="spawn", join=True)
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    failed = [f"rank {r} failed:\n{res['error']}" for r, res in enumerate(results)
              if isinstance(res, dict) and "error" in res]
    if failed:
        raise AssertionError("\n".join(failed))
    return results


def _entry(rank: int, fn, world_size: int, port: int, out: str, args) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result = fn(rank, world_size, *args)
    except Exception:  # noqa: BLE001  (reported to the parent)
        result = {"error": traceback.format_exc()}
    try:
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- the 2-rank jobs

STEPS = 20


def job_exact(rank: int, world_size: int, kinds, opts) -> dict:
    """Per optimizer: the eager loop, then each pipeline kind, over the same rank batches;
    returns the losses and states by (kind, optimizer)."""
    out = {}
    for opt in opts:
        data = batches(STEPS, rank=rank, seed=11)
        for kind in ("eager", *kinds):
            model, dense = build(opt, caching=True)
            if kind == "eager":
                losses = eager(model, dense, data)
            else:
                losses = piped(kind, model, dense, data)
            out[kind, opt] = {"losses": losses, "state": state(model),
                              "stale": sum(t.stats().stale_updates
                                           for c in (model.ebc, model.ec)
                                           for t in c.tables.values()),
                              "held": sum(t.held_rows() for c in (model.ebc, model.ec)
                                          for t in c.tables.values())}
    return out


def job_semi_sync(rank: int, world_size: int, start_batch: int, stash: bool) -> dict:
    """semi_sync, and the same schedule written by hand with the collections' stage calls."""
    from dynemb.nn.staging import StageQueue

    data = batches(10, rank=rank, seed=13)
    model, dense = build("rowwise_adagrad", caching=True)
    got = piped("semi_sync", model, dense, data, start_batch=start_batch, stash_gradients=stash)
    ref, ref_opt = build("rowwise_adagrad", caching=True)
    cols = [ref.ebc, ref.ec]
    for c in cols:
        c.attach(StageQueue("oracle"))
    staged: dict[int, list] = {}
    want, stashed = [], None

    def start(j):
        staged[j] = [c.stage_input(data[j].sparse) for c in cols]

    for i in range(len(data)):
        if i == 0:
            start(0)
        if i + 1 < len(data):
            start(i + 1)
            if i + 1 >= max(start_batch, 1):
                for c, s in zip(cols, staged[i + 1]):
                    c.stage_lookup(s)
        loss = loss_fn(ref(data[i]), data[i])
        ref_opt.zero_grad(set_to_none=True)
        loss.backward()
        if stash and i >= start_batch:
            stashed = swap_stash(list(ref.mlp.parameters()), stashed)
        ref_opt.step()
        want.append(loss.detach())
    for c in cols:
        c.detach()
    return {"got": got, "want": want, "state": state(model), "ref": state(ref)}


def job_uneven(rank: int, world_size: int, kinds) -> dict:
    """Rank 0 has one batch more than rank 1: every pipeline stops at the same step."""
    out = {}
    for kind in kinds:
        model, dense = build("sgd", caching=True)
        data = batches(6 - rank, rank=rank, seed=17)
        pipe = pipeline(kind, model=model, optimizer=dense, loss_fn=loss_fn)
        it, steps = iter(data), 0
        with pipe:
            while True:
                try:
                    pipe.progress(it)
                    steps += 1
                except StopIteration:
                    break
            out[kind] = {"steps": steps, "dropped": pipe.dropped}
    return out


def job_resume(rank: int, world_size: int, path: str) -> dict:
    """fused_sparse_dist: 6 steps, drain, save, a new model loads and continues; against the
    uninterrupted eager run."""
    data = batches(STEPS, rank=rank, seed=19)
    ref, ref_opt = build("adam", caching=True, capacity=1024)
    want = eager(ref, ref_opt, data)
    model, dense = build("adam", caching=True, capacity=1024)
    pipe = pipeline("fused_sparse_dist", model=model, optimizer=dense, loss_fn=loss_fn)
    it = iter(data)
    got = [pipe.progress(it).loss for _ in range(6)]
    refused = None
    try:
        dynemb.checkpoint.save(path, model=model, dense_optimizer=dense, step=6)
    except dynemb.checkpoint.CheckpointError as e:
        refused = str(e)
    got += [s.loss for s in pipe.drain()]
    dynemb.checkpoint.save(path, model=model, dense_optimizer=dense, step=len(got))
    pipe.close()
    model2, dense2 = build("adam", caching=True, capacity=1024)
    dynemb.checkpoint.load(path, model=model2, dense_optimizer=dense2)
    got += piped("fused_sparse_dist", model2, dense2, data[len(got):])
    return {"got": got, "want": want, "state": state(model2), "ref": state(ref),
            "refused": refused}


def job_iterator_raises(rank: int, world_size: int) -> dict:
    """Rank 1's iterator raises at its third batch: every rank raises instead of waiting."""
    model, dense = build("sgd")

    def source():
        for i, b in enumerate(batches(6, rank=rank)):
            if rank == 1 and i == 2:
                raise OSError("the data file went away")
            yield b

    pipe = pipeline("sparse_dist", model=model, optimizer=dense, loss_fn=loss_fn)
    it = source()
    try:
        while True:
            pipe.progress(it)
    except Exception as e:  # noqa: BLE001
        out = {"error": None, "kind": type(e).__name__, "msg": str(e)}
    pipe.close()
    out["held"] = sum(t.held_rows() for t in model.ebc.tables.values())
    out.pop("error")
    return out


def job_ddp(rank: int, world_size: int) -> dict:
    """The recommended setup: the sharded collection on its own group, the dense part in
    DistributedDataParallel on the default group. The eager loop, two pipelines over the same
    setup, and the manual gradient sum (loss / W, all-reduce of the dense gradients)."""
    from torch.nn.parallel import DistributedDataParallel

    from dynemb.distributed import ShardedEmbeddingBagCollection

    data = batches(8, rank=rank, seed=23)
    out = {}
    for how in ("ddp_eager", "ddp_sparse_dist", "ddp_semi_sync", "manual"):
        bag, _ = tables(OPTIMIZERS["adagrad"], capacity=128, seq=False)
        ebc = ShardedEmbeddingBagCollection(bag, group=dist.new_group(backend="gloo"),
                                            feature_policy="ignore")
        model = Net(ebc)
        if how != "manual":
            model.mlp = DistributedDataParallel(model.mlp)
        opt = torch.optim.SGD(model.mlp.parameters(), lr=0.1)
        if how == "manual":
            def after_backward(m=model) -> None:
                for p in m.mlp.parameters():
                    dist.all_reduce(p.grad)
            scaled = lambda o, b: loss_fn(o, b) / world_size  # noqa: E731
            pipe = pipeline("base", model=model, optimizer=opt, loss_fn=scaled,
                            after_backward=after_backward)
            with pipe:
                it = iter(data)
                losses = [pipe.progress(it).loss * world_size for _ in data]
        elif how == "ddp_eager":
            losses = eager(model, opt, data)
        else:
            losses = piped(how[4:], model, opt, data)
        mlp = model.mlp.module if hasattr(model.mlp, "module") else model.mlp
        out[how] = {"losses": losses, "tables": M.snapshot(model),
                    "dense": {k: v.detach().clone() for k, v in mlp.state_dict().items()}}
    return out
