"""How fast is one training step of a dynamic table? fwd + bwd + fused update, ms/step and M ids/s.

Question: the cost of one step of ``dynemb.EmbeddingBagCollection`` (one table, one pooled SUM
feature) with SGD, row-wise Adagrad and Adam, in steady state (table full, evicting), against
baselines measured in the same run on the same ids:
  * ``torch.nn.EmbeddingBag(capacity, dim, mode="sum", sparse=True)`` + the torch optimizer with
    the same rule: SGD -> torch.optim.SGD, RowWiseAdagrad -> torch.optim.Adagrad (torch has no
    row-wise Adagrad; element-wise Adagrad is the nearest rule), Adam -> torch.optim.SparseAdam;
  * fbgemm's CPU TBE (``SplitTableBatchedEmbeddingBagsCodegen``, the kernel torchrec's
    batched_embedding_kernel wraps; EmbeddingLocation.HOST, ComputeDevice.CPU) with EXACT_SGD,
    EXACT_ROWWISE_ADAGRAD, ADAM, when importable (``make install`` installs it); whatever it refuses is
    reported as skipped with its message.
Both baselines are fixed tables of ``capacity`` rows fed ``id mod capacity``.

Workload: each step is ``batch_size`` bags of ``bag_size`` ids (default 2048 x 32 = 65,536 ids),
Zipf(1.05) over ``--universe`` (default 1e8) ids, scrambled into scattered int64 ids; the loss is
the sum of the pooled outputs. Warm-up: full training steps until the table is >= ``--fill`` full
and evicting (or ``--warmup-max-steps``), then timing. Steps are timed one by one, in rounds that
alternate the implementations; batches are built outside the timed region.

    .venv/bin/python benchmarks/train_step.py [--dims 64,128] [--optimizers sgd,adam] [--out PATH]
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dynemb  # noqa: E402
from _common import (  # noqa: E402
    DEFAULT_BUCKET_CAPACITY, base_parser, bucket_note, emit, environment, loadavg_1m, log,
    rank_to_id, rate_m, ratio, set_threads, summary_ms, timed, zipf_ranks,
)

OPTIMIZERS = ("sgd", "rowwise_adagrad", "adam")
LR = {"sgd": 0.01, "rowwise_adagrad": 0.01, "adam": 0.001}
EPS = {"rowwise_adagrad": 1e-10, "adam": 1e-8}
TORCH_RULE = {"sgd": "torch.optim.SGD", "rowwise_adagrad": "torch.optim.Adagrad (element-wise; "
              "torch has no row-wise Adagrad)", "adam": "torch.optim.SparseAdam"}
FBGEMM_RULE = {"sgd": "EXACT_SGD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "adam": "ADAM"}
# torch.optim.Adagrad on sparse gradients warns once about sparse invariant checks: not ours
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")

# issue 14, per optimizer: (which dynemb column, which baseline, the least ratio of ids/s);
# "dynemb" is the evicting table, "dynemb_same_ids" the one fed the baselines' ids
_FIXED_TABLE_TARGETS = (("dynemb", "fbgemm_tbe", 0.5),
                        ("dynemb_same_ids", "torch_embedding_bag", 1.0),
                        ("dynemb_same_ids", "fbgemm_tbe", 0.8))
TARGETS = {"sgd": _FIXED_TABLE_TARGETS, "rowwise_adagrad": _FIXED_TABLE_TARGETS,
           "adam": (("dynemb", "torch_embedding_bag", 3.0),)}


def parse_args(argv=None):
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--capacity", type=int, default=1 << 20, help="rows of every table")
    p.add_argument("--dims", type=str, default="64,128", help="embedding dims, comma-separated")
    p.add_argument("--optimizers", type=str, default=",".join(OPTIMIZERS))
    p.add_argument("--batch-size", type=int, default=2048, help="bags per step")
    p.add_argument("--bag-size", type=int, default=32, help="ids per bag")
    p.add_argument("--zipf-exponent", type=float, default=1.05)
    p.add_argument("--universe", type=int, default=10**8, help="ids are Zipf ranks 1..universe")
    p.add_argument("--rounds", type=int, default=4, help="rounds alternating the implementations")
    p.add_argument("--steps", type=int, default=6, help="timed steps per round and implementation")
    p.add_argument("--fill", type=float, default=0.98,
                   help="warm up until size >= fill * capacity and rows are being evicted")
    p.add_argument("--warmup-max-steps", type=int, default=400)
    p.add_argument("--baseline-warmup-steps", type=int, default=3)
    p.add_argument("--no-fbgemm", action="store_true", help="skip the fbgemm TBE baseline")
    p.add_argument("--bucket-capacity", type=int, default=DEFAULT_BUCKET_CAPACITY,
                   help="dynemb's slots per hash bucket (TableConfig.bucket_capacity): the "
                        "eviction's granularity; issue 14's targets are at the default")
    args = p.parse_args(argv)
    if args.smoke:
        args.capacity, args.batch_size, args.bag_size = 1 << 12, 64, 8
        args.universe, args.rounds, args.steps, args.dims = 10**5, 1, 2, "16"
        args.baseline_warmup_steps = 1
    args.dims = [int(d) for d in args.dims.split(",")]
    args.optimizers = args.optimizers.split(",")
    if not set(args.optimizers) <= set(OPTIMIZERS):
        p.error(f"--optimizers: expected some of {OPTIMIZERS}, found {args.optimizers}")
    return args


@dataclass
class Step:
    """One step's inputs: the batch for dynemb, ids mod capacity + offsets for the baselines."""

    batch: dynemb.SparseBatch
    ids_mod: torch.Tensor
    offsets: torch.Tensor  # (B + 1,)
    batch_mod: dynemb.SparseBatch  # the baselines' ids (id mod capacity), for dynemb_same_ids


