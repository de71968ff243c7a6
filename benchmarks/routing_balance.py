"""How evenly do the routing modes spread ids over ranks? max/mean of unique keys and lookups.

Question: for W in {2, 4, 8, 64} ranks and four id streams, the load of the busiest rank relative
to the mean (1.0 = perfect balance), for ``continuous``, ``roundrobin`` and ``hash_roundrobin``,
computed with ``dynemb.distributed.route`` (the library's one routing function). Baseline in the
same run: each unique key sent to a uniformly random rank (the statistical floor of a hash).

Streams (``--num-ids`` lookups each, default 2**20):
  * zipf: Zipf(1.05) ranks over ``--universe`` ids, scrambled into scattered int64 ids (the
    hot ids are then anywhere in [0, 2**63));
  * strided: Zipf ranks times ``--stride`` (default 64, a multiple of every W): ids k·64;
  * sequential: 0, 1, 2, ... (every id once);
  * mixed_type_low_bits: ``(entity << 4) | type`` with Zipf entities and 3 types (ids that encode
    a type in their low bits), types drawn with probabilities 0.5 / 0.3 / 0.2.
``continuous`` gets ``id_range = 1 + the largest id`` of the stream (what a user would set).
Also timed: ``route`` throughput per mode (M keys/s, median of repeats, one thread).

    .venv/bin/python benchmarks/routing_balance.py [--num-ids 1048576] [--out PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dynemb  # noqa: E402
from _common import (  # noqa: E402
    base_parser, emit, environment, loadavg_1m, log, rank_to_id, rate_m, set_threads,
    summary_ms, timed, zipf_ranks,
)
from dynemb.distributed import max_over_mean, route  # noqa: E402

MODES = tuple(dynemb.Routing)
DISTS = ("zipf", "strided", "sequential", "mixed_type_low_bits")


def parse_args(argv=None):
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--num-ids", type=int, default=1 << 20, help="lookups per stream")
    p.add_argument("--worlds", type=str, default="2,4,8,64", help="world sizes, comma-separated")
    p.add_argument("--zipf-exponent", type=float, default=1.05)
    p.add_argument("--universe", type=int, default=10**8, help="Zipf ranks 1..universe")
    p.add_argument("--stride", type=int, default=64, help="strided ids are rank * stride")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats of route() per mode")
    args = p.parse_args(argv)
    if args.smoke:
        args.num_ids, args.universe, args.repeats = 1 << 14, 10**5, 2
    args.worlds = [int(w) for w in args.worlds.split(",")]
    return args


def streams(args, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """(num_ids,) int64 ids of each stream."""
    n = args.num_ids
    ranks = zipf_ranks(rng, n, args.zipf_exponent, args.universe)
    types = rng.choice(3, size=n, p=[0.5, 0.3, 0.2]).astype(np.int64)
    return {"zipf": rank_to_id(ranks),
            "strided": torch.from_numpy(ranks * args.stride),
            "sequential": torch.arange(n, dtype=torch.int64),
            "mixed_type_low_bits": torch.from_numpy((ranks << 4) | types)}


def balance(ids: torch.Tensor, unique: torch.Tensor, world: int, mode, id_range: int) -> dict:
    """max/mean of lookups and unique keys per rank, and the busiest rank's share."""
    lookups = torch.bincount(route(ids, world, mode, id_range=id_range), minlength=world)
    keys = torch.bincount(route(unique, world, mode, id_range=id_range), minlength=world)
    return {"lookups_max_over_mean": max_over_mean(lookups.tolist()),
            "unique_keys_max_over_mean": max_over_mean(keys.tolist()),
            "busiest_rank_lookup_share": float(lookups.max()) / ids.numel(),
            "idle_ranks": int((lookups == 0).sum())}


def random_baseline(ids: torch.Tensor, world: int, seed: int) -> dict:
    """Every unique key to a uniformly random rank (what an ideal hash does on average)."""
    g = torch.Generator().manual_seed(seed)
    unique, inverse = torch.unique(ids, return_inverse=True)
    owner = torch.randint(0, world, (unique.numel(),), generator=g)
    return {"lookups_max_over_mean": max_over_mean(
                torch.bincount(owner[inverse], minlength=world).tolist()),
            "unique_keys_max_over_mean": max_over_mean(
                torch.bincount(owner, minlength=world).tolist())}


def route_speed(args, ids: torch.Tensor, world: int) -> dict:
    """M keys/s of route() per mode on ``ids`` (one untimed warm-up call each)."""
    out = {}
    id_range = int(ids.max()) + 1
    for mode in MODES:
        route(ids, world, mode, id_range=id_range)
        s = summary_ms([timed(lambda: route(ids, world, mode, id_range=id_range))
                        for _ in range(args.repeats)])
        out[mode.value] = {"route_ms": s["median_ms"], "route_ms_p90": s["p90_ms"],
                           "route_mkeys_per_s": rate_m(ids.numel(), s["median_ms"])}
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    load_start = loadavg_1m()
    data = streams(args, np.random.default_rng(args.seed))
    results = []
    for dist_name, ids in data.items():
        unique = torch.unique(ids)
        id_range = int(ids.max()) + 1
        for world in args.worlds:
            log(f"routing_balance: {dist_name} W={world}")
            rec = {"dist": dist_name, "world_size": world, "num_ids": ids.numel(),
                   "num_unique_keys": unique.numel(), "continuous_id_range": id_range}
            for mode in MODES:
                rec[mode.value] = balance(ids, unique, world, mode, id_range)
            rec["random_owner_baseline"] = random_baseline(ids, world, args.seed + world)
            results.append(rec)
    speed = route_speed(args, data["zipf"], 8)
    record = {
        "benchmark": "routing_balance",
        "question": "max/mean load per rank of the routing modes (continuous, roundrobin, "
                    "hash_roundrobin) on Zipf, strided, sequential and type-in-low-bits ids",
        "config": {"num_ids": args.num_ids, "world_sizes": args.worlds,
                   "zipf_exponent": args.zipf_exponent, "universe_ids": args.universe,
                   "stride": args.stride, "types_in_low_bits": "3 types (p 0.5/0.3/0.2) in 4 bits",
                   "repeats": args.repeats, "seed": args.seed, "smoke": args.smoke, **threads},
        "environment": {**environment(), "loadavg_1m_start": load_start},
        "notes": [
            "max_over_mean: the busiest rank's load / the mean load (1.0 is perfect)",
            "lookups: id occurrences per rank (work per step); unique_keys: distinct keys per "
            "rank (rows stored, memory)",
            "continuous uses id_range = 1 + the largest id of the stream",
            "random_owner_baseline: every unique key to a uniformly random rank",
            "Zipf lookups are dominated by a few hot ids: their owner's lookup share is a "
            "floor no routing of whole keys can go below",
        ],
        "results": results,
        "summary": summary(results),
        "route_speed_w8_zipf": speed,
    }
    emit(record, args.out)
    return record


def summary(results: list[dict]) -> dict:
    """Per mode: the worst unique-key and lookup max/mean over streams and world sizes."""
    out = {}
    for mode in [m.value for m in MODES] + ["random_owner_baseline"]:
        out[mode] = {
            "worst_unique_keys_max_over_mean": max(r[mode]["unique_keys_max_over_mean"]
                                                   for r in results),
            "worst_lookups_max_over_mean": max(r[mode]["lookups_max_over_mean"] for r in results),
        }
    return out


if __name__ == "__main__":
    main()
