"""fmix64 and the index hashes (torch and numba) against a pure-Python MurmurHash3 reference."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from numba import njit

import dynemb
from dynemb.kernels import hashing as H

U64 = (1 << 64) - 1
M1 = 0xFF51AFD7ED558CCD
M2 = 0xC4CEB9FE1A85EC53
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1


def fmix64_ref(x: int) -> int:
    """MurmurHash3's fmix64 on the 64-bit pattern of ``x`` (an unsigned int in [0, 2**64))."""
    x &= U64
    x ^= x >> 33
    x = (x * M1) & U64
    x ^= x >> 33
    x = (x * M2) & U64
    x ^= x >> 33
    return x


def u64(x: int) -> int:
    return x % (1 << 64)


def signed(x: int) -> int:
    x &= U64
    return x - (1 << 64) if x >= 1 << 63 else x


def sample_keys() -> list[int]:
    rng = random.Random(1234)
    special = [0, 1, 2, 3, -1, -2, 42, -42, I64_MAX, I64_MIN, I64_MIN + 1, I64_MAX - 1,
               1 << 32, (1 << 32) - 1, -(1 << 32), 1 << 33, 1 << 62, -(1 << 62)]
    return special + [signed(rng.getrandbits(64)) for _ in range(300)]


KEYS = sample_keys()


@njit
def _index_hash_many(keys, out):
    for i in range(keys.shape[0]):
        out[i] = H.index_hash_nb(keys[i])


@njit
def _fmix_many(xs, out):
    for i in range(xs.shape[0]):
        out[i] = H.fmix64_nb(xs[i])


@njit
def _bucket_digest_many(hs, num_buckets, buckets, digests):
    for i in range(hs.shape[0]):
        buckets[i] = H.bucket_of_nb(hs[i], num_buckets)
        digests[i] = H.digest_of_nb(hs[i])


def test_reference_sanity():
    # fmix64(0) = 0 and fmix64 is a bijection on a sample (no collisions).
    assert fmix64_ref(0) == 0
    out = {fmix64_ref(u64(k)) for k in KEYS}
    assert len(out) == len(set(KEYS))
    # One value worked by hand from the definition (x = 1).
    x = 1
    x ^= x >> 33
    x = (x * M1) % 2**64
    x ^= x >> 33
    x = (x * M2) % 2**64
    x ^= x >> 33
    assert fmix64_ref(1) == x


def test_fmix64_torch_matches_reference():
    t = torch.tensor(KEYS, dtype=torch.int64)
    got = H.fmix64(t)
    assert got.dtype == torch.int64 and got.shape == t.shape
    for k, g in zip(KEYS, got.tolist()):
        assert u64(g) == fmix64_ref(u64(k)), k


def test_fmix64_torch_keeps_shape_and_rejects_other_dtypes():
    t = torch.tensor(KEYS[:12], dtype=torch.int64).view(3, 4)
    got = H.fmix64(t)
    assert got.shape == (3, 4)
    assert [u64(v) for v in got.flatten().tolist()] == [fmix64_ref(u64(k)) for k in KEYS[:12]]
    with pytest.raises(TypeError):
        H.fmix64(torch.tensor([1, 2], dtype=torch.int32))


def test_fmix64_numba_direct_matches_reference():
    for k in KEYS[:40]:
        assert int(H.fmix64_nb(np.uint64(u64(k)))) == fmix64_ref(u64(k)), k


def test_fmix64_numba_in_njit_loop_matches_reference():
    xs = np.array([u64(k) for k in KEYS], dtype=np.uint64)
    out = np.zeros_like(xs)
    _fmix_many(xs, out)
    assert [int(v) for v in out] == [fmix64_ref(u64(k)) for k in KEYS]


def test_index_hash_numba_matches_reference_including_negative_keys():
    ks = np.array(KEYS, dtype=np.int64)
    out = np.zeros(len(KEYS), dtype=np.uint64)
    _index_hash_many(ks, out)
    for k, h in zip(KEYS, out):
        assert int(h) == fmix64_ref(u64(k) ^ H.INDEX_SEED), k
    # ... and called directly
    for k in (0, -1, I64_MAX, I64_MIN + 1):
        assert int(H.index_hash_nb(np.int64(k))) == fmix64_ref(u64(k) ^ H.INDEX_SEED)


def test_index_hash_torch_matches_reference_and_differs_from_routing_hash():
    t = torch.tensor(KEYS, dtype=torch.int64)
    got = H.index_hash(t).tolist()
    for k, h in zip(KEYS, got):
        assert u64(h) == fmix64_ref(u64(k) ^ H.INDEX_SEED), k
    routing = H.fmix64(t).tolist()
    assert sum(a == b for a, b in zip(got, routing)) == 0


