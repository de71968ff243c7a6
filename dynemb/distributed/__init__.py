"""Row-wise sharding of dynamic tables across the ranks of a torch.distributed job.

Each id has exactly one owner rank, given by :func:`route` (the one routing function, shared
with checkpoint loading and resharding). A sharded collection keeps, on every rank, a shard of
each table of ``ceil(capacity / W)`` rows; each rank passes its own batch and gets its own
samples' embeddings::

    dist.init_process_group("gloo")                  # torchrun --nproc-per-node 2 train.py
    ebc = dynemb.EmbeddingBagCollection(tables)      # tables carry routing= (and id_range=)
    sharded = dynemb.distributed.shard(ebc)          # the default group; same forward API
    out = sharded(local_batch)                       # KeyedEmbeddings (B_local, Σdim)

Importing this package initialises nothing; :func:`shard` needs an initialised process group
and is collective (every rank calls it, with the same tables). See docs/sharding.md.
"""

from __future__ import annotations

from dynemb.distributed.base import ShardedCollection
from dynemb.distributed.input_dist import InputDist
from dynemb.distributed.comm import group_size_rank, raise_together
from dynemb.distributed.pooled import ShardedEmbeddingBagCollection
from dynemb.distributed.routing import (
    continuous_block, route, route_table, shard_capacity, shard_config,
)
from dynemb.distributed.sequence import ShardedEmbeddingCollection
from dynemb.distributed.stats import RoutingStats, TableRoutingStats, max_over_mean
from dynemb.nn.modules import EmbeddingBagCollection, EmbeddingCollection


def shard(module: EmbeddingBagCollection | EmbeddingCollection, *, group=None,
          log_every: int = 100) -> ShardedEmbeddingBagCollection | ShardedEmbeddingCollection:
    """Shards a freshly built collection row-wise over the ranks of ``group``.

    Collective: every rank calls it with a collection of the same table configs (checked; a
    difference raises ConfigError on every rank, naming the table and field). Each rank builds a
    shard of ``ceil(capacity / W)`` rows per table from the collection's configs, on its device
    and kernel backend, and in its train/eval mode; a failure to build them (e.g. a ddr store
    that cannot be created) raises on every rank. A collection's tables are built only when
    first used, so sharding a fresh one never allocates them: each rank's peak memory is its
    shards'. If they were built already (still empty), they are closed and their ddr files
    removed.

    Args:
        module: an :class:`~dynemb.EmbeddingBagCollection` or :class:`~dynemb.EmbeddingCollection`
            whose tables are still empty (rows are not redistributed; load them into the
            sharded collection instead).
        group: the process group (None: the default group).
        log_every: forward calls between debug-level log lines of each rank's load.

    Returns:
        A :class:`ShardedEmbeddingBagCollection` or :class:`ShardedEmbeddingCollection`.
    """
    world_size, _ = group_size_rank(group)
    kinds = {EmbeddingBagCollection: ShardedEmbeddingBagCollection,
             EmbeddingCollection: ShardedEmbeddingCollection}
    cls = next((v for k, v in kinds.items() if isinstance(module, k)), None)
    built = cls is not None and module.built  # a fresh collection has not allocated its tables
    filled = [t.name for t in module.tables.values() if t.size() > 0] if built else []
    if cls is None:  # raised together: a lone rank raising here would leave the others waiting
        problem = ("dynemb.distributed.shard: expected an EmbeddingBagCollection or "
                   f"EmbeddingCollection, found {type(module).__name__}.")
    elif filled:
        problem = (f"dynemb.distributed.shard: tables {filled} already hold rows; shard a "
                   "freshly built collection (rows are not redistributed), then train or load "
                   "rows into the sharded collection.")
    else:
        problem = None
    raise_together(problem, world_size, group)
    if built:  # the shards map their own files (<ddr_path>/rank<r> over several ranks)
        module.close(delete_files=True)
    sharded = cls(list(module.configs), group=group, device=module.device,
                  backend=module.backend_name, log_every=log_every,
                  feature_policy=module.feature_policy)  # builds the shards
    sharded.train(module.training)
    return sharded


__all__ = [
    "InputDist", "RoutingStats", "ShardedCollection", "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection", "TableRoutingStats", "continuous_block", "max_over_mean",
    "route", "route_table", "shard", "shard_capacity", "shard_config",
]
