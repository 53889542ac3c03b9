"""Pre-tokenized corpora written by `python -m jaxtrain.data.prepare`: flat token arrays.

A prepared directory holds `manifest.json` (version 2) and, per shard, two files:
  `shard-00003-of-00012.bin`      every document's token ids back to back, little-endian, in the
                                  manifest's `token_dtype` ("<u2" or "<u4"), no header;
  `shard-00003-of-00012.idx.npy`  int64 [num_docs + 1] document start offsets in tokens (0 first,
                                  the shard's token count last).

The `.bin` files are memory-mapped, so reading a piece of a document copies only that piece: the
pipeline reads one ~T-token piece at a time, and the ArrayRecord format this replaces (version 1)
decoded the whole document for every piece.
"""

from __future__ import annotations

import array
import collections
import io
import json
import os
import shlex
from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxtrain import storage
from jaxtrain.data.sources import remote_tokens
from jaxtrain.data.sources.common import DataError, Source

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 2
# The token dtypes a prepared corpus may hold, narrowest first: uint16 halves the disk and page
# cache of every tokenizer up to 65536 ids, which covers most pre-Llama-3 vocabularies.
TOKEN_DTYPES = ("<u2", "<u4")
BIN_SUFFIX = ".bin"
IDX_SUFFIX = ".idx.npy"
# Shards whose `.bin` stays mapped per corpus and process. Each map holds a file descriptor (mmap
# duplicates it), so a corpus of many thousands of shards must not keep them all; up to this
# many, every shard is mapped once and stays mapped.
MAX_OPEN_SHARDS = 256
# Buffered-write size of `write_token_shard`: many small documents become few large writes.
_WRITE_BUFFER_BYTES = 1 << 20
_PREPARE = "python -m jaxtrain.data.prepare"


def token_dtype(vocab_size: int) -> str:
  """The narrowest of `TOKEN_DTYPES` that holds every id of a vocab of `vocab_size` ids."""
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or (
      vocab_size < 1):
    raise DataError(f"vocab_size={vocab_size!r}: must be a positive integer to choose a token "
                    f"dtype")
  # Tokens are read back as int32, so ids past its max would wrap even where uint32 holds them.
  if vocab_size - 1 > np.iinfo(np.int32).max:
    raise DataError(f"vocab_size={vocab_size}: ids above {np.iinfo(np.int32).max} do not fit the "
                    f"int32 tokens training reads; use a tokenizer with a smaller vocab")
  return next(d for d in TOKEN_DTYPES if vocab_size - 1 <= np.iinfo(d).max)


def _as_tokens(ids, dtype: np.dtype, doc: int, prefix: str) -> np.ndarray:
  """`ids` as a contiguous `dtype` array; DataError when they are not integers that fit."""
  ids = np.asarray(ids)
  if ids.ndim != 1:
    raise DataError(f"{prefix}: document {doc} has shape {ids.shape}; a document must be a 1-D "
                    f"sequence of token ids")
  if ids.size == 0:
    return np.zeros(0, dtype)
  if ids.dtype.kind not in "iu":
    raise DataError(f"{prefix}: document {doc} has token ids of dtype {ids.dtype}; token ids "
                    f"must be integers")
  # astype wraps out-of-range ids silently, and a wrapped id is silent corruption; a dtype that
  # casts safely (uint8 -> uint16) needs no look at the values.
  if not np.can_cast(ids.dtype, dtype, "safe"):
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi > np.iinfo(dtype).max:
      raise DataError(f"{prefix}: document {doc} has token ids in [{lo}, {hi}], outside "
                      f"[0, {np.iinfo(dtype).max}] of {dtype.name} ({dtype.str}); prepare with "
                      f"token_dtype(vocab_size) of the tokenizer that made them")
  return np.ascontiguousarray(ids, dtype=dtype)


