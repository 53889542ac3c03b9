"""Raw-text documents tokenized as they are read, and their cutting into training pieces.

For sources whose token counts are unknown until tokenized (text files, JSONL, Parquet). The
pipeline shuffles documents, tokenizes each in the map step (in grain's workers when
data.num_workers > 0) and cuts it into pieces with a flat map. Pre-tokenized shards
(`python -m jaxtrain.data.prepare`) instead know every length up front and are shuffled piece by
piece; prefer them for pre-training on large corpora.
"""

from __future__ import annotations

import grain
import numpy as np

from jaxtrain.data.sources import DataError


class TokenizedText:
  """`docs[i]` = int32 token ids of document `indices[i]` of a raw-text source."""

  def __init__(self, source, tokenizer, *, add_bos: bool, add_eos: bool,
               indices_N: np.ndarray | None = None):
    self.source, self.tokenizer = source, tokenizer
    self.add_bos, self.add_eos = add_bos, add_eos
    self.indices_N = (np.arange(len(source), dtype=np.int64) if indices_N is None
                      else np.asarray(indices_N, dtype=np.int64))

  def __len__(self) -> int:
    return len(self.indices_N)

  def __getitem__(self, i: int) -> np.ndarray:
    text = self.source[int(self.indices_N[i])]
    return self.tokenizer.encode_document(text, add_bos=self.add_bos, add_eos=self.add_eos)

  def subset(self, indices_N: np.ndarray) -> "TokenizedText":
    return TokenizedText(self.source, self.tokenizer, add_bos=self.add_bos, add_eos=self.add_eos,
                         indices_N=self.indices_N[np.asarray(indices_N, dtype=np.int64)])

  def describe(self) -> str:
    return f"{self.source.describe()}, tokenizer {self.tokenizer.name}, {len(self)} used"


class ReadDocument:
  """Document index -> token ids, checked against the model's vocabulary. A class so it pickles
  into grain's worker processes."""

  def __init__(self, docs: TokenizedText, vocab_size: int):
    self.docs, self.vocab_size = docs, vocab_size

  def __call__(self, i) -> np.ndarray:
    ids = self.docs[int(i)]
    if ids.size and (ids.max() >= self.vocab_size or ids.min() < 0):
      raise DataError(f"token id {int(ids.max())} from tokenizer {self.docs.tokenizer.name} is "
                      f"outside model.vocab_size={self.vocab_size}; use a model vocab of at "
                      f"least {self.docs.tokenizer.vocab_size} or the model's own tokenizer")
    return ids


class SplitIntoPieces(grain.experimental.FlatMapTransform):
  """Token ids -> pieces of at most seq_len (input, target) pairs.

  Consecutive pieces overlap by one token, so every token after a document's first is a target
  exactly once; a document longer than seq_len + 1 becomes several pieces (packed separately).
  """

  # grain's iterator-level flat map does not cap the fan-out; the attribute is for MapDataset.
  max_fan_out = 1 << 20

  def __init__(self, seq_len: int):
    self.seq_len = seq_len

  def flat_map(self, ids):
    pieces = []
    for start in range(0, max(len(ids) - 1, 0), self.seq_len):
      piece = ids[start:start + self.seq_len + 1]
      pieces.append({"inputs": piece[:-1], "targets": piece[1:]})
    return pieces
