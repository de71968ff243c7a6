"""What the sharded collections share: the process group, the local shards, the input
distribution (route, dedup, header, id all-to-all), misuse checks and the load counters."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dynemb.batch import SparseBatch
from dynemb.config import TableConfig
from dynemb.distributed import comm
from dynemb.distributed.input_dist import TableRequest, counts_occurrences, payload_size
from dynemb.distributed.routing import shard_config
from dynemb.distributed.stats import RoutingStats, TableRoutingStats
from dynemb.distributed.owner import OwnerTable, Scratch
from dynemb.errors import ConfigError, DynembError, InputError
from dynemb.table.table import DynamicTable

logger = logging.getLogger(__name__)
_BUILT = 0
"""Sharded collections built by this process so far (part of each one's header digest)."""


@dataclass
class InputDist:
    """One step's input distribution: the local requests, every rank's header, and the id
    all-to-all (in flight until :meth:`wait`)."""

    batch: SparseBatch
    requests: list[TableRequest]
    headers: comm.Headers
    recv_sizes: list[list[int]]
    """``[r][t]``: int64 payload elements rank r sent here for table t."""
    flags: int
    """This rank's flags (``comm.F_*``); the training and grad bits agree on every rank."""
    pending: comm.Pending

    def wait(self) -> InputDist:
        """Blocks until the ids have arrived; returns self (``pooled(input_dist(b).wait())``)."""
        self.pending.wait()
        return self

    @property
    def training(self) -> bool:
        return bool(self.flags & comm.F_TRAINING)

    @property
    def grad(self) -> bool:
        return bool(self.flags & comm.F_GRAD)

    def weighted(self, r: int) -> bool:
        return bool(self.headers.flags(r) & comm.F_WEIGHTED)

    def wants_wgrad(self, r: int) -> bool:
        return bool(self.headers.flags(r) & comm.F_WANTS_WGRAD)

    @property
    def any_wants_wgrad(self) -> bool:
        """Whether some rank's weights need a gradient (then backward returns them)."""
        return any(self.wants_wgrad(r) for r in range(len(self.headers.rows)))

    def received(self) -> list[list[torch.Tensor]]:
        """``[t][r]``: the int64 payload of rank r for table t (after :meth:`wait`)."""
        return comm.unpack(self.pending.wait(), self.recv_sizes)


class ShardedCollection(torch.nn.Module):
    """Base of the row-wise sharded collections (see :mod:`dynemb.distributed`).

    Args:
        tables: the table configs, the same on every rank (checked collectively).
        group: the process group (None: the default group, resolved on every call).
        device: where this rank's shards live (CPU for gloo; the rank's GPU for nccl).
        backend: kernel backend of the shards ("numba" or "torch"; default by device).
        log_every: forward calls between debug-level log lines of this rank's load.
    """

    pooled_kind: bool = True
    local_class: type = torch.nn.Module

    def __init__(self, tables: Sequence[TableConfig], *, group=None,
                 device: torch.device | str | None = None, backend: str | None = None,
                 log_every: int = 100) -> None:
        super().__init__()
        tables = list(tables)
        self.group = group
        self.world_size, self.rank = comm.group_size_rank(group)
        kind = type(self).__name__
        comm.check_same_configs(tables, self.world_size, self.rank, kind, group)
        self.local = self.local_class([shard_config(c, self.world_size, self.rank) for c in tables],
                                      device=device, backend=backend)
        self.configs: tuple[TableConfig, ...] = tuple(tables)
        self.device = self.local.device
        self.comm_device = comm.comm_device(group, self.device)
        self.feature_names: tuple[str, ...] = self.local.feature_names
        self.log_every = log_every
        # every rank builds its sharded collections in the same order (construction is
        # collective), so the build index tells apart two collections with equal tables
        global _BUILT
        _BUILT += 1
        self._digest = comm.config_digest(tables, self.world_size, f"{kind}#{_BUILT}")
        self._anchor = torch.zeros(0, requires_grad=True)
        self._steps = 0
        self._received = [[0, 0] for _ in tables]  # per table: ids, unique keys
        self._bytes_sent = 0
        self._scratch = {c.name: Scratch() for c in tables}

    def scratch(self, name: str) -> Scratch:
        """Table ``name``'s reusable gradient buffer."""
        return self._scratch[name]

    @property
    def tables(self) -> dict[str, DynamicTable]:
        """This rank's shards, by table name (each holds ``ceil(capacity / W)`` rows)."""
        return self.local.tables

    # ------------------------------------------------------------------ input distribution

    def input_dist(self, batch: SparseBatch) -> InputDist:
        """Routes and deduplicates this rank's ids, exchanges split sizes (a blocking header
        all-to-all that also checks every rank agrees), and starts the id all-to-all.

        Collective: every rank calls it once per step. Train/eval and grad mode are taken now.
        """
        self._check_world()
        status, error, requests = comm.STATUS_OK, None, []
        try:  # any local failure is announced in the header, so no rank waits for this one
            self._check_batch(batch)
            requests = [self._plan(c, batch) for c in self.configs]
        except Exception as e:  # noqa: BLE001  (re-raised below, after the header exchange)
            status, error = comm.STATUS_BAD_INPUT, e
        flags = self._flags(batch if error is None else None)
        zero = [[(0, 0, 0)] * self.world_size for _ in self.configs]
        counts = [req.counts() for req in requests] if error is None else zero
        headers = comm.exchange_headers(status, flags, self._digest, self.world_size, counts,
                                        self.group, self.comm_device)
        self._check_headers(headers, error)
        recv = [[payload_size(self.pooled_kind, *headers.counts[r][t],
                              bool(headers.flags(r) & comm.F_WEIGHTED),
                              counts_occurrences(c, bool(flags & comm.F_TRAINING)))
                 for t, c in enumerate(self.configs)] for r in range(self.world_size)]
        like = torch.empty(0, dtype=torch.int64, device=self.comm_device)
        send, splits = comm.pack([(req.payload, req.payload_splits) for req in requests],
                                 self.world_size, like)
        pending = self.all_to_all(send, splits, [sum(row) for row in recv])
        return InputDist(batch=batch, requests=requests, headers=headers, recv_sizes=recv,
                         flags=flags, pending=pending)

    def _plan(self, config: TableConfig, batch: SparseBatch) -> TableRequest:
        raise NotImplementedError

    def _flags(self, batch: SparseBatch | None) -> int:
        flags = (comm.F_TRAINING if self.training else 0)
        flags |= comm.F_GRAD if torch.is_grad_enabled() else 0
        if batch is not None and batch.weights is not None:
            flags |= comm.F_WEIGHTED
            if self.training and torch.is_grad_enabled() and batch.weights.requires_grad:
                flags |= comm.F_WANTS_WGRAD
        return flags

    def _check_world(self) -> None:
        if not dist.is_initialized():
            raise ConfigError(f"{type(self).__name__}: sharded over {self.world_size} ranks but "
                              "torch.distributed is no longer initialised (the process group was "
                              "destroyed); initialise it again before calling the collection.")
        now = dist.get_world_size(self.group)
        if now != self.world_size:
            raise ConfigError(f"{type(self).__name__}: sharded over {self.world_size} ranks but "
                              f"the process group now has {now}; the world size changed. Build "
                              "the sharded collection again (and reshard its rows through a "
                              "checkpoint) for the new world size.")

    def _check_batch(self, batch: SparseBatch) -> None:
        name = type(self).__name__
        if not isinstance(batch, SparseBatch):
            raise InputError(f"{name}: expected a SparseBatch, found {type(batch).__name__}.")
        batch.require_features(self.feature_names, f"{name} (rank {self.rank})")

    def _check_headers(self, headers: comm.Headers, error: Exception | None) -> None:
        """Raises the same kind of error on every rank when any rank cannot go on."""
        name = type(self).__name__
        rows = headers.rows
        other = [r for r, row in enumerate(rows) if row[comm.H_DIGEST] != self._digest
                 or row[comm.H_WORLD] != self.world_size]
        if other:
            raise ConfigError(f"{name} (rank {self.rank}): rank(s) {other} called another sharded "
                              "collection (other tables, kind or world size) in the same "
                              "collective; call the sharded modules in the same order on every "
                              "rank (and build them in the same order).")
        bad = [r for r, row in enumerate(rows) if row[comm.H_STATUS] != comm.STATUS_OK]
        if bad:
            if error is not None:
                raise error
            raise InputError(f"{name} (rank {self.rank}): rank(s) {bad} rejected their batch "
                             "(see the error raised there); every rank skips this step.")
        mode = comm.F_TRAINING | comm.F_GRAD
        modes = [row[comm.H_FLAGS] & mode for row in rows]
        if len(set(modes)) > 1:
            desc = [("train" if m & comm.F_TRAINING else "eval")
                    + ("+grad" if m & comm.F_GRAD else "+no_grad") for m in modes]
            raise InputError(f"{name} (rank {self.rank}): ranks disagree on train/eval or grad "
                             f"mode (by rank: {desc}); call .train()/.eval() and torch.no_grad() "
                             "alike on every rank.")

    # ------------------------------------------------------------------ collectives, counters

    def apply_optimizers(self, owners: list[OwnerTable], grads: list[torch.Tensor]) -> None:
        """Applies each table's fused optimizer once; tables with ``max_grad_norm`` are clipped
        by the gradient norm over all shards (one all_reduce for all of them)."""
        clipped = [t for t, o in enumerate(owners)
                   if o.table.config.optimizer.max_grad_norm is not None]
        if clipped:
            norms = torch.stack([owners[t].grad_norm_sq(grads[t]) for t in clipped])
            norms = norms.to(self.comm_device)
            dist.all_reduce(norms, group=self.group, async_op=True).wait()
            for t, total_sq in zip(clipped, norms.tolist()):
                max_norm = owners[t].table.config.optimizer.max_grad_norm
                scale = max_norm / (total_sq ** 0.5 + 1e-6)
                if scale < 1.0:
                    grads[t].mul_(scale)
        for o, g in zip(owners, grads):  # already clipped by the global norm above
            o.table.apply_gradients(o.lookup, g, clip=False)

    def resolve_owners(self, inp: InputDist, parse) -> list[OwnerTable]:
        """This rank's owner lookups for one step (``parse(t, config, counts, chunks)`` gives
        table t's :class:`Received`), raising on every rank if any rank's lookup failed.

        An owner-side error (a shard too full for its keys with ``on_full=RAISE``, say) happens
        on one rank after the header exchange, while the others are about to wait in the next
        all-to-all; one small all-reduce of a failure flag lets every rank raise instead of
        leaving the others hanging. The failing rank raises its own error.
        """
        received = inp.received()
        error: Exception | None = None
        owners: list[OwnerTable] = []
        try:
            for t, (config, table) in enumerate(zip(self.configs, self.tables.values())):
                counts = [inp.headers.counts[r][t] for r in range(self.world_size)]
                chunks = [c.to(self.device) for c in received[t]]
                owners.append(OwnerTable.resolve(table, parse(t, config, counts, chunks),
                                                 inp.training, self.scratch(config.name)))
        except Exception as e:  # noqa: BLE001  (re-raised below, after the others are told)
            error = e
        flag = torch.tensor([0 if error is None else self.rank + 1], dtype=torch.int64,
                            device=self.comm_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True).wait()
        failed = int(flag[0]) - 1
        if error is not None:
            raise error
        if failed >= 0:
            raise DynembError(f"{type(self).__name__} (rank {self.rank}): rank {failed}'s owner "
                              "lookup failed (its own error says why); every rank stops this "
                              "step so none waits forever.")
        self._count([(sum(o.received.occ_splits), sum(o.received.unique_splits))
                     for o in owners])
        return owners

    def all_to_all(self, send: torch.Tensor, send_splits: Sequence[int],
                   recv_splits: Sequence[int]) -> comm.Pending:
        """Starts an all-to-all on this collection's group, counting bytes sent to other ranks."""
        others = sum(send_splits) - send_splits[self.rank]
        self._bytes_sent += int(others) * send.element_size()
        return comm.all_to_all(send.to(self.comm_device), send_splits, recv_splits, self.group)

    def _count(self, received_per_table: Sequence[tuple[int, int]]) -> None:
        self._steps += 1
        for acc, (ids, unique) in zip(self._received, received_per_table):
            acc[0] += ids
            acc[1] += unique
        if self.log_every > 0 and self._steps % self.log_every == 0 \
                and logger.isEnabledFor(logging.DEBUG):
            for c, (ids, unique) in zip(self.configs, self._received):
                logger.debug("rank %d/%d table %r after %d steps: %d ids and %d unique keys "
                             "received, %d rows stored", self.rank, self.world_size, c.name,
                             self._steps, ids, unique, self.tables[c.name].size())

    def routing_stats(self) -> RoutingStats:
        """Collective (every rank calls it): per table and rank, the ids and unique keys
        received since the collection was built (or :meth:`reset_routing_stats`) and the rows
        stored now, with their max/mean ratios; and the bytes each rank sent."""
        mine = [v for acc, c in zip(self._received, self.configs)
                for v in (*acc, self.tables[c.name].size())] + [self._bytes_sent]
        send = torch.tensor(mine, dtype=torch.int64, device=self.comm_device)
        out = [torch.empty_like(send) for _ in range(self.world_size)]
        dist.all_gather(out, send, group=self.group, async_op=True).wait()
        rows = [o.tolist() for o in out]
        tables = {c.name: TableRoutingStats(
            ids_received=tuple(row[3 * t] for row in rows),
            unique_keys_received=tuple(row[3 * t + 1] for row in rows),
            rows_stored=tuple(row[3 * t + 2] for row in rows))
            for t, c in enumerate(self.configs)}
        return RoutingStats(tables=tables, steps=self._steps,
                            bytes_sent=tuple(row[-1] for row in rows))

    def reset_routing_stats(self) -> None:
        """Restarts the received-id and byte counters (rows stored are always current)."""
        self._steps, self._bytes_sent = 0, 0
        self._received = [[0, 0] for _ in self.configs]
