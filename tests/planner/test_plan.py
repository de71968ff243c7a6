"""planner.plan: the choices a demanding user expects, pins, budgets, the Plan file."""

from __future__ import annotations

import dataclasses

import pytest

import dynemb
from dynemb import planner
from dynemb.config import Storage, StorageMode
from dynemb.errors import ConfigError, PlanningError
from dynemb.table.memory import working_set_bytes

# a cost model with clear tiers: ddr accesses and cache misses cost more than hbm lookups
COST = planner.CostModel(
    fixed_ns=dict(lookup=100.0, unique=50.0, new_row=300.0, cache_lookup=20.0, ddr_access=400.0,
                  cache_miss=800.0, ddr_access_mmap=1000.0, cache_miss_mmap=2000.0).values(),
    per_byte_ns=(0.0,) * 8, source="test constants")
AUTO = Storage(mode=StorageMode.AUTO)
ROWS = 1 << 16


def table(name: str, storage: Storage = AUTO, **kw) -> dynemb.TableConfig:
    kw.setdefault("capacity", ROWS)
    return dynemb.TableConfig(name=name, dim=16, features=[name], optimizer=dynemb.Adam(),
                              storage=storage, **kw)


def full_bytes(config: dynemb.TableConfig, world_size: int = 1) -> int:
    return dynemb.table_memory(dataclasses.replace(config, storage=Storage()),
                               world_size=world_size).hbm_bytes


def topo(hbm: int, ddr: int, world_size: int = 1, ranks_per_host: int = 1) -> planner.Topology:
    return planner.Topology(world_size=world_size, ranks_per_host=ranks_per_host,
                            hbm_bytes_per_rank=hbm, ddr_bytes_per_host=ddr)


LOOKUPS = 8192


def profile(alpha: float) -> planner.AccessProfile:
    """LOOKUPS per step over 90 % of a table's rows (no cache below x = 0.9 holds them all)."""
    return planner.AccessProfile(lookups_per_step=LOOKUPS, zipf_alpha=alpha,
                                 num_ids=int(0.9 * ROWS))


def test_ample_budgets_keep_every_table_in_hbm():
    tables = [table("a"), table("b")]
    result = planner.plan(tables, topo(1 << 30, 1 << 30), calibration=COST)
    assert {t.mode for t in result.tables.values()} == {StorageMode.HBM_ONLY}
    work = working_set_bytes(tables[0], int(planner.default_profile(tables[0]).lookups_per_step))
    assert result.hbm_bytes_per_rank == sum(full_bytes(t) for t in tables) + 2 * work


def test_skewed_table_caches_a_little_and_uniform_table_goes_hybrid():
    """Under a tight hbm budget: a skewed table's hot rows fit a small cache; a uniform table
    gains nothing from caching (its hit rate is x either way) and pays no write-backs HYBRID."""
    skewed, uniform = table("skewed"), table("uniform")
    budget = int(1.1 * full_bytes(skewed))
    result = planner.plan([skewed, uniform], topo(budget, 1 << 30), calibration=COST,
                          profiles={"skewed": profile(1.2), "uniform": profile(0.0)})
    s, u = result.tables["skewed"], result.tables["uniform"]
    assert s.mode == StorageMode.CACHING and s.cache_load_factor <= 0.3, s
    assert s.predicted_hit_rate > 0.8
    assert u.mode in (StorageMode.HYBRID, StorageMode.HBM_ONLY), u
    assert result.hbm_bytes_per_rank <= budget


def test_a_ddr_starved_host_gets_hybrid():
    """CACHING keeps every row in ddr; with ddr for about half of the rows only HYBRID fits."""
    t = table("t")
    ddr = full_bytes(t) // 2
    hbm = int(0.6 * full_bytes(t)) + working_set_bytes(t, LOOKUPS, mode=StorageMode.HYBRID)
    result = planner.plan([t], topo(hbm, ddr), calibration=COST,
                          profiles={"t": profile(1.2)})
    assert result.tables["t"].mode == StorageMode.HYBRID
    assert result.ddr_bytes_per_host <= ddr


def test_pinned_tables_are_kept_and_charged():
    pinned = table("pinned", Storage(mode=StorageMode.HYBRID, cache_load_factor=0.5))
    mode_only = table("mode_only", Storage(mode=StorageMode.CACHING))
    x_only = table("x_only", Storage(mode=StorageMode.AUTO, cache_load_factor=0.3))
    tables = [pinned, mode_only, x_only]
    result = planner.plan(tables, topo(1 << 30, 1 << 30), calibration=COST,
                          profiles={n: profile(1.05) for n in ("pinned", "mode_only", "x_only")})
    p, m, x = (result.tables[n] for n in ("pinned", "mode_only", "x_only"))
    assert p.pinned and (p.mode, p.cache_load_factor) == (StorageMode.HYBRID, 0.5)
    assert m.mode in (StorageMode.CACHING, StorageMode.HBM_ONLY)
    assert x.cache_load_factor == 0.3 and x.mode in (StorageMode.HYBRID, StorageMode.CACHING)
    configs = result.apply(tables)
    assert configs[0] is pinned
    for c in configs:
        assert c.storage.planned
        dynemb.DynamicTable(c)  # every planned table can be built