def write_token_shard(prefix: str, docs_iter: Iterable[Any], dtype: str) -> tuple[int, int]:
  """Streams documents of token ids into `prefix.bin` and `prefix.idx.npy`; (num_docs, num_tokens).

  Documents are written as they come, so a shard never has to fit in memory; only the offsets
  (8 bytes per document) are kept. Both files are written under `.tmp-<pid>` names and renamed
  at the end, the index last: a crash leaves no index, and `PreparedCorpus` refuses a `.bin`
  whose size does not match its index, so a half-written shard never reads as complete.

  Args:
    prefix: path of the shard without suffix, e.g. `DIR/shard-00003-of-00012`.
    docs_iter: documents, each a 1-D sequence of integer ids in [0, max of `dtype`]; empty
      documents are kept (length 0).
    dtype: one of `TOKEN_DTYPES`, usually `token_dtype(tokenizer.vocab_size)`.

  Raises:
    DataError: a document that is not 1-D, not integers, or has ids that do not fit `dtype`.
  """
  if dtype not in TOKEN_DTYPES:
    raise ValueError(f"dtype={dtype!r}: choose one of {', '.join(TOKEN_DTYPES)} (see "
                     f"token_dtype(vocab_size))")
  np_dtype = np.dtype(dtype)
  prefix = os.fspath(prefix)
  suffix = f".tmp-{os.getpid()}"
  bin_path, idx_path = prefix + BIN_SUFFIX, prefix + IDX_SUFFIX
  bin_tmp, idx_tmp = bin_path + suffix, idx_path + suffix
  # array('q') stores the lengths at 8 bytes each; a list of ints would take ~4x that.
  lengths = array.array("q")
  try:
    with open(bin_tmp, "wb", buffering=_WRITE_BUFFER_BYTES) as f:
      for doc, ids in enumerate(docs_iter):
        tokens = _as_tokens(ids, np_dtype, doc, prefix)
        f.write(tokens.data)
        lengths.append(len(tokens))
      f.flush()
      os.fsync(f.fileno())
    starts_D1 = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.frombuffer(lengths, dtype=np.int64), out=starts_D1[1:])
    with open(idx_tmp, "wb") as f:  # a file object: np.save would append .npy to a name
      np.save(f, starts_D1)
      f.flush()
      os.fsync(f.fileno())
    os.replace(bin_tmp, bin_path)
    os.replace(idx_tmp, idx_path)
  except BaseException:
    for tmp in (bin_tmp, idx_tmp):
      try:
        os.remove(tmp)
      except FileNotFoundError:
        pass
    raise
  return len(lengths), int(starts_D1[-1])


# --- the manifest -------------------------------------------------------------------------------


def _reprepare_command(manifest: dict[str, Any]) -> str:
  """The prepare command line that rebuilds a corpus like the one `manifest` describes."""
  def arg(key: str) -> str:
    value = manifest.get(key)
    if isinstance(value, str) and value:
      return shlex.quote(value)
    if key == "input" and isinstance(value, list) and value:
      return " ".join(shlex.quote(str(v)) for v in value)
    return "..."
  words = [_PREPARE, "--input", arg("input"), "--format", arg("format")]
  if manifest.get("format") != "text" and isinstance(manifest.get("field"), str):
    words += ["--field", arg("field")]
  words += ["--tokenizer", arg("tokenizer")]
  if manifest.get("add_bos") is True:
    words.append("--add_bos")
  if manifest.get("add_eos") is False:
    words.append("--no_add_eos")
  return " ".join(words + ["--output", "NEW_DIR"])


