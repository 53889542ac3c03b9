"""Raw records tokenized as they are read, and their cutting into training pieces.

For sources whose token counts are unknown until tokenized (text files, JSONL, Parquet). The
pipeline shuffles documents, tokenizes each in the map step (in grain's workers when
data.num_workers > 0) and cuts it into pieces with a flat map. Pre-tokenized shards
(`python -m jaxtrain.data.prepare`) instead know every length up front and are shuffled piece by
piece; prefer them for pre-training on large corpora.
"""

from __future__ import annotations

import grain
import numpy as np

from jaxtrain.data import formats
from jaxtrain.data.sources import DataError
from jaxtrain.data.sources.common import record_location


class TokenizedText:
  """`docs[i]` = features {"inputs", "targets", "weights"} of record `indices[i]` of a raw
  source, by `formats.record_features` (`kind` "text", "prompt_completion" or "chat")."""

  def __init__(self, source, tokenizer, *, kind: str = "text", add_bos: bool | None = None,
               add_eos: bool | None = None, indices_N: np.ndarray | None = None):
    self.source, self.tokenizer, self.kind = source, tokenizer, kind
    self.add_bos, self.add_eos = add_bos, add_eos
    self.indices_N = (np.arange(len(source), dtype=np.int64) if indices_N is None
                      else np.asarray(indices_N, dtype=np.int64))

  def __len__(self) -> int:
    return len(self.indices_N)

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    index = int(self.indices_N[i])
    return formats.record_features(self.tokenizer, self.source[index], self.kind,
                                   add_bos=self.add_bos, add_eos=self.add_eos,
                                   where=record_location(self.source, index))

  def subset(self, indices_N: np.ndarray) -> "TokenizedText":
    return TokenizedText(self.source, self.tokenizer, kind=self.kind, add_bos=self.add_bos,
                         add_eos=self.add_eos,
                         indices_N=self.indices_N[np.asarray(indices_N, dtype=np.int64)])

  def describe(self) -> str:
    return f"{self.source.describe()}, tokenizer {self.tokenizer.name}, {len(self)} used"


class ReadDocument:
  """Document index -> token ids, checked against the model's vocabulary. A class so it pickles
  into grain's worker processes."""

  def __init__(self, docs: TokenizedText, vocab_size: int):
    self.docs, self.vocab_size = docs, vocab_size

  def __call__(self, i) -> dict[str, np.ndarray]:
    features = self.docs[int(i)]
    for ids in (features["inputs"], features["targets"]):
      if ids.size and (ids.max() >= self.vocab_size or ids.min() < 0):
        raise DataError(f"token id {int(ids.max())} from tokenizer {self.docs.tokenizer.name} "
                        f"is outside model.vocab_size={self.vocab_size}; use a model vocab of "
                        f"at least {self.docs.tokenizer.vocab_size} or the model's own tokenizer")
    return features


class SplitIntoPieces(grain.experimental.FlatMapTransform):
  """Features -> pieces of at most seq_len (input, target, weight) triples.

  Every target stays a target exactly once; a record longer than seq_len becomes several pieces
  (packed separately). Pieces without any weighted target (e.g. the middle of a long prompt)
  would cost compute and teach nothing, so they are dropped.
  """

  # grain's iterator-level flat map does not cap the fan-out; the attribute is for MapDataset.
  max_fan_out = 1 << 20

  def __init__(self, seq_len: int):
    self.seq_len = seq_len

  def flat_map(self, features):
    pieces = []
    for start in range(0, len(features["targets"]), self.seq_len):
      piece = {k: v[start:start + self.seq_len] for k, v in features.items()}
      if piece["weights"].any():
        pieces.append(piece)
    return pieces
