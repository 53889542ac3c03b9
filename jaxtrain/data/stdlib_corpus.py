"""Zero-download demo corpus: the Python standard library's own `.py` files, as byte tokens.

Every machine that runs the trainer has this corpus, so examples and tests need no download. A
document is one file: its bytes are token ids 0..255, followed by `EOS_ID`. There is no BOS.

A source holds all of its documents' bytes in one uint8 buffer (~30 MB for the whole stdlib),
so it pickles quickly into grain's worker processes and slices cheaply: packing reads pieces of
at most `seq_len + 1` tokens, and copying a whole file for each piece would be quadratic.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterable, Sequence

import numpy as np

from jaxtrain.data import packing

EOS_ID = 256
# The smallest model vocab that covers the corpus: 256 byte values plus EOS.
BYTE_VOCAB_SIZE = 257

# Directories never read: third-party packages and bytecode caches.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def list_stdlib_files(root: str | None = None) -> list[str]:
  """Relative paths ('/'-separated) of all `.py` files under the stdlib, sorted.

  Sorted so the document order does not depend on the file system's directory order.
  """
  root = root or stdlib_root()
  rel_paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
    for name in filenames:
      if name.endswith(".py"):
        rel = os.path.relpath(os.path.join(dirpath, name), root)
        rel_paths.append(rel.replace(os.sep, "/"))
  return sorted(rel_paths)


def is_eval_path(rel_path: str, eval_fraction: float) -> bool:
  """True when a file belongs to the eval split.

  md5 of the relative path (not Python's `hash`, which is salted per process) mapped to [0, 1):
  the split is the same on every machine and run, and adding or removing a file moves no other
  file between splits.
  """
  digest = hashlib.md5(rel_path.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") / 2.0**64 < eval_fraction


def split_paths(rel_paths: Iterable[str], eval_fraction: float) -> tuple[list[str], list[str]]:
  """(train, eval) paths, each in the order given."""
  train, evals = [], []
  for p in rel_paths:
    (evals if is_eval_path(p, eval_fraction) else train).append(p)
  return train, evals


class ByteDocumentSource:
  """Random access to byte-tokenized documents, each ending with `EOS_ID`.

  The interface the pipeline packs from (any future source, e.g. a tokenized corpus, provides
  the same three members):
    `__len__()`         number of documents,
    `doc_lengths()`     int64[N] token counts including EOS,
    `read(i, start, stop)`  int32 tokens [start, stop) of document i.
  """

  def __init__(self, names: Sequence[str], contents: Sequence[bytes]):
    if len(names) != len(contents):
      raise ValueError(f"{len(names)} names but {len(contents)} documents")
    self.names = list(names)
    sizes = np.array([len(c) for c in contents], dtype=np.int64)
    # offsets_N1[i]:offsets_N1[i+1] are document i's bytes in the buffer.
    self._offsets_N1 = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    self._bytes = np.frombuffer(b"".join(contents), dtype=np.uint8)

  @classmethod
  def from_files(cls, root: str, rel_paths: Sequence[str]) -> "ByteDocumentSource":
    contents = []
    for rel in rel_paths:
      with open(os.path.join(root, rel), "rb") as f:
        contents.append(f.read())
    return cls(rel_paths, contents)

  def __len__(self) -> int:
    return len(self.names)

  def doc_lengths(self) -> np.ndarray:
    return np.diff(self._offsets_N1) + 1  # +1: EOS

  def num_tokens(self) -> int:
    return int(self.doc_lengths().sum())

  def read(self, i: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Tokens [start, stop) of document i (stop=None: to the end, EOS included), int32."""
    lo, hi = int(self._offsets_N1[i]), int(self._offsets_N1[i + 1])
    n = hi - lo + 1
    stop = n if stop is None else min(int(stop), n)
    start = int(start)
    if not 0 <= start <= stop:
      raise IndexError(f"bad slice [{start}, {stop}) of document {i} with {n} tokens")
    body = self._bytes[lo + start:lo + min(stop, n - 1)].astype(np.int32)
    if stop == n and start < n:
      body = np.append(body, np.int32(EOS_ID))
    return body

  def read_pieces(self, pieces_Q3: np.ndarray) -> np.ndarray:
    """The tokens of many pieces (doc, start, stop) concatenated, int32, in one gather."""
    doc_Q, start_Q, stop_Q = np.asarray(pieces_Q3, np.int64).T
    sizes_Q = stop_Q - start_Q
    position = packing.ranges(start_Q, stop_Q)  # within its document
    doc = np.repeat(doc_Q, sizes_Q)
    last = self._offsets_N1[doc + 1] - self._offsets_N1[doc]  # the EOS position
    body = self._bytes[np.minimum(self._offsets_N1[doc] + position, len(self._bytes) - 1)]
    return np.where(position == last, np.int32(EOS_ID), body.astype(np.int32))

  def __getitem__(self, i: int) -> np.ndarray:
    return self.read(i)


def load_stdlib_splits(eval_fraction: float,
                       root: str | None = None) -> tuple[ByteDocumentSource, ByteDocumentSource]:
  """(train, eval) sources over the stdlib's `.py` files, split by path hash."""
  root = root or stdlib_root()
  paths = list_stdlib_files(root)
  if not paths:
    raise FileNotFoundError(f"no .py files found under the Python stdlib at {root!r}")
  train_paths, eval_paths = split_paths(paths, eval_fraction)
  if not train_paths or not eval_paths:
    raise ValueError(f"data.eval_fraction={eval_fraction}: split of {len(paths)} stdlib files "
                     f"left train={len(train_paths)}, eval={len(eval_paths)} files; both must be "
                     f"non-empty")
  return (ByteDocumentSource.from_files(root, train_paths),
          ByteDocumentSource.from_files(root, eval_paths))


def unigram_entropy(docs: Iterable[np.ndarray], vocab_size: int = BYTE_VOCAB_SIZE) -> float:
  """Entropy in nats per token of the token-unigram distribution over `docs`.

  The cross-entropy a model reaches by predicting token frequencies alone: the loss a trainer
  must beat to show it learned anything from context.
  """
  counts_V = np.zeros(vocab_size, dtype=np.int64)
  for d in docs:
    counts = np.bincount(np.asarray(d), minlength=vocab_size)
    if len(counts) > vocab_size:
      raise ValueError(f"token id {len(counts) - 1} is outside the vocab of {vocab_size}")
    counts_V += counts
  p_V = counts_V[counts_V > 0] / counts_V.sum()
  return float(-(p_V * np.log(p_V)).sum())

