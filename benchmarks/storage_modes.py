"""What does each storage mode cost per training step? HBM_ONLY vs HYBRID vs CACHING, ms and hit rate.

Question: the step time (fwd + bwd + fused update of one ``dynemb.EmbeddingBagCollection``
table) and the fast-tier hit rate of HBM_ONLY, HYBRID and CACHING at cache_load_factor x in
{0.1, 0.2, 0.5, 0.8, 1.0}, with the ddr tier in RAM and in a memory-mapped file, all in one run,
on the same Zipf(1.05) ids. HBM_ONLY, measured in the same run on the same ids, is the baseline
of every ratio.

On a CPU-only host both tiers are RAM (the mmap variant: the page cache over a file), so these
numbers measure what the modes add in bookkeeping (the split gathers, the cache's fetches and
write-backs), not a bandwidth gap between tiers; with a CUDA table (``--device cuda``) hbm is
GPU memory and ddr pinned host memory, and the published ordering is HBM_ONLY < CACHING < HYBRID.

Workload: each step is ``batch_size`` bags of ``bag_size`` ids, Zipf(1.05) over ``--universe``
ids; the table (``--capacity`` rows) holds every id, so nothing is evicted from the table as a
whole and the modes compute the same rows. Each configuration trains ``--warmup`` steps, then
``--steps`` timed steps; every configuration sees the same batches. The configurations run in
``--rounds`` rounds, every other one in reverse order; a configuration's time is the median over
its steps of all rounds, its counters those of its last round.

    .venv/bin/python benchmarks/storage_modes.py [--dim 64] [--optimizer adam] [--out PATH]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dynemb  # noqa: E402
from _common import (  # noqa: E402
    base_parser, emit, environment, loadavg_1m, log, rank_to_id, rate_m, ratio, set_threads,
    summary_ms, timed, zipf_ranks,
)

FACTORS = (0.1, 0.2, 0.5, 0.8, 1.0)
OPTIMIZERS = {"sgd": lambda: dynemb.SGD(lr=0.01), "adam": lambda: dynemb.Adam(lr=0.001),
              "rowwise_adagrad": lambda: dynemb.RowWiseAdagrad(lr=0.01)}


def parse_args(argv=None):
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--capacity", type=int, default=1 << 20, help="rows of the table")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    p.add_argument("--batch-size", type=int, default=2048, help="bags per step")
    p.add_argument("--bag-size", type=int, default=32, help="ids per bag")
    p.add_argument("--zipf-exponent", type=float, default=1.05)
    p.add_argument("--universe", type=int, default=500_000,
                   help="ids are Zipf ranks 1..universe (at most capacity / 2: no table evictions)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps per configuration")
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration and round")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds over every configuration, in reverse order every other round "
                        "(the first configuration of a process runs slower)")
    p.add_argument("--device", default="cpu", help="the table's device (hbm); cuda for a GPU")
    p.add_argument("--ddr-dir", type=Path, default=None,
                   help="where the memory-mapped ddr files go (default: a temporary directory)")
    args = p.parse_args(argv)
    if args.smoke:
        args.capacity, args.batch_size, args.bag_size, args.universe = 1 << 12, 64, 8, 1500
        args.warmup, args.steps, args.dim, args.rounds = 2, 2, 8, 1
    if args.universe > args.capacity // 2:
        p.error(f"--universe {args.universe} must be at most capacity / 2 ({args.capacity // 2}) "
                "so that nothing is evicted from the table as a whole")
    return args


def batches(args, n: int) -> list[dynemb.SparseBatch]:
    rng = np.random.default_rng(args.seed)
    lengths = torch.full((args.batch_size,), args.bag_size, dtype=torch.int64)
    out = []
    for _ in range(n):
        ids = rank_to_id(zipf_ranks(rng, args.batch_size * args.bag_size, args.zipf_exponent,
                                    args.universe))
        out.append(dynemb.SparseBatch(features=["f"], values=ids, lengths=lengths))
    return out


def configurations(ddr_root: Path) -> list[tuple[str, dynemb.Storage]]:
    """(name, storage) of every measured configuration, HBM_ONLY first."""
    out = [("hbm_only", dynemb.Storage())]
    for mode in (dynemb.StorageMode.HYBRID, dynemb.StorageMode.CACHING):
        for x in FACTORS:
            out.append((f"{mode.value}_x{x}_ram", dynemb.Storage(mode=mode, cache_load_factor=x)))
            if x < 1.0:  # x = 1.0 drops the ddr tier: no file to map
                out.append((f"{mode.value}_x{x}_mmap", dynemb.Storage(
                    mode=mode, cache_load_factor=x, ddr_path=str(ddr_root / f"{mode.value}_{x}"))))
    return out


def run_one(args, storage: dynemb.Storage, data: list[dynemb.SparseBatch],
            earlier: list[float]) -> tuple[dict, list[float]]:
    """Trains one configuration; returns its record (times: ``earlier`` rounds' + this one's)
    and this round's step times."""
    table = dynemb.TableConfig(name="t", dim=args.dim, features=["f"], capacity=args.capacity,
                               optimizer=OPTIMIZERS[args.optimizer](), storage=storage)
    ebc = dynemb.EmbeddingBagCollection([table], device=args.device)
    t = ebc.tables["t"]

    def step(b):
        ebc(b).values().sum().backward()
        if args.device != "cpu":
            torch.cuda.synchronize()

    for b in data[:args.warmup]:
        step(b)
    before = t.stats()
    times = [timed(lambda b=b: step(b)) for b in data[args.warmup:]]
    after = t.stats()
    n = len(times)
    lookups = after.lookups - before.lookups
    s = summary_ms(times + earlier)
    mem = t.memory_usage()
    rec = {"mode": t.mode.value, "storage_mode_requested": storage.mode.value,
           "cache_load_factor": storage.cache_load_factor,
           "ddr": "none" if t.store.ddr is None else ("mmap" if storage.ddr_path else "ram"),
           "step_ms": s["median_ms"], "step_ms_p90": s["p90_ms"], "repeats": s["repeats"],
           "mids_per_s": rate_m(args.batch_size * args.bag_size, s["median_ms"]),
           "hbm_hit_rate": (after.hbm_hits - before.hbm_hits) / lookups,
           "hit_rate": (after.hits - before.hits) / lookups,
           "cache_evictions_per_step": (after.cache_evictions - before.cache_evictions) / n,
           "write_backs_per_step": (after.write_backs - before.write_backs) / n,
           "table_evictions": after.evicted, "rows": after.size, "hbm_rows": after.hbm_rows,
           "hbm_bytes": mem.hbm_bytes, "ddr_bytes": mem.ddr_bytes}
    ebc.close()  # releases a ddr store (its files are removed next)
    del ebc, t
    if storage.ddr_path:
        shutil.rmtree(storage.ddr_path, ignore_errors=True)
    return rec, times


