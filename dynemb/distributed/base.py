"""What the sharded collections share: the process group, the local shards, the input
distribution (route, dedup, header, id all-to-all), the step and phase checks, misuse checks,
peer loss, and the load counters."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dynemb.batch import SparseBatch, check_feature_policy
from dynemb.config import NonFinite, TableConfig
from dynemb.distributed import comm
from dynemb.distributed.input_dist import (
    InputDist, TableRequest, counts_occurrences, payload_size,
)
from dynemb.distributed.routing import shard_config
from dynemb.distributed.stats import RoutingStats, TableRoutingStats
from dynemb.distributed.owner import OwnerTable
from dynemb.errors import ConfigError, DynembError, InputError
from dynemb.interop import bag_configs, is_kjt, sequence_configs
from dynemb.optim.rules import clip_scale
from dynemb.nn.modules import TablesStayPut, describe_table, leaving_tables_out
from dynemb.nn.staging import Staged, check_idle
from dynemb.table import snapshot
from dynemb.table.table import DynamicTable

logger = logging.getLogger(__name__)


@dataclass
class FloatExchange:
    """A float32 all-to-all in flight (see :meth:`ShardedCollection.start_floats`)."""

    pending: comm.Pending
    sizes: list[list[int]]
    """``[r][t]`` elements received from rank r for part t (part 0: the status element)."""
    point: str
    what: str
    error: Exception | None
    """This rank's own failure, raised once the exchange is done."""


