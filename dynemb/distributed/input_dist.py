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
from typing import TYPE_CHECKING

import torch

from dynemb.batch import SparseBatch, check_lengths
from dynemb.config import ScorePolicy, TableConfig
from dynemb.distributed import comm
from dynemb.distributed.routing import route_table

if TYPE_CHECKING:
    from dynemb.distributed.base import ShardedCollection


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

    Raises InputError if the lengths no longer match the ids (a batch changed after it was built).
    """
    parts = [batch.feature(f) for f in config.features]
    keys = torch.cat([p[0] for p in parts]).to(device)
    lengths = torch.cat([p[1] for p in parts]).to(device=device, dtype=torch.int64)
    check_lengths(lengths, keys.numel(), f"table {config.name!r}: the batch's lengths no "
                  "longer match its ids (was the SparseBatch changed after it was built? build "
                  "a new one)")
    weights = None
    if batch.weights is not None:
        weights = torch.cat([p[2] for p in parts]).detach().to(device=device, dtype=torch.float32)
    return keys, lengths, weights


def _dedup_by_owner(keys: torch.Tensor, config: TableConfig, world_size: int):
    """(unique keys grouped by owner (U,), position of each key (N,), owner of each unique key
    grouped (U,), owner of each key (N,), unique counts per owner (W,))."""
    uniq, inv = torch.unique(keys, sorted=True, return_inverse=True)
    owner = route_table(uniq, config, world_size)
    owner_sorted, order = torch.sort(owner, stable=True)
    rank_of = torch.empty_like(order)
    rank_of[order] = torch.arange(order.numel(), device=keys.device)
    counts = torch.bincount(owner, minlength=world_size)
    return uniq[order], rank_of[inv], owner_sorted, owner[inv], counts


def plan_pooled(config: TableConfig, batch: SparseBatch, world_size: int,
                device: torch.device) -> TableRequest:
    """The request of one pooled table (see the module docstring for the payload)."""
    keys, lengths, weights = table_ids(config, batch, device)
    n, num_bags = keys.numel(), lengths.numel()
    unique_keys, position, _, occ_owner, u_counts = _dedup_by_owner(keys, config, world_size)
    u_start = torch.cumsum(u_counts, 0) - u_counts
    local = position - u_start[occ_owner]  # index into the owner's part of unique_keys
    owner_sorted, occ_order = torch.sort(occ_owner, stable=True)
    bag = torch.repeat_interleave(torch.arange(num_bags, device=device), lengths, output_size=n)
    pair = owner_sorted * num_bags + bag[occ_order]
    touched, touched_len = torch.unique_consecutive(pair, return_counts=True)
    touched_owner = torch.div(touched, max(num_bags, 1), rounding_mode="floor")
    touched_bags = touched - touched_owner * num_bags
    t_counts = torch.bincount(touched_owner, minlength=world_size)
    n_counts = torch.bincount(occ_owner, minlength=world_size)
    u_list, t_list, n_list = u_counts.tolist(), t_counts.tolist(), n_counts.tolist()
    sections = [torch.split(unique_keys, u_list), torch.split(touched_len, t_list),
                torch.split(local[occ_order], n_list)]
    if weights is not None:
        bits = weights[occ_order].to(torch.float64).view(torch.int64)
        sections.append(torch.split(bits, n_list))
    payload, splits = _interleave(sections, world_size)
    return TableRequest(config=config, batch=batch.batch_size, lengths=lengths,
                        unique_keys=unique_keys, position=position, unique_counts=u_list,
                        occ_counts=n_list, touched_bags=touched_bags, touched_counts=t_list,
                        occ_order=occ_order, payload=payload, payload_splits=splits)


def plan_sequence(config: TableConfig, batch: SparseBatch, world_size: int, device: torch.device,
                  occurrences: bool) -> TableRequest:
    """The request of one sequence (unpooled) table: unique keys per owner (and, with
    ``occurrences``, how often each occurs)."""
    keys, lengths, _ = table_ids(config, batch, device)
    unique_keys, position, _, occ_owner, u_counts = _dedup_by_owner(keys, config, world_size)
    u_list = u_counts.tolist()
    n_list = torch.bincount(occ_owner, minlength=world_size).tolist()
    sections = [torch.split(unique_keys, u_list)]
    if occurrences:
        mult = torch.bincount(position, minlength=unique_keys.numel())
        sections.append(torch.split(mult, u_list))
    payload, splits = _interleave(sections, world_size)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return TableRequest(config=config, batch=batch.batch_size, lengths=lengths,
                        unique_keys=unique_keys, position=position, unique_counts=u_list,
                        occ_counts=n_list, touched_bags=empty, touched_counts=[0] * world_size,
                        occ_order=empty, payload=payload, payload_splits=splits)


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