@pytest.mark.parametrize("m", [1, 2, 3, 7, 10, 255, 1_000_003, (1 << 40) + 15, (1 << 61) + 1,
                               (1 << 62) - 1])
def test_umod_matches_python_unsigned_mod(m):
    t = torch.tensor(KEYS, dtype=torch.int64)
    got = H.umod(t, m).tolist()
    for k, g in zip(KEYS, got):
        assert g == u64(k) % m, (k, m)


def test_umod_of_fmix64_is_the_unsigned_routing():
    t = torch.tensor(KEYS, dtype=torch.int64)
    for w in (2, 3, 8):
        got = H.umod(H.fmix64(t), w).tolist()
        assert got == [fmix64_ref(u64(k)) % w for k in KEYS]


def test_to_signed():
    assert H.to_signed(U64) == -1
    assert H.to_signed(1 << 63) == I64_MIN
    assert H.to_signed(5) == 5
    assert H.to_signed(-1) == -1


@pytest.mark.parametrize("num_buckets", [1, 2, 3, 64, 1000, 1 << 20])
def test_bucket_and_digest_torch_vs_numba_vs_reference(num_buckets):
    hs_u = [fmix64_ref(u64(k) ^ H.INDEX_SEED) for k in KEYS] + [0, U64, 1 << 63, (1 << 63) - 1]
    hs_t = torch.tensor([signed(h) for h in hs_u], dtype=torch.int64)
    b_t = H.bucket_of(hs_t, num_buckets).tolist()
    d_t = H.digest_of(hs_t)
    assert d_t.dtype == torch.uint8
    nb_b = np.zeros(len(hs_u), dtype=np.int64)
    nb_d = np.zeros(len(hs_u), dtype=np.uint8)
    _bucket_digest_many(np.array(hs_u, dtype=np.uint64), num_buckets, nb_b, nb_d)
    for i, h in enumerate(hs_u):
        ref_b = ((h >> 33) * num_buckets) >> 31
        ref_d = 2 + ((h >> 8) & 0xFF) % 254
        assert 0 <= ref_b < num_buckets and 2 <= ref_d <= 255
        assert b_t[i] == ref_b == int(nb_b[i]), h
        assert int(d_t[i]) == ref_d == int(nb_d[i]), h


def _spread(buckets: torch.Tensor, num_buckets: int) -> tuple[int, float]:
    counts = torch.bincount(buckets, minlength=num_buckets).double()
    return int((counts > 0).sum()), float(counts.max() / counts.mean())


@pytest.mark.parametrize("keys", ["dense", "strided"])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_buckets_independent_of_routing(world, keys):
    """Keys that share an owner rank (fmix64(k) % W == r, unsigned) spread over all buckets."""
    n, nb = 120_000, 64
    ks = torch.arange(n, dtype=torch.int64)
    if keys == "strided":
        ks = ks * 4096 - (1 << 40)
    owner = H.umod(H.fmix64(ks), world)
    buckets = H.bucket_of(H.index_hash(ks), nb)
    for r in range(world):
        mine = buckets[owner == r]
        assert mine.numel() > n // world // 2
        used, ratio = _spread(mine, nb)
        assert used == nb, (world, r, used)
        assert ratio < 1.5, (world, r, ratio)


def test_spread_check_detects_a_routing_dependent_bucket_hash():
    """The criterion above can fail: buckets taken from the routing hash's low bits hit only
    64 / W buckets for one rank."""
    ks = torch.arange(50_000, dtype=torch.int64)
    rh = H.fmix64(ks)
    mine = rh[H.umod(rh, 8) == 0]
    used, _ = _spread(H.umod(mine, 64), 64)
    assert used == 8


def test_table_places_each_key_in_its_index_bucket(backend):
    """A 64-bucket table: the keys exported from bucket b's slot range hash to bucket b, and
    keys of one routing class fill every bucket."""
    cfg = dynemb.TableConfig(name="t", dim=2, features=["f"], capacity=64 * 16, bucket_capacity=16)
    t = dynemb.DynamicTable(cfg, backend=backend)
    assert t.capacity() == 64 * 16
    ks = torch.arange(20_000, dtype=torch.int64) * 7 + 3
    ks = ks[H.umod(H.fmix64(ks), 8) == 5][:400]
    t.find_or_insert(ks)
    assert t.size() == 400 and t.stats().evicted == 0
    seen = []
    for b in range(64):
        got = t.export_batch(b * 16, 16).keys
        assert got.numel() > 0, b
        assert H.bucket_of(H.index_hash(got), 64).eq(b).all(), b
        seen.extend(got.tolist())
    assert sorted(seen) == sorted(ks.tolist())