class ShardedCollection(TablesStayPut):
    """Base of the row-wise sharded collections (see :mod:`dynemb.distributed`).

    Building one is collective: every rank builds it with the same tables (checked), and each
    builds its shards at once (a rank that cannot makes every rank raise ConfigError).

    Args:
        tables: the table configs, the same on every rank (checked collectively).
        group: the process group (None: the default group, resolved on every call).
        device: where this rank's shards live (CPU for gloo; the rank's GPU for nccl).
        backend: kernel backend of the shards ("numba", "torch" or "triton"; default by
            device).
        log_every: forward calls between debug-level log lines of this rank's load.
        feature_policy: batch features no table reads are refused ("strict") or skipped
            ("ignore"), as in the unsharded collections.
    """

    pooled_kind: bool = True
    local_class: type = torch.nn.Module

    def __init__(self, tables: Sequence[TableConfig], *, group=None,
                 device: torch.device | str | None = None, backend: str | None = None,
                 log_every: int = 100, feature_policy: str = "strict") -> None:
        super().__init__()
        self.feature_policy = check_feature_policy(feature_policy, type(self).__name__)
        tables = list(tables)
        self.group = group
        self.world_size, self.rank = comm.group_size_rank(group)
        kind = type(self).__name__
        # the ranks agree the collection's identity (it tells apart two collections with equal
        # tables in the per-step header) while they check the configs: nothing per process
        identity = comm.check_same_configs(tables, self.world_size, self.rank, kind, group)
        self.local = self._build_shards(tables, device, backend)
        self.configs: tuple[TableConfig, ...] = tuple(tables)
        self.device = self.local.device
        self.comm_device = comm.comm_device(group, self.device)
        self.feature_names: tuple[str, ...] = self.local.feature_names
        self.log_every = log_every
        self._digest = comm.config_digest(tables, self.world_size, f"{kind}#{identity}")
        self._calls = 0
        """Forward calls that passed the header check (a step; the number in the headers)."""
        self._lost: str | None = None
        """Why the group is unusable (a peer lost), once a collective failed in the transport."""
        self._anchor = torch.zeros(0, requires_grad=True)
        self._steps = 0
        self._received = [[0, 0] for _ in tables]  # per table: ids, unique keys
        self._bytes_sent = 0
        self._pending_counters: tuple | None = None
        self.register_load_state_dict_post_hook(ShardedCollection._apply_counters)

    def _build_shards(self, tables: list[TableConfig], device: torch.device | str | None,
                      backend: str | None) -> torch.nn.Module:
        """This rank's shards, built now (their memory allocated, their ddr stores created) on
        every rank together: if any rank cannot (a ddr store it cannot create, memory it cannot
        allocate), every rank raises ConfigError here, having released what it built, instead
        of one rank failing later, alone, while the others wait for it in a collective."""
        local, error = None, None
        try:
            local = self.local_class([shard_config(c, self.world_size, self.rank)
                                      for c in tables], device=device, backend=backend)
            local.tables  # noqa: B018  (builds them)
        except Exception as e:  # noqa: BLE001  (raised on every rank, below)
            error = e
        problem = None if error is None else (
            f"{type(self).__name__} (rank {self.rank}): could not build its shards: {error}")
        try:
            comm.raise_together(problem, self.world_size, self.group)
        except DynembError as e:
            if local is not None and error is None:
                local.close(delete_files=True)
            raise e from error
        return local

    def close(self, *, delete_files: bool = False) -> None:
        """Closes this rank's shards (local, not collective): flushes and releases their ddr
        stores, marking them cleanly closed, as ``EmbeddingBagCollection.close`` does. The
        collection cannot be used afterwards."""
        self.local.close(delete_files=delete_files)

    @property
    def tables(self) -> dict[str, DynamicTable]:
        """This rank's shards, by table name (each holds ``ceil(capacity / W)`` rows)."""
        return self.local.tables

    # ------------------------------------------------------------------ input distribution

    @torch.compiler.disable  # a graph break: torch.compile never traces the tables
    def input_dist(self, batch: SparseBatch) -> InputDist:
        """Routes and deduplicates this rank's ids, exchanges split sizes (a blocking header
        all-to-all that also checks every rank agrees), and starts the id all-to-all.

        Collective: every rank calls it once per step. Train/eval and grad mode are taken now.
        The header carries this rank's step (its forward calls that passed this check, plus
        one): ranks at different steps or phases (one skipped a backward, say) raise
        DynembError on every rank, and a call refused here on every rank is not counted.
        """
        self._check_usable()
        status, error, requests = comm.STATUS_OK, None, []
        try:  # any local failure is announced in the header, so no rank waits for this one
            batch = self._check_batch(batch)
            requests = [self._plan(c, batch) for c in self.configs]
        except Exception as e:  # noqa: BLE001  (re-raised below, after the header exchange)
            status, error = comm.STATUS_BAD_INPUT, e
        flags = self._flags(batch if error is None else None)
        zero = [[(0, 0, 0)] * self.world_size for _ in self.configs]
        counts = [req.counts() for req in requests] if error is None else zero
        step = self._calls + 1
        with self.transport(comm.step_name(comm.PHASE_FORWARD, step), "header exchange"):
            headers = comm.exchange_headers(
                (status, flags, self._digest, self.world_size, comm.PHASE_FORWARD, step),
                self.world_size, counts, self.group, self.comm_device)
        self._check_headers(headers, error)
        self._calls = step  # a call refused at the header (on every rank alike) is not a step
        recv = [[payload_size(self.pooled_kind, *headers.counts[r][t],
                              bool(headers.flags(r) & comm.F_WEIGHTED),
                              counts_occurrences(c, bool(flags & comm.F_TRAINING)))
                 for t, c in enumerate(self.configs)] for r in range(self.world_size)]
        like = torch.empty(0, dtype=torch.int64, device=self.comm_device)
        send, splits = comm.pack([(req.payload, req.payload_splits) for req in requests],
                                 self.world_size, like)
        with self.transport(comm.step_name(comm.PHASE_FORWARD, step), "id all-to-all"):
            pending = self.all_to_all(send, splits, [sum(row) for row in recv])
        return InputDist(batch=batch, requests=requests, headers=headers, recv_sizes=recv,
                         flags=flags, pending=pending, step=step, module=self)

    def stage_input(self, batch: SparseBatch) -> Staged:
        """Queues a batch a pipeline will pass to forward: its input distribution starts now
        (collective: every rank stages its batch at the same point)."""
        return self._stage(batch, self.input_dist)

    def _eager(self, batch: SparseBatch) -> Staged:
        """A batch distributed and looked up now (no pipeline attached)."""
        staged = Staged(batch=batch, training=self.training, grad=torch.is_grad_enabled(),
                        state=self.input_dist(batch))
        self.stage_lookup(staged)
        return staged

    def stage_prefetch(self, staged: Staged) -> int:
        """Brings the rows this rank owns of a staged batch's keys that the ddr backing stores
        of CACHING tables hold into their caches (waits for the batch's ids); returns how many
        rows were fetched."""
        cached = [t for t, table in enumerate(self.tables.values()) if table.cache is not None]
        if not cached:
            return 0
        fetched = 0
        with self._timed("prefetch"):
            received, inp = staged.state.received(), staged.state
            for t in cached:
                keys = torch.cat([chunk[:inp.headers.counts[r][t][0]]
                                  for r, chunk in enumerate(received[t])])
                fetched += list(self.tables.values())[t].prefetch(keys.to(self.device))
        return fetched

    def check_backward(self, inp: InputDist) -> None:
        """Collective, first thing in backward: a header exchange of the forward header's size
        saying "backward of step n", so a rank that skipped this backward (and is already in
        the next forward's header) meets a header, not the gradient all-to-all, and every rank
        raises DynembError naming it instead of gloo aborting on mismatched sizes."""
        self._check_point(comm.PHASE_BACKWARD, inp.step, inp.flags)

    def _check_point(self, phase: int, step: int, flags: int = 0) -> None:
        """Collective: a header exchange (of the forward header's size) saying that this rank is
        at ``phase`` of ``step``; every rank raises DynembError unless all are."""
        self._check_usable()
        zero = [[(0, 0, 0)] * self.world_size for _ in self.configs]
        with self.transport(comm.step_name(phase, step), "header exchange"):
            headers = comm.exchange_headers(
                (comm.STATUS_OK, flags, self._digest, self.world_size, phase, step),
                self.world_size, zero, self.group, self.comm_device)
        self._check_same_point(headers)

    @contextlib.contextmanager
    def transport(self, point: str, stage: str) -> Iterator[None]:
        """Turns a transport failure inside (a peer gone, a timeout) into a DynembError that
        says which rank vanished (see :func:`comm.peer_loss_message`); later calls raise it
        again at once (the group cannot be used any more)."""
        try:
            yield
        except RuntimeError as e:
            if not comm.is_transport_error(e):
                raise
            self._lost = comm.peer_loss_message(f"{type(self).__name__} (rank {self.rank})",
                                                f"{point} ({stage})", e, self.group)
            raise DynembError(self._lost) from e

    def _check_usable(self) -> None:
        if self._lost is not None:
            raise DynembError(f"an earlier collective of this collection failed: {self._lost}")
        self._check_world()

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

    # ------------------------------------------------------------------ state_dict

    def _sharding(self) -> dict:
        return {"world_size": self.world_size, "rank": self.rank,
                "routing": {c.name: c.routing.value for c in self.configs},
                "id_range": {c.name: c.id_range for c in self.configs}}

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001
        """``{prefix}sharding``: the world size, this rank and the routing of each table (what
        the shards under ``{prefix}local.tables.`` were cut by), and the load counters."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if leaving_tables_out():
            return
        check_idle(self, f"{type(self).__name__}.state_dict()")
        destination[f"{prefix}sharding"] = snapshot.encode(
            {**self._sharding(), "steps": self._steps, "received": self._received,
             "bytes_sent": self._bytes_sent})

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,  # noqa: ANN001
                              missing_keys, unexpected_keys, error_msgs):
        """Checks the state was saved by this rank of a collection sharded the same way (else
        ConfigError, before any shard changes: the shards load next, as children)."""
        key = f"{prefix}sharding"
        self._pending_counters = None
        rest = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if leaving_tables_out():
            return
        what = f"{type(self).__name__}.load_state_dict()"
        if key not in state_dict:  # even with strict=False: shards of unknown cut never load
            raise ConfigError(f"{what}: the state has no {key!r} entry (which world size, rank "
                              "and routing its shards were cut by), so its shards cannot be "
                              "checked; expected a sharded collection's state_dict().")
        check_idle(self, what)
        saved = snapshot.decode(state_dict[key], f"{what}: {key!r}")
        diff = snapshot.differences(saved, self._sharding())
        if diff:
            raise ConfigError(
                f"{what}: the state was saved from shards cut another way: {'; '.join(diff)}. "
                "A state_dict reloads on the rank of the world size it was saved on; to load "
                "rows into another world size save with dynemb.checkpoint.save and load with "
                "dynemb.checkpoint.load(..., reshard=True).")
        received = saved.get("received")
        if not (isinstance(received, list) and len(received) == len(self.configs)
                and all(isinstance(r, list) and len(r) == 2 and all(isinstance(v, int) for v in r)
                        for r in received)
                and isinstance(saved.get("steps"), int)
                and isinstance(saved.get("bytes_sent"), int)):
            raise ConfigError(f"{what}: {key!r} lacks the load counters a state_dict() writes.")
        self._pending_counters = (saved["steps"], saved["bytes_sent"], received)

    def _apply_counters(self, incompatible) -> None:  # noqa: ANN001  (a torch post hook)
        """After the shards loaded (a load-state-dict post hook): the load counters of the
        state, so that a refused load changes nothing here."""
        pending, self._pending_counters = self._pending_counters, None
        if pending is not None:
            self._steps, self._bytes_sent, received = pending
            self._received = [list(r) for r in received]

    def extra_repr(self) -> str:
        return "\n".join([*map(describe_table, self.configs),
                          f"world_size={self.world_size}, rank={self.rank}, "
                          f"device={self.device}, feature_policy={self.feature_policy!r}"])

    def embedding_bag_configs(self) -> list:
        """torchrec ``EmbeddingBagConfig`` objects of the (whole) tables; needs torchrec."""
        return bag_configs(self.configs)

    def embedding_configs(self) -> list:
        """torchrec ``EmbeddingConfig`` objects of the (whole) tables; needs torchrec."""
        return sequence_configs(self.configs)

    def _check_batch(self, batch: SparseBatch) -> SparseBatch:
        """The batch the tables read (a torchrec KeyedJaggedTensor converted; see
        ``feature_policy``), or InputError."""
        name = type(self).__name__
        if is_kjt(batch):
            batch = SparseBatch.from_kjt(batch)
        if not isinstance(batch, SparseBatch):
            raise InputError(f"{name}: expected a SparseBatch, found {type(batch).__name__}.")
        return batch.require_features(self.feature_names, f"{name} (rank {self.rank})",
                                      self.feature_policy)

    def _check_headers(self, headers: comm.Headers, error: Exception | None) -> None:
        """Raises the same kind of error on every rank when any rank cannot go on."""
        name = type(self).__name__
        rows = headers.rows
        self._check_same_point(headers)
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

    def _check_same_point(self, headers: comm.Headers) -> None:
        """Every rank called this collection (digest, world size) at the same step and phase."""
        name, rows = f"{type(self).__name__} (rank {self.rank})", headers.rows
        other = [r for r, row in enumerate(rows) if row[comm.H_DIGEST] != self._digest
                 or row[comm.H_WORLD] != self.world_size]
        if other:
            raise ConfigError(f"{name}: rank(s) {other} called another sharded collection (other "
                              "tables, kind or world size) in the same collective; call the "
                              "sharded modules in the same order on every rank (and build them "
                              "in the same order).")
        points: dict[tuple[int, int], list[int]] = {}
        for r, row in enumerate(rows):
            points.setdefault((row[comm.H_PHASE], row[comm.H_STEP]), []).append(r)
        if len(points) > 1:
            raise DynembError(f"{name}: the ranks are at different steps of this collection: "
                              + _describe_points(points) + ". Every rank must call forward and "
                              "backward through the collection the same number of times, in the "
                              "same order; a rank whose loss does not use the output still needs "
                              "its backward (add 0 * output.sum() to its loss, say).")

    # ------------------------------------------------------------------ collectives, counters

    def apply_optimizers(self, owners: list[OwnerTable], grads: list[torch.Tensor]) -> None:
        """Applies each table's fused optimizer once. One all_reduce serves two checks that need
        every shard: tables with ``max_grad_norm`` are clipped by the norm of their finite
        gradient rows over all shards, and tables with ``nonfinite=RAISE`` count their NaN/inf
        gradient rows per rank; if any rank saw one, every rank raises before updating any table
        (see :meth:`_raise_nonfinite`)."""
        clipped = [t for t, o in enumerate(owners)
                   if o.table.config.optimizer.max_grad_norm is not None]
        strict = [t for t, o in enumerate(owners) if o.table.config.nonfinite == NonFinite.RAISE]
        if clipped or strict:
            sums = torch.zeros(len(clipped) + len(strict) * self.world_size, dtype=torch.float64)
            for i, t in enumerate(clipped):
                sums[i] = owners[t].grad_norm_sq(grads[t])
            for i, t in enumerate(strict):
                bad = owners[t].table.gradient_rows(owners[t].lookup, grads[t].float())[1]
                sums[len(clipped) + i * self.world_size + self.rank] = bad
            sums = sums.to(self.comm_device)  # (the callers report a transport failure here)
            dist.all_reduce(sums, group=self.group, async_op=True).wait()
            sums = sums.cpu()
            bad = sums[len(clipped):].view(len(strict), self.world_size)
            if bool((bad > 0).any()):
                self._raise_nonfinite(owners, grads, strict, bad)
            for t, total_sq in zip(clipped, sums[:len(clipped)].tolist()):
                scale = clip_scale(owners[t].table.config.optimizer.max_grad_norm, total_sq)
                if scale < 1.0:
                    grads[t].mul_(scale)
        for o, g in zip(owners, grads):  # already clipped by the global norm above
            o.table.apply_gradients(o.lookup, g, clip=False)

    def _raise_nonfinite(self, owners: list[OwnerTable], grads: list[torch.Tensor],
                         strict: list[int], bad: torch.Tensor) -> None:
        """Every rank raises, having updated no table: a rank whose shard holds NaN/inf gradient
        rows raises that table's own error (counting them in its stats), the others an
        InputError naming the tables and ranks. (All ranks stop after the same collectives.)"""
        first: Exception | None = None
        for i, t in enumerate(strict):
            if bad[i, self.rank] > 0:
                try:
                    owners[t].table.apply_gradients(owners[t].lookup, grads[t], clip=False)
                except InputError as e:  # nonfinite RAISE: counted, nothing updated
                    first = first or e
        if first is not None:
            raise first
        seen = {owners[t].table.name: [r for r in range(self.world_size) if bad[i, r] > 0]
                for i, t in enumerate(strict) if bool((bad[i] > 0).any())}
        raise InputError(f"{type(self).__name__} (rank {self.rank}): gradient rows with NaN or "
                         f"inf on other ranks (table: ranks {seen}); no table was updated on any "
                         "rank this step (TableConfig.nonfinite='raise'; see the error raised "
                         "on those ranks).")

    def resolve_owners(self, inp: InputDist, parse, hold: bool = False
                       ) -> tuple[list[OwnerTable], Exception | None]:
        """This rank's owner lookups for one step (``parse(t, config, counts, chunks)`` gives
        table t's :class:`Received`), with ``hold`` keeping their rows until backward.

        An owner-side error (a shard too full for its keys with ``on_full=RAISE``, say) happens
        on one rank after the header exchange; it is returned (the lookups that succeeded
        released), not raised: the rank still takes part in the output exchange, whose status
        element tells every rank (see :meth:`start_floats`), so none is left waiting.
        """
        received = inp.received()
        owners: list[OwnerTable] = []
        try:
            for t, (config, table) in enumerate(zip(self.configs, self.tables.values())):
                counts = [inp.headers.counts[r][t] for r in range(self.world_size)]
                chunks = [c.to(self.device) for c in received[t]]
                owners.append(OwnerTable.resolve(table, parse(t, config, counts, chunks),
                                                 inp.training, hold))
        except Exception as e:  # noqa: BLE001  (raised on every rank by finish_floats)
            for o in owners:
                o.table.release(o.lookup)
            return [], e
        self._count([(sum(o.received.occ_splits), sum(o.received.unique_splits))
                     for o in owners])
        return owners, None

    def start_floats(self, parts, recv: list[list[int]], phase: int, step: int, what: str,
                     error: Exception | None) -> FloatExchange:
        """Starts one float32 all-to-all of per-table (flat tensor, elements per rank)
        ``parts``, receiving ``recv[r][t]`` elements from rank r for table t; each rank's
        part is led by one status element (1.0: this rank failed, ``error``), so a failure on
        one rank travels with data every rank waits for anyway."""
        w = self.world_size
        status = torch.full((w,), 0.0 if error is None else 1.0, dtype=torch.float32)
        like = torch.empty(0, dtype=torch.float32, device=self.comm_device)
        flat, splits = comm.pack([(status.to(self.comm_device), [1] * w), *parts], w, like)
        sizes = [[1, *row] for row in recv]
        point = comm.step_name(phase, step)
        with self.transport(point, f"{what} all-to-all"):
            pending = self.all_to_all(flat, splits, [sum(row) for row in sizes])
        return FloatExchange(pending=pending, sizes=sizes, point=point, what=what, error=error)

    def finish_floats(self, ex: FloatExchange) -> list[torch.Tensor]:
        """Waits for :meth:`start_floats`'s exchange; per table, the flat float32 values received
        (on ``device``), or the error of the rank(s) that failed, raised on every rank."""
        with self.transport(ex.point, f"{ex.what} all-to-all"):
            flat = ex.pending.wait()
        got = comm.unpack_tables(flat.to(self.device), ex.sizes)
        if ex.error is not None:
            raise ex.error
        failed = torch.nonzero(got[0]).flatten().tolist()
        if failed:
            raise DynembError(f"{type(self).__name__} (rank {self.rank}): "
                              f"{comm.ranks_text(failed)}'s owner lookup failed at {ex.point} "
                              "(the error raised "
                              "there says why); every rank stops this step so none waits "
                              "forever.")
        return got[1:]

    def exchange_floats(self, parts, recv: list[list[int]], phase: int, step: int,
                        what: str) -> torch.Tensor:
        """One float32 all-to-all of per-table (flat tensor, elements per rank) ``parts`` at
        ``phase`` of ``step``, receiving ``recv[r][t]`` elements; the result on ``device``."""
        like = torch.empty(0, dtype=torch.float32, device=self.comm_device)
        flat, splits = comm.pack(parts, self.world_size, like)
        with self.transport(comm.step_name(phase, step), f"{what} all-to-all"):
            return self.all_to_all(flat, splits, [sum(row) for row in recv]).wait().to(self.device)

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
        stored now, with their max/mean ratios; and the bytes each rank sent.

        A header exchange first checks that every rank is here, after the same step (a rank
        still owing a backward raises DynembError on every rank instead of meeting it with
        another collective)."""
        self._check_point(comm.PHASE_STATS, self._calls)
        mine = [v for acc, c in zip(self._received, self.configs)
                for v in (*acc, self.tables[c.name].size())] + [self._bytes_sent]
        send = torch.tensor(mine, dtype=torch.int64, device=self.comm_device)
        out = [torch.empty_like(send) for _ in range(self.world_size)]
        with self.transport(comm.step_name(comm.PHASE_STATS, self._calls), "all-gather"):
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


def _describe_points(points: dict[tuple[int, int], list[int]]) -> str:
    """``"rank 0 at backward of step 3, rank 1 at forward of step 4 (rank 1 called forward
    again without the backward of step 3)"``."""
    text = ", ".join(f"{comm.ranks_text(ranks)} at {comm.step_name(phase, step)}"
                     for (phase, step), ranks in sorted(points.items(), key=lambda kv: kv[1]))
    for (phase, step), ranks in points.items():
        if phase == comm.PHASE_FORWARD and (comm.PHASE_BACKWARD, step - 1) in points:
            text += (f" ({comm.ranks_text(ranks)} called forward again without the backward of "
                     f"step {step - 1})")
    return text