class Stream:
    """The id stream: step i draws the same ids in every configuration (same seed)."""

    def __init__(self, args, seed: int) -> None:
        self.args = args
        self.rng = np.random.default_rng(seed)
        b, l = args.batch_size, args.bag_size
        self.lengths = torch.full((b,), l, dtype=torch.int64)
        self.offsets = torch.arange(0, b * l + 1, l, dtype=torch.int64)

    def next(self) -> Step:
        a = self.args
        ids = rank_to_id(zipf_ranks(self.rng, a.batch_size * a.bag_size, a.zipf_exponent,
                                    a.universe))
        batch = dynemb.SparseBatch(features=["f"], values=ids, lengths=self.lengths)
        ids_mod = ids % a.capacity
        batch_mod = dynemb.SparseBatch(features=["f"], values=ids_mod, lengths=self.lengths)
        return Step(batch=batch, ids_mod=ids_mod, offsets=self.offsets, batch_mod=batch_mod)


# ---------------------------------------------------------------------------- implementations

class Ours:
    name = "dynemb"

    def __init__(self, args, dim: int, opt: str, capacity: int | None = None,
                 threads: int | None = None) -> None:
        config = {"sgd": lambda: dynemb.SGD(lr=LR[opt]),
                  "rowwise_adagrad": lambda: dynemb.RowWiseAdagrad(lr=LR[opt], eps=EPS[opt]),
                  "adam": lambda: dynemb.Adam(lr=LR[opt], eps=EPS[opt])}[opt]()
        table = dynemb.TableConfig(name="t", dim=dim, features=["f"],
                                   capacity=capacity or args.capacity, optimizer=config,
                                   score=dynemb.ScorePolicy.LRU, threads=threads,
                                   bucket_capacity=args.bucket_capacity)
        self.ebc = dynemb.EmbeddingBagCollection([table])
        self.table = self.ebc.tables["t"]
        self.rule = f"dynemb.{type(config).__name__} (fused)"

    def step(self, s: Step) -> None:
        self.ebc(s.batch).values().sum().backward()


class OursSameIds(Ours):
    """dynemb fed the baselines' ids (id mod capacity) in a table twice that size: every id
    fits, and at the default bucket capacity nothing is evicted (with small buckets a few
    overflow: its ``evicted_per_step`` says). Isolates the cost of hashing raw ids from the cost
    of churn."""

    name = "dynemb_same_ids"

    def __init__(self, args, dim: int, opt: str) -> None:
        super().__init__(args, dim, opt, capacity=2 * args.capacity)

    def step(self, s: Step) -> None:
        self.ebc(s.batch_mod).values().sum().backward()


class TorchEmbeddingBag:
    name = "torch_embedding_bag"

    def __init__(self, args, dim: int, opt: str) -> None:
        self.emb = torch.nn.EmbeddingBag(args.capacity, dim, mode="sum", sparse=True)
        params = list(self.emb.parameters())
        self.opt = {"sgd": lambda: torch.optim.SGD(params, lr=LR[opt]),
                    "rowwise_adagrad": lambda: torch.optim.Adagrad(params, lr=LR[opt],
                                                                   eps=EPS[opt]),
                    "adam": lambda: torch.optim.SparseAdam(params, lr=LR[opt], eps=EPS[opt])}[opt]()
        self.rule = TORCH_RULE[opt]

    def step(self, s: Step) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.emb(s.ids_mod, s.offsets).sum().backward()
        self.opt.step()


