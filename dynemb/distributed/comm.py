"""Collectives of the sharded collections: asynchronous all-to-alls, the header that carries
split sizes, each rank's step and phase, and lets every rank fail together, the shard-time config
check, and what a rank says when a peer is lost.

Every exchange of variable-sized data is preceded by an exchange of its sizes: gloo's
``all_to_all_single`` takes uneven splits, but both sides must agree on them (gloo aborts the
process that receives more than it posted), so a receiver only ever posts the sizes its senders
announced, and the header (equal sizes on every rank of one collection) also carries the step and
phase each rank is at, so ranks that reached different points never exchange anything else.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from dynemb.config import TableConfig
from dynemb.errors import ConfigError, DynembError

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
STATUS_ABSENT = -1
"""Pre-filled in the receive buffer: a row still holding it never arrived (the rank is missing)."""

F_TRAINING = 1
F_GRAD = 2
F_WEIGHTED = 4
F_WANTS_WGRAD = 8

PHASE_FORWARD = 1
PHASE_BACKWARD = 2
PHASE_STATS = 3
PHASES = {PHASE_FORWARD: "forward of step", PHASE_BACKWARD: "backward of step",
          PHASE_STATS: "routing_stats after step"}

H_STATUS, H_FLAGS, H_DIGEST, H_WORLD, H_PHASE, H_STEP = range(6)
HEADER = 6
PER_TABLE = 3
"""Per table and destination: unique keys U, touched bags T, id occurrences N."""


@dataclass
class Headers:
    """What every rank announced: ``rows[r]`` is rank r's header to this rank (``H_*`` fields
    first), ``counts[r][t]`` its (U, T, N) for table t."""

    rows: list[list[int]]
    counts: list[list[tuple[int, int, int]]]

    def flags(self, r: int) -> int:
        return self.rows[r][H_FLAGS]


def ranks_text(ranks: Sequence[int]) -> str:
    """``"rank 1"``, ``"ranks 0, 2"``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def step_name(phase: int, step: int) -> str:
    """``"forward of step 3"``: a point in a collection's life (steps count forward calls)."""
    return f"{PHASES.get(phase, f'phase {phase} of step')} {step}"


class TransportError(RuntimeError):
    """A collective failed in the transport (a peer gone, a timeout); ``absent`` lists the ranks
    whose header never arrived, when the failed collective was a header exchange."""

    def __init__(self, message: str, absent: list[int] | None = None) -> None:
        super().__init__(message)
        self.absent = absent


def exchange_headers(head: Sequence[int], world_size: int,
                     counts: Sequence[Sequence[Sequence[int]]], group,
                     device: torch.device) -> Headers:
    """Sends every rank this rank's header and its (U, T, N) per table for that rank, and waits.

    Args:
        head: the ``HEADER`` fields (status, flags, digest, world size, phase, step).
        counts: ``counts[t][r]`` = (U, T, N) this rank sends to rank r for table t.
    Returns:
        :class:`Headers` received from every rank (equal split sizes: HEADER + 3 per table).
    Raises:
        TransportError: the exchange failed (its ``absent``: the ranks whose header never came).
    """
    num_tables = len(counts)
    per_rank = HEADER + PER_TABLE * num_tables
    rows = [[int(x) for x in head]
            + [int(x) for t in range(num_tables) for x in counts[t][r]] for r in range(world_size)]
    send = torch.tensor(rows, dtype=torch.int64).reshape(world_size, per_rank).to(device)
    got = torch.full((world_size * per_rank,), STATUS_ABSENT, dtype=torch.int64, device=device)
    split = [per_rank] * world_size
    try:
        work = dist.all_to_all_single(got, send.flatten(), split, split, group=group,
                                      async_op=True)
        work.wait()
    except RuntimeError as e:
        try:  # gloo writes each rank's row into ``got`` as it arrives
            absent = [r for r, row in enumerate(got.view(world_size, per_rank).tolist())
                      if row[H_STATUS] == STATUS_ABSENT]
        except RuntimeError:  # a device that failed with the collective (nccl)
            absent = None
        raise TransportError(str(e), absent) from e
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
                       group) -> int:
    """Collective: raises ConfigError on every rank unless all ranks shard the same tables, and
    agrees the new collection's identity.

    The message names the first difference (table lists, or a field of one table) and the ranks.
    Returns:
        A 62-bit number drawn by the group's rank 0 and the same on every rank: it tells apart
        two collections with equal tables on one group (a collection's identity is agreed by the
        ranks that build it, never counted per process, so ranks that built other collections on
        other groups before still agree).
    """
    mine = (kind, world_size, describe_configs(configs))
    gathered = gather_objects((*mine, secrets.randbits(62)), world_size, group,
                              f"{kind} (rank {rank})", "the collection's build-time config check")
    for r, theirs in enumerate(gathered):
        if theirs[:3] != gathered[0][:3]:
            raise ConfigError(_difference(gathered[0][:3], theirs[:3], r) + " Every rank must "
                              "shard the same list of TableConfigs (same order, same values); "
                              f"this is rank {rank}.")
    return int(gathered[0][3])


