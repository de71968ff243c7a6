"""64-bit mixing: MurmurHash3's fmix64 finaliser, in numba (CPU kernels) and in torch (reference
and CUDA), plus the derived hashes the hash index uses.

fmix64 works on a key's 64-bit pattern (an int64 key ``-1`` is ``0xFFFF_FFFF_FFFF_FFFF``). torch
has no unsigned 64-bit arithmetic, so the torch version works on int64 with wrapping
multiplication and masked (logical) right shifts; both agree bit for bit.

Hashes used by a table (all independent of the routing hash ``fmix64(key)``):

- ``index_hash(key) = fmix64(key ^ INDEX_SEED)``: bucket from bits 33..63, start slot in the
  bucket from the low bits, 1-byte digest from bits 8..15.
- ``tier_hash(key) = fmix64(key ^ TIER_SEED)``: a HYBRID table's tier (``home_bucket``).
- ``element_bits(key_mix, j)``: 32 random bits of element j of a new row (initializers): a
  32-bit finaliser of a Weyl sequence seeded by the low half of ``key_mix``, its high half
  mixed in between the rounds. 32-bit arithmetic, so the init kernel hashes 8 elements per
  AVX2 instruction.
"""

from __future__ import annotations

import numpy as np
import torch

from dynemb.kernels.jit import njit

M1 = 0xFF51AFD7ED558CCD
M2 = 0xC4CEB9FE1A85EC53
INDEX_SEED = 0xD6E8FEB86659FD93  # the index's own seed: no other hash uses it
TIER_SEED = 0x3C6EF372FE94F82B  # HYBRID tiers: independent of the index and routing hashes
GOLDEN = 0x9E3779B97F4A7C15  # spreads an initializer's seed (``lifecycle._mix``)
E_STEP = 0x9E3779B9  # element_bits: the Weyl step of the per-element counters (32 bits)
E_M1 = 0x85EBCA6B  # element_bits: murmur3's fmix32 multipliers
E_M2 = 0xC2B2AE35
U64 = (1 << 64) - 1

_U33 = np.uint64(33)
_M1 = np.uint64(M1)
_M2 = np.uint64(M2)
_SEED = np.uint64(INDEX_SEED)
_TIER = np.uint64(TIER_SEED)
_E_STEP, _E_M1, _E_M2 = np.uint32(E_STEP), np.uint32(E_M1), np.uint32(E_M2)
_S13, _S16 = np.uint32(13), np.uint32(16)


def to_signed(x: int) -> int:
    """The int64 with the same 64-bit pattern as the unsigned int ``x``."""
    x &= U64
    return x - (1 << 64) if x >= 1 << 63 else x


# ---------------------------------------------------------------- numba (uint64 arithmetic)


@njit(cache=True, inline="always")
def fmix64_nb(x: np.uint64) -> np.uint64:
    x ^= x >> _U33
    x *= _M1
    x ^= x >> _U33
    x *= _M2
    x ^= x >> _U33
    return x


@njit(cache=True, inline="always")
def index_hash_nb(key: np.int64) -> np.uint64:
    return fmix64_nb(np.uint64(key) ^ _SEED)


@njit(cache=True, inline="always")
def bucket_of_nb(h: np.uint64, num_buckets: np.int64) -> np.int64:
    return np.int64(((h >> np.uint64(33)) * np.uint64(num_buckets)) >> np.uint64(31))


@njit(cache=True, inline="always")
def home_bucket_nb(key: np.int64, h: np.uint64, num_buckets: np.int64,
                   split: np.int64) -> np.int64:
    """The bucket of a key with index hash ``h``. Buckets ``[0, split)`` hold the hbm tier of a
    HYBRID table: ``tier_hash(key)`` sends a key there with probability split / num_buckets;
    ``split >= num_buckets`` means one tier."""
    if split >= num_buckets:
        return bucket_of_nb(h, num_buckets)
    if bucket_of_nb(fmix64_nb(np.uint64(key) ^ _TIER), num_buckets) < split:
        return bucket_of_nb(h, split)
    return split + bucket_of_nb(h, num_buckets - split)


@njit(cache=True, inline="always")
def digest_of_nb(h: np.uint64) -> np.uint8:
    return np.uint8(2 + ((h >> np.uint64(8)) & np.uint64(0xFF)) % np.uint64(254))


@njit(cache=True, nogil=True, error_model="numpy")
def element_bits_nb(lo: np.uint32, hi: np.uint32, bits) -> None:
    """``bits[j]`` (uint32) = the random bits of element j of the row whose key mixes to
    ``key_mix`` = (``hi`` << 32) | ``lo``, for every j of ``bits``. (A function of its own, on
    32-bit halves: inlined into the init kernel, LLVM vectorises it with 64-bit lanes, 4x
    slower.)"""
    for j in range(bits.shape[0]):
        x = np.uint32(lo + np.uint32(j) * _E_STEP)
        x = np.uint32(x ^ (x >> _S16))
        x = np.uint32(x * _E_M1)
        x = np.uint32(x ^ (x >> _S13))
        x = np.uint32(x ^ hi)
        x = np.uint32(x * _E_M2)
        bits[j] = np.uint32(x ^ (x >> _S16))


# ---------------------------------------------------------------- torch (int64, wrapping)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def fmix64(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 fmix64 of each int64 bit pattern.

    Args:
        x: int64 tensor of any shape, any device.
    Returns:
        int64 tensor of the same shape holding the unsigned result's bit pattern.
    """
    if x.dtype != torch.int64:
        raise TypeError(f"fmix64 expects int64, found {x.dtype}")
    x = x ^ _srl(x, 33)
    x = x * to_signed(M1)
    x = x ^ _srl(x, 33)
    x = x * to_signed(M2)
    return x ^ _srl(x, 33)


def umod(x: torch.Tensor, m: int) -> torch.Tensor:
    """``x mod m`` treating int64 ``x`` as unsigned 64-bit (``0 < m < 2**62``)."""
    half = _srl(x, 1) % m
    return (half * 2 + (x & 1)) % m


def index_hash(keys: torch.Tensor) -> torch.Tensor:
    return fmix64(keys ^ to_signed(INDEX_SEED))


def bucket_of(h: torch.Tensor, num_buckets: int) -> torch.Tensor:
    return (_srl(h, 33) * num_buckets) >> 31


def home_bucket(keys: torch.Tensor, h: torch.Tensor, num_buckets: int, split: int) -> torch.Tensor:
    """Torch twin of :func:`home_bucket_nb`."""
    if split >= num_buckets:
        return bucket_of(h, num_buckets)
    hbm = bucket_of(fmix64(keys ^ to_signed(TIER_SEED)), num_buckets) < split
    return torch.where(hbm, bucket_of(h, split), split + bucket_of(h, num_buckets - split))


def digest_of(h: torch.Tensor) -> torch.Tensor:
    return (2 + (_srl(h, 8) & 0xFF) % 254).to(torch.uint8)


def element_bits(key_mix: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """Torch twin of :func:`element_bits_nb`: int64 (in [0, 2**32)) bits of elements ``j`` of
    the rows with ``key_mix`` (broadcast against each other)."""
    m32 = 0xFFFFFFFF
    x = (key_mix + j * E_STEP) & m32
    x = x ^ (x >> 16)
    x = (x * E_M1) & m32  # (wraps in int64; the low 32 bits are exact)
    x = x ^ (x >> 13)
    x = x ^ (_srl(key_mix, 32))
    x = (x * E_M2) & m32
    return x ^ (x >> 16)
