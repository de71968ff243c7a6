"""Full tables for the reshard tests: one collection with an HBM_ONLY, a HYBRID and a CACHING
table (LRU, buckets of 8), filled to capacity by training, and the checks that a load which had
to drop rows kept exactly saved rows, the highest-scored of each full bucket."""

from __future__ import annotations

import torch

import dynemb

MODES = {"h": dynemb.Storage(),
         "y": dynemb.Storage(mode=dynemb.StorageMode.HYBRID, cache_load_factor=0.5),
         "c": dynemb.Storage(mode=dynemb.StorageMode.CACHING, cache_load_factor=0.25)}
CAPACITY = 256


def configs(capacity: int = CAPACITY) -> list[dynemb.TableConfig]:
    return [dynemb.TableConfig(name=n, dim=3, features=[n], capacity=capacity,
                               bucket_capacity=8, optimizer=dynemb.Adam(lr=0.05),
                               storage=storage, initializer=dynemb.Initializer(std=0.1))
            for n, storage in MODES.items()]


def fill(collection: torch.nn.Module, rank: int = 0, steps: int = 24, ids: int = 32) -> None:
    """Trains ``steps`` steps of ``ids`` new ids per feature (rank-distinct): every bucket ends
    full (LRU evicts meanwhile), no batch overflows a bucket by itself."""
    for step in range(steps):
        new = torch.arange(ids) + 100_000 * step + 10_000 * rank
        batch = dynemb.SparseBatch(features=list(MODES), values=torch.cat([new] * len(MODES)),
                                   lengths=torch.full((len(MODES) * ids // 4,), 4))
        collection(batch).values().sum().backward()


def rows(table: dynemb.DynamicTable) -> dict[str, torch.Tensor]:
    """Every row of a table, sorted by key."""
    e = table.export_batch(0, table.capacity())
    order = torch.argsort(e.keys)
    return {"keys": e.keys[order], "embeddings": e.embeddings[order],
            "optimizer_state": e.optimizer_state[order], "scores": e.scores[order]}


def merge(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Rows of several tables (or dropped batches), sorted by key."""
    cat = {f: torch.cat([p[f] for p in parts]) for f in parts[0]}
    order = torch.argsort(cat["keys"])
    return {f: v[order] for f, v in cat.items()}


def batch_rows(b) -> dict[str, torch.Tensor]:
    return {"keys": b.keys, "embeddings": b.embeddings, "optimizer_state": b.optimizer_state,
            "scores": b.scores}


def assert_kept_and_dropped(kept: dict, dropped: dict, saved: dict) -> None:
    """kept + dropped is the saved table, row for row, each row exactly once."""
    both = merge([kept, dropped])
    for f in saved:
        assert torch.equal(both[f], saved[f]), f


def assert_highest_kept(table: dynemb.DynamicTable, kept: dict, dropped: dict) -> None:
    """In every bucket that dropped rows, no dropped row outranks a kept one (score, then the
    lower key first) and the bucket is full."""
    kb, db = table.home_buckets(kept["keys"]), table.home_buckets(dropped["keys"])
    for b in torch.unique(db).tolist():
        k = kept["keys"][kb == b].numel()
        assert k == table.index.width, (b, k)
        ks, kk = kept["scores"][kb == b], kept["keys"][kb == b]
        ds, dk = dropped["scores"][db == b], dropped["keys"][db == b]
        worst = min(zip(ks.tolist(), (-kk).tolist()))
        best = max(zip(ds.tolist(), (-dk).tolist()))
        assert best < worst, (b, best, worst)
