"""Collectives of the sharded collections: asynchronous all-to-alls, the per-step header that
carries split sizes and lets every rank fail together, and the shard-time config check.

Every exchange of variable-sized data is preceded by an exchange of its sizes: gloo's
``all_to_all_single`` takes uneven splits, but both sides must agree on them (mismatched splits
hang), so a receiver only ever posts the sizes its senders announced.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from dynemb.config import TableConfig
from dynemb.errors import ConfigError

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- the process group


def group_size_rank(group) -> tuple[int, int]:
    """(world size, rank) of ``group`` (None: the default group); ConfigError without one."""
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("dynemb.distributed: torch.distributed is not initialised; call "
                          "torch.distributed.init_process_group('gloo' or 'nccl') first "
                          "(torchrun sets the environment it reads).")
    return dist.get_world_size(group), dist.get_rank(group)


def comm_device(group, device: torch.device) -> torch.device:
    """Where tensors for ``group``'s collectives live: CUDA for nccl, else CPU."""
    if dist.get_backend(group) == "nccl":
        if device.type != "cuda":
            raise ConfigError(f"dynemb.distributed: the process group uses nccl but the tables "
                              f"are on {device}; build them with device='cuda' or use gloo.")
        return device
    return torch.device("cpu")


# ---------------------------------------------------------------- asynchronous all-to-all


class Pending:
    """An all-to-all in flight: ``wait()`` blocks until it is done and returns its output."""

    def __init__(self, work, out: torch.Tensor) -> None:
        self._work = work
        self._out = out

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._out


def all_to_all(send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
               group) -> Pending:
    """Starts ``all_to_all_single`` (async_op=True) of a flat tensor.

    Args:
        send: (Σ send_splits,) flat tensor, the part for rank r at offset Σ send_splits[:r].
        send_splits: (W,) element counts sent to each rank.
        recv_splits: (W,) element counts each rank announced it sends here.
        group: the process group.
    Returns:
        A :class:`Pending` whose ``wait()`` gives the (Σ recv_splits,) output, by source rank.
    """
    out = send.new_empty(int(sum(recv_splits)))
    work = dist.all_to_all_single(out, send.contiguous(), list(map(int, recv_splits)),
                                  list(map(int, send_splits)), group=group, async_op=True)
    return Pending(work, out)


