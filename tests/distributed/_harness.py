"""Multi-process harness of the sharded-collection tests: the cases, their deterministic batches,
the spawned gloo job that runs them all (one job per world size) and the single-process twin.

A job spawns W ranks (torch.multiprocessing, start method "spawn", gloo on 127.0.0.1 and a free
port, one torch thread per rank); every rank runs every case and writes its results to
``<out>/rank<r>.pt``; the parent compares them with a single-process collection fed the
concatenation of the ranks' batches.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dynemb

STEPS = 5
CAPACITY = 4096  # large enough: no eviction, so the sharded and single-process tables agree
OPTIMIZERS = {
    "sgd": dynemb.SGD(lr=0.1),
    "adagrad": dynemb.Adagrad(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
    "rowwise_adagrad": dynemb.RowWiseAdagrad(lr=0.1),
    "adam": dynemb.Adam(lr=0.05, weight_decay=0.01),
}
ROUTINGS = tuple(dynemb.Routing)
ID_RANGE = 120  # CONTINUOUS: most ids below it, some negative or beyond (the fallback)


@dataclass
class Case:
    """One equivalence case: tables, module kind and how each rank's batches look."""

    name: str
    tables: list[dynemb.TableConfig]
    kind: str = "ebc"  # or "ec"
    weighted: bool = False
    backend: str = "numba"
    batch_sizes: tuple[int, ...] = (3, 4, 2)  # per rank (cycled)
    empty: dict[int, str] = field(default_factory=dict)  # rank -> feature with empty bags
    unweighted_ranks: tuple[int, ...] = ()  # weighted case: these ranks send no weights
    no_wgrad_ranks: tuple[int, ...] = ()  # weighted case: these ranks' weights need no grad
    eval_steps: int = 0  # eval-mode forwards after the training steps
    steps: int = STEPS
    seed: int = 0

    @property
    def features(self) -> list[str]:
        return [f for t in self.tables for f in t.features]


def _tables(optimizer, routing, *, dims=(4, 3), **kw) -> list[dynemb.TableConfig]:
    """Two tables: "a" (SUM, one feature) and "b" (MEAN, two features sharing it)."""
    common = dict(optimizer=optimizer, routing=routing, capacity=CAPACITY,
                  id_range=ID_RANGE if routing == dynemb.Routing.CONTINUOUS else None, **kw)
    return [dynemb.TableConfig(name="a", dim=dims[0], features=["fa"],
                               pooling=dynemb.PoolingMode.SUM, **common),
            dynemb.TableConfig(name="b", dim=dims[1], features=["fb1", "fb2"],
                               pooling=dynemb.PoolingMode.MEAN, **common)]


def cases() -> list[Case]:
    """Every routing mode x optimizer (both pooling modes, shared features, weights on half),
    and the special cases."""
    out = []
    for i, routing in enumerate(ROUTINGS):
        for j, (opt_name, opt) in enumerate(OPTIMIZERS.items()):
            out.append(Case(name=f"{routing.value}-{opt_name}", tables=_tables(opt, routing),
                            weighted=(i + j) % 2 == 0, seed=10 * i + j))
    hr = dynemb.Routing.HASH_ROUNDROBIN
    out += [
        Case(name="empty-feature-and-empty-batch", tables=_tables(OPTIMIZERS["adam"], hr),
             weighted=True, batch_sizes=(3, 4, 0), empty={1: "fb1", 0: "fa"}, seed=40),
        Case(name="mixed-weights", tables=_tables(OPTIMIZERS["sgd"], hr), weighted=True,
             unweighted_ranks=(1,), no_wgrad_ranks=(2,), seed=47),
        Case(name="lfu-and-admission",
             tables=_tables(OPTIMIZERS["adagrad"], hr, score=dynemb.ScorePolicy.LFU,
                            admission=dynemb.Admission(threshold=2)), seed=41),
        Case(name="clip-global-norm",
             tables=_tables(dynemb.Adam(lr=0.05, max_grad_norm=0.05), hr), seed=42),
        Case(name="eval-mode",
             tables=_tables(OPTIMIZERS["sgd"], hr, eval_initializer=dynemb.Initializer(
                 kind=dynemb.InitKind.CONSTANT, value=0.5)),
             weighted=True, steps=2, eval_steps=2, seed=43),
        Case(name="torch-backend", tables=_tables(OPTIMIZERS["rowwise_adagrad"], hr),
             weighted=True, backend="torch", seed=44),
        Case(name="ec-sequence", tables=_tables(OPTIMIZERS["adam"], hr), kind="ec", seed=45),
        Case(name="caching-tiers", weighted=True, seed=48, tables=_tables(
            OPTIMIZERS["adam"], hr, bucket_capacity=8, storage=dynemb.Storage(
                mode=dynemb.StorageMode.CACHING, cache_load_factor=0.1))),
        Case(name="ec-hybrid-tiers", kind="ec", seed=49, tables=_tables(
            OPTIMIZERS["rowwise_adagrad"], hr, storage=dynemb.Storage(
                mode=dynemb.StorageMode.HYBRID, cache_load_factor=0.3))),
        Case(name="ec-sequence-lfu-continuous",
             tables=_tables(OPTIMIZERS["sgd"], dynemb.Routing.CONTINUOUS,
                            score=dynemb.ScorePolicy.LFU),
             kind="ec", batch_sizes=(2, 0, 3), seed=46),
    ]
    return out