class FbgemmTBE:
    name = "fbgemm_tbe"

    def __init__(self, args, dim: int, opt: str) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation, PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen,
        )

        kw = {"eps": EPS[opt]} if opt in EPS else {}
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(args.capacity, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            optimizer=getattr(EmbOptimType, FBGEMM_RULE[opt]), learning_rate=LR[opt],
            pooling_mode=PoolingMode.SUM, weights_precision=SparseType.FP32,
            output_dtype=SparseType.FP32, device=torch.device("cpu"), **kw)
        self.rule = f"fbgemm_gpu SplitTableBatchedEmbeddingBagsCodegen {FBGEMM_RULE[opt]}, HOST/CPU"

    def step(self, s: Step) -> None:
        self.tbe(s.ids_mod, s.offsets).sum().backward()


def fbgemm_available() -> str | None:
    """None if fbgemm's TBE imports, else why not."""
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception as e:  # ImportError, or a library that fails to load with this torch
        return f"fbgemm_gpu not importable ({type(e).__name__}: {e}); run `make install`"
    return None


# ---------------------------------------------------------------------------- one configuration

def warm_up(ours: Ours, stream: Stream, args) -> dict:
    """Full training steps until the table is full enough and evicting."""
    t = ours.table
    target = args.fill * t.capacity()
    steps = 0
    while steps < args.warmup_max_steps:
        ours.step(stream.next())
        steps += 1
        st = t.stats()
        if st.size >= target and st.evicted > 0:
            break
    st = t.stats()
    return {"warmup_steps": steps, "load_factor_after_warmup": st.size / st.capacity,
            "evicted_during_warmup": st.evicted,
            "steady_state_reached": bool(st.size >= target and st.evicted > 0)}


def build(args, dim: int, opt: str, fb_why: str | None) -> tuple[list, dict[str, str]]:
    """The implementations to time (dynemb first) and {name: why} for the skipped ones."""
    impls = [Ours(args, dim, opt), OursSameIds(args, dim, opt), TorchEmbeddingBag(args, dim, opt)]
    skipped: dict[str, str] = {}
    if args.no_fbgemm:
        skipped["fbgemm_tbe"] = "skipped by --no-fbgemm"
    elif fb_why is not None:
        skipped["fbgemm_tbe"] = fb_why
    else:
        try:
            impls.append(FbgemmTBE(args, dim, opt))
        except Exception as e:  # e.g. fbgemm 1.8.0: "Optimizer adam is not supported in CPU mode."
            skipped["fbgemm_tbe"] = (f"fbgemm CPU TBE refused {FBGEMM_RULE[opt]}: "
                                     f"{type(e).__name__}: {e}")
    return impls, skipped


def time_rounds(impls: list, stream: Stream, args) -> tuple[dict[str, list[float]], list[int]]:
    """Seconds per step of each implementation, in rounds over the same steps; unique ids/step."""
    times: dict[str, list[float]] = {impl.name: [] for impl in impls}
    unique: list[int] = []
    for _ in range(args.rounds):
        steps = [stream.next() for _ in range(args.steps)]
        unique += [int(torch.unique(s.batch.values).numel()) for s in steps]
        for impl in impls:
            for s in steps:
                times[impl.name].append(timed(lambda: impl.step(s)))
    return times, unique


def table_facts(st0, st1, n_timed: int, unique: list[int]) -> dict:
    """The dynemb table's state over the timed steps (from two ``stats()``)."""
    lookups = st1.lookups - st0.lookups
    return {"load_factor_timed": st1.size / st1.capacity,
            "evicted_per_step": (st1.evicted - st0.evicted) / n_timed,
            "inserted_per_step": (st1.inserted - st0.inserted) / n_timed,
            "hit_rate_timed": (st1.hits - st0.hits) / lookups if lookups else None,
            "stale_updates_timed": st1.stale_updates - st0.stale_updates,
            "unique_ids_per_step": float(np.median(unique))}


