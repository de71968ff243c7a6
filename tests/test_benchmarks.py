"""Smoke tests of the benchmark scripts: each runs with --smoke (tiny sizes, seconds) in a
subprocess and must print one JSON record, the same as the one written to --out, with the
expected keys and positive numbers. Speed itself is not checked here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

pytestmark = pytest.mark.slow


def run_smoke(script: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / f"{script}.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{script}.py"), "--smoke", "--out", str(out), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-4000:]}"
    record = json.loads(proc.stdout)  # stdout is exactly one JSON record
    assert json.loads(out.read_text()) == record
    assert record["benchmark"] == script
    assert record["config"]["smoke"] is True
    assert record["config"]["torch_num_threads"] == 1
    assert record["environment"]["torch"]
    return record


def positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_table_ops_smoke(tmp_path):
    rec = run_smoke("table_ops", tmp_path)
    impls = ("dynemb", "torch_backend", "python_dict")
    ops = ("find", "find_or_insert", "insert_or_assign")
    got = {(r["dist"], r["load_factor"]) for r in rec["results"]}
    assert got == {(d, lf) for d in ("zipf", "uniform") for lf in (0.5, 0.9)}
    for r in rec["results"]:
        for impl in impls:
            for op in ops:
                for key in (f"{op}_mkeys_per_s", f"{op}_mkeys_per_s_at_p90", f"{op}_ms",
                            f"{op}_ms_p90"):
                    assert positive(r[impl][key]), (r["dist"], r["load_factor"], impl, key)
                assert r[impl][f"{op}_ms_p90"] >= r[impl][f"{op}_ms"]
            assert 0 < r[impl]["load_factor_actual"] <= 1
            assert r[impl]["find_hit_rate"] > 0.9
        ceiling = r["dynemb"]["memory_ceiling"]
        assert positive(ceiling["row_gather_mkeys_per_s"])
        assert ceiling["row_gather_ms_p90"] >= ceiling["row_gather_ms"]
        floor = r["dynemb"]["find_or_insert_floor"]  # new rows initialised + that gather
        assert floor["new_rows"] == round(r["dynemb"]["find_or_insert_new_keys_per_call"]) > 0
        assert positive(floor["initializer_ms"]) and floor["row_gather_ms"] == ceiling[
            "row_gather_ms"]
        assert floor["floor_ms"] == pytest.approx(floor["initializer_ms"] + floor["row_gather_ms"])
        for op in ops:
            for base in impls[1:]:
                assert positive(r["ratios"][f"{op}_vs_{base}"])
        if r["load_factor"] == 0.9:  # new keys into a nearly full table: eviction is measured
            assert r["dynemb"]["find_or_insert_evicted_keys_per_call"] > 0
            assert r["dynemb"]["find_or_insert_new_keys_per_call"] > 0
    assert len(rec["targets"]) == 6  # find, find_or_insert, insert_or_assign x zipf, uniform
    assert all(positive(t["measured_mkeys_per_s"]) for t in rec["targets"])
    for t in rec["targets"]:  # find's carry its memory ceiling, find_or_insert's its floor
        assert ("memory_ceiling_mkeys_per_s" in t) == t["what"].startswith("find ")
        assert ("floor_mkeys_per_s" in t) == t["what"].startswith("find_or_insert ")
    assert rec["config"]["bucket_capacity"] == 128  # the default, where the targets are set
    assert not any("note" in t for t in rec["targets"])


def test_table_ops_bucket_capacity_smoke(tmp_path):
    rec = run_smoke("table_ops", tmp_path, "--loads", "0.9", "--dists", "zipf", "--impls",
                    "dynemb", "--bucket-capacity", "16")
    assert rec["config"]["bucket_capacity"] == 16
    assert rec["config"]["capacity_rows"] % 16 == 0
    assert len(rec["targets"]) == 3 and all("bucket_capacity 16" in t["note"]
                                            for t in rec["targets"])


def test_train_step_smoke(tmp_path):
    rec = run_smoke("train_step", tmp_path)
    results = rec["results"]
    assert [(r["dim"], r["optimizer"]) for r in results] == [
        (16, "sgd"), (16, "rowwise_adagrad"), (16, "adam")]
    for r in results:
        ours = r["dynemb"]
        for impl in ("dynemb", "dynemb_same_ids", "torch_embedding_bag"):
            for key in ("step_ms", "step_ms_p90", "mids_per_s", "mids_per_s_at_p90"):
                assert positive(r[impl][key]), (r["optimizer"], impl, key)
        assert ours["steady_state_reached"] is True
        assert ours["evicted_per_step"] > 0 and ours["load_factor_timed"] > 0.9
        assert positive(r["ratios"]["mids_per_s_vs_torch_embedding_bag"])
        assert positive(r["ratios_same_ids"]["mids_per_s_vs_torch_embedding_bag"])
        fb = r["fbgemm_tbe"]  # measured, or skipped with the reason (not installed, refused)
        if "skipped" in fb:
            assert isinstance(fb["skipped"], str) and fb["skipped"]
            assert "mids_per_s_vs_fbgemm_tbe" not in r["ratios"]
        else:
            assert positive(fb["step_ms"]) and positive(fb["mids_per_s"])
            assert positive(r["ratios"]["mids_per_s_vs_fbgemm_tbe"])
    assert len(rec["targets"]) == 7  # SGD, row-wise Adagrad: 3 each; Adam: 1
    assert rec["config"]["bucket_capacity"] == 128 and not any("note" in t for t in rec["targets"])
    assert all(r["dynemb"]["bucket_capacity"] == 128 for r in results)
    assert all(r["dynemb_same_ids"]["evicted_per_step"] == 0 for r in results)  # twice the room


def test_train_step_bucket_capacity_smoke(tmp_path):
    """``--bucket-capacity`` reaches dynemb's tables, and the targets (set at the default) say
    they were measured at another."""
    rec = run_smoke("train_step", tmp_path, "--optimizers", "sgd", "--bucket-capacity", "16")
    assert rec["config"]["bucket_capacity"] == 16
    (r,) = rec["results"]
    assert r["dynemb"]["bucket_capacity"] == 16 and r["dynemb"]["evicted_per_step"] > 0
    assert len(rec["targets"]) == 3 and all("bucket_capacity 16" in t["note"]
                                            for t in rec["targets"])


def test_many_tables_smoke(tmp_path):
    rec = run_smoke("many_tables", tmp_path)
    assert rec["config"]["tables"] == 26 and len(rec["config"]["rows_per_table"]) == 26
    ours = rec["results"]["dynemb"]
    for key in ("step_ms", "step_ms_p90", "samples_per_s", "mids_per_s"):
        assert positive(ours[key]), key
    assert ours["step_ms_p90"] >= ours["step_ms"]
    fb = rec["results"]["fbgemm_tbe"]  # measured, or skipped with the reason
    target = rec["targets"]
    if "skipped" in fb:
        assert isinstance(fb["skipped"], str) and fb["skipped"]
        assert target["measured_ratio"] is None and target["met"] is None
    else:
        assert positive(fb["step_ms"])
        assert target["measured_ratio"] == pytest.approx(fb["step_ms"] / ours["step_ms"])
        assert isinstance(target["met"], bool)


def test_threads_smoke(tmp_path):
    rec = run_smoke("threads", tmp_path)
    assert rec["config"]["threads_compared"] == 2
    assert {(r["dim"], r["optimizer"]) for r in rec["results"]} == {
        (16, o) for o in ("sgd", "rowwise_adagrad", "adam")}
    for r in rec["results"]:
        ms = r["ms_per_step"]
        assert set(ms) == {"1", "table_2", "torch_2"}
        for v in ms.values():
            assert positive(v["median_ms"]) and v["p90_ms"] >= v["median_ms"]
        for name, x in r["speedup"].items():
            assert x == pytest.approx(ms["1"]["median_ms"] / ms[name]["median_ms"])
        assert r["target"]["best"] == max(r["speedup"].values())
        assert r["target"]["met"] == (r["target"]["best"] >= 1.6)
        g = r["memory_ceiling"]
        assert set(g["ms_per_gather"]) == {"1", "2"}
        assert g["speedup"] == pytest.approx(g["ms_per_gather"]["1"]["median_ms"]
                                             / g["ms_per_gather"]["2"]["median_ms"])
        assert r["target"]["memory_ceiling_speedup"] == g["speedup"]
        assert "note" not in r["target"]  # measured at the default bucket capacity


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_the_memory_ceiling_gathers_the_rows_asked(parts, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    from _ceiling import RowGather

    g = RowGather(100, 5, 40)
    idx = np.random.default_rng(1).integers(0, 100, 37)
    assert g.seconds(idx, parts) > 0
    np.testing.assert_array_equal(g.out[:37], g.rows[idx])
    counts = sorted({1, parts})
    times = g.times([idx, idx[:10]], counts, 3)
    assert sorted(times) == counts and all(len(v) == 3 for v in times.values())
    for bad in (np.array([100]), np.array([-1]), np.arange(41) % 100):
        with pytest.raises(ValueError, match="RowGather"):
            g.seconds(bad, parts)


def test_routing_balance_smoke(tmp_path):
    rec = run_smoke("routing_balance", tmp_path)
    modes = ("continuous", "roundrobin", "hash_roundrobin")
    got = {(r["dist"], r["world_size"]) for r in rec["results"]}
    assert got == {(d, w) for d in ("zipf", "strided", "sequential", "mixed_type_low_bits")
                   for w in (2, 4, 8, 64)}
    for r in rec["results"]:
        for mode in (*modes, "random_owner_baseline"):
            for key in ("lookups_max_over_mean", "unique_keys_max_over_mean"):
                v = r[mode][key]
                assert positive(v) and 1.0 <= v <= r["world_size"], (r["dist"], mode, key, v)
        if r["dist"] == "strided":  # ids k*64: plain modulo puts everything on rank 0
            assert r["roundrobin"]["unique_keys_max_over_mean"] == r["world_size"]
            assert r["hash_roundrobin"]["unique_keys_max_over_mean"] < 1.5
        if r["dist"] == "sequential":
            assert r["continuous"]["unique_keys_max_over_mean"] == pytest.approx(1.0, abs=0.01)
    for mode in modes:
        assert positive(rec["route_speed_w8_zipf"][mode]["route_mkeys_per_s"])
        assert set(rec["summary"][mode]) == {"worst_unique_keys_max_over_mean",
                                             "worst_lookups_max_over_mean"}


def test_sharded_step_smoke(tmp_path):
    rec = run_smoke("sharded_step", tmp_path)
    assert [r["optimizer"] for r in rec["results"]] == ["sgd", "adam"]
    for r in rec["results"]:
        for impl in ("single_process_global_batch", "single_process_one_rank_batch",
                     "sharded_2_ranks"):
            for key in ("step_ms", "step_ms_p90", "mids_per_s"):
                assert positive(r[impl][key]), (r["optimizer"], impl, key)
            assert r[impl]["step_ms_p90"] >= r[impl]["step_ms"]
        sh = r["sharded_2_ranks"]
        assert len(sh["per_rank_step_ms"]) == 2 and all(map(positive, sh["per_rank_step_ms"]))
        assert all(map(positive, sh["bytes_sent_per_step_per_rank"]))
        assert 1.0 <= sh["ids_received_max_over_mean"] < 2.0
        assert set(sh["rank0_stage_ms"]) == {"input_dist", "lookup_pool_output_dist",
                                             "backward_update"}
        assert all(map(positive, sh["rank0_stage_ms"].values()))
        base = r["sharded_2_ranks_torch_grouping"]
        assert positive(base["step_ms"]) and all(map(positive, base["rank0_stage_ms"].values()))
        assert positive(r["ratios"]["input_dist_vs_torch_grouping"])
        assert all(n > 0 for n in sh["rows_stored"])
        assert positive(r["ratios"]["speedup_sharded_vs_single_process"])
        assert positive(r["ratios"]["ideal_speedup_without_communication"])


def test_storage_modes_smoke(tmp_path):
    rec = run_smoke("storage_modes", tmp_path)
    names = [r["name"] for r in rec["results"]]
    assert names[0] == "hbm_only" and len(names) == len(set(names)) == 19
    for mode in ("hybrid", "caching"):
        for x in (0.1, 0.2, 0.5, 0.8):
            assert {f"{mode}_x{x}_ram", f"{mode}_x{x}_mmap"} <= set(names)
    for r in rec["results"]:
        assert positive(r["step_ms"]) and positive(r["step_ms_vs_hbm_only"]), r["name"]
        assert 0 <= r["hbm_hit_rate"] <= r["hit_rate"] <= 1 and r["table_evictions"] == 0
        if r["cache_load_factor"] == 1.0:
            assert r["mode"] == "hbm_only" and r["ddr_bytes"] == 0
        elif r["mode"] == "caching":  # the cache serves what the table serves, once warm
            assert r["hbm_hit_rate"] > 0 and r["ddr_bytes"] > 0


def test_checkpoint_io_smoke(tmp_path):
    rec = run_smoke("checkpoint_io", tmp_path, "--dir", str(tmp_path))
    raw = rec["raw_disk"]
    for key in ("write_fsync_mb_per_s", "read_cold_mb_per_s", "read_warm_mb_per_s",
                "sha256_in_memory_mb_per_s"):
        assert positive(raw[key]), key
    full, inc = rec["full"], rec["incremental"]
    assert full["rows"] > 0.99 * 20_000 and raw["bytes"] == full["checkpoint_bytes"] > 0
    for op in ("save", "load_cold", "load_warm"):
        for key in ("median_s", "mb_per_s", "rows_per_s"):
            assert positive(full[op][key]), (op, key)
    assert 0 < inc["delta_bytes"] < full["checkpoint_bytes"]
    assert inc["delta_rows"] == int(full["rows"] * inc["delta_fraction"]) > 0
    for op in ("export", "load_cold_on_base"):
        assert positive(inc[op]["mb_per_s"]) and positive(inc[op]["rows_per_s"]), op
    assert set(rec["ratios"]) == {"save_vs_raw_write", "load_cold_vs_raw_read_cold",
                                  "load_warm_vs_raw_read_warm",
                                  "incremental_export_vs_full_save_time"}
    assert all(map(positive, rec["ratios"].values()))
    assert list(tmp_path.glob("dynemb-ckpt-bench-*")) == []  # the checkpoints were removed


def test_planner_smoke(tmp_path):
    rec = run_smoke("planner", tmp_path)
    results = rec["results"]
    assert len(results) == 10 and len({r["name"] for r in results}) == 10
    modes = {t["mode"] for r in results for t in r["tables"]}
    assert modes == {"hbm_only", "hybrid", "caching"}
    assert {t["ddr"] for r in results for t in r["tables"]} == {"none", "ram", "mmap"}
    assert {t["zipf_alpha"] for r in results for t in r["tables"]} == {0.0, 1.05, 1.2}
    kinds = ("predicted_zipf", "predicted_sampled_ids", "baseline_skew_blind",
             "baseline_cpu_defaults")
    for r in results:
        m = r["measured"]
        assert positive(m["step_ms"]) and positive(m["step_cpu_ms"]) and m["steps"] == 4
        assert len(m["hbm_hit_rate"]) == len(r["tables"])
        for k in kinds:
            assert positive(r[k]["step_ms"]), (r["name"], k)
            assert all(0 <= h <= 1 for h in r[k]["hbm_hit_rate"] + m["hbm_hit_rate"])
        for t, h in zip(r["tables"], m["hbm_hit_rate"]):
            if t["mode"] == "hbm_only":  # filled with every id: every lookup hits hbm
                assert h == 1.0 and r["predicted_zipf"]["hbm_hit_rate"][0] == 1.0
    for k in kinds:
        acc = rec["accuracy"][k]
        assert 0 <= acc["max_abs_error_hbm_hit_rate"] <= 1
        assert acc["median_abs_rel_error_step_ms"] >= 0
        assert acc["spearman_step_ms"] is None or -1 <= acc["spearman_step_ms"] <= 1
    assert [s["world_size"] for s in rec["solver"]] == [8, 64]
    for s in rec["solver"]:
        assert positive(s["solve_s"]) and s["options_per_table"] == [19] and s["optimal"]
        assert s["plan_hbm_bytes_per_rank"] <= s["hbm_budget_bytes_per_rank"]
        assert s["plan_ddr_bytes_per_rank"] <= s["ddr_budget_bytes_per_rank"]
        assert isinstance(s["nodes"], int) and s["nodes"] >= 0
    assert len(rec["targets"]) == 7
    cal = rec["calibration"]
    assert len(cal["fixed_ns"]) == len(cal["per_byte_ns"]) == 8 and positive(cal["seconds_each"])
    assert cal["calibrations"] == 2 and positive(cal["last_over_first_median_run_time_ratio"])


def test_pipelines_smoke(tmp_path):
    rec = run_smoke("pipelines", tmp_path)
    kinds = ["base", "sparse_dist", "fused_sparse_dist", "semi_sync", "prefetch"]
    assert rec["config"]["kinds"] == kinds and rec["config"]["world_size"] == 2
    assert rec["config"]["caching_tables"] >= 1 and rec["config"]["rounds"] == 2
    assert list(rec["results"]) == kinds
    split_keys = {"data", "input_dist", "lookup", "prefetch", "output_dist", "dense",
                  "backward", "optimizer", "total", "other"}
    for kind, r in rec["results"].items():
        for key in ("step_ms_p50", "step_ms_p90", "step_ms_min", "step_ms_mean",
                    "samples_per_s"):
            assert positive(r[key]), (kind, key)
        assert r["step_ms_min"] <= r["step_ms_p50"] <= r["step_ms_p90"]
        assert r["steps_timed"] == 2 * rec["config"]["timed_steps_per_window"]
        assert len(r["step_ms_p50_per_window"]) == 2 and all(map(positive,
                                                                  r["step_ms_p50_per_window"]))
        assert len(r["peak_rss_mb_per_rank"]) == 2 and all(map(positive,
                                                               r["peak_rss_mb_per_rank"]))
        assert isinstance(r["peak_rss_reset_per_run"], bool)
        assert len(r["main_thread_share_per_rank"]) == 2
        for share in r["main_thread_share_per_rank"]:  # None where schedstat is missing
            assert share is None or (set(share) == {"running", "waiting_for_a_core", "blocked"}
                                     and positive(share["running"])
                                     and sum(share.values()) == pytest.approx(1, abs=0.05))
        split = r["split_ms_per_step"]
        assert set(split) == split_keys
        for key in ("input_dist", "lookup", "dense", "backward", "optimizer", "total"):
            assert positive(split[key]), (kind, key)
        assert all(v >= 0 for k, v in split.items() if k != "other"), kind
        assert split["total"] <= r["step_ms_mean"] * 1.5  # the split is of the timed steps
        assert set(r["split_share_of_total"]) == split_keys - {"total"}
        assert set(rec["ratios"][kind]) == {"p50_vs_base", "p90_vs_base",
                                            "p50_vs_base_paired_by_round"}
        assert all(map(positive, rec["ratios"][kind].values())), kind
        tables = r["tables_at_end"]
        assert set(tables) == {"t0", "t1", "t2", "t3"}
        for name, t in tables.items():  # nothing lost to the look-ahead: rows stay held
            assert 0 < t["load_factor"] <= 1 and 0 <= t["hbm_hit_rate"] <= 1, (kind, name)
            assert t["stale_updates"] == 0 and t["failed_inserts"] == 0, (kind, name)
        assert tables["t0"]["cache_evictions"] > 0  # the CACHING table's cache is full
        assert (tables["t0"]["prefetched"] > 0) == (kind == "prefetch"), kind
    assert positive(rec["results"]["prefetch"]["split_ms_per_step"]["prefetch"])
    assert rec["results"]["base"]["split_ms_per_step"]["prefetch"] == 0
    assert len(rec["environment"]["loadavg_1m_per_round"]) == 2
    assert rec["ratios"]["base"] == {"p50_vs_base": 1.0, "p90_vs_base": 1.0,
                                     "p50_vs_base_paired_by_round": 1.0}
    targets = rec["targets"]
    assert {k for k, v in targets.items() if isinstance(v, bool)} == {
        "sparse_dist_p90_no_slower_than_base", "fused_sparse_dist_p90_no_slower_than_base",
        "semi_sync_p90_faster_than_sparse_dist"}
    assert positive(targets["semi_sync_p90_vs_sparse_dist"])
    assert positive(targets["fused_sparse_dist_p90_vs_sparse_dist"])


def test_gpu_tables_smoke(tmp_path):
    rec = run_smoke("gpu_tables", tmp_path)
    assert rec["config"]["device"] in ("cpu", "cuda") and rec["config"]["tables"] == 2
    keys = {f"{o}/{m}" for o in ("adam", "sgd")
            for m in ("hbm_only", "caching_100", "caching_80", "hybrid_10")}
    assert set(rec["results"]) == keys
    for key, r in rec["results"].items():
        assert positive(r["step_ms"]) and r["step_ms_p90"] >= r["step_ms"], key
        assert r["target_met"] is None  # a smoke run is never compared with published numbers
    assert rec["results"]["adam/caching_100"]["dynamicemb_published_ms"] == 12.28
    caching = [rec["results"][f"adam/caching_{p}"]["cache_rows_per_table"] for p in (100, 80)]
    assert all(a >= b for a, b in zip(*caching))  # the 80 % cache is not larger
    fb = rec["results"]["sgd/hbm_only"]["fbgemm_tbe"]  # measured, or skipped with the reason
    assert positive(fb["step_ms"]) if "step_ms" in fb else fb["skipped"]
