"""The routing function: an independent fmix64 reference, every key to exactly one rank,
roundrobin of negative keys, continuous blocks and their fallback, strided keys, and the spread of
each rank's keys over its shard's buckets. No processes are spawned here."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dynemb
from dynemb.distributed import route, route_table, shard_capacity, shard_config
from dynemb.errors import ConfigError, InputError
from dynemb.kernels.hashing import bucket_of, index_hash
from dynemb.table import index_geometry

R = dynemb.Routing
U64 = (1 << 64) - 1
INT64 = st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)
WORLD = st.integers(min_value=1, max_value=1000)


def fmix64_ref(key: int) -> int:
    """MurmurHash3's fmix64 on the unsigned 64-bit pattern of ``key``, in plain Python ints."""
    x = key & U64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & U64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & U64
    return x ^ (x >> 33)


def test_fmix64_reference_known_values():
    assert fmix64_ref(0) == 0
    # MurmurHash3 fmix64(1), computed by hand from the published constants
    assert fmix64_ref(1) == 0xB456BCFC34C2CB2C
    assert fmix64_ref(-1) == fmix64_ref(U64)


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(INT64, min_size=1, max_size=50), world=WORLD)
def test_hash_roundrobin_is_fmix64_mod_w(keys, world):
    got = route(torch.tensor(keys, dtype=torch.int64), world, R.HASH_ROUNDROBIN).tolist()
    assert got == [fmix64_ref(k) % world for k in keys]


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(INT64, min_size=1, max_size=50), world=WORLD,
       mode=st.sampled_from(list(R)), id_range=st.integers(min_value=1, max_value=1 << 63))
def test_every_key_goes_to_exactly_one_rank(keys, world, mode, id_range):
    t = torch.tensor(keys, dtype=torch.int64)
    owners = route(t, world, mode, id_range=id_range)
    assert owners.dtype == torch.int64 and owners.shape == t.shape
    assert bool(((owners >= 0) & (owners < world)).all())
    # one owner per key: independent of the batch it comes in, its position and repeats
    alone = [int(route(torch.tensor([k]), world, mode, id_range=id_range)) for k in keys]
    assert owners.tolist() == alone
    again = route(t.flip(0).repeat(2), world, mode, id_range=id_range)
    assert again.tolist() == (alone[::-1] * 2)


@settings(max_examples=200, deadline=None)
@given(keys=st.lists(INT64, min_size=1, max_size=50), world=WORLD)
def test_roundrobin_is_floor_modulo(keys, world):
    got = route(torch.tensor(keys, dtype=torch.int64), world, R.ROUNDROBIN).tolist()
    assert got == [k % world for k in keys]  # Python's % : -1 -> W - 1


def test_roundrobin_of_negative_keys():
    keys = torch.tensor([-1, -2, -3, -4, 0, 1, -(1 << 63) + 1])
    assert route(keys, 3, R.ROUNDROBIN).tolist() == [2, 1, 0, 2, 0, 1, (-(1 << 63) + 1) % 3]
    assert route(keys, 2, "roundrobin").tolist() == [1, 0, 1, 0, 0, 1, 1]


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(INT64, min_size=1, max_size=50), world=WORLD,
       id_range=st.integers(min_value=1, max_value=1 << 63))
