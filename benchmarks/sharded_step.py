"""How fast is a training step sharded over 2 gloo ranks, against one process on the same batch?

Question: the step time (forward + backward + fused update) of
``dynemb.distributed.ShardedEmbeddingBagCollection`` on W gloo ranks (default 2, one process
and one torch thread each; hash_roundrobin routing), each rank feeding its own B/W samples,
against one process running ``dynemb.EmbeddingBagCollection`` on the whole global batch of B
samples (the baseline), both measured in this run. Also measured: one process on one rank's
B/W samples with a table of capacity/W rows (the step a rank would take if communication were
free), which bounds what sharding can gain. And the sharded run once more with the requesters
grouping their ids by owner the way other devices do (``torch.unique`` and stable sorts, what
the CPU path did before its compiled pass): the baseline of rank 0's input-distribution stage.

Workload: one table, one pooled SUM feature, global batch ``--batch-size`` bags of
``--bag-size`` Zipf(1.05) ids over ``--universe`` ids (scrambled); loss = sum of the outputs.
Warm-up steps (untimed) fill the tables; then every step is timed. Sharded: a barrier before
each step, each rank times its step, the step time is the slowest rank's. Times are medians
(P90 beside them); ids/s = global ids per step / median step time.

    .venv/bin/python benchmarks/sharded_step.py [--optimizers sgd,adam] [--out PATH]
"""

from __future__ import annotations

import datetime
import json
import os
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
    base_parser, emit, environment, loadavg_1m, log, rank_to_id, rate_m, ratio, set_threads,
    summary_ms, timed, zipf_ranks,
)

STAGES = ("input_dist", "lookup_pool_output_dist", "backward_update")
OPTIMIZERS = {"sgd": lambda: dynemb.SGD(lr=0.01), "rowwise_adagrad": lambda: dynemb.RowWiseAdagrad(
    lr=0.01), "adam": lambda: dynemb.Adam(lr=0.001)}


def parse_args(argv=None):
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks of the sharded run")
    p.add_argument("--capacity", type=int, default=1 << 20, help="global rows of the table")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--optimizers", type=str, default="sgd,adam")
    p.add_argument("--batch-size", type=int, default=4096, help="global bags per step")
    p.add_argument("--bag-size", type=int, default=16, help="ids per bag")
    p.add_argument("--zipf-exponent", type=float, default=1.05)
    p.add_argument("--universe", type=int, default=10**7, help="ids are Zipf ranks 1..universe")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--steps", type=int, default=30, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds alternating the three runs (fresh tables each); times pooled")
    args = p.parse_args(argv)
    if args.smoke:
        args.capacity, args.dim, args.batch_size, args.bag_size = 1 << 12, 8, 128, 4
        args.universe, args.warmup_steps, args.steps, args.rounds = 10**4, 2, 3, 1
    args.optimizers = args.optimizers.split(",")
    if not set(args.optimizers) <= set(OPTIMIZERS):
        p.error(f"--optimizers: expected some of {sorted(OPTIMIZERS)}, found {args.optimizers}")
    if args.batch_size % args.world_size:
        p.error("--batch-size must be a multiple of --world-size")
    return args


def table(args, opt: str, capacity: int) -> dynemb.TableConfig:
    return dynemb.TableConfig(name="t", dim=args.dim, features=["f"], capacity=capacity,
                              optimizer=OPTIMIZERS[opt](), routing=dynemb.Routing.HASH_ROUNDROBIN)


def rank_batch(args, step: int, rank: int) -> dynemb.SparseBatch:
    """Rank ``rank``'s B/W samples of ``step`` (the same in every process)."""
    rng = np.random.default_rng([args.seed, step, rank])
    b = args.batch_size // args.world_size
    ids = rank_to_id(zipf_ranks(rng, b * args.bag_size, args.zipf_exponent, args.universe))
    return dynemb.SparseBatch(features=["f"], values=ids,
                              lengths=torch.full((b,), args.bag_size, dtype=torch.int64))


def global_batch(args, step: int) -> dynemb.SparseBatch:
    parts = [rank_batch(args, step, r) for r in range(args.world_size)]
    return dynemb.SparseBatch(features=["f"], values=torch.cat([p.values for p in parts]),
                              lengths=torch.cat([p.lengths for p in parts]))


def train_step(module, batch) -> None:
    """forward + backward (the fused optimizer updates rows in backward)."""
    module(batch).values().sum().backward()