def test_two_hosts_of_two_ranks_charge_ddr_per_host():
    """Every rank holds one shard of every table: a host's ddr carries ranks_per_host shards."""
    t = table("t", capacity=4 * ROWS)
    shard = full_bytes(t, world_size=4)
    one = topo(shard // 2, 10 * shard, world_size=4, ranks_per_host=2)
    result = planner.plan([t], one, calibration=COST, profiles={"t": profile(0.0)})
    choice = result.tables["t"]
    assert choice.mode != StorageMode.HBM_ONLY and choice.hbm_bytes <= shard // 2
    assert result.ddr_bytes_per_host == 2 * choice.ddr_bytes
    # ddr for one shard per host only: two ranks' shards no longer fit beside each other
    with pytest.raises(PlanningError, match="ddr"):
        planner.plan([t], topo(shard // 2, choice.ddr_bytes, world_size=4, ranks_per_host=2),
                     calibration=COST, profiles={"t": profile(0.0)})


def test_infeasible_plans_name_the_tier_and_the_table():
    t = table("big")
    with pytest.raises(PlanningError, match="'big' alone does not fit"):
        planner.plan([t], topo(1000, 0), calibration=COST)
    with pytest.raises(PlanningError, match="hbm in total"):
        planner.plan([table("a"), table("b")], topo(int(1.5 * full_bytes(t)), 0),
                     calibration=COST)
    assert planner.plan([], topo(0, 0)).tables == {}


def test_plan_file_round_trip_and_apply(tmp_path):
    tables = [table("a"), table("b", Storage(mode=StorageMode.CACHING))]
    result = planner.plan(tables, topo(full_bytes(tables[0]), 1 << 30), calibration=COST,
                          profiles={"a": profile(1.2), "b": profile(0.5)})
    path = tmp_path / "plan.json"
    result.save(path)
    again = planner.Plan.load(path)
    assert again == result
    assert [c.storage for c in again.apply(tables)] == [c.storage for c in result.apply(tables)]
    with pytest.raises(PlanningError, match="not in the plan"):
        again.apply([table("other")])
    path.write_text("{}")
    with pytest.raises(PlanningError, match="version"):
        planner.Plan.load(path)


def test_a_plan_or_calibration_saved_over_an_old_one_is_never_torn(tmp_path, monkeypatch):
    """Killed between writing and renaming (here: the rename fails), the old file is intact
    and no temporary file is left."""
    result = planner.plan([table("a")], topo(1 << 30, 1 << 30), calibration=COST)
    path, cal = tmp_path / "plan.json", tmp_path / "cal.json"
    result.save(path)
    COST.save(cal)
    before = path.read_text(), cal.read_text()

    def crash(src, dst):
        raise OSError("killed")
    monkeypatch.setattr("os.replace", crash)
    other = planner.plan([table("a"), table("b")], topo(1 << 30, 1 << 30), calibration=COST)
    with pytest.raises(OSError, match="killed"):
        other.save(path)
    with pytest.raises(OSError, match="killed"):
        planner.default_cost_model("cpu").save(cal)
    assert (path.read_text(), cal.read_text()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.json", "plan.json"]
    monkeypatch.undo()
    other.save(path)
    assert planner.Plan.load(path) == other


def test_an_unplanned_table_cannot_be_built():
    with pytest.raises(ConfigError, match="left to the planner"):
        dynemb.DynamicTable(table("t"))


def test_hbm_only_with_another_x_and_bad_torchrun_variables_are_refused(tmp_path, monkeypatch):
    with pytest.raises(PlanningError, match="hbm_only has cache_load_factor 1.0"):
        planner.TableChoice(mode=StorageMode.HBM_ONLY, cache_load_factor=0.5,
                            predicted_hit_rate=1.0, predicted_ms=1.0, hbm_bytes=1, ddr_bytes=0)
    path = tmp_path / "plan.json"
    planner.plan([table("a")], topo(1 << 30, 1 << 30), calibration=COST).save(path)
    text = path.read_text()
    path.write_text(text.replace('"cache_load_factor": 1.0', '"cache_load_factor": 0.5'))
    with pytest.raises(PlanningError, match="table 'a'.*hbm_only has cache_load_factor"):
        planner.Plan.load(path)
    for name, value in (("WORLD_SIZE", "two"), ("LOCAL_WORLD_SIZE", "0")):
        monkeypatch.setenv(name, value)
        with pytest.raises(PlanningError, match=f"{name} must be an int >= 1"):
            planner.Topology.from_machine()
        monkeypatch.delenv(name)
