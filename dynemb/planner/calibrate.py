"""``dynemb calibrate``: measure this machine's cost constants (see :mod:`dynemb.planner.cost`).

Short training runs of one table each (forward + backward + fused update of an
``EmbeddingBagCollection``) at two row widths (dim 16 with SGD: 64 bytes a row; dim 64 with
Adam: 768 bytes), chosen so that each group of events moves on its own (see :func:`runs`):
HBM_ONLY on uniform, skewed and churning ids (lookups vs distinct keys vs new rows); HYBRID
and CACHING on uniform ids (many ddr accesses, many misses) and on Zipf ids, with ddr in RAM
and in memory-mapped files; CACHING with a cache that holds nearly every hot row (the cache's
cost per lookup).

Every run measures a steady state, the state the cost model describes:

1. every page of the table's tensors (rows of both tiers, index arrays, ddr files) is written
   once before anything is timed, so no step pays the first-touch page faults of fresh memory
   or of freshly allocated files (microseconds a page: counted in timed steps they made a cache
   miss look like tens of microseconds);
2. the table is filled: every id of the run's universe (or as many as it has rows) is looked up
   once (``lookup``: rows are made, nothing is updated), so a run without churn creates no rows
   while timed, and a churning one evicts;
3. ``warmup`` untimed steps settle the cache and compile the kernels;
4. ``steps`` timed steps; before each, its distinct keys are located (new, in ddr, in the cache
   or not), which gives the step's events exactly.

The runs of one row width are built together and their steps interleaved: pass after pass,
each run takes one step, every other pass in reverse order. A slow spell of the machine then
lands on every run alike instead of on a few, which keeps the constants (fitted from the
differences between runs) stable on a busy machine. On the CPU a step's time is the CPU time
of the process (its wall time on an idle machine, one thread; time the process spends waiting
for a core is not the step's cost); on a GPU, the wall time after a synchronize. A run's time is
the median of its steps, its events their mean; the constants are the non-negative least
squares fit of all runs on relative error (:func:`dynemb.planner.cost.fit`).

What the constants do not see: every run looks up ``ids_per_step`` ids (16,384) per step in bags
of ``bag_size`` (16), so a table's fixed cost per step (Python and autograd: about 1 ms on a
2-core CPU machine) and its cost per bag (the pooled output row and its gradient: 0.1 to 0.3 us
at dim 16 to 64) are spread over those lookups: a table with far fewer lookups per step, or with
one id per bag, costs more per lookup than predicted. The tables are about 200 MB each (beyond
any CPU cache): a much larger table pays more per row for the same access pattern (address
translation), a much smaller one less.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dynemb.batch import SparseBatch
from dynemb.config import SGD, Adam, OptimizerConfig, Storage, StorageMode, TableConfig
from dynemb.data.synthetic import zipf_ranks
from dynemb.errors import PlanningError
from dynemb.nn import EmbeddingBagCollection
from dynemb.optim.rules import state_width
from dynemb.planner.cost import CostModel, Counts, fit

logger = logging.getLogger(__name__)

PAGE_BYTES = 4096
"""Bytes between two writes of :func:`touch_pages` (the smallest page size)."""


@dataclass(frozen=True)
class Run:
    """One measured configuration: a table and the ids it is trained on."""

    name: str
    storage: Storage
    optimizer: OptimizerConfig
    dim: int
    capacity: int
    universe: int
    """Distinct ids the steps draw from (more than ``capacity``: the table churns)."""
    alpha: float
    """Zipf exponent of the ids (0: uniform)."""

    @property
    def row_bytes(self) -> int:
        return 4 * (self.dim + state_width(self.optimizer, self.dim))


@dataclass
class Sample:
    """What the timed steps of one run measured."""

    run: Run
    events: list[tuple[float, ...]]
    """Per timed step: (lookups, distinct keys, new keys, keys in ddr, cache misses)."""
    times_ms: list[float]

    def fit_input(self) -> tuple[Counts, int, bool, float]:
        """``(counts, row_bytes, mmap, median ms)`` for :func:`dynemb.planner.cost.fit`."""
        n = len(self.events)
        lookup, unique, new, ddr, miss = (sum(e[i] for e in self.events) / n for i in range(5))
        caching = self.run.storage.effective_mode == StorageMode.CACHING
        counts = Counts(lookup=lookup, unique=unique, new_row=new,
                        cache_lookup=lookup if caching else 0.0, ddr_access=ddr, cache_miss=miss)
        return (counts, self.run.row_bytes, self.run.storage.ddr_path is not None,
                statistics.median(self.times_ms))


def to_ids(ranks: torch.Tensor) -> torch.Tensor:
    """Ranks (int64, >= 0) -> distinct, scattered, positive int64 ids."""
    return ranks * 0x9E3779B1 + 12345


def workload(universe: int, ids_per_step: int, steps: int, alpha: float,
             seed: int) -> list[torch.Tensor]:
    """``steps`` batches of ``ids_per_step`` ids, Zipf(alpha) over ``universe`` ids (0: uniform;
    rank 0 the most frequent)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if alpha == 0:
            ranks = torch.randint(0, universe, (ids_per_step,), generator=g)
        else:
            u = torch.rand(ids_per_step, generator=g, dtype=torch.float64)
            ranks = zipf_ranks(u.clamp_(1e-12, 1 - 1e-12), universe, alpha)
        out.append(to_ids(ranks))
    return out


