"""A seeded permutation of [0, n) computed index by index, without materializing it.

Shuffling the pieces of a large corpus globally needs a permutation of hundreds of millions of
indices per epoch; materialized, that is gigabytes per process. A Feistel network is a bijection
on [0, 2^b) for any round function, and cycle walking (re-applying it to results >= n) restricts
it to [0, n). So any slice of an epoch's order is computed from its positions alone, vectorized,
and the same on every process.
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 6
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(x_N: np.ndarray) -> np.ndarray:
  """splitmix64's finalizer: a fast 64-bit mix whose every output bit depends on every input
  bit (uint64 arithmetic wraps, which is what the hash wants)."""
  x_N = (x_N ^ (x_N >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x_N = (x_N ^ (x_N >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x_N ^ (x_N >> np.uint64(31))


def hash_key(*parts: int) -> int:
  """One 64-bit key from integers (seed, epoch, component, ...), order-sensitive."""
  h = np.array([0x9E3779B97F4A7C15], dtype=np.uint64)
  for p in parts:
    h = _mix64(h ^ np.array([int(p) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
  return int(h[0])


def _feistel(x_N: np.ndarray, half_bits: int, round_keys: np.ndarray) -> np.ndarray:
  mask = np.uint64((1 << half_bits) - 1)
  shift = np.uint64(half_bits)
  left_N, right_N = x_N >> shift, x_N & mask
  for k in round_keys:
    left_N, right_N = right_N, left_N ^ (_mix64(right_N ^ k) & mask)
  return (left_N << shift) | right_N


def permute(index_N, n: int, key: int) -> np.ndarray:
  """int64 positions -> their images under the permutation of [0, n) named by `key`.

  A bijection of [0, n) for every key; different keys give unrelated orders. Vectorized: a
  block of 8192 indices costs about a millisecond.
  """
  index_N = np.asarray(index_N, dtype=np.int64)
  if n < 1:
    raise ValueError(f"permute: n={n}; the domain must be non-empty")
  if index_N.size and (index_N.min() < 0 or index_N.max() >= n):
    raise ValueError(f"permute: indices outside [0, {n})")
  if n == 1:
    return np.zeros_like(index_N)
  bits = max(int(n - 1).bit_length(), 2)
  bits += bits % 2  # a balanced network: two halves of equal width
  # Round keys from the key, each round different.
  round_keys = _mix64(np.uint64(key) ^ (np.arange(1, _ROUNDS + 1, dtype=np.uint64)
                                        * np.uint64(0x9E3779B97F4A7C15)))
  y_N = _feistel(index_N.astype(np.uint64), bits // 2, round_keys)
  # The domain is at most 4n, so walking leaves any index with probability <= 3/4 per step.
  outside = y_N >= np.uint64(n)
  while outside.any():
    y_N[outside] = _feistel(y_N[outside], bits // 2, round_keys)
    outside = y_N >= np.uint64(n)
  return y_N.astype(np.int64)
