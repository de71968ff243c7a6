"""The cost constants the planner uses without a calibration, per device kind.

``cpu``: measured with ``dynemb calibrate``'s runs (``planner.calibrate``) on a 2-core x86-64
machine, the kind dynemb's CI runs on: an AMD EPYC KVM guest (2 vCPUs, 32 MB L3, 24 GB RAM,
4 KB pages, Linux 6.18, ext4 local disk for the ddr files), torch 2.13 with one thread, numba
0.68, on 2026-11-23 at 01:26 UTC, with nothing else running (load average 0.6 to 0.9: the
calibration's own process). Three calibrations in a row were pooled run by run and fitted once
(``model_of(pool(a, b, c))``). Alone, the three agreed within 13 % of their median on the costs
that weigh (lookup 226 to 252 ns, new row 2.4 to 2.7 us, cache miss 1.38 to 1.49 us, in files
1.31 to 1.59 us, distinct key at 768 bytes 494 to 577 ns, cache lookup 116 ns); the small ddr
access (150 to 410 ns, a tenth of a HYBRID step here) within 45 %. ddr in RAM and in
memory-mapped files: on a CPU host both tiers are memory, so a ddr access costs little more than
an hbm one and a cache miss is the bookkeeping (backing probe, copy in, write-back), about
1.4 us whether the backing rows are in RAM or in the page cache. The constants hold for what
the calibration runs: tables of about 200 MB, 16,384 lookups per table and step in bags of 16
(see ``dynemb.planner.calibrate``); this machine's speed drifts by up to 20 % from one minute to
the next, so expect predictions within about that.

``cuda``: derived from NVIDIA dynamicemb's published H100 figures for 10 tables of 104,857
lookups each per step (1,048,570 in all), dim 128, Adam (row bytes 1,536), Zipf(1.05), forward
and backward: HBM-only 2.19 ms, CACHING with the cache as large as the touched rows 12.28 ms,
CACHING at 80 % of them 24.33 ms, HYBRID with 10 % of the rows in HBM 33.31 ms. Taking
1,048,576 rows per table (the figures do not say) and Che's approximation for the LRU hit rates:

- lookup = HBM-only time / lookups;
- cache_lookup = (CACHING full - HBM-only) / lookups (the cache's cost on every lookup);
- cache_miss = (CACHING 80 % - CACHING full) / misses, misses = lookups x (1 - hit(0.8 rows));
- ddr_access = (HYBRID 10 % - HBM-only) / (0.9 x distinct keys per step);
- new_row: HierarchicalKV's insert_or_assign, 0.8 billion keys/s in HBM (1.25 ns per key).

Bytes enter these only through the figures' one row width, so ``per_byte_ns`` is 0. Calibrate
on the GPU (``dynemb calibrate --device cuda``) for constants of dynemb's own CUDA path.
"""

from __future__ import annotations

from dynemb.errors import PlanningError
from dynemb.planner.cost import EVENTS, CostModel
from dynemb.planner.profile import AccessProfile

CPU_FIXED_NS = (234.0, 212.0, 2490.0, 112.0, 179.0, 1430.0, 179.0, 1390.0)
"""Nanoseconds per event (``EVENTS`` order), measured as the module docs say."""
CPU_PER_BYTE_NS = (0.0, 0.438, 0.0, 0.0, 0.198, 0.0, 0.0996, 0.0)
"""Nanoseconds per event and byte of a row (``EVENTS`` order), measured with them."""

_TABLES, _LOOKUPS, _ROWS, _ALPHA = 10, 104_857, 1 << 20, 1.05
_HBM_MS, _CACHING_FULL_MS, _CACHING_80_MS, _HYBRID_10_MS = 2.19, 12.28, 24.33, 33.31
_NEW_ROW_NS = 1.25


def _cuda() -> CostModel:
    prof = AccessProfile(lookups_per_step=_LOOKUPS, zipf_alpha=_ALPHA, num_ids=_ROWS)
    per_table = 1e6 / _TABLES  # ms of all tables -> ns of one
    lookup = _HBM_MS * per_table / _LOOKUPS
    cache_lookup = (_CACHING_FULL_MS - _HBM_MS) * per_table / _LOOKUPS
    misses = _LOOKUPS * (1.0 - prof.hit_rate(0.8 * _ROWS, _ROWS))
    cache_miss = (_CACHING_80_MS - _CACHING_FULL_MS) * per_table / misses
    ddr = (_HYBRID_10_MS - _HBM_MS) * per_table / (0.9 * prof.unique_ids(_ROWS))
    fixed = dict(lookup=lookup, unique=0.0, new_row=_NEW_ROW_NS, cache_lookup=cache_lookup,
                 ddr_access=ddr, cache_miss=cache_miss, ddr_access_mmap=ddr,
                 cache_miss_mmap=cache_miss)
    return CostModel(fixed_ns=tuple(fixed[e] for e in EVENTS), per_byte_ns=(0.0,) * len(EVENTS),
                     device="cuda", source="defaults for cuda (derived from dynamicemb's "
                     "published H100 figures; calibrate for dynemb's own CUDA path)")


def default_cost_model(device: str) -> CostModel:
    """The constants of ``device`` ("cpu" or "cuda") when no calibration is given."""
    if device == "cuda":
        return _cuda()
    if device == "cpu":
        return CostModel(fixed_ns=CPU_FIXED_NS, per_byte_ns=CPU_PER_BYTE_NS, device="cpu",
                         source="defaults for cpu (measured on a 2-core x86-64 machine on "
                                "2026-11-23; calibrate for this one)")
    raise PlanningError(f"default_cost_model: expected device 'cpu' or 'cuda', found {device!r}.")