def test_continuous_blocks_and_fallback(keys, world, id_range):
    block = -(-id_range // world)  # exact integer ceil (floats round above 2**53)
    want = [k // block if 0 <= k < block * world else k % world for k in keys]
    got = route(torch.tensor(keys, dtype=torch.int64), world, R.CONTINUOUS, id_range=id_range)
    assert got.tolist() == want


def test_continuous_examples():
    keys = torch.arange(-2, 14)
    # id_range 10 over 3 ranks: blocks of 4 -> [0, 4) 0, [4, 8) 1, [8, 12) 2; else key mod 3
    want = [1, 2] + [0] * 4 + [1] * 4 + [2] * 4 + [0, 1]
    assert route(keys, 3, R.CONTINUOUS, id_range=10).tolist() == want
    big = torch.tensor([0, (1 << 62) - 1, 1 << 62, (1 << 63) - 1, -5])
    assert route(big, 2, R.CONTINUOUS, id_range=1 << 63).tolist() == [0, 0, 1, 1, 1]


def test_strided_keys_break_roundrobin_not_hash_roundrobin():
    for world in (2, 4, 8, 64):
        keys = torch.arange(1 << 17, dtype=torch.int64) * world  # >= 1e5 unique, stride W
        rr = torch.bincount(route(keys, world, R.ROUNDROBIN), minlength=world)
        assert rr[0] == keys.numel() and int(rr[1:].sum()) == 0
        h = torch.bincount(route(keys, world, R.HASH_ROUNDROBIN), minlength=world).double()
        assert float(h.max() / h.mean()) <= 1.1, (world, h.tolist())


@pytest.mark.parametrize("world", [2, 3, 4, 8, 64])
@pytest.mark.parametrize("pattern", ["sequential", "strided", "low_bits_type"])
def test_each_ranks_keys_spread_over_all_its_buckets(world, pattern):
    """The shard's index hash is independent of the routing hash: the keys one rank owns under
    hash_roundrobin fill all buckets (and start slots) of its shard evenly."""
    n = 1 << 17
    base = torch.arange(n, dtype=torch.int64)
    keys = {"sequential": base, "strided": base * world,
            "low_bits_type": (base << 4) | (base % 3)}[pattern]
    owners = route(keys, world, R.HASH_ROUNDROBIN)
    cfg = dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=n)
    num_buckets, width = index_geometry(shard_config(cfg, world).capacity, cfg.bucket_capacity)
    for r in range(world):
        mine = keys[owners == r]
        h = index_hash(mine)
        per_bucket = torch.bincount(bucket_of(h, num_buckets), minlength=num_buckets).double()
        assert per_bucket.numel() == num_buckets and bool((per_bucket > 0).all()), (r, pattern)
        assert float(per_bucket.max() / per_bucket.mean()) < 1.5, (r, pattern)
        starts = torch.bincount(h & (width - 1), minlength=width)
        assert bool((starts > 0).all())


def test_shard_capacity_and_config():
    assert [shard_capacity(10, w) for w in (1, 2, 3, 4, 10, 11)] == [10, 5, 4, 3, 1, 1]
    cfg = dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=1000,
                             routing=R.CONTINUOUS, id_range=77)
    sc = shard_config(cfg, 3)
    assert sc.capacity == 334 and sc.name == "t" and sc.routing == R.CONTINUOUS
    assert route_table(torch.tensor([0, 26, 76]), cfg, 3).tolist() == [0, 1, 2]


def test_world_size_one_and_shapes():
    keys = torch.tensor([[5, -7], [1 << 62, 3]])
    for mode in R:
        assert route(keys, 1, mode, id_range=10).tolist() == [[0, 0], [0, 0]]
        assert route(keys, 4, mode, id_range=10).shape == (2, 2)
    assert route(torch.empty(0, dtype=torch.int64), 5).numel() == 0


def test_route_errors():
    keys = torch.tensor([1, 2])
    with pytest.raises(InputError, match="int64"):
        route(keys.int(), 2)
    with pytest.raises(InputError, match="int64"):
        route([1, 2], 2)
    for bad in (0, -1, True, 2.0, 1 << 40):
        with pytest.raises(ConfigError, match="world_size"):
            route(keys, bad)
    with pytest.raises(ConfigError, match="roundrobin"):
        route(keys, 2, "modulo")
    for id_range in (None, 0, True, 1 << 64):
        with pytest.raises(ConfigError, match="id_range"):
            route(keys, 2, R.CONTINUOUS, id_range=id_range)


def test_table_config_routing_validation():
    kw = dict(name="items", dim=4, features=["f"], capacity=8)
    assert dynemb.TableConfig(**kw).routing == R.HASH_ROUNDROBIN
    with pytest.raises(ConfigError, match=r"TableConfig\('items'\)\.id_range.*CONTINUOUS"):
        dynemb.TableConfig(**kw, routing=R.CONTINUOUS)
    for bad in (0, -3, True, 1.5, (1 << 63) + 1):
        with pytest.raises(ConfigError, match="id_range"):
            dynemb.TableConfig(**kw, id_range=bad)
    with pytest.raises(ConfigError, match="routing"):
        dynemb.TableConfig(**kw, routing="roundrobin")
    cfg = dynemb.TableConfig(**kw, routing=R.CONTINUOUS, id_range=1 << 63)
    assert cfg.id_range == 1 << 63
    assert R("hash_roundrobin") is R.HASH_ROUNDROBIN and R.ROUNDROBIN.value == "roundrobin"


def test_continuous_needs_id_range_at_any_world_size():
    for w in (1, 2):
        with pytest.raises(dynemb.errors.ConfigError, match="id_range"):
            route(torch.tensor([1, 2]), w, dynemb.Routing.CONTINUOUS)