def main(argv=None) -> None:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    data = batches(args, args.warmup + args.steps)
    ddr_root = args.ddr_dir or Path(tempfile.mkdtemp(prefix="dynemb-storage-modes-"))
    ddr_root.mkdir(parents=True, exist_ok=True)
    configs = configurations(ddr_root)
    records: dict[str, dict] = {}
    times: dict[str, list[float]] = {name: [] for name, _ in configs}
    try:
        for r in range(args.rounds):
            for name, storage in (configs if r % 2 == 0 else configs[::-1]):
                log(f"storage_modes: round {r + 1}, {name} ...")
                rec, got = run_one(args, storage, data, times[name])
                times[name] += got
                records[name] = {"name": name, **rec}
                log(f"  {rec['step_ms']:.1f} ms/step, hbm hit rate {rec['hbm_hit_rate']:.3f}")
    finally:
        if args.ddr_dir is None:
            shutil.rmtree(ddr_root, ignore_errors=True)
    results = [records[name] for name, _ in configs]
    base = results[0]["step_ms"]
    for r in results:
        r["step_ms_vs_hbm_only"] = ratio(r["step_ms"], base)
    emit({"benchmark": "storage_modes",
          "question": "train-step ms and fast-tier hit rate per storage mode and cache_load_factor",
          "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     **threads, "ids_per_step": args.batch_size * args.bag_size,
                     "loadavg_1m_start": loadavg_1m()},
          "interpretation": ("CPU-only host: hbm and ddr are both RAM (mmap: page cache over a "
                             "file); the ratios measure each mode's bookkeeping, not a memory "
                             "bandwidth gap" if args.device == "cpu" else
                             f"hbm on {args.device}, ddr in pinned host memory"),
          "results": results, "environment": environment()}, args.out)


if __name__ == "__main__":
    main()
