"""planner.calibrate and the cost model's fit and file: the fit recovers known constants, a
quick calibration runs end to end, every page is touched before timing, the events are counted
exactly, and a calibration file round-trips or fails with a PlanningError."""

from __future__ import annotations

import importlib
import json
import math
import mmap
import resource

import numpy as np
import pytest
import torch

import dynemb
from dynemb import planner
from dynemb.config import Storage, StorageMode
from dynemb.errors import PlanningError
from dynemb.planner.cost import EVENTS, Counts, fit

# the module (``planner.calibrate`` is the function the package exports)
cal = importlib.import_module("dynemb.planner.calibrate")

TRUE = planner.CostModel(
    fixed_ns=(180.0, 120.0, 1300.0, 75.0, 150.0, 900.0, 120.0, 950.0),
    per_byte_ns=(0.07, 0.5, 1.0, 0.0, 0.02, 0.3, 0.0, 0.25))


def synthetic_samples(rng: np.random.Generator, n: int, noise: float = 0.0):
    """Samples like a calibration's: counts varied per mode, two row widths, ms from TRUE."""
    out = []
    for i in range(n):
        mode = ("hbm_only", "hybrid", "caching")[i % 3]
        lookup = float(rng.integers(1000, 20000))
        unique = lookup * rng.uniform(0.1, 1.0)
        new = unique * rng.uniform(0.0, 0.4) if rng.random() < 0.5 else 0.0
        counts = Counts(lookup=lookup, unique=unique, new_row=new,
                        cache_lookup=lookup if mode == "caching" else 0.0,
                        ddr_access=(unique - new) * rng.uniform(0.1, 0.9) if mode == "hybrid"
                        else 0.0,
                        cache_miss=unique * rng.uniform(0.0, 0.8) if mode == "caching" else 0.0)
        row_bytes, mmap_ = (64, 768)[(i // 3) % 2], bool((i // 6) % 2)
        ms = TRUE.step_ms(counts, row_bytes, mmap_) * (1 + noise * rng.standard_normal())
        out.append((counts, row_bytes, mmap_, ms))
    return out


def test_fit_recovers_known_constants_from_exact_samples():
    model = fit(synthetic_samples(np.random.default_rng(0), 96), device="cpu", source="t",
                machine={})
    np.testing.assert_allclose(model.fixed_ns, TRUE.fixed_ns, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(model.per_byte_ns, TRUE.per_byte_ns, rtol=1e-6, atol=1e-8)


def test_fit_with_noise_predicts_within_the_noise():
    rng = np.random.default_rng(1)
    model = fit(synthetic_samples(rng, 96, noise=0.03), device="cpu", source="t", machine={})
    assert all(x >= 0 for x in model.fixed_ns + model.per_byte_ns)
    for counts, row_bytes, mmap_, _ in synthetic_samples(rng, 30):
        truth = TRUE.step_ms(counts, row_bytes, mmap_)
        assert model.step_ms(counts, row_bytes, mmap_) == pytest.approx(truth, rel=0.06)


def test_fit_needs_four_usable_samples():
    samples = synthetic_samples(np.random.default_rng(2), 5)
    samples = samples[:3] + [(c, b, m, 0.0) for c, b, m, _ in samples[3:]]  # ms 0: unusable
    with pytest.raises(PlanningError, match="3 usable measurements; need at least 4"):
        fit(samples, device="cpu", source="t", machine={})


def test_quick_calibration_runs_and_gives_finite_non_negative_constants(tmp_path):
    seen = []
    model = planner.calibrate(quick=True, ddr_dir=tmp_path,
                              progress=lambda i, n, what: seen.append((i, n, what)))
    for v in model.fixed_ns + model.per_byte_ns:
        assert math.isfinite(v) and v >= 0
    assert sum(model.fixed_ns) > 0
    assert model.device == "cpu" and model.source.startswith("calibrated on ")
    assert model.machine["cpu_count"] >= 1 and model.machine["torch_threads"] >= 1
    n = seen[0][1]
    assert [i for i, _, _ in seen] == list(range(n)) and all(k == n for _, k, _ in seen)
    assert list(tmp_path.iterdir()) == []  # the ddr files were removed


def test_settings_reject_bad_sizes():
    assert cal.Settings.of(True).capacity == 1 << 13
    assert cal.Settings.of(False, steps=7).steps == 7
    with pytest.raises(PlanningError, match="expected ints >= 1"):
        cal.Settings.of(False, steps=0)
    with pytest.raises(PlanningError, match="expected ints >= 1"):
        cal.Settings.of(False, warmup=-1)


def test_the_grid_moves_every_event():
    """Each event has runs where it is counted and runs where it is not (else the fit could not
    tell it from the others), at both row widths, with ddr in RAM and in files."""
    grid = cal.runs(__import__("pathlib").Path("/nonexistent"), 1 << 18)
    assert {r.row_bytes for r in grid} == {64, 768}
    for width in (64, 768):
        runs = [r for r in grid if r.row_bytes == width]
        modes = {(r.storage.effective_mode, r.storage.ddr_path is not None) for r in runs}
        assert modes == {(StorageMode.HBM_ONLY, False), (StorageMode.HYBRID, False),
                         (StorageMode.HYBRID, True), (StorageMode.CACHING, False),
                         (StorageMode.CACHING, True)}
        assert any(r.universe > r.capacity for r in runs)  # churn: new rows
        assert {r.alpha for r in runs} >= {0.0, 1.2}  # distinct keys vs lookups


def _faults_writing_every_page(t: torch.Tensor) -> tuple[int, int]:
    """(page faults, pages) while one byte of every page under ``t`` is written (its value)."""
    flat = t.reshape(-1).view(torch.uint8)
    idx = torch.arange(0, flat.numel(), mmap.PAGESIZE)
    vals = flat[idx].clone()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    flat[idx] = vals
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return r1.ru_minflt + r1.ru_majflt - r0.ru_minflt - r0.ru_majflt, idx.numel()


def _caching_table(tmp_path):
    cfg = dynemb.TableConfig(name="t", dim=16, features=["f"], capacity=1 << 15,
                             optimizer=dynemb.Adam(),
                             storage=Storage(mode=StorageMode.CACHING, cache_load_factor=0.2,
                                             ddr_path=str(tmp_path)))
    return dynemb.nn.EmbeddingBagCollection([cfg]).tables["t"]


def test_touch_pages_leaves_no_page_to_fault_in_a_timed_step(tmp_path):
    """The defect: the pages of freshly allocated ddr files were first touched inside timed
    steps (a fault per page), which made a cache miss look like tens of microseconds."""
    table = _caching_table(tmp_path)
    try:
        files = [table.store.ddr, table.index.scores, table.index.written]
        covered = cal.touch_pages(table)
        assert covered >= sum(t.numel() * t.element_size() for t in files)
        for t in files:
            faults, pages = _faults_writing_every_page(t)
            assert pages >= 8 and faults <= pages // 8, (t.shape, faults, pages)
    finally:
        table.close()
    fresh = _caching_table(tmp_path / "fresh")  # the check can fail: untouched, they fault
    try:
        faults, pages = _faults_writing_every_page(fresh.store.ddr)
        assert faults >= pages // 2
    finally:
        fresh.close()


def test_touch_pages_changes_nothing(tmp_path):
    table = _caching_table(tmp_path)
    try:
        table.lookup(cal.to_ids(torch.arange(5000)), train=True)
        before = [t.clone() for t in cal._tensors(table)]
        cal.touch_pages(table)
        after = list(cal._tensors(table))
        assert len(after) == len(before) > 8
        assert all(torch.equal(a, b) for a, b in zip(after, before))
    finally:
        table.close()


@pytest.mark.parametrize("mode", [StorageMode.HBM_ONLY, StorageMode.HYBRID, StorageMode.CACHING])
def test_events_are_the_step_s_own_counts(mode):
    """The events located before a step are what the step then does: its new rows, the rows it
    serves from ddr (HYBRID) and its cache misses (CACHING), as TableStats counts them."""
    storage = Storage() if mode == StorageMode.HBM_ONLY else Storage(mode=mode,
                                                                      cache_load_factor=0.3)
    run = cal.Run("t", storage, dynemb.SGD(lr=0.1), 8, 4096, 3000, 0.0)
    settings = cal.Settings(capacity=4096, ids_per_step=512, steps=3, warmup=0)
    live = cal._Live(run, settings, seed=0, device="cpu")
    try:
        ids = cal.to_ids(torch.randperm(6000, generator=torch.Generator().manual_seed(0))[:512])
        live.data[0] = ids  # distinct ids, half of them new: occurrences = distinct keys
        before = live.table.stats()
        live.step(0, timed=True)
        after = live.table.stats()
    finally:
        live.close()
    lookups, unique, new, ddr, miss = live.sample.events[0]
    assert (lookups, unique) == (512, 512)
    assert new == after.size - before.size > 0
    hbm_hits = after.hbm_hits - before.hbm_hits
    if mode == StorageMode.CACHING:
        assert ddr == 0 and miss == after.ddr_hits - before.ddr_hits > 0
        assert hbm_hits == unique - new - miss
    elif mode == StorageMode.HYBRID:
        assert miss == 0 and ddr > 0 and hbm_hits == unique - new - ddr
    else:
        assert ddr == miss == 0 and hbm_hits == unique - new


# ---------------------------------------------------------------------------- the file

def test_cost_model_json_round_trip(tmp_path):
    model = planner.CostModel(fixed_ns=TRUE.fixed_ns, per_byte_ns=TRUE.per_byte_ns,
                              device="cuda", source="calibrated on x at y",
                              machine={"host": "x", "cpu_count": 2})
    path = tmp_path / "cal.json"
    model.save(path)
    assert planner.CostModel.load(path) == model
    data = json.loads(path.read_text())
    assert data["events"] == list(EVENTS) and data["version"] == 1


def _bad(tmp_path, change) -> str:
    data = TRUE.as_dict()
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(version=2), "expected a dynemb calibration of version 1"),
    (lambda d: d.update(events=list(EVENTS)[::-1]), "expected a dynemb calibration"),
    (lambda d: d.pop("fixed_ns"), "malformed"),
    (lambda d: d.update(fixed_ns=None), "malformed"),
    (lambda d: d.update(machine="x"), "malformed"),
    (lambda d: d.update(per_byte_ns=[1.0] * 7), "expected 8 finite numbers >= 0"),
    (lambda d: d.update(fixed_ns=[1.0] * 7 + [-1.0]), "expected 8 finite numbers >= 0"),
    (lambda d: d.update(fixed_ns=[1.0] * 7 + [float("nan")]), "expected 8 finite numbers"),
    (lambda d: d.update(fixed_ns=[True] * 8), "expected 8 finite numbers >= 0"),
    (lambda d: d.update(fixed_ns=["1"] * 8), "expected 8 finite numbers >= 0"),
])
def test_cost_model_load_rejects_bad_files(tmp_path, change, message):
    with pytest.raises(PlanningError, match=message):
        planner.CostModel.load(_bad(tmp_path, change))


def test_cost_model_load_rejects_unreadable_files(tmp_path):
    with pytest.raises(PlanningError, match="cannot read it as JSON"):
        planner.CostModel.load(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(PlanningError, match="cannot read it as JSON"):
        planner.CostModel.load(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("[1, 2]")
    with pytest.raises(PlanningError, match="expected a dynemb calibration"):
        planner.CostModel.load(tmp_path / "y.json")