def bench_config(args, dim: int, opt: str, fb_why: str | None) -> dict:
    log(f"[train_step] dim {dim} {opt}: building")
    stream = Stream(args, args.seed)
    impls, skipped = build(args, dim, opt, fb_why)
    ours, same = impls[0], impls[1]  # (build's order: dynemb, dynemb_same_ids, baselines)
    warm = warm_up(ours, stream, args)
    log(f"[train_step] dim {dim} {opt}: warm-up {warm}")
    for impl in impls[1:]:  # dynemb_same_ids fills its table as long as dynemb did
        n = warm["warmup_steps"] if isinstance(impl, OursSameIds) else args.baseline_warmup_steps
        for _ in range(n):
            impl.step(stream.next())
    st0, same0 = ours.table.stats(), same.table.stats()
    times, unique = time_rounds(impls, stream, args)
    st1, same1 = ours.table.stats(), same.table.stats()
    n_ids = args.batch_size * args.bag_size
    rec: dict = {"dim": dim, "optimizer": opt}
    for impl in impls:
        s = summary_ms(times[impl.name])
        rec[impl.name] = {"rule": impl.rule, "step_ms": s["median_ms"], "step_ms_p90": s["p90_ms"],
                          "mids_per_s": rate_m(n_ids, s["median_ms"]),
                          "mids_per_s_at_p90": rate_m(n_ids, s["p90_ms"]),
                          "timed_steps": s["repeats"]}
    rec["dynemb"].update(warm)
    rec["dynemb"]["bucket_capacity"] = ours.table.config.bucket_capacity
    rec["dynemb"].update(table_facts(st0, st1, args.rounds * args.steps, unique))
    rec["dynemb_same_ids"]["evicted_per_step"] = (
        (same1.evicted - same0.evicted) / (args.rounds * args.steps))
    for name, why in skipped.items():
        rec[name] = {"skipped": why}
    rec["ratios"] = {f"mids_per_s_vs_{impl.name}": ratio(rec["dynemb"]["mids_per_s"],
                                                        rec[impl.name]["mids_per_s"])
                     for impl in impls[2:]}
    rec["ratios_same_ids"] = {f"mids_per_s_vs_{impl.name}": ratio(
        rec["dynemb_same_ids"]["mids_per_s"], rec[impl.name]["mids_per_s"]) for impl in impls[2:]}
    log(f"[train_step] dim {dim} {opt}: " + ", ".join(
        f"{impl.name} {rec[impl.name]['step_ms']:.1f} ms" for impl in impls))
    return rec


def targets(results: list[dict], bucket_capacity: int = DEFAULT_BUCKET_CAPACITY) -> list[dict]:
    """Issue 14's targets (``TARGETS``), set at the default bucket capacity: a run with another
    one says so beside each."""
    out = []
    for rec in results:
        for ours, base, need in TARGETS[rec["optimizer"]]:
            key = "ratios" if ours == "dynemb" else "ratios_same_ids"
            got = rec[key].get(f"mids_per_s_vs_{base}")
            out.append({"what": f"{rec['optimizer']} dim {rec['dim']}: {ours} ids/s / {base} ids/s",
                        "target_ratio": need, "measured_ratio": got,
                        "met": None if got is None else bool(got >= need)})
            out[-1].update(bucket_note(bucket_capacity))
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_start = loadavg_1m()
    threads = set_threads(args.threads)
    fb_why = None if args.no_fbgemm else fbgemm_available()
    results = [bench_config(args, dim, opt, fb_why) for dim in args.dims for opt in args.optimizers]
    record = {
        "benchmark": "train_step",
        "question": "ms/step and M ids/s of fwd + bwd + fused update through "
                    "dynemb.EmbeddingBagCollection vs nn.EmbeddingBag + torch optimizer and "
                    "fbgemm's CPU TBE, one thread, steady state",
        "config": {"capacity_rows": args.capacity, "dims": args.dims,
                   "optimizers": args.optimizers, "batch_size_bags": args.batch_size,
                   "bag_size_ids": args.bag_size, "ids_per_step": args.batch_size * args.bag_size,
                   "pooling": "sum, one feature, fixed bag length", "zipf_exponent":
                   args.zipf_exponent, "universe_ids": args.universe, "rounds": args.rounds,
                   "steps_per_round": args.steps, "fill_target": args.fill,
                   "score_policy": "lru", "bucket_capacity": args.bucket_capacity,
                   "learning_rates": LR, "eps": EPS, "seed": args.seed,
                   "smoke": args.smoke, **threads},
        "environment": {**environment(), "loadavg_1m_start": load_start,
                        "fbgemm_gpu": _version("fbgemm_gpu"),
                        "torchrec": _version("torchrec")},
        "notes": [
            "step_ms is the median over timed steps (P90 beside it); M ids/s = ids per step / "
            "median step time; ratios are dynemb ids/s over the baseline's",
            "a step: dynemb = ebc(batch).values().sum().backward() (the optimizer is fused into "
            "backward); torch = zero_grad, forward, sum, backward, opt.step(); fbgemm = forward, "
            "sum, backward (fused update)",
            "baselines are fixed tables of capacity rows fed id mod capacity; dynemb hashes raw "
            "ids into a table that is full and evicting (see load_factor_timed, "
            "evicted_per_step); dynemb_same_ids is fed the baselines' ids in a table of "
            "2 x capacity (no eviction at the default bucket capacity; see its "
            "evicted_per_step): the cost of hashing without the churn",
            "RowWiseAdagrad's torch baseline is element-wise torch.optim.Adagrad (nearest rule)",
            "SparseBatch construction and id generation are outside the timed region",
        ],
        "results": results,
        "targets": targets(results, args.bucket_capacity),
    }
    emit(record, args.out)
    return record


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version({"fbgemm_gpu": "fbgemm-gpu-cpu"}.get(module, module))
    except Exception:
        return None


if __name__ == "__main__":
    main()
