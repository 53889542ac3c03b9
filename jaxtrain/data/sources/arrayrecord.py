"""Pre-tokenized documents in ArrayRecord shards (int32 little-endian records)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxtrain.data.sources.common import DataError, Source, check_nonempty, doc_index, resolve_paths

# Sidecar of a shard written by `write_array_record_shard`: the documents' token counts. ArrayRecord
# stores records compressed, so their lengths are otherwise known only by reading every record.
LENGTHS_SUFFIX = ".lengths.npy"



def _as_int32_tokens(ids) -> np.ndarray:
  ids = np.asarray(ids)
  if ids.ndim != 1:
    raise DataError(f"a document must be a 1-D sequence of token ids, got shape {ids.shape}")
  if ids.size == 0:
    return np.zeros(0, dtype="<i4")
  if ids.dtype.kind not in "iu":
    raise DataError(f"token ids must be integers, got dtype {ids.dtype}")
  info = np.iinfo(np.int32)
  # np.asarray(..., "<i4") wraps out-of-range ids silently; a wrapped id is silent corruption.
  if ids.dtype != np.int32 and (ids.min() < info.min or ids.max() > info.max):
    raise DataError(f"token ids in [{ids.min()}, {ids.max()}] do not fit in int32")
  return np.asarray(ids, dtype="<i4")


# Records are stored uncompressed by default: the pipeline reads a whole document for every
# piece it cuts from it, and zstd decoding made that 8x slower (stdlib shards: 76 vs 21 us per
# record, 1.1M vs ~8M tokens/s at seq_len 256) for about 8x less disk with byte-level tokens.
COMPRESSION_OPTIONS = {"none": "group_size:1,uncompressed", "zstd": "group_size:1"}


def write_array_record_shard(path: str, docs_iter: Iterable[Any], write_lengths: bool = True,
                             compression: str = "none") -> tuple[int, int]:
  """Writes documents (sequences of token ids) as one ArrayRecord shard; (num_docs, num_tokens).

  Each record is a document's ids as little-endian int32 bytes, with group size 1 (what grain's
  random access needs). With `write_lengths`, also writes `path + LENGTHS_SUFFIX` (int64 token
  counts) so `ArrayRecordTokenSource.doc_lengths()` need not read the shard. Both files are
  written under a temporary name and renamed, so a crash never leaves a truncated shard that
  reads as complete.
  """
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  tmp = f"{path}.tmp-{os.getpid()}"
  lengths = []
  if compression not in COMPRESSION_OPTIONS:
    raise ValueError(f"compression={compression!r}: choose one of {', '.join(COMPRESSION_OPTIONS)}")
  writer = array_record_module.ArrayRecordWriter(tmp, COMPRESSION_OPTIONS[compression])
  try:
    for ids in docs_iter:
      tokens = _as_int32_tokens(ids)
      writer.write(tokens.tobytes())
      lengths.append(len(tokens))
  except BaseException:
    writer.close()
    os.remove(tmp)
    raise
  writer.close()
  lengths_D = np.array(lengths, dtype=np.int64)
  if write_lengths:
    tmp_lengths = f"{tmp}{LENGTHS_SUFFIX}"
    with open(tmp_lengths, "wb") as f:
      np.save(f, lengths_D)
    os.replace(tmp_lengths, path + LENGTHS_SUFFIX)
  os.replace(tmp, path)
  return len(lengths_D), int(lengths_D.sum())


class ArrayRecordTokenSource(Source):
  """Pre-tokenized documents in ArrayRecord shards; `__getitem__` returns int32 token ids.

  Reads through `grain.sources.ArrayRecordDataSource` (lazy readers, picklable). Also provides
  the pipeline's source protocol: `doc_lengths()`, `read(doc, start, stop)`, `num_tokens()`.
  Tokens are returned as stored: an EOS, if wanted, is part of each record.

  `doc_lengths()` uses the `.lengths.npy` sidecars written by `write_array_record_shard`; a shard
  without a current sidecar costs one pass reading every record (then kept in memory). Files
  ending in `LENGTHS_SUFFIX` are dropped from the resolved paths, so a glob like `shards/*`
  names only the shards.
  """

  kind = "array_record"

  def __init__(self, pattern_or_paths, *, what: str = "paths"):
    import grain  # pylint: disable=g-import-not-at-top
    paths = [p for p in resolve_paths(pattern_or_paths, what) if not p.endswith(LENGTHS_SUFFIX)]
    if not paths:
      raise DataError(f"data.{what}: {pattern_or_paths!r} names only {LENGTHS_SUFFIX} sidecars; "
                      f"name the ArrayRecord shards")
    self.paths = paths
    try:
      self._records = grain.sources.ArrayRecordDataSource(paths)
    except Exception as e:  # the C++ reader raises plain RuntimeError/ValueError on bad files
      raise DataError(f"data.{what}: cannot open ArrayRecord shards {paths[0]}, ...: {e}") from None
    self._doc_lengths_D = None
    self._last = None  # (doc, tokens): `read` is called once per piece of a document
    check_nonempty(self.kind, self.paths, len(self), what)

  def __len__(self) -> int:
    return len(self._records)

  def __getstate__(self):
    state = self.__dict__.copy()
    state["_last"] = None
    return state

  def _shard_of(self, d: int) -> str:
    # Only for error messages: opens every shard's footer.
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    for path in self.paths:
      reader = array_record_module.ArrayRecordReader(path)
      n = reader.num_records()
      reader.close()
      if d < n:
        return f"{path} record {d}"
      d -= n
    return "?"

  def __getitem__(self, i) -> np.ndarray:
    d = doc_index(i, len(self))
    raw = self._records[d]
    if len(raw) % 4:
      raise DataError(f"{self._shard_of(d)}: {len(raw)} bytes is not a whole number of int32 "
                      f"tokens; write shards with write_array_record_shard")
    # A copy: frombuffer over bytes is read-only, and callers may edit tokens in place.
    return np.frombuffer(raw, dtype="<i4").astype(np.int32)

  def read(self, i, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Tokens [start, stop) of document i, int32; the last document read is kept, since the
    pipeline reads a long document one piece at a time."""
    d = doc_index(i, len(self))
    last = self._last
    if last is None or last[0] != d:
      last = self._last = (d, self[d])
    return last[1][start:stop].copy()

  def doc_lengths(self) -> np.ndarray:
    """int64[N] token counts, from sidecars where current, else by reading the shard."""
    if self._doc_lengths_D is None:
      from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
      parts = []
      for path in self.paths:
        reader = array_record_module.ArrayRecordReader(path)
        n = reader.num_records()
        sidecar = path + LENGTHS_SUFFIX
        lengths = None
        if os.path.isfile(sidecar) and os.path.getmtime(sidecar) >= os.path.getmtime(path):
          lengths = np.load(sidecar)
          if lengths.shape != (n,):
            lengths = None  # stale: written for another version of the shard
        if lengths is None:
          lengths = np.empty(n, dtype=np.int64)
          for lo in range(0, n, 4096):
            hi = min(lo + 4096, n)
            lengths[lo:hi] = [len(r) // 4 for r in reader.read(lo, hi)]
        reader.close()
        parts.append(lengths.astype(np.int64))
      self._doc_lengths_D = np.concatenate(parts)
    return self._doc_lengths_D

  def num_tokens(self) -> int:
    return int(self.doc_lengths().sum())
