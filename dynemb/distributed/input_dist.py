"""The input distribution. The requesting side: one table's ids, deduplicated, routed and
grouped by owner rank, laid out as the int64 payload each owner receives; and
:class:`InputDist`, one step's distribution in flight.

For a table with F features, a local batch of B samples and N ids (its features' ids, feature
after feature), the payload for owner o is, in this order:

- ``U_o`` unique keys owned by o (the rank's distinct keys, grouped by owner);
- pooled only: ``T_o`` lengths of the touched bags, i.e. the bags (feature, sample) with at least
  one id owned by o, in bag order; with them, per id owned by o (bag order):
  ``N_o`` indices into the o-part of the unique keys, then, if the batch is weighted, ``N_o``
  weights (float32 widened to float64, sent as their int64 bit patterns: exact);
- sequence only, when the owner counts occurrences (training with LFU scores or admission):
  ``U_o`` occurrence counts, one per unique key.

:func:`payload_size` is the one formula both sides use for the split sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from dynemb.batch import SparseBatch, check_keys, check_table_lengths
from dynemb.config import Routing, ScorePolicy, TableConfig
from dynemb.distributed import comm
from dynemb.distributed.routing import continuous_block, route_table
from dynemb.kernels import group_numba as gnb
from dynemb.kernels.lookup_numba import set_size

if TYPE_CHECKING:
    from dynemb.distributed.base import ShardedCollection

_NO_LENGTHS = torch.empty(0, dtype=torch.int64)


def counts_occurrences(config: TableConfig, training: bool) -> bool:
    """Whether the owner's lookup must see every id occurrence, not one per unique key: LFU
    scores and admission count occurrences (training only), so the owner expands each unique key
    by its occurrence count to match a single-process table exactly."""
    return training and (config.score == ScorePolicy.LFU or config.admission is not None)


def payload_size(pooled: bool, u: int, t: int, n: int, weighted: bool, occurrences: bool) -> int:
    """int64 elements of one (requester, owner, table) payload (see the module docstring)."""
    if pooled:
        return u + t + n + (n if weighted else 0)
    return u + (u if occurrences else 0)


@dataclass
class TableRequest:
    """One table's ids on the requesting rank, deduplicated and grouped by owner.

    N ids (the table's features concatenated), F·B bags, U unique keys, T touched bags.
    """

    config: TableConfig
    batch: int
    """B, the local batch size."""
    lengths: torch.Tensor
    """(F·B,) int64 bag lengths, feature-major (pooled: MEAN divides by them)."""
    unique_keys: torch.Tensor
    """(U,) int64 distinct keys, grouped by owner rank (ascending)."""
    position: torch.Tensor
    """(N,) int64: index of each id in ``unique_keys``."""
    unique_counts: list[int]
    """(W,) unique keys per owner."""
    occ_counts: list[int]
    """(W,) ids per owner."""
    touched_bags: torch.Tensor
    """Pooled: (T,) int64 bag (f·B + b) of each touched (owner, bag), grouped by owner."""
    touched_counts: list[int]
    """Pooled: (W,) touched bags per owner; all zeros for sequence lookups."""
    occ_order: torch.Tensor
    """Pooled: (N,) int64 ids in payload order (by owner, then bag): id ``occ_order[j]`` is the
    j-th id sent."""
    payload: torch.Tensor
    """Flat int64 payload for every owner, owner after owner."""
    payload_splits: list[int]
    """(W,) payload elements per owner."""

    def counts(self) -> list[tuple[int, int, int]]:
        """(U, T, N) per owner, as announced in the header."""
        return list(zip(self.unique_counts, self.touched_counts, self.occ_counts))


def table_ids(config: TableConfig, batch: SparseBatch, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(keys (N,), lengths (F·B,) int64, weights (N,) float32 or None) of the table's features.

    Raises InputError if the ids are not int64 ids or the lengths no longer match them (a batch
    changed after it was built).
    """
    parts = [batch.feature(f) for f in config.features]
    keys = torch.cat([p[0] for p in parts]).to(device)
    check_keys(keys, f"table {config.name!r}: lookup")
    lengths = torch.cat([p[1] for p in parts]).to(device=device, dtype=torch.int64)
    check_table_lengths(lengths, keys.numel(), config.name)
    weights = None
    if batch.weights is not None:
        weights = torch.cat([p[2] for p in parts]).detach().to(device=device, dtype=torch.float32)
    return keys, lengths, weights


class _Grouped(NamedTuple):
    """A table's ids grouped by owner (``_group``)."""

    unique_keys: torch.Tensor
    """(U,) distinct keys, grouped by owner (ascending), each owner's in ascending order."""
    position: torch.Tensor
    """(N,) index of each id in ``unique_keys``."""
    occ_owner: torch.Tensor
    """(N,) owner of each id."""
    occ_order: torch.Tensor
    """(N,) the ids by owner, each owner's in batch order (pooled only; else empty)."""
    sent: torch.Tensor
    """(N,) pooled: in that order, each id's index among its owner's distinct keys."""
    touched_bags: torch.Tensor
    """(T,) pooled: each owner's bags with ids there, in bag order, owner after owner."""
    touched_len: torch.Tensor
    """(T,) pooled: ids of each of those bags."""
    u_counts: list[int]
    """(W,) distinct keys per owner."""
    n_counts: list[int]
    """(W,) ids per owner."""
    t_counts: list[int]
    """(W,) touched bags per owner (pooled; else zeros)."""


_ROUTING_CODES = {Routing.ROUNDROBIN: gnb.R_ROUNDROBIN,
                  Routing.HASH_ROUNDROBIN: gnb.R_HASH_ROUNDROBIN,
                  Routing.CONTINUOUS: gnb.R_CONTINUOUS}


def _group(keys: torch.Tensor, lengths: torch.Tensor | None, config: TableConfig,
           world_size: int) -> _Grouped:
    """Dedups, routes and groups the ids ``keys`` by owner; ``lengths`` (F·B,) for a pooled
    table (None: a sequence one). On CPU one compiled pass (``kernels.group_numba``), else
    :func:`_group_torch`; the two agree element for element."""
    if keys.device.type != "cpu":
        return _group_torch(keys, lengths, config, world_size)
    n, w = keys.numel(), world_size
    block = (continuous_block(config.id_range, w)
             if config.routing == Routing.CONTINUOUS and w > 1 else 1)
    table = np.empty((set_size(n), 2), np.int64)
    unique_keys, position, occ_owner, occ_order = (torch.empty(n, dtype=torch.int64)
                                                   for _ in range(4))
    pooled = lengths is not None
    sent, touched_bags, touched_len = (torch.empty(n if pooled else 0, dtype=torch.int64)
                                       for _ in range(3))
    counts = np.zeros((3, w), np.int64)
    u, t = gnb.group_by_owner(
        keys.numpy(), (lengths if pooled else _NO_LENGTHS).numpy(),
        _ROUTING_CODES[config.routing], w, block, table, unique_keys.numpy(),
        position.numpy(), occ_owner.numpy(), occ_order.numpy(), counts[0], counts[1],
        sent.numpy(), touched_bags.numpy(), touched_len.numpy(), counts[2])
    u_list, n_list, t_list = counts.tolist()
    return _Grouped(unique_keys[:u], position, occ_owner, occ_order if pooled else _NO_LENGTHS,
                    sent, touched_bags[:t], touched_len[:t], u_list, n_list, t_list)


def _group_torch(keys: torch.Tensor, lengths: torch.Tensor | None, config: TableConfig,
                 world_size: int) -> _Grouped:
    """:func:`_group` with torch's sorts (any device)."""
    uniq, inv = torch.unique(keys, sorted=True, return_inverse=True)
    owner = route_table(uniq, config, world_size)
    _, order = torch.sort(owner, stable=True)
    rank_of = torch.empty_like(order)
    rank_of[order] = torch.arange(order.numel(), device=keys.device)
    u_counts = torch.bincount(owner, minlength=world_size)
    occ_owner = owner[inv]
    n_counts = torch.bincount(occ_owner, minlength=world_size)
    empty = keys[:0]
    position = rank_of[inv]
    if lengths is None:
        return _Grouped(uniq[order], position, occ_owner, empty, empty, empty, empty,
                        u_counts.tolist(), n_counts.tolist(), [0] * world_size)
    n, num_bags = keys.numel(), lengths.numel()
    owner_sorted, occ_order = torch.sort(occ_owner, stable=True)
    bag = torch.repeat_interleave(torch.arange(num_bags, device=keys.device), lengths,
                                  output_size=n)
    pair = owner_sorted * num_bags + bag[occ_order]
    touched, touched_len = torch.unique_consecutive(pair, return_counts=True)
    touched_owner = torch.div(touched, max(num_bags, 1), rounding_mode="floor")
    t_counts = torch.bincount(touched_owner, minlength=world_size)
    u_start = torch.cumsum(u_counts, 0) - u_counts
    sent = (position - u_start[occ_owner])[occ_order]
    return _Grouped(uniq[order], position, occ_owner, occ_order, sent,
                    touched - touched_owner * num_bags, touched_len, u_counts.tolist(),
                    n_counts.tolist(), t_counts.tolist())


def plan_pooled(config: TableConfig, batch: SparseBatch, world_size: int,
                device: torch.device) -> TableRequest:
    """The request of one pooled table (see the module docstring for the payload)."""
    keys, lengths, weights = table_ids(config, batch, device)
    g = _group(keys, lengths, config, world_size)
    sections = [torch.split(g.unique_keys, g.u_counts), torch.split(g.touched_len, g.t_counts),
                torch.split(g.sent, g.n_counts)]
    if weights is not None:
        bits = weights[g.occ_order].to(torch.float64).view(torch.int64)
        sections.append(torch.split(bits, g.n_counts))
    payload, splits = _interleave(sections, world_size)
    return TableRequest(config=config, batch=batch.batch_size, lengths=lengths,
                        unique_keys=g.unique_keys, position=g.position,
                        unique_counts=g.u_counts, occ_counts=g.n_counts,
                        touched_bags=g.touched_bags, touched_counts=g.t_counts,
                        occ_order=g.occ_order, payload=payload, payload_splits=splits)


def plan_sequence(config: TableConfig, batch: SparseBatch, world_size: int, device: torch.device,
                  occurrences: bool) -> TableRequest:
    """The request of one sequence (unpooled) table: unique keys per owner (and, with
    ``occurrences``, how often each occurs)."""
    keys, lengths, _ = table_ids(config, batch, device)
    g = _group(keys, None, config, world_size)
    sections = [torch.split(g.unique_keys, g.u_counts)]
    if occurrences:
        mult = torch.bincount(g.position, minlength=g.unique_keys.numel())
        sections.append(torch.split(mult, g.u_counts))
    payload, splits = _interleave(sections, world_size)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return TableRequest(config=config, batch=batch.batch_size, lengths=lengths,
                        unique_keys=g.unique_keys, position=g.position,
                        unique_counts=g.u_counts, occ_counts=g.n_counts, touched_bags=empty,
                        touched_counts=[0] * world_size, occ_order=empty, payload=payload,
                        payload_splits=splits)


def _interleave(sections: list[tuple[torch.Tensor, ...]], world_size: int
                ) -> tuple[torch.Tensor, list[int]]:
    """One flat payload, owner after owner, each owner's part section after section."""
    pieces = [s[r] for r in range(world_size) for s in sections]
    splits = [sum(s[r].numel() for s in sections) for r in range(world_size)]
    return torch.cat(pieces), splits


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
    step: int
    """The collection's forward call this input belongs to (1, 2, ...; the same on every rank)."""
    module: ShardedCollection
    """The collection it came from (whose :meth:`~ShardedCollection.transport` names a peer lost
    while the ids are in flight)."""

    def wait(self) -> InputDist:
        """Blocks until the ids have arrived; returns self (``pooled(input_dist(b).wait())``)."""
        with self.module.transport(comm.step_name(comm.PHASE_FORWARD, self.step), "id all-to-all"):
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
        """``[t][r]``: the int64 payload of rank r for table t (waits for them)."""
        self.wait()
        return comm.unpack(self.pending.wait(), self.recv_sizes)