def load_manifest(path, where: str = "") -> tuple[str, dict[str, Any]]:
  """(directory, manifest) of the prepared corpus at `path` (its directory or manifest.json).

  Checks the manifest and that every shard it lists has both files; `PreparedCorpus` checks the
  files' contents. `where` (e.g. "data.train_paths: ") starts every error message.

  Raises:
    DataError: one line naming the path, the problem and the fix.
  """
  if storage.is_url(os.fspath(path)):
    return _load_remote_manifest(os.fspath(path).rstrip("/"), where)
  given = os.path.expanduser(os.fspath(path))
  path = os.path.abspath(given)
  if not os.path.exists(path):
    if any(c in given for c in "*?["):
      raise DataError(f"{where}{given!r} is a glob; name the prepared directory itself (the one "
                      f"holding {MANIFEST_NAME}), e.g. {os.path.dirname(path)}")
    raise DataError(f"{where}{path} does not exist; name a directory written by {_PREPARE} "
                    f"... --output DIR (or its {MANIFEST_NAME})")
  if os.path.isdir(path):
    directory, manifest_path = path, os.path.join(path, MANIFEST_NAME)
  elif os.path.basename(path) == MANIFEST_NAME:
    directory, manifest_path = os.path.dirname(path), path
  else:
    raise DataError(f"{where}{path} is a file, not a prepared corpus; name the directory that "
                    f"holds {MANIFEST_NAME} (written by {_PREPARE} ... --output DIR)")
  if not os.path.isfile(manifest_path):
    raise DataError(f"{where}{directory} has no {MANIFEST_NAME}: not a prepared corpus, or its "
                    f"prepare run did not finish; run {_PREPARE} ... --output {directory}")
  try:
    with open(manifest_path, encoding="utf-8") as f:
      manifest = json.load(f)
  except (OSError, ValueError) as e:
    reason = " ".join(f"{type(e).__name__}: {e}".split())
    raise DataError(f"{where}{manifest_path}: cannot read it as JSON ({reason}); rerun prepare "
                    f"with --overwrite") from None
  return directory, _check_manifest(manifest, directory, manifest_path, where)


def _load_remote_manifest(url: str, where: str) -> tuple[str, dict[str, Any]]:
  """load_manifest of a prepared directory on object storage (s3://, gs://)."""
  try:
    storage.check_url(url)
    storage.check_bucket(url)
  except storage.StorageError as e:
    raise DataError(f"{where}{e}") from None
  if url.endswith("/" + MANIFEST_NAME):
    directory, manifest_path = url[:-len(MANIFEST_NAME) - 1], url
  else:
    directory, manifest_path = url, storage.join(url, MANIFEST_NAME)
  if not storage.isfile(manifest_path):
    raise DataError(f"{where}{directory} has no {MANIFEST_NAME}: not a prepared corpus, or its "
                    f"upload did not finish; copy the whole directory written by {_PREPARE} "
                    f"(its {MANIFEST_NAME} last)")
  try:
    manifest = json.loads(storage.read_bytes(manifest_path))
  except ValueError as e:
    raise DataError(f"{where}{manifest_path}: cannot read it as JSON ({e}); copy it again or "
                    f"rerun prepare") from None
  return directory, _check_manifest(manifest, directory, manifest_path, where)


def _check_manifest(manifest, directory: str, manifest_path: str, where: str) -> dict[str, Any]:
  """The manifest, checked: its version, dtype and shard list, and that every shard it lists
  has both files in `directory` (a local path or a URL)."""
  version = manifest.get("version") if isinstance(manifest, dict) else None
  if version == 1:
    raise DataError(f"{where}{manifest_path}: version 1 manifest: these shards are the old "
                    f"ArrayRecord format, read whole document by document, which is no longer "
                    f"read; re-prepare them into flat token arrays: "
                    f"{_reprepare_command(manifest)}")
  if version != MANIFEST_VERSION:
    raise DataError(f"{where}{manifest_path}: manifest version {version!r}, but this jaxtrain "
                    f"reads version {MANIFEST_VERSION}; re-prepare the corpus with "
                    f"{_reprepare_command(manifest if isinstance(manifest, dict) else {})}")
  shards = manifest.get("shards")
  dtype = manifest.get("token_dtype")
  bad = None
  if dtype not in TOKEN_DTYPES:
    bad = f"token_dtype {dtype!r} is not one of {', '.join(TOKEN_DTYPES)}"
  elif not isinstance(shards, list) or not all(
      isinstance(s, dict) and isinstance(s.get("file"), str) and s["file"]
      and os.path.basename(s["file"]) == s["file"] for s in shards):
    bad = "'shards' is not a list of {\"file\": NAME, ...} entries naming files in its directory"
  if bad:
    raise DataError(f"{where}{manifest_path}: {bad}; the manifest was edited or written by "
                    f"another tool: rerun prepare with --overwrite")
  for shard in shards:
    for suffix in (BIN_SUFFIX, IDX_SUFFIX):
      if not storage.isfile(storage.join(directory, shard["file"] + suffix)):
        raise DataError(f"{where}{manifest_path} lists {shard['file']}, but "
                        f"{shard['file']}{suffix} is missing from {directory}; copy the whole "
                        f"directory, or rerun prepare with --overwrite")
  return manifest


