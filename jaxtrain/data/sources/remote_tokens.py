"""A prepared shard's tokens on object storage, sliced like its memory map.

A `.bin` shard on s3:// or gs:// is read in fixed blocks (BLOCK_BYTES) by ranged reads and kept
in a bounded LRU cache shared by the corpus' shards (CACHE_BYTES per reading process). Before a
batch's pieces are copied, `fetch` gets every block they need that is not cached, neighbouring
blocks of a shard coalesced into one range, the ranges of all shards in one concurrent call: a
batch costs about one round trip, not one per piece or per shard. The global stream calls the
same for the pieces of the next batches on a background thread (jaxtrain/data/lookahead.py), so
the round trip is usually off the step.

Blocks rather than the pieces' exact bytes: a request costs far more than the bytes it carries
(S3 serves a few thousand requests per second per prefix; a 256-token piece is 512 bytes), and
blocks turn the documents a row packs side by side, and any reread, into cache hits. The price
is read amplification for a corpus much larger than the cache with short pieces (measured in
benchmarks/data_throughput.py). The global stream's order and its checkpointed
position do not depend on how the bytes arrive, so a corpus read from a bucket gives the batches
the same corpus gives from local disk.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from jaxtrain import storage

BLOCK_BYTES = 256 << 10
CACHE_BYTES = 256 << 20


def read_ahead_pieces() -> int:
  """Pieces the stream may fetch ahead of the reader: their blocks (about one each, as a piece
  is far shorter than a block) take at most half the cache, so none is dropped before it is
  read."""
  return max(1, CACHE_BYTES // (2 * BLOCK_BYTES))


class BlockCache:
  """(url, block index) -> bytes, least recently used dropped past `max_bytes`; thread-safe (the
  pipeline's reader threads share it)."""

  def __init__(self, max_bytes: int | None = None):
    self.max_bytes = CACHE_BYTES if max_bytes is None else max_bytes
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
               block_bytes: int | None = None):
    self.url, self.dtype, self.num_tokens, self.cache = url, np.dtype(dtype), num_tokens, cache
    # Whole tokens per block, so no token straddles two blocks.
    self.block_tokens = max(1, (block_bytes or BLOCK_BYTES) // self.dtype.itemsize)

  def _blocks_of(self, first: int, stop: int) -> range:
    if stop <= first:
      return range(0)
    return range(first // self.block_tokens, (stop - 1) // self.block_tokens + 1)

  def missing_blocks(self, spans) -> list[int]:
    """The blocks the token spans [(first, stop), ...] need that are not cached, sorted."""
    return sorted({b for first, stop in spans for b in self._blocks_of(first, stop)
                   if self.cache.get((self.url, b)) is None})

  def prefetch(self, spans) -> None:
    """Fetches the uncached blocks of the token spans [(first, stop), ...] of this shard."""
    fetch([(self, first, stop) for first, stop in spans])

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


def fetch(spans) -> int:
  """Fetches the uncached blocks of the spans (RemoteTokens, first, stop) of any shards: each
  shard's runs of neighbouring blocks as one range, every range in one concurrent call. Returns
  the number of ranged reads."""
  by_shard: dict[int, tuple[RemoteTokens, list]] = {}
  for tokens, first, stop in spans:
    by_shard.setdefault(id(tokens), (tokens, []))[1].append((first, stop))
  requests, runs = [], []  # (url, start byte, end byte); (shard, first block, last block)
  for tokens, shard_spans in by_shard.values():
    shard_runs = []
    for b in tokens.missing_blocks(shard_spans):
      if shard_runs and b == shard_runs[-1][1] + 1:
        shard_runs[-1][1] = b
      else:
        shard_runs.append([b, b])
    step = tokens.block_tokens * tokens.dtype.itemsize
    end_byte = tokens.num_tokens * tokens.dtype.itemsize
    for lo, hi in shard_runs:
      requests.append((tokens.url, lo * step, min((hi + 1) * step, end_byte)))
      runs.append((tokens, lo, hi))
  if not requests:
    return 0
  for (tokens, lo, hi), data in zip(runs, storage.read_ranges_many(requests)):
    step = tokens.block_tokens * tokens.dtype.itemsize
    for b in range(lo, hi + 1):
      tokens.cache.put((tokens.url, b), data[(b - lo) * step:(b - lo + 1) * step])
  return len(requests)
