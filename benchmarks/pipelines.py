"""How fast does each training pipeline step a sharded DLRM, against the eager schedule?

Question: the step time of every pipeline of ``dynemb.train.pipeline`` (base, sparse_dist,
fused_sparse_dist, semi_sync, prefetch) training the same DLRM over the same batches on W gloo
ranks (default 2, one process and one torch thread each). ``base`` is the eager schedule (stage
after stage); the others overlap a coming batch's input distribution, lookup or cache prefetch
with the current batch's work. Targets on a CPU machine: sparse_dist and fused_sparse_dist no
slower than base at P90, semi_sync faster than sparse_dist (reported as flags, not asserted).

Workload: ``dynemb.models.dlrm.DLRM`` with 13 dense features (bottom MLP 512-256-dim), 8 sparse
features in 4 tables of 2 features each (dim 64, 2^18 rows each, row-wise Adagrad fused into
backward, Zipf(1.05) ids over 10^7 scrambled ids, 4 ids per bag; the tables fill and evict),
the first table CACHING at cache_load_factor 0.25 (so that every kind, prefetch included,
trains the same model), the pairwise dot interaction and a top MLP 512-256-1; dense parameters
trained by Adam, their gradients summed over the ranks with one all-reduce after backward;
global batch 512 samples (256 per rank), which makes a step take tens of ms on a 2-core
machine.

Method: one spawned job of W ranks. Each kind first runs alone, untimed, on a fresh model for
its peak RSS per rank (VmHWM, reset through ``/proc/self/clear_refs``). Then each kind gets its
own model (the same initial weights) and pipeline, alive side by side and fed the same batches,
and ``--rounds`` rounds run one short window of each kind, in an order rotated by r, so load
bursts from other processes hit all kinds alike. A window: ``--rewarm-steps`` untimed steps
(the batches a kind runs ahead are staged right before timing, as in a long run), a barrier on
a separate gloo group, ``--steps`` timed ``progress`` calls with the garbage collector paused.
A step's time on a rank is the interval between the ends of successive calls (the first from
the barrier); the step's time is the slowest rank's. No barrier per step: it would add a
synchronisation point to every step and cut the overlap the pipelines build across steps; in
steady state the staging done inside a window for coming batches equals what was done before it
for the window's own, so every kind is charged for exactly its ``--steps`` batches. Reported:
P50 and P90 over all windows' steps, the median over rounds of each kind's window median over
base's (paired, so drift between rounds cancels), samples/s at the mean step time,
``Step.seconds`` averaged per step and over ranks, and the main thread's running, waiting for
a core and blocked shares (``/proc/thread-self/schedstat``).

    .venv/bin/python benchmarks/pipelines.py [--rounds 15] [--steps 20] [--out PATH]
    .venv/bin/python benchmarks/pipelines.py --device cuda     # nccl, one GPU, world size 1
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dynemb  # noqa: E402
from _common import (  # noqa: E402
    base_parser, emit, environment, loadavg_1m, log, rank_to_id, ratio, set_threads, summary_ms,
    zipf_ranks,
)
from dynemb.data.base import Batch  # noqa: E402
from dynemb.models.dlrm import DLRM  # noqa: E402
from dynemb.train import PIPELINES, pipeline  # noqa: E402
from dynemb.train.pipelines import SPLIT  # noqa: E402

SPLIT_KEYS = (*SPLIT, "total")


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(",") if s)


def parse_args(argv=None):
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: W gloo ranks; cuda: nccl on one GPU (world size 1)")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (cpu)")
    p.add_argument("--kinds", type=str, default=",".join(PIPELINES))
    p.add_argument("--batch-size", type=int, default=512, help="global samples per step")
    p.add_argument("--dense-features", type=int, default=13)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--features-per-table", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--bag-size", type=int, default=4, help="ids per bag")
    p.add_argument("--capacity", type=int, default=1 << 18, help="global rows per table")
    p.add_argument("--caching-tables", type=int, default=1,
                   help="how many tables (the first ones) are CACHING (>= 1: prefetch needs one)")
    p.add_argument("--cache-load-factor", type=float, default=0.25)
    p.add_argument("--bottom-mlp", type=_sizes, default=(512, 256))
    p.add_argument("--top-mlp", type=_sizes, default=(512, 256))
    p.add_argument("--zipf-exponent", type=float, default=1.05)
    p.add_argument("--universe", type=int, default=10**7, help="ids are Zipf ranks 1..universe")
    p.add_argument("--warmup-steps", type=int, default=8,
                   help="untimed steps of each kind's model before the first round")
    p.add_argument("--rewarm-steps", type=int, default=2,
                   help="untimed steps before each window (2: the most any kind runs ahead)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per window")
    p.add_argument("--rounds", type=int, default=15,
                   help="rounds, each one window of every kind (a multiple of the kinds' count "
                        "puts each kind in each place of the order equally often)")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch_size, args.dim, args.bag_size, args.capacity = 64, 8, 2, 1 << 11
        args.bottom_mlp, args.top_mlp, args.universe = (16,), (16,), 10**4
        args.warmup_steps, args.steps, args.rounds = 3, 3, 2
    args.kinds = args.kinds.split(",")
    if not args.kinds or not set(args.kinds) <= set(PIPELINES) or "base" not in args.kinds:
        p.error(f"--kinds: expected 'base' and any of {list(PIPELINES)}, found {args.kinds}")
    if not 1 <= args.caching_tables <= args.tables:
        p.error(f"--caching-tables: expected 1..{args.tables} (the prefetch pipeline needs a "
                f"CACHING table), found {args.caching_tables}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda: torch.cuda.is_available() is False on this machine (no GPU "
                    "or no CUDA build of torch); run it on a GPU machine, or use --device cpu")
        args.world_size = 1
    if args.world_size < 1 or args.batch_size % args.world_size:
        p.error(f"--batch-size {args.batch_size}: expected a multiple of --world-size "
                f"{args.world_size} (>= 1)")
    return args


# ---------------------------------------------------------------------------- workload

def feature_names(args) -> list[str]:
    return [f"t{t}_f{f}" for t in range(args.tables) for f in range(args.features_per_table)]


def tables(args) -> list[dynemb.TableConfig]:
    """The DLRM's tables: the first ``--caching-tables`` CACHING, the others HBM_ONLY."""
    caching = dynemb.Storage(mode=dynemb.StorageMode.CACHING,
                             cache_load_factor=args.cache_load_factor)
    names = feature_names(args)
    k = args.features_per_table
    return [dynemb.TableConfig(
        name=f"t{t}", dim=args.dim, features=names[t * k:(t + 1) * k], capacity=args.capacity,
        optimizer=dynemb.RowWiseAdagrad(lr=0.01),
        storage=caching if t < args.caching_tables else dynemb.Storage())
        for t in range(args.tables)]


