"""Compiled input distribution of a sharded step: one pass that deduplicates a table's ids,
routes the distinct keys to their owner ranks and groups everything by owner, where the torch
path (``distributed.input_dist``, any device) sorts the ids twice and routes with vectorised
hashing. The results are the torch path's, element for element:

* distinct keys grouped by owner (ascending), each owner's in ascending key order (what
  ``torch.unique(sorted=True)`` then a stable sort by owner gives);
* each id's position among them and its owner;
* the ids in payload order: by owner, each owner's in their order in the batch, and each one's
  index among its owner's distinct keys;
* per owner, the bags it has ids of (in bag order) and how many ids of each.
"""

from __future__ import annotations

import numpy as np

from dynemb.kernels.hashing import fmix64_nb
from dynemb.kernels.jit import njit
from dynemb.kernels.prefetch import AHEAD, prefetch_read

R_ROUNDROBIN, R_HASH_ROUNDROBIN, R_CONTINUOUS = 0, 1, 2
"""Routing codes (``dynemb.Routing``)."""


@njit(cache=True, inline="always")
def owner_of(key, code, world_size, block):
    """The owner rank of ``key``, as ``distributed.routing.route`` computes it (``block``:
    CONTINUOUS's ids per rank; a non-negative key below ``block * world_size`` is inside)."""
    if world_size == 1:
        return 0
    if code == R_ROUNDROBIN:
        return key % world_size  # Python's modulo: never negative
    if code == R_HASH_ROUNDROBIN:
        return np.int64(fmix64_nb(np.uint64(key)) % np.uint64(world_size))
    if key >= 0 and key // block < world_size:
        return key // block
    return key % world_size


_DIGIT = 11  # bits per radix pass: 6 passes over 64 bits, 2048 counters (in L1)


@njit(cache=True, nogil=True)
def _sorted_by_key(keys):
    """The indices of ``keys`` (int64) in ascending key order: an LSD radix sort of 11 bits a
    pass (numba's argsort takes about 60 ns per key here, this about a third)."""
    n = keys.shape[0]
    order = np.arange(n)
    tmp = np.empty(n, np.int64)
    flip = np.uint64(1) << np.uint64(63)  # signed order as unsigned
    mask = np.uint64((1 << _DIGIT) - 1)
    count = np.empty((1 << _DIGIT) + 1, np.int64)
    for shift in range(0, 64, _DIGIT):
        sh = np.uint64(shift)
        count[:] = 0
        for j in range(n):
            count[np.int64(((np.uint64(keys[j]) ^ flip) >> sh) & mask) + 1] += 1
        if count[1:].max() == n:  # every key has the same digit here: nothing moves
            continue
        for b in range(1 << _DIGIT):
            count[b + 1] += count[b]
        for j in range(n):
            d = order[j]
            b = np.int64(((np.uint64(keys[d]) ^ flip) >> sh) & mask)
            tmp[count[b]] = d
            count[b] += 1
        order, tmp = tmp, order
    return order


@njit(cache=True, nogil=True)
def group_by_owner(keys, lengths, code, world_size, block, table, unique_keys,
                   position, occ_owner, occ_order, u_counts, n_counts, sent, touched_bags,
                   touched_len, t_counts):
    """Groups the ids ``keys`` (N,) of a table by owner; returns (U distinct keys, T touched
    bags).

    Writes ``unique_keys[:U]``, ``position`` (N,) (each id's index in ``unique_keys``),
    ``occ_owner`` (N,), ``occ_order`` (N,) (the ids in payload order), ``u_counts`` and
    ``n_counts`` (W,) (distinct keys and ids per owner). With ``lengths`` (F·B,) (a pooled
    table; empty for a sequence one) also ``sent`` (N,) (in payload order, each id's index
    among its owner's distinct keys), ``touched_bags[:T]`` and ``touched_len[:T]`` (each
    owner's bags with ids there, in bag order, and how many) and ``t_counts`` (W,).
    ``table``: a scratch hash set, (a power of two >= 2N, 2) int64 (key, number; a slot's two
    in one cache line)."""
    n = keys.shape[0]
    smask = np.uint64(table.shape[0] - 1)
    table[:, 1] = -1
    first = np.empty(n, np.int64)  # distinct keys in first-occurrence order
    dkey = np.empty(n, np.int64)
    n_u = 0
    for i in range(n):
        if i + AHEAD < n:
            prefetch_read(table, fmix64_nb(np.uint64(keys[i + AHEAD])) & smask, 0)
        k = keys[i]
        p = fmix64_nb(np.uint64(k)) & smask
        while table[p, 1] >= 0 and table[p, 0] != k:
            p = (p + np.uint64(1)) & smask
        if table[p, 1] < 0:
            table[p, 0] = k
            table[p, 1] = n_u
            dkey[n_u] = k
            n_u += 1
        first[i] = table[p, 1]
    order = _sorted_by_key(dkey[:n_u])
    u_counts[:] = 0
    downer = np.empty(n_u, np.int64)
    for d in range(n_u):
        r = owner_of(dkey[d], code, world_size, block)
        downer[d] = r
        u_counts[r] += 1
    # by owner, then by key: a stable counting sort by owner of the keys in key order
    fill = np.zeros(world_size, np.int64)
    for r in range(1, world_size):
        fill[r] = fill[r - 1] + u_counts[r - 1]
    rank_of = np.empty(n_u, np.int64)
    for j in range(n_u):
        d = order[j]
        r = downer[d]
        unique_keys[fill[r]] = dkey[d]
        rank_of[d] = fill[r]
        fill[r] += 1
    n_counts[:] = 0
    for i in range(n):
        d = first[i]
        position[i] = rank_of[d]
        r = downer[d]
        occ_owner[i] = r
        n_counts[r] += 1
    ostart = np.zeros(world_size, np.int64)
    for r in range(1, world_size):
        ostart[r] = ostart[r - 1] + n_counts[r - 1]
    for i in range(n):  # a stable counting sort of the ids by owner
        r = occ_owner[i]
        occ_order[ostart[r]] = i
        ostart[r] += 1
    n_t = 0
    if lengths.shape[0] > 0:
        u_start = np.zeros(world_size, np.int64)
        for r in range(1, world_size):
            u_start[r] = u_start[r - 1] + u_counts[r - 1]
        for j in range(n):
            i = occ_order[j]
            sent[j] = position[i] - u_start[occ_owner[i]]
        bag_of = np.empty(n, np.int64)
        i = 0
        for bag in range(lengths.shape[0]):
            for _ in range(lengths[bag]):
                bag_of[i] = bag
                i += 1
        t_counts[:] = 0
        prev_owner = -1
        prev_bag = -1
        for j in range(n):  # ids by owner, each owner's in batch (so bag) order
            i = occ_order[j]
            r = occ_owner[i]
            b = bag_of[i]
            if r != prev_owner or b != prev_bag:
                touched_bags[n_t] = b
                touched_len[n_t] = 0
                t_counts[r] += 1
                n_t += 1
                prev_owner, prev_bag = r, b
            touched_len[n_t - 1] += 1
    return n_u, n_t
