"""Shared helpers of the benchmark scripts: key generation, timing, state restore, JSON output.

Every benchmark prints one JSON record on stdout (units in key names: ``*_ms``,
``*_mkeys_per_s``, ``*_mids_per_s``) and optionally writes it to ``--out``. Times are medians over
repeats, with the 90th percentile beside them; throughputs are computed from the median time.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import dynemb

# An odd 64-bit multiplier: ``rank * SCRAMBLE mod 2**63`` is a bijection on [0, 2**63), so Zipf
# ranks become distinct, positive, scattered ids (hot ids are not 1, 2, 3, ...).
SCRAMBLE = np.uint64(0x9E3779B97F4A7C15)
_MASK63 = np.uint64((1 << 63) - 1)


# ---------------------------------------------------------------------------- command line

def base_parser(description: str) -> argparse.ArgumentParser:
    """Flags every benchmark has: --threads, --seed, --smoke, --out."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (torch.set_num_threads); 1 on purpose: on small "
                        "CPU machines torch's threading slows small ops down")
    p.add_argument("--seed", type=int, default=0, help="seed of every random draw")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes and few repeats (seconds): checks the script runs, not speed")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON record here")
    return p


DEFAULT_BUCKET_CAPACITY = next(f.default for f in dataclasses.fields(dynemb.TableConfig)
                               if f.name == "bucket_capacity")
"""``TableConfig.bucket_capacity``'s default (128), at which issue 14's targets are set."""


def bucket_note(bucket_capacity: int) -> dict:
    """What a target measured at another bucket capacity than the default carries beside it."""
    if bucket_capacity == DEFAULT_BUCKET_CAPACITY:
        return {}
    return {"note": f"measured at bucket_capacity {bucket_capacity}; the target is set at the "
                    f"default, {DEFAULT_BUCKET_CAPACITY}"}


def set_threads(threads: int) -> dict:
    """Sets torch's intra-op threads deliberately; returns what the JSON reports about it."""
    if threads < 1:
        raise SystemExit(f"--threads: expected >= 1, found {threads}")
    torch.set_num_threads(threads)
    return {"torch_num_threads": torch.get_num_threads(), "threads_flag": threads,
            "threads_note": "torch.set_num_threads set deliberately (default 1); the tables' "
                            "kernels follow it (TableConfig.threads None)"}


def loadavg_1m() -> float | None:
    """The machine's 1-minute load average (above ~1.2 during a one-thread run, other processes
    were competing for the cores or memory bandwidth: treat the numbers with suspicion)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def environment() -> dict:
    """Versions and machine facts recorded with every result."""
    import numba

    return {"git_commit": _git("rev-parse", "--short", "HEAD"),
            "git_uncommitted_files": len((_git("status", "--porcelain") or "").splitlines()),
            "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "numba": numba.__version__,
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine()}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


# ---------------------------------------------------------------------------- keys

def zipf_ranks(rng: np.random.Generator, n: int, exponent: float, num_ranks: int) -> np.ndarray:
    """(n,) int64 ranks in [1, num_ranks] with P(k) ∝ k**-exponent (bounded Zipf).

    Exact sampling by rejection-inversion (W. Hörmann, G. Derflinger, 1996), vectorised:
    rejected draws (a few percent) are drawn again.
    """
    if exponent <= 0 or num_ranks < 1:
        raise ValueError(f"zipf_ranks: expected exponent > 0 and num_ranks >= 1, found "
                         f"{exponent}, {num_ranks}")
    t = 1.0 - exponent

    def helper1(x):  # log1p(x) / x, continuous at 0
        small = np.abs(x) < 1e-8
        safe = np.where(small, 1.0, x)
        return np.where(small, 1.0 - x / 2.0, np.log1p(safe) / safe)

    def helper2(x):  # expm1(x) / x, continuous at 0
        small = np.abs(x) < 1e-8
        safe = np.where(small, 1.0, x)
        return np.where(small, 1.0 + x / 2.0, np.expm1(safe) / safe)

    def big_h(x):  # integral of x**-exponent, shifted so that it is smooth at exponent == 1
        log_x = np.log(x)
        return helper2(t * log_x) * log_x

    def big_h_inv(y):
        ty = np.maximum(t * y, -1.0)
        return np.exp(helper1(ty) * y)

    def small_h(x):
        return np.exp(-exponent * np.log(x))

    h_x1 = float(big_h(np.float64(1.5))) - 1.0
    h_n = float(big_h(np.float64(num_ranks + 0.5)))
    s = 2.0 - float(big_h_inv(big_h(np.float64(2.5)) - small_h(np.float64(2.0))))
    out = np.empty(n, dtype=np.int64)
    todo = np.arange(n)
    while todo.size:
        u = h_n + rng.random(todo.size) * (h_x1 - h_n)
        x = big_h_inv(u)
        k = np.clip(np.floor(x + 0.5), 1, num_ranks)
        ok = (k - x <= s) | (u >= big_h(k + 0.5) - small_h(k))
        out[todo[ok]] = k[ok].astype(np.int64)
        todo = todo[~ok]
    return out


def uniform_ranks(rng: np.random.Generator, n: int, num_ranks: int) -> np.ndarray:
    """(n,) int64 ranks uniform in [1, num_ranks]."""
    return rng.integers(1, num_ranks + 1, size=n, dtype=np.int64)


def draw_ranks(rng: np.random.Generator, dist: str, n: int, num_ranks: int,
               exponent: float) -> np.ndarray:
    """(n,) ranks from ``dist`` ("zipf" or "uniform") over [1, num_ranks]."""
    if dist == "zipf":
        return zipf_ranks(rng, n, exponent, num_ranks)
    if dist == "uniform":
        return uniform_ranks(rng, n, num_ranks)
    raise ValueError(f"unknown distribution {dist!r}")


def rank_to_id(ranks: np.ndarray) -> torch.Tensor:
    """Scrambles ranks into distinct positive int64 ids (a bijection on [0, 2**63))."""
    with np.errstate(over="ignore"):
        ids = (ranks.astype(np.uint64) * SCRAMBLE) & _MASK63
    return torch.from_numpy(ids.astype(np.int64))


def distinct_ranks(rng: np.random.Generator, dist: str, n: int, num_ranks: int,
                   exponent: float) -> np.ndarray:
    """(n,) distinct ranks: draws from ``dist`` in draw order, repeats dropped, until n remain."""
    if n > num_ranks:
        raise ValueError(f"distinct_ranks: {n} distinct ranks asked of {num_ranks}")
    got = np.empty(0, dtype=np.int64)
    while got.size < n:
        more = draw_ranks(rng, dist, 2 * n, num_ranks, exponent)
        both = np.concatenate([got, more])
        _, first = np.unique(both, return_index=True)
        got = both[np.sort(first)]
    return got[:n]


# ---------------------------------------------------------------------------- timing

def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes (perf_counter), with the garbage collector paused (a
    collection costs ~0.1 s with torch loaded: it would land in random repeats)."""
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    finally:
        gc.enable()


