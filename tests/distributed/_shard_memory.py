"""The spawned ranks of tests/distributed/test_shard_memory.py: each measures the peak resident
memory of building its shards one way (a fresh process, so ``ru_maxrss`` is that build's), and
the "shard" job then shards a collection whose tables keep their ddr tier in files."""

from __future__ import annotations

import resource
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dynemb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import free_port, init_group  # noqa: E402

ROWS = 1 << 20  # dim 64 with Adam: 768 B per row, 768 MiB for the whole table
DIM = 64


def big_table() -> dynemb.TableConfig:
    return dynemb.TableConfig(name="big", dim=DIM, features=("f",), capacity=ROWS,
                              optimizer=dynemb.Adam(lr=0.01))


def ddr_table(directory: str) -> dynemb.TableConfig:
    storage = dynemb.Storage(mode=dynemb.StorageMode.CACHING, cache_load_factor=0.25,
                             ddr_path=directory)
    return dynemb.TableConfig(name="t", dim=4, features=("g",), capacity=512,
                              optimizer=dynemb.Adam(lr=0.01), storage=storage)


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _ddr_job(rank: int, out: Path, results: dict) -> None:
    """shard() of a collection with a ddr_path: one training step, then close()."""
    ebc = dynemb.EmbeddingBagCollection([ddr_table(str(out / "ddr"))])
    sharded = dynemb.distributed.shard(ebc)
    keys = torch.arange(rank * 100, rank * 100 + 40)
    batch = dynemb.SparseBatch(features=["g"], values=keys, lengths=torch.full((8,), 5))
    sharded(batch).values().sum().backward()
    t = sharded.tables["t"]
    results["rows"] = export_rows(t)
    results["ddr_files"] = sorted(str(p) for p in t.files.dir.glob("t.ddr.*"))
    sharded.close()


def export_rows(t: dynemb.DynamicTable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys, embeddings, optimizer state) of every row of ``t``, sorted by key."""
    e = t.export_batch(0, t.capacity())
    order = torch.argsort(e.keys)
    return e.keys[order], e.embeddings[order], e.optimizer_state[order]


def _worker(rank: int, world_size: int, port: int, out: str, how: str) -> None:
    torch.set_num_threads(1)
    init_group(rank, world_size, port)
    results: dict = {}
    try:
        if how == "shard":
            sharded = dynemb.distributed.shard(dynemb.EmbeddingBagCollection([big_table()]))
        else:
            sharded = dynemb.distributed.ShardedEmbeddingBagCollection([big_table()])
        t = sharded.tables["big"]
        results["capacity"] = t.capacity()
        results["table_bytes"] = t.memory_usage().total_bytes
        results["peak_bytes"] = _peak_bytes()
        del sharded, t
    except Exception:  # noqa: BLE001  (reported by the parent)
        results["error"] = traceback.format_exc()
    try:
        if how == "shard":
            _ddr_job(rank, Path(out), results)
    except Exception:  # noqa: BLE001
        results["ddr_error"] = traceback.format_exc()
    finally:
        torch.save(results, Path(out) / f"{how}{rank}.pt")
        dist.destroy_process_group()


def spawn(how: str, world_size: int, out: Path) -> list[dict]:
    """Runs ``how`` ("shard": shard(EmbeddingBagCollection(tables)); "direct":
    ShardedEmbeddingBagCollection(tables)) on fresh spawned gloo ranks."""
    mp.start_processes(_worker, args=(world_size, free_port(), str(out), how), nprocs=world_size,
                       start_method="spawn", join=True)
    return [torch.load(out / f"{how}{r}.pt", weights_only=False) for r in range(world_size)]