def make_batches(args, rank: int, n: int) -> list[Batch]:
    """Rank ``rank``'s ``n`` batches (every kind trains on these, in this order)."""
    rng = np.random.default_rng([args.seed, rank])
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 62)))
    b = args.batch_size // args.world_size
    num_ids = len(feature_names(args)) * b * args.bag_size
    out = []
    for _ in range(n):
        ids = rank_to_id(zipf_ranks(rng, num_ids, args.zipf_exponent, args.universe))
        sparse = dynemb.SparseBatch(
            features=feature_names(args), values=ids,
            lengths=torch.full((num_ids // args.bag_size,), args.bag_size, dtype=torch.int64))
        out.append(Batch(dense=torch.randn(b, args.dense_features, generator=gen), sparse=sparse,
                         labels=(torch.rand(b, generator=gen) < 0.25).float()))
    return out


def build(args, device: torch.device) -> tuple[DLRM, torch.optim.Optimizer]:
    """The same DLRM on every rank and in every run (seeded), its tables sharded."""
    torch.manual_seed(args.seed)
    model = DLRM(dense_dim=args.dense_features, tables=tables(args),
                 bottom_mlp=args.bottom_mlp, top_mlp=args.top_mlp, device=device)
    model.embeddings = dynemb.distributed.shard(model.embeddings)
    return model, torch.optim.Adam(model.dense_parameters(), lr=1e-3)


def sum_gradients(params: list[torch.nn.Parameter]) -> None:
    """The dense gradients summed over the ranks (one all-reduce), as a data-parallel job."""
    if dist.get_world_size() == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(p)
        offset += g.numel()


# ---------------------------------------------------------------------------- memory

def _reset_peak_rss() -> bool:
    """Hands freed heap back to the OS and resets the process's RSS high-water mark (Linux);
    False where that is not possible (then the peak is the process's lifetime peak)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _schedstat() -> tuple[float, float] | None:
    """This thread's (seconds on a core, seconds runnable but waiting for one) so far, from
    /proc/thread-self/schedstat (Linux with schedstats); None elsewhere."""
    try:
        run_ns, wait_ns = Path("/proc/thread-self/schedstat").read_text().split()[:2]
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return None


def _peak_rss_mb() -> float:
    """The RSS high-water mark (MiB) since the last reset (or of the process's life)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------------- the runs

class KindRun:
    """One kind's model and pipeline, trained on ``data`` window by window."""

    def __init__(self, args, kind: str, data: list[Batch], device: torch.device) -> None:
        self.args, self.device = args, device
        self.model, opt = build(args, device)
        params = self.model.dense_parameters()
        w = dist.get_world_size()

        def loss_fn(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
            return torch.nn.functional.binary_cross_entropy_with_logits(logits,
                                                                        batch.labels) / w

        self.pipe = pipeline(kind, model=self.model, optimizer=opt, loss_fn=loss_fn,
                             forward=lambda m, b: m(b.dense, b.sparse),
                             after_backward=lambda: sum_gradients(params))
        self.it = iter(data)

    def advance(self, steps: int) -> None:
        """``steps`` untimed steps."""
        for _ in range(steps):
            self.pipe.progress(self.it)

    def window(self, timing) -> dict:
        """``--rewarm-steps`` untimed steps, a barrier, ``--steps`` timed steps: this rank's
        seconds per step, the summed split of the timed steps, and the main thread's seconds
        running and waiting for a core during them (None where the kernel does not say)."""
        self.advance(self.args.rewarm_steps)
        steps, split = [], dict.fromkeys(SPLIT_KEYS, 0.0)
        gc.collect()
        dist.barrier(group=timing)
        gc.disable()
        try:
            sched, last = _schedstat(), time.perf_counter()
            for k in range(self.args.steps):
                step = self.pipe.progress(self.it)
                if self.device.type == "cuda" and k == self.args.steps - 1:
                    torch.cuda.synchronize(self.device)  # the window ends when the GPU is done
                now = time.perf_counter()
                steps.append(now - last)
                last = now
                for key in SPLIT_KEYS:
                    split[key] += step.seconds.get(key, 0.0)
            end = _schedstat()
        finally:
            gc.enable()
        sched = None if sched is None or end is None else [b - a for a, b in zip(sched, end)]
        return {"step_s": steps, "split_s": split, "sched_s": sched}

    def table_counts(self) -> dict[str, dict[str, int]]:
        """This rank's shard counters per table (summed over ranks in the record), taken after
        the last window (the batches the kind runs ahead are looked up or staged by then)."""
        keys = ("size", "capacity", "lookups", "hbm_hits", "evicted", "failed_inserts",
                "stale_updates", "cache_evictions", "prefetched")
        return {name: {k: getattr(t.stats(), k) for k in keys}
                for name, t in self.model.embeddings.tables.items()}

    def close(self) -> None:
        self.pipe.drain()
        self.pipe.close()
        self.model.embeddings.close()


def memory_of(args, kind: str, data: list[Batch], device: torch.device) -> dict:
    """One kind alone on a fresh model (warm-up + ``--steps`` untimed steps): the peak RSS (and
    GPU memory) of the process meanwhile. Also takes first-call costs off the timed windows."""
    gc.collect()
    exact = _reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run = KindRun(args, kind, data, device)
    run.advance(args.warmup_steps + args.steps)
    run.close()
    out = {"peak_rss_mb": _peak_rss_mb(), "peak_rss_exact": exact}
    if device.type == "cuda":
        out["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def _rank(rank: int, args, port: int, out: str) -> None:
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=300))
    try:
        timing = dist.new_group(backend="gloo")  # barriers outside the collections' group
        n = args.warmup_steps + args.rounds * (args.rewarm_steps + args.steps) + 3
        data = [b.to(device) for b in make_batches(args, rank, n)]
        memory = {}
        for kind in args.kinds:
            if rank == 0:
                log(f"pipelines: memory of {kind} (alone, untimed)")
            memory[kind] = memory_of(args, kind, data, device)
        runs = {kind: KindRun(args, kind, data, device) for kind in args.kinds}
        for run in runs.values():
            run.advance(args.warmup_steps)
        windows, load = [], []
        for r in range(args.rounds):
            load.append(loadavg_1m())
            if rank == 0:
                log(f"pipelines: round {r + 1} of {args.rounds} (load {load[-1]})")
            order = args.kinds[r % len(args.kinds):] + args.kinds[:r % len(args.kinds)]
            for kind in order:
                windows.append({"round": r, "kind": kind, **runs[kind].window(timing)})
        counts = {kind: run.table_counts() for kind, run in runs.items()}
        for run in runs.values():
            run.close()
        Path(out, f"rank{rank}.json").write_text(json.dumps(
            {"memory": memory, "windows": windows, "tables": counts, "load": load}))
        dist.barrier()  # every rank done before any tears down (see examples/torchrun_sharded.py)
    finally:
        dist.destroy_process_group()


def spawn_job(args) -> list[dict]:
    """Runs the job on ``--world-size`` spawned ranks; returns each rank's memory and windows."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(args, port, tmp), nprocs=args.world_size,
                           start_method="spawn", join=True)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text())
                for r in range(args.world_size)]


# ---------------------------------------------------------------------------- summary

def _slowest(per_rank: list[dict], kind: str) -> list[list[float]]:
    """Per window of ``kind`` (round order): the slowest rank's seconds of each step."""
    wins = [[w["step_s"] for w in rank["windows"] if w["kind"] == kind] for rank in per_rank]
    return [[max(ts) for ts in zip(*ranks)] for ranks in zip(*wins)]


def _main_thread(windows: list[dict]) -> dict | None:
    """Shares of a rank's timed wall seconds its main thread spent running, runnable but
    waiting for a core (other processes or threads had it), and blocked (waiting for the other
    rank, a collective, a lock)."""
    if any(w["sched_s"] is None for w in windows):
        return None
    wall = sum(sum(w["step_s"]) for w in windows)
    run, queued = (sum(w["sched_s"][k] for w in windows) for k in (0, 1))
    return {"running": run / wall, "waiting_for_a_core": queued / wall,
            "blocked": max(0.0, 1.0 - (run + queued) / wall)}


def _tables_at_end(per_rank: list[dict]) -> dict:
    """Per table, over the ranks: load factor, hbm hit rate, and the counters that show the
    tables evicting and nothing lost (stale_updates, failed_inserts)."""
    out = {}
    for name in per_rank[0]:
        c = {k: sum(rank[name][k] for rank in per_rank) for k in per_rank[0][name]}
        out[name] = {"load_factor": c["size"] / c["capacity"],
                     "hbm_hit_rate": c["hbm_hits"] / max(c["lookups"], 1),
                     **{k: c[k] for k in ("evicted", "cache_evictions", "prefetched",
                                          "stale_updates", "failed_inserts")}}
    return out


def summarise(args, per_rank: list[dict]) -> dict:
    """Per kind: P50/P90 of the slowest rank's step times, samples/s, peak RSS per rank and the
    step time split (ms per step, and as shares of the step)."""
    results = {}
    for kind in args.kinds:
        windows = _slowest(per_rank, kind)
        slowest = [t for w in windows for t in w]
        s = summary_ms(slowest)
        splits = [w["split_s"] for rank in per_rank for w in rank["windows"] if w["kind"] == kind]
        n = len(slowest) * len(per_rank)  # rank-steps the split is averaged over
        split = {key: 1e3 * sum(sp[key] for sp in splits) / n for key in SPLIT_KEYS}
        split["other"] = split["total"] - sum(split[k] for k in SPLIT)
        memory = [rank["memory"][kind] for rank in per_rank]
        threads = [_main_thread([w for w in rank["windows"] if w["kind"] == kind])
                   for rank in per_rank]
        results[kind] = {
            "tables_at_end": _tables_at_end([rank["tables"][kind] for rank in per_rank]),
            "step_ms_p50": s["median_ms"], "step_ms_p90": s["p90_ms"], "step_ms_min": s["min_ms"],
            "step_ms_mean": 1e3 * sum(slowest) / len(slowest), "steps_timed": len(slowest),
            "step_ms_p50_per_window": [summary_ms(w)["median_ms"] for w in windows],
            "samples_per_s": len(slowest) * args.batch_size / sum(slowest),
            "peak_rss_mb_per_rank": [m["peak_rss_mb"] for m in memory],
            "peak_rss_reset_per_run": all(m["peak_rss_exact"] for m in memory),
            "main_thread_share_per_rank": threads,
            "split_ms_per_step": split,
            "split_share_of_total": {k: v / split["total"] for k, v in split.items()
                                     if k != "total" and split["total"] > 0},
        }
        if args.device == "cuda":
            results[kind]["cuda_max_allocated_mb"] = max(m["cuda_max_allocated_mb"]
                                                         for m in memory)
    return results


def ratios_and_targets(results: dict) -> tuple[dict, dict]:
    """Each kind against base (pooled P50 and P90, and the median over rounds of the ratio of
    window medians, which pairs windows run seconds apart), and the issue's targets."""
    base = results["base"]
    ratios = {kind: {
        "p50_vs_base": ratio(r["step_ms_p50"], base["step_ms_p50"]),
        "p90_vs_base": ratio(r["step_ms_p90"], base["step_ms_p90"]),
        "p50_vs_base_paired_by_round": float(np.median(
            [a / b for a, b in zip(r["step_ms_p50_per_window"],
                                   base["step_ms_p50_per_window"])]))}
        for kind, r in results.items()}
    p90 = {kind: r["step_ms_p90"] for kind, r in results.items()}
    targets = {}
    for kind in ("sparse_dist", "fused_sparse_dist"):
        if kind in p90:
            targets[f"{kind}_p90_no_slower_than_base"] = p90[kind] <= p90["base"]
    if "semi_sync" in p90 and "sparse_dist" in p90:
        targets["semi_sync_p90_faster_than_sparse_dist"] = p90["semi_sync"] < p90["sparse_dist"]
        targets["semi_sync_p90_vs_sparse_dist"] = ratio(p90["semi_sync"], p90["sparse_dist"])
    if "fused_sparse_dist" in p90 and "sparse_dist" in p90:
        targets["fused_sparse_dist_p90_vs_sparse_dist"] = ratio(p90["fused_sparse_dist"],
                                                                p90["sparse_dist"])
    return ratios, targets


def config_record(args, threads: dict) -> dict:
    return {"device": args.device, "backend": "nccl" if args.device == "cuda" else "gloo",
            "world_size": args.world_size, "kinds": args.kinds,
            "global_batch_size": args.batch_size,
            "samples_per_rank": args.batch_size // args.world_size,
            "dense_features": args.dense_features, "tables": args.tables,
            "sparse_features": args.tables * args.features_per_table, "dim": args.dim,
            "bag_size": args.bag_size, "capacity_rows_per_table": args.capacity,
            "caching_tables": args.caching_tables, "cache_load_factor": args.cache_load_factor,
            "bottom_mlp": [*args.bottom_mlp, args.dim], "top_mlp": [*args.top_mlp, 1],
            "sparse_optimizer": "rowwise_adagrad", "dense_optimizer": "adam",
            "zipf_exponent": args.zipf_exponent, "universe_ids": args.universe,
            "warmup_steps": args.warmup_steps, "rewarm_steps_per_window": args.rewarm_steps,
            "timed_steps_per_window": args.steps, "rounds": args.rounds, "seed": args.seed,
            "smoke": args.smoke, **threads}


NOTES = [
    "each rank is a process with --threads torch threads (default 1); 2 ranks fill 2 cores, so "
    "an overlap can only hide waiting (on the other rank, a collective), never run two "
    "computations of one rank at once",
    "step time = the slowest rank's interval between the ends of successive progress() calls, "
    "in windows of --steps after a barrier (none per step); see the script's docstring",
    "p50_vs_base_paired_by_round = median over rounds of (the kind's window median / base's in "
    "the same round): the ratio that holds up when other processes load the machine in bursts "
    "(environment.loadavg_1m_per_round: the job's own ranks make about 2)",
    "main_thread_share_per_rank: of each rank's timed wall time, the share its main thread "
    "(which runs every stage) was running, runnable but without a core, or blocked (waiting "
    "for the other rank or a collective): blocked time is what an overlap can hide",
    "split_ms_per_step: Step.seconds averaged per step and over ranks; dense includes the dense "
    "gradient all-reduce (waiting for the other rank lands there); other = total minus the "
    "parts (the per-batch agreement all-reduce, bookkeeping)",
    "peak_rss_mb_per_rank: each kind alone on a fresh model before the rounds, VmHWM reset "
    "before it (clear_refs after malloc_trim; peak_rss_reset_per_run false: lifetime peak)",
]


def main(argv=None) -> dict:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    load_start = loadavg_1m()
    t0 = time.perf_counter()
    per_rank = spawn_job(args)
    results = summarise(args, per_rank)
    ratios, targets = ratios_and_targets(results)
    record = {
        "benchmark": "pipelines",
        "question": f"step time of each training pipeline on a sharded DLRM, "
                    f"{args.world_size} {'nccl' if args.device == 'cuda' else 'gloo'} rank(s), "
                    "against base (the eager schedule)",
        "config": config_record(args, threads),
        "environment": {**environment(), "loadavg_1m_start": load_start,
                        "wall_s": time.perf_counter() - t0,
                        "loadavg_1m_per_round": per_rank[0]["load"]},
        "notes": NOTES,
        "results": results,
        "ratios": ratios,
        "targets": targets,
    }
    emit(record, args.out)
    return record


if __name__ == "__main__":
    main()
