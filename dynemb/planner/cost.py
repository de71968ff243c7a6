"""The planner's cost model: predicted time per training step of one table shard.

A step of a table on one rank is a sum of events, each with a cost that grows with the bytes of
a row (``row_bytes = 4 * (dim + optimizer state width)``)::

    ms = sum over events e of  count_e * (fixed_e + per_byte_e * row_bytes) * 1e-6

Events (per rank and step):

- ``lookup``: an id looked up (an occurrence): the find pass, pooling, the gradient scatter;
- ``unique``: a distinct key: deduplication, the row's optimizer update in hbm;
- ``new_row``: a key new to the table: the insert, a victim scan, an eviction, initialisation;
- ``cache_lookup``: an id looked up in a CACHING table: what its cache adds to every lookup;
- ``ddr_access``: a distinct key whose row lives in ddr (HYBRID): the gather into the pooled
  input and the update where the row lives;
- ``cache_miss``: a distinct key missing from a CACHING table's cache but in its backing store:
  the backing probe, the copy in, and the write-back of the dirty row it evicts.

``ddr_access`` and ``cache_miss`` have separate constants for a ddr tier in RAM and in
memory-mapped files. The counts come from the table's access profile (``predict_counts``); the
constants from a calibration (``dynemb calibrate``) or the defaults of the device kind.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dynemb.checkpoint.files import write_text_atomic
from dynemb.config import StorageMode
from dynemb.errors import PlanningError
from dynemb.planner.profile import AccessProfile
from dynemb.table.memory import Layout

EVENTS = ("lookup", "unique", "new_row", "cache_lookup", "ddr_access", "cache_miss",
          "ddr_access_mmap", "cache_miss_mmap")
"""Cost terms; the ``_mmap`` twins replace their RAM terms for a ddr tier in files."""
VERSION = 1


@dataclass(frozen=True)
class Counts:
    """Events per step on one rank (see the module docs), and the hbm hit rate they imply."""

    lookup: float
    unique: float
    new_row: float
    cache_lookup: float = 0.0
    ddr_access: float = 0.0
    cache_miss: float = 0.0
    hbm_hit_rate: float = 1.0
    """Share of lookups served from hbm (what ``TableStats.hbm_hit_rate`` measures)."""
    hit_rate: float = 1.0
    """Share of lookups whose key had a row in any tier."""

    def vector(self, mmap: bool) -> np.ndarray:
        """The counts in ``EVENTS`` order (ddr terms in the RAM or the mmap columns)."""
        ddr = (0.0, 0.0, self.ddr_access, self.cache_miss) if mmap else \
            (self.ddr_access, self.cache_miss, 0.0, 0.0)
        return np.array([self.lookup, self.unique, self.new_row, self.cache_lookup, *ddr])


def predict_counts(profile: AccessProfile, layout: Layout, world_size: int) -> Counts:
    """The events per step of one rank's shard (``layout``: the shard's geometry) under
    ``profile`` (the whole table's traffic; each rank owns about 1/W of it)."""
    w = world_size
    slots = layout.slots
    lookups = profile.lookups_per_step / w
    unique = min(lookups, profile.unique_ids(slots * w) / w)
    in_table = profile.hit_rate(slots * w, slots * w)
    new = lookups * (1.0 - in_table)
    if layout.mode == StorageMode.HBM_ONLY:
        return Counts(lookup=lookups, unique=unique, new_row=new, hbm_hit_rate=in_table,
                      hit_rate=in_table)
    if layout.mode == StorageMode.HYBRID:
        in_hbm, distinct_in_hbm = profile.hbm_shares(layout.split, layout.num_buckets)
        return Counts(lookup=lookups, unique=unique, new_row=new,
                      ddr_access=(1.0 - distinct_in_hbm) * max(0.0, unique - new),
                      hbm_hit_rate=in_hbm * in_table, hit_rate=in_table)
    in_cache = min(in_table, profile.hit_rate(layout.hbm_rows * w, slots * w))
    return Counts(lookup=lookups, unique=unique, new_row=new, cache_lookup=lookups,
                  cache_miss=lookups * (in_table - in_cache), hbm_hit_rate=in_cache,
                  hit_rate=in_table)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Nanoseconds per event: ``fixed[e] + per_byte[e] * row_bytes`` (``EVENTS`` order)."""

    fixed_ns: tuple[float, ...]
    per_byte_ns: tuple[float, ...]
    device: str = "cpu"
    source: str = ""
    """Where the constants come from (a calibration's machine and date, or the defaults)."""
    machine: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("fixed_ns", "per_byte_ns"):
            v = tuple(getattr(self, name))
            if len(v) != len(EVENTS) or not all(isinstance(x, (int, float)) and not isinstance(
                    x, bool) and math.isfinite(x) and x >= 0 for x in v):
                raise PlanningError(f"CostModel.{name}: expected {len(EVENTS)} finite numbers "
                                    f">= 0 ({', '.join(EVENTS)}), found {v!r}.")
            object.__setattr__(self, name, tuple(float(x) for x in v))

    def step_ms(self, counts: Counts, row_bytes: int, mmap: bool) -> float:
        per_event = np.array(self.fixed_ns) + np.array(self.per_byte_ns) * row_bytes
        return float(counts.vector(mmap) @ per_event) * 1e-6

    def as_dict(self) -> dict:
        return {"version": VERSION, "device": self.device, "source": self.source,
                "machine": self.machine, "events": list(EVENTS),
                "fixed_ns": list(self.fixed_ns), "per_byte_ns": list(self.per_byte_ns)}

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, json.dumps(self.as_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """A calibration written by :meth:`save` (``dynemb calibrate --out``)."""
        data = read_json(path, "calibration")
        if not isinstance(data, dict) or data.get("version") != VERSION \
                or data.get("events") != list(EVENTS):
            raise PlanningError(f"calibration {str(path)!r}: expected a dynemb calibration of "
                                f"version {VERSION} with events {list(EVENTS)}; run "
                                "`dynemb calibrate --out` again.")
        try:
            return cls(fixed_ns=data["fixed_ns"], per_byte_ns=data["per_byte_ns"],
                       device=str(data.get("device", "cpu")), source=str(data.get("source", "")),
                       machine=dict(data.get("machine") or {}))
        except (KeyError, TypeError, ValueError) as e:
            raise PlanningError(f"calibration {str(path)!r}: malformed ({e}).") from None


def read_json(path: str | Path, what: str) -> object:
    """The JSON value in the file ``path``; PlanningError naming ``what`` and the file."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PlanningError(f"{what} {str(path)!r}: cannot read it as JSON ({e}).") from None


def fit(samples: list[tuple[Counts, int, bool, float]], *, device: str, source: str,
        machine: dict) -> CostModel:
    """Constants (>= 0) that best explain measured steps: ``(counts, row_bytes, mmap, ms)``
    each, by non-negative least squares on relative error (every sample weighs the same)."""
    rows, target = [], []
    for counts, row_bytes, mmap, ms in samples:
        if ms <= 0:
            continue
        v = counts.vector(mmap)
        rows.append(np.concatenate([v, v * row_bytes]) / ms)
        target.append(1e6)  # ns: sum(rows @ x) = ms * 1e6, divided by ms
    if len(rows) < 4:
        raise PlanningError(f"calibration: {len(rows)} usable measurements; need at least 4.")
    x = _nnls(np.array(rows), np.array(target))
    n = len(EVENTS)
    return CostModel(fixed_ns=tuple(x[:n]), per_byte_ns=tuple(x[n:]), device=device,
                     source=source, machine=machine)


def _nnls(a: np.ndarray, b: np.ndarray, iters: int = 500) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson-Hanson active set)."""
    m, n = a.shape
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(iters):
        w = a.T @ (b - a @ x)
        if passive.all() or (w[~passive] <= 1e-12 * max(1.0, np.abs(w).max())).all():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            alpha = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x / scale
