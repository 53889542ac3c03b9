"""A prepared shard's tokens on object storage, sliced like its memory map.

A `.bin` shard on s3:// or gs:// is read in fixed blocks (BLOCK_BYTES) by ranged reads and kept
in a bounded LRU cache shared by the corpus' shards (CACHE_BYTES per reading process). Before a
batch's pieces are copied, `prefetch` fetches every block they need that is not cached, neighbours
coalesced into one range, all ranges of a shard concurrently: a batch costs one round trip per
shard it touches rather than one per piece. The global stream's order and its checkpointed
position do not depend on how the bytes arrive, so a corpus read from a bucket gives the batches
the same corpus gives from local disk.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from jaxtrain import storage

BLOCK_BYTES = 4 << 20
CACHE_BYTES = 256 << 20


class BlockCache:
  """(url, block index) -> bytes, least recently used dropped past `max_bytes`; thread-safe (the
  pipeline's reader threads share it)."""

  def __init__(self, max_bytes: int = CACHE_BYTES):
    self.max_bytes = max_bytes
    self._blocks = collections.OrderedDict()
    self._bytes = 0
    self._lock = threading.Lock()

  def get(self, key):
    with self._lock:
      block = self._blocks.get(key)
      if block is not None:
        self._blocks.move_to_end(key)
      return block

  def put(self, key, block: bytes):
    with self._lock:
      if key in self._blocks:
        return
      self._blocks[key] = block
      self._bytes += len(block)
      while self._bytes > self.max_bytes and len(self._blocks) > 1:
        _, dropped = self._blocks.popitem(last=False)
        self._bytes -= len(dropped)


class RemoteTokens:
  """The tokens of one `.bin` object: `tokens[a:b]` gives the ndarray a memory map would."""

  def __init__(self, url: str, dtype: np.dtype, num_tokens: int, cache: BlockCache,
               block_bytes: int = BLOCK_BYTES):
    self.url, self.dtype, self.num_tokens, self.cache = url, np.dtype(dtype), num_tokens, cache
    # Whole tokens per block, so no token straddles two blocks.
    self.block_tokens = max(1, block_bytes // self.dtype.itemsize)

  def _blocks_of(self, first: int, stop: int) -> range:
    if stop <= first:
      return range(0)
    return range(first // self.block_tokens, (stop - 1) // self.block_tokens + 1)

  def prefetch(self, spans) -> None:
    """Fetches the uncached blocks of the token spans [(first, stop), ...] of this shard: runs
    of neighbouring blocks as one range each, all ranges at once."""
    needed = sorted({b for first, stop in spans for b in self._blocks_of(first, stop)
                     if self.cache.get((self.url, b)) is None})
    if not needed:
      return
    runs = []  # [first block, last block] of each run of neighbours
    for b in needed:
      if runs and b == runs[-1][1] + 1:
        runs[-1][1] = b
      else:
        runs.append([b, b])
    item, per_block = self.dtype.itemsize, self.block_tokens
    end_byte = self.num_tokens * item
    ranges = [(lo * per_block * item, min((hi + 1) * per_block * item, end_byte))
              for lo, hi in runs]
    for (lo, hi), data in zip(runs, storage.read_ranges(self.url, ranges)):
      step = per_block * item
      for b in range(lo, hi + 1):
        self.cache.put((self.url, b), data[(b - lo) * step:(b - lo + 1) * step])

  def __getitem__(self, s: slice) -> np.ndarray:
    first, stop, _ = s.indices(self.num_tokens)
    if stop <= first:
      return np.zeros(0, self.dtype)
    self.prefetch([(first, stop)])
    parts = []
    for b in self._blocks_of(first, stop):
      block = self.cache.get((self.url, b))
      if block is None:  # dropped by another reader between the fetch and here
        self.prefetch([(first, stop)])
        block = self.cache.get((self.url, b))
      tokens = np.frombuffer(block, self.dtype)
      base = b * self.block_tokens
      parts.append(tokens[max(first - base, 0):min(stop - base, len(tokens))])
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