def single_process(args, opt: str, *, local: bool) -> tuple[list[float], float]:
    """One process: the global batch on the full table, or (``local``) rank 0's batch on a
    table of capacity / W rows. Returns (seconds per timed step, load factor)."""
    cap = -(-args.capacity // args.world_size) if local else args.capacity
    ebc = dynemb.EmbeddingBagCollection([table(args, opt, cap)])
    make = (lambda s: rank_batch(args, s, 0)) if local else (lambda s: global_batch(args, s))
    for s in range(args.warmup_steps):
        train_step(ebc, make(s))
    times = []
    for s in range(args.warmup_steps, args.warmup_steps + args.steps):
        batch = make(s)
        times.append(timed(lambda: train_step(ebc, batch)))
    t = ebc.tables["t"]
    return times, t.size() / t.capacity()


def _times(seconds: list[float], ids_per_step: int) -> dict:
    s = summary_ms(seconds)
    return {"step_ms": s["median_ms"], "step_ms_p90": s["p90_ms"], "repeats": s["repeats"],
            "mids_per_s": rate_m(ids_per_step, s["median_ms"])}


# ---------------------------------------------------------------------------- sharded ranks

def _rank(rank: int, args, opt: str, port: int, out: str, torch_grouping: bool) -> None:
    torch.set_num_threads(1)
    if torch_grouping:  # the baseline: the grouping of any device (torch.unique, stable sorts)
        from dynemb.distributed import input_dist
        input_dist._group = input_dist._group_torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        ebc = dynemb.EmbeddingBagCollection([table(args, opt, args.capacity)])
        sharded = dynemb.distributed.shard(ebc)
        del ebc
        for s in range(args.warmup_steps):
            train_step(sharded, rank_batch(args, s, rank))
        sharded.reset_routing_stats()
        times, stages = [], []
        for s in range(args.warmup_steps, args.warmup_steps + args.steps):
            batch = rank_batch(args, s, rank)
            dist.barrier()
            t0 = time.perf_counter()
            inp = sharded.input_dist(batch).wait()  # the same step, stage by stage
            t1 = time.perf_counter()
            values = sharded.pooled(inp).values()
            t2 = time.perf_counter()
            values.sum().backward()
            t3 = time.perf_counter()
            times.append(t3 - t0)
            stages.append((t1 - t0, t2 - t1, t3 - t2))
        gathered = [None] * args.world_size
        dist.all_gather_object(gathered, (times, stages))
        stats = sharded.routing_stats()
        if rank == 0:
            per_rank = [g[0] for g in gathered]
            slowest = [max(ts) for ts in zip(*per_rank)]
            Path(out).write_text(json.dumps({"slowest": slowest, "per_rank": per_rank,
                                             "stages": [g[1] for g in gathered],
                                             "stats": stats.as_dict()}))
    finally:
        dist.destroy_process_group()


def sharded(args, opt: str, torch_grouping: bool = False) -> dict:
    """One spawned run of W ranks: the slowest rank's seconds per step, per-rank times, stats
    (``torch_grouping``: the requesters group their ids with the torch path, not the compiled
    pass)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        mp.start_processes(_rank, args=(args, opt, port, out, torch_grouping),
                           nprocs=args.world_size, start_method="spawn", join=True)
        return json.loads(Path(out).read_text())


def measure(args, opt: str) -> dict:
    """``--rounds`` rounds of: one process (global batch), one process (one rank's batch), W
    ranks; the step times of each are pooled over the rounds."""
    one, local, shard_runs, torch_runs = [], [], [], []
    for r in range(args.rounds):
        log(f"sharded_step: {opt} round {r}: one process, global batch")
        times, one_load = single_process(args, opt, local=False)
        one += times
        log(f"sharded_step: {opt} round {r}: one process, one rank's batch")
        times, local_load = single_process(args, opt, local=True)
        local += times
        log(f"sharded_step: {opt} round {r}: {args.world_size} gloo ranks")
        shard_runs.append(sharded(args, opt))
        log(f"sharded_step: {opt} round {r}: {args.world_size} gloo ranks, torch grouping")
        torch_runs.append(sharded(args, opt, torch_grouping=True))
    ids = args.batch_size * args.bag_size
    st = shard_runs[-1]["stats"]
    t = st["tables"]["t"]
    shard = _times([x for run in shard_runs for x in run["slowest"]], ids)
    shard.update({
        "per_rank_step_ms": [summary_ms([x for run in shard_runs for x in run["per_rank"][k]])
                             ["median_ms"] for k in range(args.world_size)],
        "rank0_stage_ms": _stages(shard_runs),
        "bytes_sent_per_step_per_rank": [b / st["steps"] for b in st["bytes_sent"]],
        "ids_received_max_over_mean": t["ids_max_over_mean"],
        "unique_keys_received_max_over_mean": t["unique_keys_max_over_mean"],
        "rows_stored": t["rows_stored"],
        "unique_keys_sent_per_step": sum(t["unique_keys_received"]) / st["steps"]})
    return {"single_process_global_batch": {**_times(one, ids), "load_factor": one_load},
            "single_process_one_rank_batch": {**_times(local, ids // args.world_size),
                                              "load_factor": local_load},
            f"sharded_{args.world_size}_ranks": shard,
            f"sharded_{args.world_size}_ranks_torch_grouping": {
                **_times([x for run in torch_runs for x in run["slowest"]], ids),
                "rank0_stage_ms": _stages(torch_runs)}}


def _stages(runs: list[dict]) -> dict:
    """Medians of rank 0's stages over the runs, in ms."""
    return {name: summary_ms([st[i] for run in runs for st in run["stages"][0]])["median_ms"]
            for i, name in enumerate(STAGES)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    load_start = loadavg_1m()
    results = []
    for opt in args.optimizers:
        rec = measure(args, opt)
        one, local = rec["single_process_global_batch"], rec["single_process_one_rank_batch"]
        shard = rec[f"sharded_{args.world_size}_ranks"]
        torch_grouped = rec[f"sharded_{args.world_size}_ranks_torch_grouping"]
        results.append({
            "optimizer": opt, **rec,
            "ratios": {
                "speedup_sharded_vs_single_process": ratio(one["step_ms"], shard["step_ms"]),
                "communication_overhead_ms": shard["step_ms"] - local["step_ms"],
                "ideal_speedup_without_communication": ratio(one["step_ms"], local["step_ms"]),
                "input_dist_vs_torch_grouping": ratio(
                    shard["rank0_stage_ms"]["input_dist"],
                    torch_grouped["rank0_stage_ms"]["input_dist"]),
            }})
    record = {
        "benchmark": "sharded_step",
        "question": f"training step time of {args.world_size} gloo ranks (sharded, each its "
                    "own B/W samples) vs one process on the whole batch",
        "config": {"world_size": args.world_size, "capacity_rows": args.capacity,
                   "dim": args.dim, "global_batch_size": args.batch_size,
                   "bag_size": args.bag_size, "ids_per_step": args.batch_size * args.bag_size,
                   "zipf_exponent": args.zipf_exponent, "universe_ids": args.universe,
                   "warmup_steps": args.warmup_steps, "timed_steps_per_round": args.steps,
                   "rounds": args.rounds,
                   "routing": "hash_roundrobin", "pooling": "sum", "backend": "gloo",
                   "seed": args.seed, "smoke": args.smoke, **threads},
        "environment": {**environment(), "loadavg_1m_start": load_start},
        "notes": [
            "each rank is a process with one torch thread; on a 2-core machine 2 ranks use both "
            "cores while the single-process baseline uses one",
            "sharded step = the slowest rank's time per step (barrier before each step)",
            "each round builds fresh tables and warms them up; the three runs alternate round "
            "by round and their step times are pooled (this VM's timings drift by 20-50% "
            "between minutes)",
            "single_process_one_rank_batch: one rank's B/W samples on a capacity/W table in one "
            "process, no communication: the floor of the sharded step",
            "bytes_sent_per_step_per_rank: all-to-all bytes to other ranks (headers, ids, "
            "partial pools, gradients)",
            "rank0_stage_ms: medians of rank 0's stages (input_dist: route, dedup, header and id "
            "all-to-alls; lookup_pool_output_dist: owner lookup + pooling + partials all-to-all "
            "+ assembly; backward_update: gradient all-to-all, pooling backward, fused update); "
            "waits for the other rank land in the stage that waits",
            "sharded_*_torch_grouping: the sharded run again, the requesters grouping their ids "
            "by owner with the torch path (torch.unique, stable sorts) instead of the compiled "
            "pass; ratios.input_dist_vs_torch_grouping compares rank 0's input_dist stages",
        ],
        "results": results,
    }
    emit(record, args.out)
    return record


if __name__ == "__main__":
    main()
