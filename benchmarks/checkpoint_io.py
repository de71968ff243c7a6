"""How fast are checkpoints? save / load of a 10^7-row × dim 64 table, full and incremental, in
MB/s and rows/s, against the raw disk measured in the same run.

Question: throughput of ``dynemb.checkpoint.save``, ``load`` and ``export_incremental`` (+ the
delta's load) for one table of ``--rows`` rows (default 10^7) of dim ``--dim`` (64) with
row-wise Adagrad (one float of optimizer state per row), one process, one thread, against:

  * raw write: the same number of bytes written with ``write`` in 64 MiB blocks and fsynced
    (the disk's sequential write speed, what a save cannot beat);
  * raw read: those bytes read back in 8 MiB blocks, cold (after ``posix_fadvise(DONTNEED)``
    dropped them from the page cache) and warm (from the page cache);
  * sha256 over bytes in memory (saves and loads hash every byte once).

A save includes exporting the rows, serialising them to safetensors, hashing, writing, fsyncing
every file and directory and the atomic rename. A load includes reading the manifest, checking
every file's size and sha256 (one read pass), the shard shapes and key ownership (a read of the
keys), clearing the table and inserting every row (``load_rows``). "cold" loads first drop the
checkpoint's files from the page cache; "warm" loads read them from it. The incremental export
covers ``--delta-fraction`` of the rows, rewritten (``insert_or_assign``) after the base save;
its load applies it on top of a freshly loaded base. MB = 10^6 bytes of checkpoint files.

    .venv/bin/python benchmarks/checkpoint_io.py [--rows 10000000] [--dim 64] [--dir DIR]
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dynemb  # noqa: E402
from _common import (  # noqa: E402
    base_parser, emit, environment, loadavg_1m, log, rank_to_id, ratio, set_threads, summary_ms,
)
from dynemb import checkpoint  # noqa: E402

CHUNK = 1 << 16
"""Rows per insert_or_assign call while filling the table."""
LOAD_FACTOR = 0.75
"""Rows / capacity: a few of the fullest buckets may still overflow and evict (rows = size)."""


def parse_args(argv=None):
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000, help="rows in the table")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension")
    p.add_argument("--delta-fraction", type=float, default=0.01,
                   help="fraction of the rows rewritten before the incremental export")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each operation")
    p.add_argument("--dir", type=Path, default=None,
                   help="where checkpoints are written (default: a temporary directory)")
    args = p.parse_args(argv)
    if args.smoke:
        args.rows, args.dim, args.repeats = 20_000, 16, 1
    # fixed once: near full, a table of another bucket count would overflow some buckets
    args.capacity = int(args.rows / LOAD_FACTOR)
    return args


def drop_cache(path: Path) -> None:
    """Drops the (clean, fsynced) pages of every file under ``path`` from the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def mb_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def raw_disk(root: Path, nbytes: int, repeats: int) -> dict:
    """Sequential write (+fsync), cold and warm read of ``nbytes``; sha256 in memory."""
    block = np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    path = root / "raw.bin"
    writes, cold, warm = [], [], []
    for _ in range(repeats):
        path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        with open(path, "xb", buffering=0) as f:
            done = 0
            while done < nbytes:
                done += f.write(memoryview(block)[:min(len(block), nbytes - done)])
            os.fsync(f.fileno())
        writes.append(time.perf_counter() - t0)
        for out in (cold, warm):
            if out is cold:
                drop_cache(path)
            t0 = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                while f.read(8 << 20):
                    pass
            out.append(time.perf_counter() - t0)
    path.unlink()
    t0 = time.perf_counter()
    hashlib.sha256(block).digest()
    sha = time.perf_counter() - t0
    med = lambda xs: float(np.median(xs))  # noqa: E731
    return {"bytes": nbytes, "write_fsync_mb_per_s": mb_per_s(nbytes, med(writes)),
            "read_cold_mb_per_s": mb_per_s(nbytes, med(cold)),
            "read_warm_mb_per_s": mb_per_s(nbytes, med(warm)),
            "sha256_in_memory_mb_per_s": mb_per_s(len(block), sha),
            "write_s": summary_ms(writes)}


def fresh_like(args) -> dynemb.EmbeddingBagCollection:
    """An empty collection with the benchmark's table."""
    config = dynemb.TableConfig(
        name="t", dim=args.dim, features=["f"], capacity=args.capacity,
        optimizer=dynemb.RowWiseAdagrad(lr=0.01))
    return dynemb.EmbeddingBagCollection([config])


def build(args) -> tuple[dynemb.EmbeddingBagCollection, torch.Tensor]:
    """A collection with one table of about ``args.rows`` rows (random values and state);
    returns it and the keys it holds. ``args.rows`` becomes the exact row count."""
    ebc = fresh_like(args)
    table = ebc.tables["t"]
    keys = rank_to_id(np.arange(1, args.rows + 1, dtype=np.int64))
    g = torch.Generator().manual_seed(args.seed)
    for lo in range(0, args.rows, CHUNK):
        k = keys[lo:lo + CHUNK]
        table.insert_or_assign(k, torch.randn(k.numel(), args.dim, generator=g),
                               optimizer_state=torch.rand(k.numel(), 1, generator=g))
    keys = keys[table.find(keys).found] if table.size() < keys.numel() else keys
    log(f"{keys.numel():,} rows held ({args.rows - keys.numel()} evicted by full buckets)")
    args.rows = keys.numel()
    return ebc, keys