# --- reading ------------------------------------------------------------------------------------


def _load_idx(path: str, where: str) -> np.ndarray:
  """A shard's document start offsets, checked: int64 [D + 1], 0 first, non-decreasing."""
  try:
    starts = np.load(io.BytesIO(storage.read_bytes(path)) if storage.is_url(path) else path,
                     allow_pickle=False)
  except (OSError, ValueError) as e:
    reason = " ".join(f"{type(e).__name__}: {e}".split())
    raise DataError(f"{where}{path}: cannot read it as a .npy array ({reason}); rerun prepare "
                    f"with --overwrite") from None
  if starts.dtype != np.int64 or starts.ndim != 1 or starts.size == 0:
    problem = f"an array of dtype {starts.dtype} and shape {starts.shape}"
  elif starts[0] != 0:
    problem = f"offsets starting at {starts[0]}, not 0"
  elif np.any(starts[1:] < starts[:-1]):
    problem = f"decreasing offsets (first at entry {int(np.argmax(starts[1:] < starts[:-1])) + 1})"
  else:
    return starts
  raise DataError(f"{where}{path}: {problem}, but a shard index is int64 [documents + 1] "
                  f"non-decreasing token offsets from 0; it was written by another tool or "
                  f"damaged: rerun prepare with --overwrite")