def raise_together(message: str | None, world_size: int, group) -> None:
    """Collective: raises ConfigError on every rank if any rank passes a message (its own
    message on that rank, a pointer to it elsewhere), so no rank is left waiting in a later
    collective."""
    gathered = gather_objects(message, world_size, group,
                              f"dynemb.distributed.shard (rank {dist.get_rank(group)})",
                              "the shard-time check")
    failed = [r for r, m in enumerate(gathered) if m is not None]
    if not failed:
        return
    if message is not None:
        raise ConfigError(message)
    raise ConfigError(f"dynemb.distributed: rank(s) {failed} failed: {gathered[failed[0]]}")


def gather_objects(obj, world_size: int, group, who: str, where: str) -> list:
    """``all_gather_object``, raising DynembError (which rank vanished) if the transport fails."""
    gathered: list = [None] * world_size
    try:
        dist.all_gather_object(gathered, obj, group=group)
    except RuntimeError as e:
        if not is_transport_error(e):
            raise
        raise DynembError(peer_loss_message(who, where, e, group)) from e
    return gathered


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


# ---------------------------------------------------------------- a peer lost

PROBE_TAG = 0x5D1E
"""Tag of the one-element sends that find which connections are closed after a failure."""
_PROBES: list = []
"""The probes' pending sends, kept alive (a gloo send must outlive its buffer's use)."""
_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "timed out",
            "pair closure", "broken pipe", "socket")


def is_transport_error(error: BaseException) -> bool:
    """Whether ``error`` came from the process group's transport (a peer gone, a timeout), not
    from dynemb or from torch's tensor code."""
    if isinstance(error, DynembError) or not isinstance(error, RuntimeError):
        return False
    if isinstance(error, (TransportError, dist.DistError)):
        return True
    text = str(error).lower()
    return any(m in text for m in _MARKERS)


def probe_peers(group) -> dict[int, str]:
    """Posts a one-element send to every other rank of a gloo ``group``; returns {rank: the
    transport's message} of the ranks whose connection is closed (the post fails at once).

    The sends to reachable ranks stay pending (nobody receives them; the group is unusable
    anyway) and are kept alive until the process ends. Empty for nccl (its sends do not fail at
    once) or when the group is gone.
    """
    try:
        if dist.get_backend(group) != "gloo":
            return {}
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    except (RuntimeError, ValueError):
        return {}
    closed = {}
    for peer in range(world_size):
        if peer == rank:
            continue
        try:
            _PROBES.append(dist.isend(torch.zeros(1), group=group, group_dst=peer, tag=PROBE_TAG))
        except RuntimeError as e:
            closed[peer] = str(e)
    return closed


def peer_loss_message(who: str, where: str, error: BaseException, group) -> str:
    """What a rank says when a collective failed in the transport: which rank vanished (its
    connection closed), or, after a timeout, which ranks never sent their header, and what to do.

    Args:
        who: the collection and this rank (``"ShardedEmbeddingBagCollection (rank 0)"``).
        where: the collective that failed (``"forward of step 3 (id all-to-all)"``).
        error: the transport's error (a :class:`TransportError` knows the absent ranks).
        group: the process group (probed with :func:`probe_peers`).
    """
    closed = probe_peers(group)
    gone = sorted(p for p, m in closed.items() if "timeout" not in m.lower())
    absent = getattr(error, "absent", None) or []
    timed_out = "timed out" in str(error).lower() or len(gone) < len(closed)
    if gone:
        head = (f"lost {ranks_text(gone)} during {where}: the connection closed (the process "
                "exited, crashed or was killed, or destroyed its process group)")
    elif timed_out and absent:
        head = (f"{where} timed out: {ranks_text(absent)} never reached it within the "
                "collective timeout (hung, far slower than the others, or waiting in another "
                "collective)")
    elif timed_out:
        head = (f"{where} timed out: no answer within the collective timeout, and the transport "
                "closed every connection without saying which rank was missing (one is hung, far "
                "slower than the others, or waiting in another collective)")
    else:
        head = f"{where} failed in the transport; no rank is known to be gone"
    fix = (" The process group cannot be used again: stop every rank and restart the job (from "
           "its last checkpoint).")
    if timed_out and not gone:
        fix += (" If a rank is merely slow, raise the collective timeout (the timeout of "
                "init_process_group; TrainConfig.timeout_s for dynemb train).")
    detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"{who}: {head}.{fix} Transport error: {detail}"