# ---------------------------------------------------------------- deterministic data


def key_pool(seed: int) -> torch.Tensor:
    """Ids of one case: small, strided, negative and huge ones."""
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.cat([torch.arange(0, 60, 3), torch.randint(-50, 200, (15,), generator=g),
                      torch.randint(-(2**62), 2**62, (10,), generator=g)])


def rank_batch(case: Case, step: int, rank: int, world_size: int) -> dynemb.SparseBatch:
    """Rank ``rank``'s batch of ``step`` (same on every process)."""
    g = torch.Generator().manual_seed(case.seed * 100_003 + step * 1009 + rank * 7 + world_size)
    keys = key_pool(case.seed)
    b = case.batch_sizes[rank % len(case.batch_sizes)]
    lengths = torch.randint(0, 5, (len(case.features), b), generator=g)
    for r, feature in case.empty.items():
        if r == rank:
            lengths[case.features.index(feature)] = 0
    lengths = lengths.flatten()
    n = int(lengths.sum())
    values = keys[torch.randint(0, keys.numel(), (n,), generator=g)]
    weights = torch.rand(n, generator=g) + 0.5 if case.weighted else None
    if rank in case.unweighted_ranks:
        weights = None
    return dynemb.SparseBatch(features=case.features, values=values, lengths=lengths,
                              weights=weights)


def concat_batches(batches: list[dynemb.SparseBatch]) -> dynemb.SparseBatch:
    """The global batch: every rank's samples, rank after rank (weights of ones for a rank
    without weights when others have them)."""
    feats = batches[0].features
    weighted = any(b.weights is not None for b in batches)
    values, lengths, weights = [], [], []
    for f in feats:
        for b in batches:
            v, ln, w = b.feature(f)
            values.append(v)
            lengths.append(ln)
            weights.append(w if w is not None else torch.ones(v.numel()))
    return dynemb.SparseBatch(features=feats, values=torch.cat(values), lengths=torch.cat(lengths),
                              weights=torch.cat(weights) if weighted else None)


def projection(case: Case, step: int, batch: dynemb.SparseBatch, feature: str | None = None
               ) -> torch.Tensor:
    """A fixed random projection of the global output (rows: global samples or ids)."""
    g = torch.Generator().manual_seed(case.seed * 31 + step)
    if feature is None:
        width = sum(t.dim * len(t.features) for t in case.tables)
        return torch.randn(batch.batch_size, width, generator=g)
    dim = next(t.dim for t in case.tables if feature in t.features)
    return torch.randn(batch.feature(feature)[0].numel(), dim, generator=g)


def local_slices(case: Case, step: int, world_size: int):
    """(global batch, per rank: (sample offset, {feature: id offset}))."""
    batches = [rank_batch(case, step, r, world_size) for r in range(world_size)]
    offsets, s, ids = [], 0, dict.fromkeys(case.features, 0)
    for b in batches:
        offsets.append((s, dict(ids)))
        s += b.batch_size
        for f in case.features:
            ids[f] += b.feature(f)[0].numel()
    return concat_batches(batches), offsets, batches