def summary_ms(seconds: list[float]) -> dict:
    """Median and 90th percentile of per-call times, in ms, plus the repeat count."""
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    return {"median_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90)),
            "min_ms": float(ms.min()), "repeats": int(ms.size)}


def rate_m(items: int, ms: float) -> float:
    """Millions of items per second for ``items`` processed in ``ms`` milliseconds."""
    return items / (ms * 1e-3) / 1e6 if ms > 0 else math.inf


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


# ---------------------------------------------------------------------------- state restore

def _holds_tensors(obj: object, depth: int = 0) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if depth > 3 or not hasattr(obj, "__dict__") or isinstance(obj, type):
        return False
    return any(_holds_tensors(v, depth + 1) for v in vars(obj).values())


def restore_(dst: object, snap: object) -> None:
    """Puts ``dst`` back into the state of ``snap`` (a ``copy.deepcopy`` of it taken earlier).

    Tensors are copied in place (no reallocation, so the restore costs one memcpy), objects that
    hold tensors are restored recursively, plain values (ints, counters, ...) are deep-copied,
    and everything else (configs, backends) is left as it is. Used between repeats of the
    verbs that change a table (find_or_insert, insert_or_assign), outside the timed region.
    """
    for name, sv in vars(snap).items():
        dv = dst.__dict__.get(name)
        if isinstance(sv, torch.Tensor):
            if isinstance(dv, torch.Tensor) and dv.shape == sv.shape and dv.dtype == sv.dtype:
                dv.copy_(sv)
            else:
                dst.__dict__[name] = sv.clone()
        elif isinstance(sv, np.ndarray):
            if isinstance(dv, np.ndarray) and dv.shape == sv.shape and dv.dtype == sv.dtype:
                np.copyto(dv, sv)
            else:
                dst.__dict__[name] = sv.copy()
        elif _holds_tensors(sv):
            restore_(dv, sv)
        elif isinstance(sv, (int, float, bool, str, type(None), dict, list, tuple, set)):
            dst.__dict__[name] = copy.deepcopy(sv)


# ---------------------------------------------------------------------------- output

def emit(record: dict, out: Path | None) -> None:
    """Prints the JSON record on stdout (one object) and writes it to ``out`` if given; adds the
    load average at the end of the run to ``record["environment"]``."""
    record.setdefault("environment", {})["loadavg_1m_end"] = loadavg_1m()
    text = json.dumps(record, indent=2, sort_keys=False, allow_nan=False, default=_jsonable)
    print(text)
    sys.stdout.flush()
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def _jsonable(obj: object):
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def log(msg: str) -> None:
    """Progress on stderr (stdout carries only the JSON record)."""
    print(msg, file=sys.stderr, flush=True)
