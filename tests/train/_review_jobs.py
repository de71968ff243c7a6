"""Shared by the review tests of the pipelines: small tables and batches for hard cases, the
eager loop and a pipeline loop over them, and the spawned multi-process jobs (run by
test_review_pipelines_sharded.py through ``_pipes.spawn``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import dynemb
from dynemb.train import pipeline

FEATS = ["fa", "fb1", "fb2"]


class Batch:
    def __init__(self, sparse: dynemb.SparseBatch, labels: torch.Tensor) -> None:
        self.sparse, self.labels = sparse, labels


def configs(**over) -> list[dynemb.TableConfig]:
    """Table "a" (SUM, fa) and "b" (MEAN, fb1 and fb2), both 32 rows; ``over["a"|"b"]``
    overrides their fields."""
    a = dict(name="a", dim=4, features=["fa"], capacity=32, bucket_capacity=16,
             optimizer=dynemb.Adagrad(lr=0.1), pooling=dynemb.PoolingMode.SUM)
    b = dict(name="b", dim=3, features=["fb1", "fb2"], capacity=32, bucket_capacity=16,
             optimizer=dynemb.Adam(lr=0.05), pooling=dynemb.PoolingMode.MEAN)
    a.update(over.get("a", {}))
    b.update(over.get("b", {}))
    return [dynemb.TableConfig(**a), dynemb.TableConfig(**b)]


def data(n: int, *, size: int = 5, seed: int = 0, weighted: bool = False, wgrad: bool = False,
         hi: int = 60, empty_at=(), maxlen: int = 4) -> list[Batch]:
    """``n`` batches of ``size`` samples (0 at ``empty_at``), bags of 0 to ``maxlen - 1`` ids
    drawn from ``[0, hi)`` (so MEAN bags are often empty), optional weights (needing a
    gradient with ``wgrad``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        s = 0 if i in empty_at else size
        lengths = torch.randint(0, maxlen, (3 * s,), generator=g)
        values = torch.randint(0, hi, (int(lengths.sum()),), generator=g)
        w = torch.rand(values.numel(), generator=g).requires_grad_(wgrad) if weighted else None
        sparse = dynemb.SparseBatch(features=FEATS, values=values, lengths=lengths, weights=w)
        out.append(Batch(sparse, (torch.rand(s, generator=g) > 0.5).float()))
    return out


class Net(torch.nn.Module):
    def __init__(self, ebc: torch.nn.Module, width: int) -> None:
        super().__init__()
        self.ebc = ebc
        torch.manual_seed(0)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 1))

    def forward(self, b: Batch) -> torch.Tensor:
        return self.mlp(self.ebc(b.sparse).values()).squeeze(-1)


def loss_fn(out: torch.Tensor, b: Batch) -> torch.Tensor:
    # a sum: an empty batch has a loss (0) and a backward
    return torch.nn.functional.binary_cross_entropy_with_logits(out, b.labels, reduction="sum")


def build(cfgs, net=Net):
    model = net(dynemb.EmbeddingBagCollection(cfgs), sum(c.dim * len(c.features) for c in cfgs))
    return model, torch.optim.Adam(model.mlp.parameters(), lr=0.01)


