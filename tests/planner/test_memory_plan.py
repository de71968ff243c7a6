"""The planner charges every option exactly what the runtime allocates: table_memory (shard-
aware) against memory_usage() of the built table and of a W=2 shard."""

from __future__ import annotations

import dataclasses

import pytest

import dynemb
from dynemb import planner
from dynemb.config import Storage, StorageMode
from dynemb.distributed import shard_config
from dynemb.table.memory import working_set_bytes

OPTIMIZERS = {"sgd": dynemb.SGD(), "rowwise_adagrad": dynemb.RowWiseAdagrad(), "adam": dynemb.Adam()}
TABLES = {"small": dict(dim=8, capacity=700), "mid": dict(dim=16, capacity=3000, bucket_capacity=64),
          "admitted": dict(dim=4, capacity=2000, admission=dynemb.Admission(counter_capacity=500))}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind", sorted(TABLES))
@pytest.mark.parametrize("world_size", [1, 2])
def test_every_option_is_charged_what_its_shard_allocates(kind, opt, world_size):
    config = dynemb.TableConfig(name=kind, features=["f"], optimizer=OPTIMIZERS[opt],
                                storage=Storage(mode=StorageMode.AUTO), **TABLES[kind])
    topo = planner.Topology(world_size=world_size, ranks_per_host=world_size,
                            hbm_bytes_per_rank=1 << 30, ddr_bytes_per_host=1 << 30)
    profile = planner.AccessProfile(lookups_per_step=512, zipf_alpha=1.05)
    options = planner.table_options(config, profile, topo, planner.default_cost_model("cpu"))
    assert len(options) >= 10  # HBM_ONLY and HYBRID / CACHING at most x
    for option, choice in options:
        work = working_set_bytes(config, 512 // world_size, world_size, choice.mode)
        storage = choice.storage()
        built = dynemb.DynamicTable(shard_config(dataclasses.replace(config, storage=storage),
                                                 world_size, rank=world_size - 1))
        mem = built.memory_usage()
        assert (mem.hbm_bytes + work, mem.ddr_bytes) == (option.hbm_bytes, option.ddr_bytes), \
            (choice.mode, choice.cache_load_factor)
        assert (choice.hbm_bytes, choice.ddr_bytes) == (option.hbm_bytes, option.ddr_bytes)
        assert dynemb.table_memory(dataclasses.replace(config, storage=storage),
                                   world_size=world_size) == mem