def pack(tables: Sequence[tuple[torch.Tensor, Sequence[int]]], world_size: int,
         like: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Lays out the tables' parts rank-major for an all-to-all.

    Args:
        tables: per table, (its flat tensor ordered by destination rank, (W,) elements per rank).
        world_size: W.
        like: gives the dtype and device of an empty result.
    Returns:
        (flat tensor ordered rank 0: table 0, 1, ...; rank 1: ..., (W,) elements per rank).
        With one table its tensor is returned as it is (no copy).
    """
    splits = [sum(int(sp[r]) for _, sp in tables) for r in range(world_size)]
    if len(tables) == 1:
        return tables[0][0].reshape(-1), splits
    if not tables:
        return like.new_empty(0), splits
    pieces = [torch.split(t.reshape(-1), [int(n) for n in sp]) for t, sp in tables]
    return torch.cat([pieces[t][r] for r in range(world_size) for t in range(len(tables))]), splits


def unpack(flat: torch.Tensor, sizes: Sequence[Sequence[int]]) -> list[list[torch.Tensor]]:
    """Inverse of :func:`pack` on the receiving side: ``sizes[r][t]`` elements came from rank r
    for table t; returns ``out[t][r]`` (flat views)."""
    num_tables = len(sizes[0]) if sizes else 0
    chunks = torch.split(flat, [int(n) for row in sizes for n in row])
    return [[chunks[r * num_tables + t] for r in range(len(sizes))] for t in range(num_tables)]


def unpack_tables(flat: torch.Tensor, sizes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Like :func:`unpack`, but each table's parts joined in rank order (a view for one table)."""
    if sizes and len(sizes[0]) == 1:
        return [flat]
    return [torch.cat(parts) for parts in unpack(flat, sizes)]


# ---------------------------------------------------------------- the per-step header

STATUS_OK = 0
STATUS_BAD_INPUT = 1

F_TRAINING = 1
F_GRAD = 2
F_WEIGHTED = 4
F_WANTS_WGRAD = 8

H_STATUS, H_FLAGS, H_DIGEST, H_WORLD = range(4)
HEADER = 4
PER_TABLE = 3
"""Per table and destination: unique keys U, touched bags T, id occurrences N."""


@dataclass
class Headers:
    """What every rank announced this step: ``rows[r]`` is rank r's header to this rank,
    ``counts[r][t]`` its (U, T, N) for table t."""

    rows: list[list[int]]
    counts: list[list[tuple[int, int, int]]]

    def flags(self, r: int) -> int:
        return self.rows[r][H_FLAGS]


def exchange_headers(status: int, flags: int, digest: int, world_size: int,
                     counts: Sequence[Sequence[Sequence[int]]], group,
                     device: torch.device) -> Headers:
    """Sends every rank this rank's header and its (U, T, N) per table for that rank, and waits.

    Args:
        counts: ``counts[t][r]`` = (U, T, N) this rank sends to rank r for table t.
    Returns:
        :class:`Headers` received from every rank (equal split sizes: HEADER + 3 per table).
    """
    num_tables = len(counts)
    per_rank = HEADER + PER_TABLE * num_tables
    rows = [[status, flags, digest, world_size]
            + [int(x) for t in range(num_tables) for x in counts[t][r]] for r in range(world_size)]
    send = torch.tensor(rows, dtype=torch.int64).reshape(world_size, per_rank)
    split = [per_rank] * world_size
    got = all_to_all(send.to(device).flatten(), split, split, group).wait()
    rows = got.view(world_size, per_rank).tolist()
    table_counts = [[tuple(row[HEADER + PER_TABLE * t:HEADER + PER_TABLE * (t + 1)])
                     for t in range(num_tables)] for row in rows]
    return Headers(rows=rows, counts=table_counts)


# ---------------------------------------------------------------- configs agree across ranks


def describe_configs(configs: Sequence[TableConfig]) -> list[tuple[str, dict[str, str]]]:
    """[(table name, {field: repr(value)})]: what must agree on every rank (anything that is not
    a TableConfig is described by its repr; the collection constructor rejects it afterwards)."""
    return [(c.name, {f.name: repr(getattr(c, f.name)) for f in fields(c)})
            if isinstance(c, TableConfig) else (repr(c), {}) for c in configs]


def config_digest(configs: Sequence[TableConfig], world_size: int, kind: str) -> int:
    """A 62-bit digest of the table configs, world size and module kind (sent every step)."""
    text = repr((kind, world_size, describe_configs(configs)))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def check_same_configs(configs: Sequence[TableConfig], world_size: int, rank: int, kind: str,
                       group) -> None:
    """Collective: raises ConfigError on every rank unless all ranks shard the same tables.

    The message names the first difference (table lists, or a field of one table) and the ranks.
    """
    mine = (kind, world_size, describe_configs(configs))
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, mine, group=group)
    for r, theirs in enumerate(gathered):
        if theirs != gathered[0]:
            raise ConfigError(_difference(gathered[0], theirs, r) + " Every rank must shard the "
                              "same list of TableConfigs (same order, same values); this is rank "
                              f"{rank}.")


def raise_together(message: str | None, world_size: int, group) -> None:
    """Collective: raises ConfigError on every rank if any rank passes a message (its own
    message on that rank, a pointer to it elsewhere), so no rank is left waiting in a later
    collective."""
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, message, group=group)
    failed = [r for r, m in enumerate(gathered) if m is not None]
    if not failed:
        return
    if message is not None:
        raise ConfigError(message)
    raise ConfigError(f"dynemb.distributed: rank(s) {failed} failed: {gathered[failed[0]]}")


def _difference(first, other, r: int) -> str:
    kind0, w0, tables0 = first
    kind1, w1, tables1 = other
    if (kind0, w0) != (kind1, w1):
        return (f"dynemb.distributed.shard: rank 0 shards a {kind0} over {w0} ranks, rank {r} "
                f"a {kind1} over {w1} ranks.")
    names0, names1 = [n for n, _ in tables0], [n for n, _ in tables1]
    if names0 != names1:
        return (f"dynemb.distributed.shard: rank 0 has tables {names0}, rank {r} has tables "
                f"{names1}; expected the same list.")
    for (name, f0), (_, f1) in zip(tables0, tables1):
        for key in f0:
            if f0[key] != f1.get(key):
                return (f"dynemb.distributed.shard: table {name!r}: {key} is {f0[key]} on rank 0 "
                        f"but {f1.get(key)} on rank {r}.")
    return f"dynemb.distributed.shard: the table configs of rank 0 and rank {r} differ."
