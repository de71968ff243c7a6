"""Sharding without a full-size build: a collection allocates its tables only when first used,
so ``shard(EmbeddingBagCollection(tables))`` costs each rank what its shards cost (peak resident
memory within 10 % of building the shards directly, with a 768 MiB table over 2 gloo ranks),
and it works with a ddr_path (each rank's store in ``<ddr_path>/rank<r>``)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import dynemb
from dynemb.distributed import shard_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _shard_memory as M  # noqa: E402

WORLD = 2


def test_a_collection_builds_its_tables_on_first_use(tmp_path):
    cfg = M.ddr_table(str(tmp_path))
    ebc = dynemb.EmbeddingBagCollection([cfg])
    assert not ebc.built and list(tmp_path.iterdir()) == []  # no rows, no files yet
    t = ebc.tables["t"]  # the README's path: ebc.tables[name] builds them
    assert ebc.built and t is ebc.tables["t"] and (tmp_path / "t.ddr.rows").exists()
    batch = dynemb.SparseBatch(features=["g"], values=torch.arange(6), lengths=torch.full((2,), 3))
    ebc2 = dynemb.EmbeddingBagCollection([dataclasses.replace(cfg, storage=dynemb.Storage())])
    assert torch.equal(ebc(batch).values(), ebc2(batch).values())  # forward builds them too
    assert ebc2.built
    ebc.close()
    with pytest.raises(dynemb.errors.ConfigError, match="at least 2"):  # still refused early
        dynemb.EmbeddingBagCollection([dataclasses.replace(cfg, capacity=8, storage=dynemb.Storage(
            mode=dynemb.StorageMode.HYBRID, cache_load_factor=0.5))])


def test_shard_peak_memory_is_the_shards(tmp_path):
    """Each rank's peak RSS for shard(EmbeddingBagCollection(tables)) is within 10 % of building
    the shards directly (ShardedEmbeddingBagCollection(tables)); the full table is 768 MiB, a
    shard 384 MiB, so building the full table first would add about 100 %."""
    shard_runs = M.spawn("shard", WORLD, tmp_path)
    direct_runs = M.spawn("direct", WORLD, tmp_path)
    for rank, (s, d) in enumerate(zip(shard_runs, direct_runs)):
        assert "error" not in s and "error" not in d, s.get("error") or d.get("error")
        assert s["capacity"] == d["capacity"] == M.ROWS // WORLD
        assert s["table_bytes"] == d["table_bytes"] >= 384 * 2**20
        ratio = s["peak_bytes"] / d["peak_bytes"]
        assert ratio <= 1.10, (f"rank {rank}: shard() peaked at {s['peak_bytes'] / 2**20:.0f} "
                               f"MiB, the shards alone at {d['peak_bytes'] / 2**20:.0f} MiB")

    # the same "shard" job then sharded a collection with a ddr_path and trained one step
    for run in shard_runs:
        assert "ddr_error" not in run, run["ddr_error"]
    root = tmp_path / "ddr"
    assert sorted(p.name for p in root.iterdir()) == ["rank0", "rank1"]  # nothing at the root
    cfg = M.ddr_table(str(root))
    keys = []
    for rank, run in enumerate(shard_runs):
        mine = shard_config(cfg, WORLD, rank)
        assert run["ddr_files"] and all(f.startswith(str(root / f"rank{rank}"))
                                        for f in run["ddr_files"])
        # each rank closed its store cleanly: it reopens with the rows the rank held
        reopened = dynemb.DynamicTable(dataclasses.replace(
            mine, storage=dataclasses.replace(mine.storage, reopen=True)))
        got = M.export_rows(reopened)
        assert all(torch.equal(a, b) for a, b in zip(got, run["rows"]))
        keys.append(got[0])
        reopened.close()
    assert torch.equal(torch.sort(torch.cat(keys)).values,
                       torch.cat([torch.arange(40), torch.arange(100, 140)]))



@pytest.mark.parametrize("how", ["shard", "direct"])
def test_shard_raises_when_a_rank_cannot_build_its_shards(group_of_one, tmp_path, how):
    """The shards are built when the sharded collection is, every rank together, whether by
    shard() or directly from configs: a store another table holds is a ConfigError there
    (raised on every rank), not at the first forward (nor, alone, at routing_stats)."""
    cfg = M.ddr_table(str(tmp_path))
    holder = dynemb.DynamicTable(cfg)
    with pytest.raises(dynemb.errors.ConfigError, match="could not build its shards.*in use"):
        if how == "shard":
            dynemb.distributed.shard(dynemb.EmbeddingBagCollection([cfg]))
        else:
            dynemb.distributed.ShardedEmbeddingBagCollection([cfg])
    holder.close()


def test_a_sharded_collection_closes_its_ddr_stores(group_of_one, tmp_path):
    """close() flushes and releases this rank's ddr stores: they reopen with the trained rows
    (before: sharded collections had no close())."""
    cfg = M.ddr_table(str(tmp_path))
    sharded = dynemb.distributed.ShardedEmbeddingCollection([cfg])
    batch = dynemb.SparseBatch(features=["g"], values=torch.arange(200), lengths=torch.full(
        (40,), 5))
    sum(v.values.sum() for v in sharded(batch).values()).backward()
    want = M.export_rows(sharded.tables["t"])
    sharded.close()
    reopened = dynemb.DynamicTable(dataclasses.replace(
        cfg, storage=dataclasses.replace(cfg.storage, reopen=True)))
    got = M.export_rows(reopened)
    reopened.close()
    assert got[0].numel() == 200 and all(torch.equal(a, b) for a, b in zip(got, want))