class PreparedCorpus(Source):
  """The documents of a prepared directory, read by slice from memory-mapped `.bin` shards.

  Provides the pipeline's document-source protocol: `len()`, `doc_lengths()`, `num_tokens()`,
  `read(doc, start, stop)` (int32) and `describe()`. Tokens are returned as stored: BOS / EOS, if
  prepare added them, are part of each document.

  Pickles into grain's worker processes as paths plus the small index arrays: the maps open
  lazily in the process that reads, and the per-document lookup arrays are rebuilt there.
  """

  kind = "prepared"

  def __init__(self, path, *, what: str = "train_paths"):
    """Args:
      path: a prepared directory or its manifest.json (str or os.PathLike; `~` is expanded).
      what: the config key under `data.` that holds `path`, for error messages.

    Raises:
      DataError: not a complete, readable version-2 prepared corpus, or one with no documents.
    """
    where = f"data.{what}: "
    self.directory, self.manifest = load_manifest(path, where)
    self.vocab_size = int(self.manifest.get("vocab_size", 0))
    self.dtype = np.dtype(self.manifest["token_dtype"])
    self.remote = storage.is_url(self.directory)
    prefixes = [storage.join(self.directory, s["file"]) for s in self.manifest["shards"]]
    self.paths = [p + BIN_SUFFIX for p in prefixes]
    self._starts_S = []  # per shard: int64 [D_s + 1] document start offsets
    for shard, prefix in zip(self.manifest["shards"], prefixes):
      starts = _load_idx(prefix + IDX_SUFFIX, where)
      num_docs, num_tokens = len(starts) - 1, int(starts[-1])
      size = storage.size(prefix + BIN_SUFFIX)
      if size != num_tokens * self.dtype.itemsize:
        raise DataError(
            f"{where}{prefix}{BIN_SUFFIX}: {size:,} bytes, but its index ends at {num_tokens:,} "
            f"tokens of {self.dtype.str} = {num_tokens * self.dtype.itemsize:,} bytes: truncated "
            f"(an unfinished copy?) or written by another tool; copy it again or rerun prepare "
            f"with --overwrite")
      if (shard.get("documents"), shard.get("tokens")) != (num_docs, num_tokens):
        raise DataError(
            f"{where}{prefix}{IDX_SUFFIX}: {num_docs} documents and {num_tokens} tokens, but "
            f"{MANIFEST_NAME} lists {shard.get('documents')} and {shard.get('tokens')}: the "
            f"directory mixes files of different prepare runs; rerun prepare with --overwrite")
      self._starts_S.append(starts)
    self._num_docs = sum(len(s) - 1 for s in self._starts_S)
    self._num_tokens = sum(int(s[-1]) for s in self._starts_S)
    if self._num_docs == 0:
      raise DataError(f"{where}{self.directory}: empty corpus: its {len(self.paths)} shards hold "
                      f"no documents; re-prepare it from input that has some")
    self._reset()

  def _reset(self):
    # Built on first use in each process: (shard_N, offset_N, lengths_N).
    self._lookup = None
    self._maps = [None] * len(self.paths)  # per shard: its mapped tokens, or None
    self._mapped = collections.deque()  # shards with a map, oldest first
    # A corpus on object storage: its shards' blocks, fetched by ranged reads (remote_tokens).
    self._blocks = remote_tokens.BlockCache() if self.remote else None

  def __getstate__(self):
    state = self.__dict__.copy()
    for key in ("_lookup", "_maps", "_mapped", "_blocks"):
      del state[key]
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._reset()

  def _build_lookup(self):
    """Per document: its shard, its start in that shard's `.bin`, its length (tokens)."""
    counts_S = [len(s) - 1 for s in self._starts_S]
    shard_dtype = np.int16 if len(counts_S) <= np.iinfo(np.int16).max else np.int32
    shard_N = np.repeat(np.arange(len(counts_S), dtype=shard_dtype), counts_S)
    offset_N = np.concatenate([s[:-1] for s in self._starts_S])
    lengths_N = np.concatenate([np.diff(s) for s in self._starts_S])
    lengths_N.flags.writeable = False  # handed out by doc_lengths()
    self._lookup = (shard_N, offset_N, lengths_N)  # one assignment: safe for reader threads
    return self._lookup

  def _open_shard(self, shard: int) -> np.ndarray:
    if self._num_shard_tokens(shard) == 0:
      tokens = np.zeros(0, self.dtype)  # mmap refuses an empty file
    elif self.remote:
      tokens = remote_tokens.RemoteTokens(self.paths[shard], self.dtype,
                                          self._num_shard_tokens(shard), self._blocks)
    else:
      # A plain ndarray view: slicing an np.memmap runs its Python __array_finalize__ per slice.
      tokens = np.memmap(self.paths[shard], dtype=self.dtype, mode="r").view(np.ndarray)
    mapped = self._mapped
    mapped.append(shard)
    while len(mapped) > MAX_OPEN_SHARDS:
      # Slices already taken keep their map alive; only this source's reference goes.
      self._maps[mapped.popleft()] = None
    self._maps[shard] = tokens
    return tokens

  def _num_shard_tokens(self, shard: int) -> int:
    return int(self._starts_S[shard][-1])

  def read(self, doc, start: int = 0, stop: int | None = None) -> np.ndarray:
    """int32 tokens [start, stop) of document `doc` (0 <= start <= stop <= its length; None: to
    its end). Called once per training piece, so it is a few array lookups and one slice copy."""
    lookup = self._lookup or self._build_lookup()
    shard = lookup[0][doc]
    offset = lookup[1][doc]
    length = lookup[2][doc]
    if stop is None:
      stop = length
    # One comparison chain (~0.1 us): a slice past the end would return the next document's
    # tokens without any error.
    if not 0 <= start <= stop <= length:
      raise IndexError(f"read({doc}, {start}, {stop}): document {doc} has {length} tokens; "
                       f"need 0 <= start <= stop <= {length}")
    tokens = self._maps[shard]
    if tokens is None:
      tokens = self._open_shard(int(shard))
    return tokens[offset + start:offset + stop].astype(np.int32)

  def read_pieces(self, pieces_Q3) -> np.ndarray:
    """The tokens of many pieces (doc, start, stop) concatenated, int32 (the global stream reads
    a batch's pieces this way)."""
    shard_N, offset_N, lengths_N = self._lookup or self._build_lookup()
    doc_Q, start_Q, stop_Q = np.asarray(pieces_Q3, np.int64).reshape(-1, 3).T
    if len(doc_Q) and ((start_Q < 0) | (start_Q > stop_Q) | (stop_Q > lengths_N[doc_Q])).any():
      bad = int(np.flatnonzero((start_Q < 0) | (start_Q > stop_Q)
                               | (stop_Q > lengths_N[doc_Q]))[0])
      raise IndexError(f"read_pieces: piece ({doc_Q[bad]}, {start_Q[bad]}, {stop_Q[bad]}) is "
                       f"outside its document of {lengths_N[doc_Q[bad]]} tokens")
    # One slice copy per piece: a batch's pieces come from about as many shards as there are
    # pieces, so per-shard gathers would loop as often and do more work per turn.
    sizes_Q = stop_Q - start_Q
    out = np.empty(int(sizes_Q.sum()), np.int32)
    maps = self._maps
    if self.remote:  # the batch's blocks first: one concurrent fetch over every shard it touches
      self._prefetch(shard_N[doc_Q], offset_N[doc_Q] + start_Q, sizes_Q)
    at = 0
    for shard, first, size in zip(shard_N[doc_Q].tolist(), (offset_N[doc_Q] + start_Q).tolist(),
                                  sizes_Q.tolist()):
      tokens = maps[shard]
      if tokens is None:
        tokens = self._open_shard(shard)
      out[at:at + size] = tokens[first:first + size]
      at += size
    return out

  @property
  def read_ahead_pieces(self) -> int:
    """How many pieces the stream may fetch ahead of the reader (see remote_tokens)."""
    return remote_tokens.read_ahead_pieces()

  def warm(self, pieces_Q3) -> None:
    """Fetches the tokens of pieces (doc, start, stop) that `read_pieces` will read soon, for a
    corpus on object storage (the stream's read-ahead thread calls it); nothing for local
    files, which the page cache serves."""
    if not self.remote or len(pieces_Q3) == 0:
      return
    shard_N, offset_N, _ = self._lookup or self._build_lookup()
    doc_Q, start_Q, stop_Q = np.asarray(pieces_Q3, np.int64).reshape(-1, 3).T
    self._prefetch(shard_N[doc_Q], offset_N[doc_Q] + start_Q, stop_Q - start_Q)

  def _prefetch(self, shard_Q, first_Q, sizes_Q):
    spans = []
    for shard, first, size in zip(shard_Q.tolist(), first_Q.tolist(), sizes_Q.tolist()):
      tokens = self._maps[shard]
      if tokens is None:
        tokens = self._open_shard(shard)
      if isinstance(tokens, remote_tokens.RemoteTokens):
        spans.append((tokens, first, first + size))
    remote_tokens.fetch(spans)

  def __getitem__(self, i) -> np.ndarray:
    return self.read(i)

  def __len__(self) -> int:
    return self._num_docs

  def doc_lengths(self) -> np.ndarray:
    """int64 [N] token counts of the documents, in shard order (from the index files)."""
    lookup = self._lookup or self._build_lookup()
    return lookup[2]

  def num_tokens(self) -> int:
    return self._num_tokens

  def describe(self) -> str:
    shards = "shard" if len(self.paths) == 1 else "shards"
    return (f"{self.kind}: {len(self.paths)} {shards}, {self._num_docs:,} documents, "
            f"{self._num_tokens:,} tokens (tokenizer {self.manifest.get('tokenizer')})")