def run_case(case: Case, module, batches, offsets, rank: int | None = None) -> dict:
    """Trains ``module`` STEPS steps (and evaluates), recording outputs and weight gradients.

    ``batches[step]`` is this process's batch, ``offsets[step]`` its slice of the global one;
    ``rank`` (None: the single process) decides whether its weights require grad."""
    rec = {"out": [], "wgrad": []}
    for step in range(case.steps + case.eval_steps):
        module.train(step < case.steps)
        batch, global_batch, (s0, id0) = batches[step], *offsets[step]
        if batch.weights is not None:
            grad = rank not in case.no_wgrad_ranks
            batch = dynemb.SparseBatch(features=batch.features, values=batch.values,
                                       lengths=batch.lengths,
                                       weights=batch.weights.clone().requires_grad_(grad))
        out = module(batch)
        if case.kind == "ebc":
            vals = out.values()
            proj = projection(case, step, global_batch)[s0:s0 + batch.batch_size]
            loss = (vals * proj).sum()
            rec["out"].append(vals.detach().clone())
        else:
            loss, vals = 0.0, {}
            for f in case.features:
                v = out[f].values
                full = projection(case, step, global_batch, f)
                loss = loss + (v * full[id0[f]:id0[f] + v.shape[0]]).sum()
                vals[f] = v.detach().clone()
            rec["out"].append(vals)
        if module.training:
            loss.backward()
        rec["wgrad"].append(None if batch.weights is None or batch.weights.grad is None
                            else batch.weights.grad.clone())
    rec["rows"] = {name: export(t) for name, t in module.tables.items()}
    return rec


def export(table: dynemb.DynamicTable) -> dict[str, torch.Tensor]:
    """Every row of a table, sorted by key."""
    e = table.export_batch(0, table.capacity())
    order = torch.argsort(e.keys)
    return {"keys": e.keys[order], "embeddings": e.embeddings[order],
            "optimizer_state": e.optimizer_state[order], "scores": e.scores[order]}


def collection(case: Case):
    cls = dynemb.EmbeddingBagCollection if case.kind == "ebc" else dynemb.EmbeddingCollection
    return cls(case.tables, backend=case.backend)


def single_process(case: Case, world_size: int) -> dict:
    """The twin: one collection fed the concatenation of the ranks' batches."""
    steps = [local_slices(case, s, world_size) for s in range(case.steps + case.eval_steps)]
    offsets = [(g, (0, dict.fromkeys(case.features, 0))) for g, _, _ in steps]
    return run_case(case, collection(case), [g for g, _, _ in steps], offsets)


# ---------------------------------------------------------------- the spawned job


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world_size: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))


def _worker(rank: int, world_size: int, ports: tuple[int, int], out_dir: str, job: str) -> None:
    torch.set_num_threads(1)
    init_group(rank, world_size, ports[0])
    results: dict = {}
    try:
        JOBS[job](rank, world_size, ports, results)
    except Exception:  # record it: the parent reports the traceback of every rank
        results["__error__"] = traceback.format_exc()
        raise
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(job: str, world_size: int, out_dir: Path) -> list[dict]:
    """Runs ``JOBS[job]`` on ``world_size`` spawned gloo ranks; returns each rank's results."""
    ports = (free_port(), free_port())
    mp.start_processes(_worker, args=(world_size, ports, str(out_dir), job), nprocs=world_size,
                       start_method="spawn", join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _equivalence_job(rank: int, world_size: int, ports, results: dict) -> None:
    for case in cases():
        steps = [local_slices(case, s, world_size) for s in range(case.steps + case.eval_steps)]
        sharded = dynemb.distributed.shard(collection(case))
        rec = run_case(case, sharded, [b[rank] for _, _, b in steps],
                       [(g, off[rank]) for g, off, _ in steps], rank)
        rec["stats"] = sharded.routing_stats().as_dict()
        rec["sizes"] = {name: t.size() for name, t in sharded.tables.items()}
        rec["capacity"] = {name: t.capacity() for name, t in sharded.tables.items()}
        results[case.name] = rec
    from _misuse import misuse_job  # noqa: PLC0415  (the misuse scenarios, same job)

    misuse_job(rank, world_size, ports, results)


JOBS = {"equivalence": _equivalence_job}
