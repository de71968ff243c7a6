"""THE routing function: which rank owns a key when a table is sharded row-wise over W ranks.

The input distribution of the sharded collections uses it, and so will checkpoint loading and
resharding: a key's owner must be computed by this one function everywhere.

Modes (:class:`dynemb.Routing`):

- ``ROUNDROBIN``: ``key mod W`` with the floor modulo (the result is in ``[0, W)`` for negative
  keys too: ``-1`` goes to ``W - 1``, so consecutive ids, negative or not, cycle over the ranks).
- ``HASH_ROUNDROBIN``: ``fmix64(key) mod W`` where ``fmix64`` is MurmurHash3's 64-bit finaliser
  applied to the key's 64-bit pattern and the modulo is taken on the unsigned result. Strided ids
  (``k·W``) and ids that carry a type in their low bits spread evenly.
- ``CONTINUOUS``: ``key // block`` for keys in ``[0, block·W)``, ``block = ceil(id_range / W)``;
  every other key (negative, or beyond the range) falls back to ``key mod W`` (floor modulo).

A shard's hash index uses ``fmix64(key ^ INDEX_SEED)`` (a different mix), so the keys one rank
owns still spread over all of its buckets, whatever the routing mode and W.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from dynemb.config import Routing, TableConfig
from dynemb.errors import ConfigError, InputError
from dynemb.kernels.hashing import fmix64, umod
from dynemb.table.memory import shard_capacity

MAX_WORLD_SIZE = 1 << 31
"""Largest world size ``route`` accepts (``umod`` needs a modulus below 2**62)."""


def _routing(mode: Routing | str) -> Routing:
    if isinstance(mode, Routing):
        return mode
    try:
        return Routing(mode)
    except ValueError:
        raise ConfigError(f"route: expected a dynemb.Routing or one of "
                          f"{[r.value for r in Routing]}, found {mode!r}.") from None


def _check_world_size(world_size: int) -> None:
    if (not isinstance(world_size, int) or isinstance(world_size, bool)
            or not 1 <= world_size <= MAX_WORLD_SIZE):
        raise ConfigError(f"route: expected world_size an int in [1, {MAX_WORLD_SIZE}], "
                          f"found {world_size!r}.")


def continuous_block(id_range: int, world_size: int) -> int:
    """Keys per rank of ``Routing.CONTINUOUS``: ``ceil(id_range / world_size)``."""
    return -(-id_range // world_size)


def route(keys: torch.Tensor, world_size: int, mode: Routing | str = Routing.HASH_ROUNDROBIN,
          *, id_range: int | None = None) -> torch.Tensor:
    """The owner rank of each key.

    Args:
        keys: int64 tensor of any shape and device (raw ids; every int64 value is accepted).
        world_size: W, the number of ranks the table is sharded over (>= 1).
        mode: the routing mode (a :class:`dynemb.Routing` or its string value).
        id_range: ``Routing.CONTINUOUS`` only (required there): ids are expected in
            ``[0, id_range)``; ranks own blocks of ``ceil(id_range / W)`` consecutive ids.

    Returns:
        int64 tensor of the shape and device of ``keys``, every value in ``[0, W)``.

    Raises:
        InputError: ``keys`` is not an int64 tensor.
        ConfigError: a bad world size, mode, or a CONTINUOUS route without a valid id_range.
    """
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64:
        found = getattr(keys, "dtype", type(keys).__name__)
        raise InputError(f"route: expected keys as an int64 tensor, found {found}; convert ids "
                         "with .long().")
    _check_world_size(world_size)
    mode = _routing(mode)
    if mode == Routing.CONTINUOUS and (
            id_range is None or not isinstance(id_range, int) or isinstance(id_range, bool)
            or not 1 <= id_range <= 2**63):
        raise ConfigError(f"route: Routing.CONTINUOUS needs id_range, an int in [1, 2**63], "
                          f"found {id_range!r}; pass the table's TableConfig.id_range.")
    if world_size == 1:
        return torch.zeros_like(keys)
    if mode == Routing.ROUNDROBIN:
        return torch.remainder(keys, world_size)
    if mode == Routing.HASH_ROUNDROBIN:
        return umod(fmix64(keys), world_size)
    block = continuous_block(id_range, world_size)
    inside = keys >= 0
    if block * world_size < 2**63:  # else every non-negative int64 key is inside
        inside &= keys < block * world_size
    return torch.where(inside, torch.div(keys, block, rounding_mode="floor"),
                       torch.remainder(keys, world_size))


def route_table(keys: torch.Tensor, config: TableConfig, world_size: int) -> torch.Tensor:
    """``route`` with the routing mode and id range of ``config``."""
    return route(keys, world_size, config.routing, id_range=config.id_range)


def shard_config(config: TableConfig, world_size: int, rank: int | None = None) -> TableConfig:
    """The config of one rank's shard: ``config`` with ``capacity = shard_capacity(...)`` and,
    over several ranks, a ddr directory of its own (``<ddr_path>/rank<r>``).

    Everything else (name, seed, initializers, optimizer) is unchanged, so a key's initial row is
    the same whichever rank owns it.
    """
    storage = config.storage
    if storage.ddr_path is not None and world_size > 1:
        if rank is None:
            raise ConfigError(f"table {config.name!r}: shard_config needs the rank to give the "
                              "shard its own ddr_path directory.")
        storage = dataclasses.replace(storage, ddr_path=os.path.join(storage.ddr_path, f"rank{rank}"))
    _check_world_size(world_size)
    return dataclasses.replace(config, capacity=shard_capacity(config.capacity, world_size),
                               storage=storage)
