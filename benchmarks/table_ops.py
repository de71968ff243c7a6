"""How fast are a table's verbs? find / find_or_insert / insert_or_assign in M keys/s.

Question: throughput of ``DynamicTable`` (numba backend, the CPU default) on one thread, at load
factors 0.5 and 0.9, for Zipf(1.05) and uniform keys, against two baselines measured in the same
run: the same table on the torch reference backend, and a Python dict (key -> row index, rows
gathered from a tensor).

Workload, per load factor λ (capacity C, query Q keys per call):
  * the table is filled with the ids of ranks 1..λ·C (find_or_insert in chunks of
    ``--fill-chunk``; a bucket that overflows during the fill evicts, so the real load, reported
    as ``load_factor_actual``, is a little lower at 0.9);
  * find: Q ids drawn from the distribution over the resident ranks 1..λ·C (nearly all hits);
  * find_or_insert: Q ids drawn from the distribution over ranks 1..``--universe`` (default 1e8):
    Zipf hits the resident hot ids most of the time and inserts the tail, uniform inserts nearly
    every id; at 0.9 full buckets evict (``find_or_insert_evicted_keys_per_call`` > 0);
  * insert_or_assign: Q distinct ids drawn the same way, with random values.
Beside them, the memory ceiling of find (``_ceiling.RowGather``, timed right after dynemb's
verbs): a bare gather of Q rows of a (capacity, dim) float32 table, the rows of find's ranks
(each resident rank stands for one row, scattered at random), with no index at all: what find
would reach if looking a key up cost nothing. And the floor of find_or_insert: its new rows (as
many as a call inserts) initialised alone by the table's own init kernel (the default
initializer, normal draws), plus that gather: what it would take if finding and placing keys
cost nothing.
The verbs that change the table run on a table restored to the filled state before each repeat
(outside the timed region). Ranks are scrambled into scattered positive int64 ids. All three
implementations get the same query batches; each repeat uses another batch; one untimed call
per verb warms up (numba loads its compiled kernels).

    .venv/bin/python benchmarks/table_ops.py [--capacity 1048576] [--dim 64] [--out PATH]
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dynemb  # noqa: E402
from _ceiling import RowGather  # noqa: E402
from _common import (  # noqa: E402
    DEFAULT_BUCKET_CAPACITY, base_parser, bucket_note, distinct_ranks, draw_ranks, emit,
    environment, loadavg_1m, log, rank_to_id, rate_m, ratio, restore_, set_threads, summary_ms,
    timed,
)

OPS = ("find", "find_or_insert", "insert_or_assign")
IMPLS = ("dynemb", "torch_backend", "python_dict")
# Issue 14's targets, one thread, load 0.9, with eviction: M keys/s per (verb, distribution)
TARGETS_MKEYS_PER_S = {("find", "zipf"): 20.0, ("find", "uniform"): 20.0,
                       ("find_or_insert", "zipf"): 10.0, ("find_or_insert", "uniform"): 5.0,
                       ("insert_or_assign", "zipf"): 5.0, ("insert_or_assign", "uniform"): 5.0}


class DictTable:
    """Baseline: a Python dict key -> row index over a (capacity, dim) float32 tensor of rows.

    find = dict lookups + row gather (missing keys get zeros); find_or_insert = setdefault with
    the next row index (modulo capacity: no eviction, no row initialisation); insert_or_assign =
    the same, then a row scatter. Keys cross between tensors and Python lists in every call.
    """

    def __init__(self, capacity: int, dim: int) -> None:
        self.d: dict[int, int] = {}
        self.cap = capacity
        self.rows = torch.zeros(capacity, dim)

    def find(self, keys: torch.Tensor):
        get = self.d.get
        idx = torch.tensor([get(k, -1) for k in keys.tolist()], dtype=torch.int64)
        found = idx >= 0
        values = self.rows[idx.clamp(min=0)]
        values[~found] = 0.0
        return values, found

    def _slots(self, keys: torch.Tensor) -> torch.Tensor:
        d, cap = self.d, self.cap
        setdefault = d.setdefault
        return torch.tensor([setdefault(k, len(d) % cap) for k in keys.tolist()], dtype=torch.int64)

    def find_or_insert(self, keys: torch.Tensor):
        return self.rows[self._slots(keys)]

    def insert_or_assign(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.rows[self._slots(keys)] = values

    def size(self) -> int:
        return len(self.d)


def parse_args(argv=None):
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--capacity", type=int, default=1 << 20, help="table capacity (rows)")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension")
    p.add_argument("--query-keys", type=int, default=65536, help="keys per call")
    p.add_argument("--loads", type=str, default="0.5,0.9", help="load factors, comma-separated")
    p.add_argument("--dists", type=str, default="zipf,uniform", help="key distributions")
    p.add_argument("--zipf-exponent", type=float, default=1.05)
    p.add_argument("--universe", type=int, default=10**8,
                   help="ids find_or_insert / insert_or_assign draw from (ranks 1..universe)")
    p.add_argument("--repeats", type=int, default=7, help="timed calls per verb (median, P90)")
    p.add_argument("--fill-chunk", type=int, default=65536, help="keys per call while filling")
    p.add_argument("--bucket-capacity", type=int, default=DEFAULT_BUCKET_CAPACITY,
                   help="slots per hash bucket (TableConfig.bucket_capacity); issue 14's targets "
                        "are at the default")
    p.add_argument("--impls", type=str, default=",".join(IMPLS),
                   help=f"implementations to run, comma-separated, of {IMPLS}")
    args = p.parse_args(argv)
    if args.smoke:
        args.capacity, args.query_keys, args.repeats = 1 << 13, 2048, 3
        args.universe, args.fill_chunk = 10**6, 2048
    args.loads = [float(x) for x in args.loads.split(",")]
    args.dists = args.dists.split(",")
    args.impls = args.impls.split(",")
    if not set(args.impls) <= set(IMPLS) or "dynemb" not in args.impls:
        p.error(f"--impls: expected 'dynemb' and any of {IMPLS}, found {args.impls}")
    return args


def make_table(impl: str, args):
    if impl == "python_dict":
        return DictTable(args.capacity, args.dim)
    cfg = dynemb.TableConfig(name="bench", dim=args.dim, features=["f"], capacity=args.capacity,
                             optimizer=dynemb.SGD(lr=0.01), score=dynemb.ScorePolicy.LRU,
                             bucket_capacity=args.bucket_capacity)
    return dynemb.DynamicTable(cfg, backend="numba" if impl == "dynemb" else "torch")


def fill(table, impl: str, resident: torch.Tensor, chunk: int) -> None:
    if impl == "python_dict":
        table.d = {k: i for i, k in enumerate(resident.tolist())}
        return
    for i in range(0, resident.numel(), chunk):
        table.find_or_insert(resident[i:i + chunk])


def capacity_of(table, impl: str) -> int:
    return table.cap if impl == "python_dict" else table.capacity()


def make_queries(args, rng, num_resident: int) -> dict:
    """Per distribution: per verb, ``repeats + 1`` batches (the first one warms up); and
    ``find_rows``, the rows of find's batches for the memory ceiling (rank r: row
    ``scatter[r - 1]``)."""
    n, q = args.repeats + 1, args.query_keys
    scatter = np.random.default_rng(args.seed + 1).permutation(args.capacity)  # own stream
    out = {}
    for dist in args.dists:
        def draw(hi: int, dist: str = dist) -> torch.Tensor:
            return rank_to_id(draw_ranks(rng, dist, q, hi, args.zipf_exponent))

        find_ranks = [draw_ranks(rng, dist, q, num_resident, args.zipf_exponent)
                      for _ in range(n)]
        out[dist] = {
            "find": [rank_to_id(r) for r in find_ranks],
            "find_rows": [scatter[r - 1] for r in find_ranks],
            "find_or_insert": [draw(args.universe) for _ in range(n)],
            "insert_or_assign": [
                (rank_to_id(distinct_ranks(rng, dist, q, args.universe, args.zipf_exponent)),
                 torch.randn(q, args.dim)) for _ in range(n)],
        }
    return out


def run_op(table, impl: str, op: str, batches: list, snap) -> tuple[list[float], dict]:
    """Times ``op`` on each batch but the first (warm-up); returns seconds and per-call facts."""
    times, facts = [], {"hits": [], "new": [], "evicted": []}
    out = None  # dynemb's find writes into one reused buffer (find(keys, out=)): no page faults
    if op == "find" and impl != "python_dict":
        out = torch.empty(batches[0].numel(), table.dim)
    for i, batch in enumerate(batches):
        if op != "find":
            restore(table, impl, snap)
        if op == "find":
            res = {}
            kw = {} if out is None else {"out": out[:batch.numel()]}
            t = timed(lambda: res.setdefault("r", table.find(batch, **kw)))
            found = res["r"][1] if impl == "python_dict" else res["r"].found
            facts["hits"].append(float(found.float().mean()))
        elif op == "find_or_insert":
            res = {}
            t = timed(lambda: res.setdefault("r", table.find_or_insert(batch)))
            if impl != "python_dict":
                r = res["r"]
                facts["new"].append(int(r.inserted.sum()))
                facts["evicted"].append(int(r.evicted.keys.numel()))
        else:
            keys, values = batch
            res = {}
            t = timed(lambda: res.setdefault("r", table.insert_or_assign(keys, values)))
            if impl != "python_dict":
                facts["evicted"].append(int(res["r"].keys.numel()))
        if i > 0:
            times.append(t)
        else:
            facts = {k: [] for k in facts}
    return times, facts


def restore(table, impl: str, snap) -> None:
    if impl == "python_dict":
        table.d = snap.copy()
        return
    restore_(table, snap)
    if table.stats() != snap.stats():
        raise RuntimeError(f"restore failed: {table.stats()} != {snap.stats()}")


def snapshot(table, impl: str):
    return dict(table.d) if impl == "python_dict" else copy.deepcopy(table)


def op_record(op: str, seconds: list[float], facts: dict, q: int) -> dict:
    s = summary_ms(seconds)
    rec = {f"{op}_ms": s["median_ms"], f"{op}_ms_p90": s["p90_ms"],
           f"{op}_mkeys_per_s": rate_m(q, s["median_ms"]),
           f"{op}_mkeys_per_s_at_p90": rate_m(q, s["p90_ms"]), f"{op}_repeats": s["repeats"]}
    if facts["hits"]:
        rec[f"{op}_hit_rate"] = float(np.median(facts["hits"]))
    if facts["new"]:
        rec[f"{op}_new_keys_per_call"] = float(np.median(facts["new"]))
    if facts["evicted"]:
        rec[f"{op}_evicted_keys_per_call"] = float(np.median(facts["evicted"]))
    return rec


def bench_impl(impl: str, args, load: float, queries: dict, resident: torch.Tensor) -> dict:
    """{dist: record} for one implementation at one load factor."""
    table = make_table(impl, args)
    log(f"[table_ops] {impl}: filling to load {load} ({resident.numel()} keys)")
    fill(table, impl, resident, args.fill_chunk)
    snap = snapshot(table, impl)
    load_actual = table.size() / capacity_of(table, impl)
    out = {}
    for dist in args.dists:
        rec = {"load_factor_actual": load_actual}
        for op in OPS:
            seconds, facts = run_op(table, impl, op, queries[dist][op], snap)
            rec.update(op_record(op, seconds, facts, args.query_keys))
            log(f"[table_ops] {impl} {dist} load {load}: {op} "
                f"{rec[f'{op}_mkeys_per_s']:.2f} M keys/s")
        restore(table, impl, snap)
        if impl == "dynemb":
            gather = RowGather(args.capacity, args.dim, args.query_keys)
            rec["memory_ceiling"] = find_ceiling(args, gather, queries[dist]["find_rows"])
            rec["find_or_insert_floor"] = find_or_insert_floor(
                args, table, gather.rows, rec["find_or_insert_new_keys_per_call"],
                rec["memory_ceiling"]["row_gather_ms"])
        out[dist] = rec
    return out


def find_ceiling(args, gather: RowGather, batches: list[np.ndarray]) -> dict:
    """The bare row gather of find's rows (the first batch warms up, as find's did)."""
    seconds = gather.times(batches[1:], [1], args.repeats)[1]
    s = summary_ms(seconds)
    rate = rate_m(args.query_keys, s["median_ms"])
    log(f"[table_ops] memory ceiling of find: {rate:.2f} M keys/s")
    return {"what": "a bare gather of find's rows, no index", "row_gather_ms": s["median_ms"],
            "row_gather_ms_p90": s["p90_ms"], "row_gather_mkeys_per_s": rate}


def find_or_insert_floor(args, table, rows: np.ndarray, new_per_call: float,
                         gather_ms: float) -> dict:
    """What ``find_or_insert`` cannot go below with the table's initializer: a call's new rows
    (their median count) initialised on their own, by the table's init kernel into rows of
    ``rows`` drawn at random, plus the bare gather of a call's rows (find's memory ceiling: the
    call returns a row per key). Medians over ``repeats`` calls, after one untimed call."""
    n = round(new_per_call)
    rng = np.random.default_rng(args.seed + 2)
    dst, cfg = torch.from_numpy(rows), table.config
    seconds = []
    for k in range(args.repeats + 1):
        at = torch.from_numpy(rng.choice(rows.shape[0], n, replace=False))
        keys = rank_to_id(rng.integers(1, args.universe + 1, n))
        t = timed(lambda: table.store.backend.init_rows(
            dst, at, keys, cfg.dim, 0.0, cfg.initializer, table.life.init_mix))
        if k:
            seconds.append(t)
    init_ms = summary_ms(seconds)["median_ms"]
    floor_ms = init_ms + gather_ms
    log(f"[table_ops] floor of find_or_insert: {n} new rows initialised in {init_ms:.2f} ms, "
        f"{rate_m(args.query_keys, floor_ms):.2f} M keys/s with the gather")
    return {"what": "the call's new rows initialised alone (the table's initializer, "
                    f"{cfg.initializer.kind.name}) plus find's bare row gather",
            "new_rows": n, "initializer_ms": init_ms, "row_gather_ms": gather_ms,
            "floor_ms": floor_ms, "floor_mkeys_per_s": rate_m(args.query_keys, floor_ms)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_start = loadavg_1m()
    threads = set_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    probe = make_table("dynemb", args)
    capacity = probe.capacity()  # rounded up to whole buckets
    del probe
    if capacity != args.capacity:
        args.capacity = capacity
    results = []
    for load in args.loads:
        num_resident = round(load * capacity)
        resident = rank_to_id(rng.permutation(np.arange(1, num_resident + 1)))
        queries = make_queries(args, rng, num_resident)
        per_impl = {impl: bench_impl(impl, args, load, queries, resident) for impl in args.impls}
        for dist in args.dists:
            rec = {"dist": dist, "load_factor": load}
            rec.update({impl: per_impl[impl][dist] for impl in args.impls})
            rec["ratios"] = ratios(rec, args.impls)
            results.append(rec)
    record = {
        "benchmark": "table_ops",
        "question": "find / find_or_insert / insert_or_assign throughput of DynamicTable "
                    "(numba) vs the torch backend and a Python dict, one thread",
        "config": {"capacity_rows": capacity, "dim": args.dim, "query_keys_per_call":
                   args.query_keys, "load_factors": args.loads, "dists": args.dists,
                   "zipf_exponent": args.zipf_exponent, "universe_ids": args.universe,
                   "repeats": args.repeats, "fill_chunk_keys": args.fill_chunk,
                   "bucket_capacity": args.bucket_capacity, "score_policy": "lru",
                   "optimizer": "sgd",
                   "seed": args.seed, "smoke": args.smoke, **threads},
        "environment": {**environment(), "loadavg_1m_start": load_start},
        "notes": [
            "times are medians over repeats (P90 beside them); M keys/s = keys per call / median",
            "find returns the values (N, dim) in every implementation (rows gathered); dynemb "
            "and torch_backend write them into one reused buffer (find(keys, out=))",
            "find_or_insert and insert_or_assign run on a table restored to the filled state "
            "before each repeat, outside the timed region",
            "python_dict: no eviction and no row initialisation (new keys take the next row "
            "index modulo capacity); includes tensor <-> list conversion",
            "ids: ranks scrambled by an odd 64-bit multiplier mod 2**63",
        ],
        "results": results,
        "targets": targets(results, args.bucket_capacity),
    }
    emit(record, args.out)
    return record


def ratios(rec: dict, impls: list[str]) -> dict:
    out = {}
    for base in impls:
        if base == "dynemb":
            continue
        for op in OPS:
            key = f"{op}_mkeys_per_s"
            out[f"{op}_vs_{base}"] = ratio(rec["dynemb"][key], rec[base][key])
    return out


def targets(results: list[dict], bucket_capacity: int = DEFAULT_BUCKET_CAPACITY) -> list[dict]:
    """Issue 14's targets at load 0.9 (``TARGETS_MKEYS_PER_S``), set at the default bucket
    capacity: a run with another one says so beside each."""
    out = []
    for rec in results:
        if abs(rec["load_factor"] - 0.9) > 1e-9:
            continue
        for (op, dist), target in TARGETS_MKEYS_PER_S.items():
            if dist != rec["dist"]:
                continue
            got = rec["dynemb"][f"{op}_mkeys_per_s"]
            out.append({"what": f"{op} {rec['dist']} load 0.9", "target_mkeys_per_s": target,
                        "measured_mkeys_per_s": got, "met": bool(got >= target)})
            out[-1].update(bucket_note(bucket_capacity))
            if op == "find":
                out[-1]["memory_ceiling_mkeys_per_s"] = \
                    rec["dynemb"]["memory_ceiling"]["row_gather_mkeys_per_s"]
            elif op == "find_or_insert":
                out[-1]["floor_mkeys_per_s"] = \
                    rec["dynemb"]["find_or_insert_floor"]["floor_mkeys_per_s"]
    return out


if __name__ == "__main__":
    main()
