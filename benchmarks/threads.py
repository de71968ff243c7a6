"""Does a rank go faster with more cores? One training step at 1 thread and at N threads.

Question: issue 14's "more than one core per rank": the step of ``benchmarks/train_step.py``'s
evicting table (one table, 2^20 rows, 2048 bags x 32 Zipf ids, dim 64, full and evicting) in
three configurations built alike, warmed up alike and taking the same steps, alternating in
rounds:
  * ``1``: torch and the table's kernels at one thread;
  * ``table_N``: torch at one thread, ``TableConfig.threads=N`` (the table's kernels split over N
    threads; torch's own ops, small ones, stay on one);
  * ``torch_N``: ``torch.set_num_threads(N)``, ``TableConfig.threads`` None (follows torch).
The JSON has each one's median and P90 ms per step and the speed-ups over ``1`` (target: >= 1.6x
at 2 threads on this 2-core machine). Beside them, in the same rounds, the memory ceiling
(``_ceiling.RowGather``): a bare gather of each step's rows (the ids modulo the capacity, the
rows the fixed-table baselines of ``train_step.py`` read), at 1 and at N threads; a step that
reads and writes those rows, and more, cannot scale better than this gather does.

    .venv/bin/python benchmarks/threads.py [--threads 2] [--optimizers sgd,adam] [--out PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ceiling import RowGather  # noqa: E402
from _common import (  # noqa: E402
    bucket_note, emit, environment, loadavg_1m, log, summary_ms, timed,
)
from train_step import Ours, Stream, parse_args, warm_up  # noqa: E402

TARGET = 1.6


def measure(args, dim: int, opt: str, n: int) -> dict:
    """{configuration: (torch threads, implementation)} timed over the same steps."""
    configs = {"1": (1, Ours(args, dim, opt, threads=1)),
               f"table_{n}": (1, Ours(args, dim, opt, threads=n)),
               f"torch_{n}": (n, Ours(args, dim, opt))}
    warm = {}
    for name, (t, ours) in configs.items():
        torch.set_num_threads(t)
        warm[name] = warm_up(ours, Stream(args, seed=1), args)
    stream = Stream(args, seed=2)
    times: dict[str, list[float]] = {name: [] for name in configs}
    gather = RowGather(args.capacity, dim, args.batch_size * args.bag_size)
    gathered: dict[int, list[float]] = {1: [], n: []}
    for _ in range(args.rounds):
        steps = [stream.next() for _ in range(args.steps)]
        for name, (t, ours) in configs.items():
            torch.set_num_threads(t)
            for s in steps:
                times[name].append(timed(lambda: ours.step(s)))
        torch.set_num_threads(1)
        for t, v in gather.times([s.ids_mod.numpy() for s in steps], [1, n],
                                 args.steps).items():
            gathered[t] += v
    ms = {name: summary_ms(v) for name, v in times.items()}
    one = ms["1"]["median_ms"]
    speedup = {name: one / v["median_ms"] for name, v in ms.items() if name != "1"}
    g_ms = {str(t): summary_ms(v) for t, v in gathered.items()}
    ceiling = g_ms["1"]["median_ms"] / g_ms[str(n)]["median_ms"]
    log(f"dim {dim} {opt}: " + ", ".join(f"{k} {v['median_ms']:.1f} ms" for k, v in ms.items())
        + " | speed-up " + ", ".join(f"{k} {v:.2f}x" for k, v in speedup.items())
        + f" | bare row gather {ceiling:.2f}x")
    best = max(speedup.values())
    return {"dim": dim, "optimizer": opt, "ms_per_step": ms, "warmup": warm,
            "speedup": speedup,
            "memory_ceiling": {"what": "a bare gather of each step's rows (ids modulo the "
                                       "capacity), ms per call at 1 and N threads",
                               "ms_per_gather": g_ms, "speedup": ceiling},
            "target": {"least_speedup": TARGET, "best": best, "met": best >= TARGET,
                       "memory_ceiling_speedup": ceiling, **bucket_note(args.bucket_capacity)}}


def main(argv=None) -> dict:
    args = parse_args(argv)  # train_step's flags; --threads is the count compared with 1
    n = max(2, args.threads)
    load0 = loadavg_1m()
    results = [measure(args, dim, opt, n) for dim in args.dims for opt in args.optimizers]
    torch.set_num_threads(1)
    record = {"benchmark": "threads",
              "question": f"step speed-up of one rank from 1 to {n} threads",
              "config": {"smoke": args.smoke, "threads_compared": n,
                         "torch_num_threads": torch.get_num_threads(),
                         "capacity": args.capacity, "batch_size": args.batch_size,
                         "bag_size": args.bag_size, "zipf_exponent": args.zipf_exponent,
                         "universe": args.universe, "rounds": args.rounds,
                         "steps": args.steps, "bucket_capacity": args.bucket_capacity},
              "results": results, "loadavg_1m": {"before": load0, "after": loadavg_1m()},
              "environment": environment()}
    emit(record, args.out)
    return record


if __name__ == "__main__":
    main()