def timed_s(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def rates(nbytes: int, rows: int, seconds: list[float]) -> dict:
    med = float(np.median(seconds))
    return {"median_s": med, "times_s": [round(s, 4) for s in seconds],
            "mb_per_s": mb_per_s(nbytes, med), "rows_per_s": rows / med}


def check_same(a: dynemb.DynamicTable, b: dynemb.DynamicTable, keys: torch.Tensor) -> None:
    probe = keys[torch.randperm(keys.numel(), generator=torch.Generator().manual_seed(7))[:4096]]
    fa, fb = a.find(probe), b.find(probe)
    if not (bool(fb.found.all()) and torch.equal(fa.values, fb.values)):
        raise SystemExit("the loaded table differs from the saved one")


def bench_full(args, root: Path, src, keys) -> tuple[dict, Path]:
    path = root / "full"
    saves = [timed_s(lambda: checkpoint.save(path, model=src, step=1)) for _ in range(args.repeats)]
    nbytes = dir_bytes(path)
    loads = {"cold": [], "warm": []}
    for _ in range(args.repeats):
        for mode in ("cold", "warm"):
            dst = fresh_like(args)
            if mode == "cold":
                drop_cache(path)
            loads[mode].append(timed_s(lambda: checkpoint.load(path, model=dst)))
            check_same(src.tables["t"], dst.tables["t"], keys)
            del dst
    return {"checkpoint_bytes": nbytes, "rows": args.rows,
            "save": rates(nbytes, args.rows, saves),
            "load_cold": rates(nbytes, args.rows, loads["cold"]),
            "load_warm": rates(nbytes, args.rows, loads["warm"])}, path


def bench_incremental(args, root: Path, src, keys, base: Path) -> dict:
    table = src.tables["t"]
    n = max(1, int(args.rows * args.delta_fraction))
    g = torch.Generator().manual_seed(args.seed + 1)
    exports, loads = [], []
    nbytes = 0
    for r in range(args.repeats):
        checkpoint.save(base, model=src, step=10 * r + 1)  # the base (not timed here)
        pick = keys[torch.randperm(keys.numel(), generator=g)[:n]]
        table.insert_or_assign(pick, torch.randn(n, args.dim, generator=g))
        delta = root / "delta"
        exports.append(timed_s(lambda: checkpoint.export_incremental(
            delta, model=src, since_step=10 * r + 1, step=10 * r + 2)))
        nbytes = dir_bytes(delta)
        dst = fresh_like(args)
        checkpoint.load(base, model=dst)
        drop_cache(delta)
        loads.append(timed_s(lambda: checkpoint.load(delta, model=dst)))
        check_same(table, dst.tables["t"], pick)
        del dst
    return {"delta_rows": n, "delta_bytes": nbytes, "delta_fraction": args.delta_fraction,
            "export": rates(nbytes, n, exports), "load_cold_on_base": rates(nbytes, n, loads)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_start = loadavg_1m()
    threads = set_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="dynemb-ckpt-bench-", dir=args.dir))
    try:
        log(f"building a table of {args.rows:,} rows x dim {args.dim}")
        src, keys = build(args)
        log("full save / load")
        full, base = bench_full(args, root, src, keys)
        log("raw disk")
        raw = raw_disk(root, full["checkpoint_bytes"], args.repeats)
        log("incremental export / load")
        inc = bench_incremental(args, root, src, keys, base)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    record = {
        "benchmark": "checkpoint_io",
        "question": "save / load / incremental throughput of dynemb.checkpoint for one table, "
                    "against the raw disk (write + fsync, cold and warm read) in the same run",
        "config": {"rows": args.rows, "capacity": args.capacity, "dim": args.dim,
                   "optimizer": "rowwise_adagrad", "row_bytes": 8 + 4 * args.dim + 4 + 8,
                   "repeats": args.repeats, "delta_fraction": args.delta_fraction,
                   "dir": str(args.dir or tempfile.gettempdir()),
                   "seed": args.seed, "smoke": args.smoke, **threads},
        "environment": {**environment(), "loadavg_1m_start": load_start},
        "notes": [
            "MB = 10^6 bytes of checkpoint files (manifest, shard files, dense file); times are "
            "medians over repeats (times_s lists them)",
            "save: export + safetensors + sha256 + write + fsync + atomic rename",
            "load: sha256 check of every file + shape/ownership check + clear + load_rows; "
            "cold = the files dropped from the page cache first (posix_fadvise DONTNEED)",
            "raw disk: the same byte count, write in 64 MiB blocks + fsync; read in 8 MiB blocks",
        ],
        "raw_disk": raw,
        "full": full,
        "incremental": inc,
        "ratios": {
            "save_vs_raw_write": ratio(full["save"]["mb_per_s"], raw["write_fsync_mb_per_s"]),
            "load_cold_vs_raw_read_cold": ratio(full["load_cold"]["mb_per_s"],
                                                raw["read_cold_mb_per_s"]),
            "load_warm_vs_raw_read_warm": ratio(full["load_warm"]["mb_per_s"],
                                                raw["read_warm_mb_per_s"]),
            "incremental_export_vs_full_save_time": ratio(inc["export"]["median_s"],
                                                          full["save"]["median_s"]),
        },
    }
    emit(record, args.out)
    return record


if __name__ == "__main__":
    main()