def eager(model, opt, batches) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for b in batches:
        y = model(b)
        loss = loss_fn(y, b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        out.append((loss.detach(), y.detach()))
    return out


def run(kind: str, model, opt, batches, **kw) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    with pipeline(kind, model=model, optimizer=opt, loss_fn=loss_fn, **kw) as pipe:
        it = iter(batches)
        while True:
            try:
                s = pipe.progress(it)
            except StopIteration:
                break
            out.append((s.loss, s.output.detach()))
    return out


def held(model) -> int:
    """Rows held on this rank by every collection of ``model``."""
    return sum(t.held_rows() for m in model.modules()
               if isinstance(m, dynemb.EmbeddingBagCollection | dynemb.EmbeddingCollection)
               for t in m.tables.values())


# ---------------------------------------------------------------------- spawned jobs

EXACT = ("base", "sparse_dist", "fused_sparse_dist", "prefetch")


class Mixed(torch.nn.Module):
    """A sharded collection (tables "a", "b") and an unsharded one of this rank ("loc", read
    from feature fb1 too), in one model."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        from dynemb.distributed import ShardedEmbeddingBagCollection

        cached = dynemb.Storage(mode=dynemb.StorageMode.CACHING, cache_load_factor=0.25)
        cfgs = configs(a=dict(capacity=16 * world_size, on_full=dynemb.OnFull.COUNT,
                              admission=dynemb.Admission(threshold=2, counter_capacity=64),
                              score=dynemb.ScorePolicy.LFU),
                       b=dict(capacity=32 * world_size, storage=cached,
                              on_full=dynemb.OnFull.COUNT))
        self.sharded = ShardedEmbeddingBagCollection(cfgs, feature_policy="ignore")
        loc = dynemb.TableConfig(name="loc", dim=2, features=["fb1"], capacity=16,
                                 bucket_capacity=16, optimizer=dynemb.SGD(lr=0.1),
                                 on_full=dynemb.OnFull.COUNT)
        self.local = dynemb.EmbeddingBagCollection([loc], feature_policy="ignore")
        torch.manual_seed(0)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 1))

    def forward(self, b: Batch) -> torch.Tensor:
        x = torch.cat([self.sharded(b.sparse).values(), self.local(b.sparse).values()], dim=1)
        return self.mlp(x).squeeze(-1)


def _mixed(world_size: int):
    model = Mixed(world_size)
    return model, torch.optim.Adam(model.mlp.parameters(), lr=0.01)


def _state(model) -> dict:
    from _pipes import M

    tables = {f"local.{k}": v for k, v in M.snapshot(model.local).items()}
    return {"tables": {**M.snapshot(model.sharded), **tables},
            "dense": [p.detach().clone() for p in model.mlp.parameters()]}


def job_ranks(rank: int, world_size: int) -> dict:
    """On 3 ranks: (1) each exact kind over a model with a sharded and an unsharded collection,
    weights needing a gradient, empty batches on rank 1, full tables (admission, LFU, COUNT, a
    CACHING table smaller than a batch), against the eager loop; (2) iterators of 6, 5 and 4
    batches; (3) a batch rejected by the sharded collection on rank 1 only."""
    out: dict = {}

    def make():
        return data(8, seed=100 + rank, weighted=True, wgrad=True, hi=150, maxlen=6,
                    empty_at=(2, 5) if rank == 1 else ())

    ref, ref_opt = _mixed(world_size)
    want_data = make()
    want = eager(ref, ref_opt, want_data)
    out["want"] = {"losses": [w[0] for w in want], "state": _state(ref),
                   "wgrads": [b.sparse.weights.grad for b in want_data],
                   "evicted": [t.stats().evicted for t in ref.sharded.tables.values()]}
    for kind in EXACT:
        model, opt = _mixed(world_size)
        got_data = make()
        got = run(kind, model, opt, got_data)
        out[kind] = {"losses": [g[0] for g in got], "state": _state(model), "held": held(model),
                     "wgrads": [b.sparse.weights.grad for b in got_data]}
    out["uneven"] = {}
    for kind in ("base", "sparse_dist", "fused_sparse_dist", "semi_sync", "prefetch"):
        model, opt = _mixed(world_size)
        pipe = pipeline(kind, model=model, optimizer=opt, loss_fn=loss_fn)
        steps = 0
        with pipe:
            it = iter(data(6 - rank, seed=rank))
            try:
                while True:
                    pipe.progress(it)
                    steps += 1
            except StopIteration:
                pass
            more = len(run_on(pipe, iter(data(2, seed=50 + rank))))  # a new iterator goes on
        out["uneven"][kind] = {"steps": steps, "dropped": pipe.dropped, "more": more,
                               "held": held(model)}
    out["rejected"] = {}
    for kind in ("sparse_dist", "semi_sync", "prefetch"):
        model, opt = _mixed(world_size)
        batches = data(6, seed=rank)
        if rank == 1:
            bad = batches[3].sparse
            batches[3] = Batch(dynemb.SparseBatch(features=["fa", "fb1", "zz"],
                                                  values=bad.values, lengths=bad.lengths),
                               batches[3].labels)
        pipe = pipeline(kind, model=model, optimizer=opt, loss_fn=loss_fn)
        it, steps, error = iter(batches), 0, None
        try:
            while True:
                pipe.progress(it)
                steps += 1
        except Exception as e:  # noqa: BLE001  (reported)
            error = (type(e).__name__, str(e))
        held_failed = held(model)
        pipe.close()
        eager(model, opt, data(1, seed=9 + rank))  # every rank goes on without the pipeline
        out["rejected"][kind] = {"steps": steps, "error": error, "held": held_failed,
                                 "after": held(model)}
    out["closed_early"] = {}
    for kind in ("fused_sparse_dist", "semi_sync"):
        model, opt = _mixed(world_size)
        pipe = pipeline(kind, model=model, optimizer=opt, loss_fn=loss_fn)
        it = iter(data(6, seed=rank))
        for _ in range(2):
            pipe.progress(it)
        pipe.close()  # batches (looked up, their output exchange started) dropped
        held_closed = held(model)
        eager(model, opt, data(1, seed=7 + rank))
        more = len(run(kind, model, opt, data(3, seed=8 + rank)))
        out["closed_early"][kind] = {"held": held_closed, "more": more, "after": held(model)}
    dist.barrier()
    return out


def run_on(pipe, it) -> list:
    steps = []
    try:
        while True:
            steps.append(pipe.progress(it))
    except StopIteration:
        return steps