def _tensors(obj: object, depth: int = 0, seen: set | None = None) -> Iterator[torch.Tensor]:
    """The tensors held by ``obj``'s attributes, and their attributes' (a few levels down)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 3:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, depth + 1, seen)
        return
    if hasattr(obj, "__dict__") and not isinstance(obj, type) and obj.__class__.__module__ \
            .startswith("dynemb."):
        for v in vars(obj).values():
            yield from _tensors(v, depth + 1, seen)


def touch_pages(table: object) -> int:
    """Writes one byte of every page of the table's CPU tensors (its own value back), so that
    none is first touched in a timed step; returns the bytes covered."""
    total = 0
    for t in _tensors(table):
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            continue
        flat = t.reshape(-1).view(torch.uint8)
        every = flat[::PAGE_BYTES]
        every.copy_(every.clone())
        total += flat.numel()
    return total


def _events(table, ids: torch.Tensor) -> tuple[float, ...]:
    """(lookups, distinct keys, new keys, keys in ddr, cache misses) of the coming step."""
    keys = torch.unique(ids)
    rid = table.locate(keys)
    new = int((rid < 0).sum())
    away = int((rid >= table.layout.hbm_rows).sum())
    if table.mode == StorageMode.CACHING:
        return ids.numel(), keys.numel(), new, 0, away
    return ids.numel(), keys.numel(), new, away, 0


def _batch(ids: torch.Tensor, bag_size: int) -> SparseBatch:
    """One feature, bags of ``bag_size`` ids (the last one shorter if it must)."""
    n = ids.numel()
    lengths = torch.full((-(-n // bag_size),), bag_size, dtype=torch.int64, device=ids.device)
    if n % bag_size:
        lengths[-1] = n % bag_size
    return SparseBatch(features=["f"], values=ids, lengths=lengths)


def runs(ddr_dir: Path, capacity: int) -> list[Run]:
    """The calibration grid (see the module docs): per row width, HBM_ONLY on uniform,
    Zipf(1.05), Zipf(1.2) and churning ids; HYBRID at x = 0.3 and CACHING at x = 0.2 on uniform
    ids (many ddr accesses, many misses) and on Zipf(1.05) ids, with ddr in RAM and in files;
    CACHING at x = 0.5 on Zipf(1.2) ids (almost no misses: the cache's cost per lookup). Runs
    on the same law see the same batches, so that their difference is the storage's alone.

    ``capacity`` is the rows of the 768-byte-row tables; the 64-byte-row tables get 8 times as
    many, about as many bytes, so that neither width fits in a CPU cache (a table that does is
    cheaper per row than the large tables a plan places)."""
    out = []
    for dim, opt, rows in ((16, SGD(lr=0.01), 8 * capacity), (64, Adam(lr=1e-3), capacity)):
        def add(name: str, mode: StorageMode = StorageMode.HBM_ONLY, x: float = 1.0,
                ddr: str = "", alpha: float = 1.05, universe: int = rows // 2,
                dim: int = dim, opt: OptimizerConfig = opt, rows: int = rows) -> None:
            path = str(ddr_dir / f"{len(out)}") if ddr == "mmap" else None
            storage = Storage() if mode == StorageMode.HBM_ONLY else Storage(
                mode=mode, cache_load_factor=x, ddr_path=path)
            label = f"{mode.value}{'' if x == 1.0 else f' x={x}'} {name}{' ' + ddr if ddr else ''}"
            out.append(Run(f"{label} dim={dim}", storage, opt, dim, rows, universe, alpha))

        add("uniform", alpha=0.0)
        add("zipf1.05")
        add("zipf1.2", alpha=1.2)
        add("churn", universe=16 * rows)
        for ddr in ("ram", "mmap"):
            add("uniform", StorageMode.HYBRID, 0.3, ddr, alpha=0.0)
            add("zipf1.05", StorageMode.HYBRID, 0.3, ddr)
            add("uniform", StorageMode.CACHING, 0.2, ddr, alpha=0.0)
            add("zipf1.05", StorageMode.CACHING, 0.2, ddr)
        add("zipf1.2", StorageMode.CACHING, 0.5, "ram", alpha=1.2)
    return out


@dataclass(frozen=True)
class Settings:
    """Sizes of a calibration (see :func:`calibrate`)."""

    capacity: int = 1 << 18
    ids_per_step: int = 16384
    steps: int = 30
    warmup: int = 3
    bag_size: int = 16

    @classmethod
    def of(cls, quick: bool = False, **given: int | None) -> Settings:
        """The defaults (``quick``: tiny ones) with the values ``given`` (None: default)."""
        base = cls(capacity=1 << 13, ids_per_step=1024, steps=3, warmup=1, bag_size=16) \
            if quick else cls()
        out = cls(**{k: getattr(base, k) if given.get(k) is None else given[k]
                     for k in cls.__dataclass_fields__})
        bad = {k: v for k, v in vars(out).items()
               if not isinstance(v, int) or isinstance(v, bool) or v < (k != "warmup")}
        if bad:
            raise PlanningError(f"calibrate: expected ints >= 1 (warmup >= 0), found {bad}.")
        return out


class _Live:
    """One run's table, built, touched and filled, with its batches."""

    def __init__(self, run: Run, settings: Settings, seed: int, device: str,
                 fill_chunk: int = 1 << 16) -> None:
        self.run, self.device, self.bag_size = run, device, settings.bag_size
        self.sample = Sample(run, [], [])
        cfg = TableConfig(name="calibration", dim=run.dim, features=["f"], capacity=run.capacity,
                          optimizer=run.optimizer, storage=run.storage)
        self.ebc = EmbeddingBagCollection([cfg], device=device)
        self.table = self.ebc.tables["calibration"]
        try:
            touch_pages(self.table)
            fill = to_ids(torch.arange(min(run.universe, run.capacity) - 1, -1, -1)).to(device)
            chunk = max(1, min(fill_chunk, run.capacity // 4))  # no bucket full in one call
            for part in fill.split(chunk):  # rows for the hottest ids last; nothing updated
                self.table.lookup(part, train=True)
            self.data = [ids.to(device) for ids in workload(
                run.universe, settings.ids_per_step, settings.warmup + settings.steps,
                run.alpha, seed)]
        except BaseException:
            self.close()
            raise

    def step(self, i: int, timed: bool) -> None:
        """Trains step ``i`` of the batches; if ``timed``, records its events and time."""
        ids = self.data[i]
        if timed:
            self.sample.events.append(_events(self.table, ids))
        cpu = self.device == "cpu"
        clock = time.process_time if cpu else time.perf_counter
        if not cpu:
            torch.cuda.synchronize()
        t0 = clock()
        self.ebc(_batch(ids, self.bag_size)).values().sum().backward()
        if not cpu:
            torch.cuda.synchronize()
        if timed:
            self.sample.times_ms.append((clock() - t0) * 1e3)

    def close(self) -> None:
        self.ebc.close()
        if self.run.storage.ddr_path:
            shutil.rmtree(self.run.storage.ddr_path, ignore_errors=True)


def _interleave(live: list[_Live], st: Settings) -> None:
    """Pass after pass, one step of each run (every other pass in reverse order)."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()  # a collection (~0.1 s with torch loaded) would land in one step
    try:
        for i in range(st.warmup + st.steps):
            for one in (live if i % 2 == 0 else live[::-1]):
                one.step(i, timed=i >= st.warmup)
    finally:
        if was:
            gc.enable()


def measure_all(settings: Settings, *, device: str = "cpu",
                ddr_dir: str | os.PathLike | None = None,
                progress: Callable[[int, int, str], None] | None = None) -> list[Sample]:
    """Measures every run of :func:`runs`, the runs of one row width together (see the module
    docs); returns one sample per run, in the grid's order."""
    st = settings
    tmp = Path(tempfile.mkdtemp(prefix="dynemb-calibrate-", dir=ddr_dir))
    try:
        grid = runs(tmp, st.capacity)
        widths = sorted({r.row_bytes for r in grid})
        total, done = len(grid) + len(widths), 0
        samples: dict[str, Sample] = {}
        for width in widths:
            group = [r for r in grid if r.row_bytes == width]
            live: list[_Live] = []
            try:
                for run in group:
                    if progress is not None:
                        progress(done, total, f"building {run.name}")
                    seed = round(run.alpha * 1000) + run.universe  # one per law: same batches
                    live.append(_Live(run, st, seed=seed, device=device))
                    done += 1
                if progress is not None:
                    progress(done, total, f"{st.warmup + st.steps} steps of each {width}-byte-row "
                                          f"table, interleaved")
                _interleave(live, st)
                done += 1
            finally:
                for one in live:
                    one.close()
            samples.update((one.run.name, one.sample) for one in live)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [samples[r.name] for r in grid]


def calibrate(*, device: str = "cpu", quick: bool = False, capacity: int | None = None,
              ids_per_step: int | None = None, steps: int | None = None,
              warmup: int | None = None, ddr_dir: str | os.PathLike | None = None,
              progress: Callable[[int, int, str], None] | None = None) -> CostModel:
    """Measures every run of :func:`runs` and fits the constants (about 35 s on a 2-core
    machine, with 13 tables of about 200 MB alive at once: 5 GB of memory, a third of it the
    page cache of the ddr files; ``quick``: about 2 s).

    Args:
        device: "cpu", or "cuda" (hbm on the GPU, ddr in host memory).
        quick: tiny tables and few steps: checks the machinery, not the machine (its constants
            are dominated by per-call overheads).
        capacity: rows of the 768-byte-row tables, 8 times as many for 64-byte rows (default
            2^18, about 200 MB a table; quick 2^13).
        ids_per_step: ids per step (default 16384; quick 1024).
        steps: timed steps per run (default 30; quick 3).
        warmup: untimed steps per run, after the fill (default 3; quick 1).
        ddr_dir: where the memory-mapped ddr files go (a temporary directory is made in it and
            removed; default: the system's temporary directory).
        progress: called as ``progress(i, n, what)`` before each of ``n`` parts (a table
            built, the interleaved steps of one row width).

    Returns:
        The fitted :class:`CostModel`, with the machine's description and the date.
    """
    settings = Settings.of(quick, capacity=capacity, ids_per_step=ids_per_step, steps=steps,
                           warmup=warmup)
    return model_of(measure_all(settings, device=device, ddr_dir=ddr_dir, progress=progress),
                    device)


def model_of(samples: list[Sample], device: str = "cpu") -> CostModel:
    """The constants fitted to ``samples`` (of :func:`measure_all`; the samples of several
    calibrations may be pooled run by run with :func:`pool`), with the machine's description."""
    for s in samples:
        logger.debug("calibration %s: %.3f ms", s.run.name, s.fit_input()[3])
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = {"host": platform.node(), "processor": platform.processor() or platform.machine(),
               "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
               "device": device if device == "cpu" else torch.cuda.get_device_name(),
               "loadavg_1m": _loadavg()}
    return fit([s.fit_input() for s in samples], device=device,
               source=f"calibrated on {machine['host']} at {now}", machine=machine)


def pool(*calibrations: list[Sample]) -> list[Sample]:
    """The samples of several :func:`measure_all` calls, run by run (steps and events joined)."""
    return [Sample(group[0].run, [e for s in group for e in s.events],
                   [t for s in group for t in s.times_ms]) for group in zip(*calibrations)]


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None
