"""Preference pairs -> DPO batches: deterministic, checkpointable, one pair per row.

Records are JSONL `{"prompt": ..., "chosen": ..., "rejected": ...}` (the "preference" kind of
`formats`; the prompt a string or a list of chat messages). Each side becomes one row of
`seq_len + 1` ids, right-padded, in the format of `jaxtrain.dpo`:

  {side}_input_ids       int32    [B, T+1]  prompt + response ids, 0 after the end
  {side}_attention_mask  int32    [B, T+1]  1 on real tokens
  {side}_loss_mask       float32  [B, T+1]  1 on response tokens at their own positions

Pairs are not packed (each side's log-probability is a sum over one sequence). A pair longer
than T+1 tokens is cut at the end; one whose cut leaves either response without a token is
skipped, since it can no longer say which response is better.
"""

from __future__ import annotations

import grain
import numpy as np

from jaxtrain.config import ConfigError
from jaxtrain.data import formats
from jaxtrain.data.sources.common import DataError

SIDES = ("chosen", "rejected")


def pair_rows(features: dict, length: int) -> dict[str, np.ndarray] | None:
  """Preference features ({side: {inputs, targets, weights}}) -> one padded row per side of
  `length` ids; None when a response does not survive the cut."""
  row = {}
  for side in SIDES:
    f = features[side]
    ids = np.concatenate([f["inputs"][:1], f["targets"]]).astype(np.int32)[:length]
    # weights[t] belongs to target t = token t+1: shifted, it marks tokens at their positions.
    loss = np.concatenate([[0.0], f["weights"]]).astype(np.float32)[:length]
    if not loss.any():
      return None
    n = len(ids)
    row[f"{side}_input_ids"] = np.pad(ids, (0, length - n))
    row[f"{side}_attention_mask"] = np.pad(np.ones(n, np.int32), (0, length - n))
    row[f"{side}_loss_mask"] = np.pad(loss, (0, length - n))
  return row


class PreferenceRows:
  """Record index -> padded pair rows (or None), with the vocabulary checked. A class so it
  pickles into grain's worker processes."""

  def __init__(self, source, tokenizer, *, length: int, vocab_size: int):
    self.source, self.tokenizer = source, tokenizer
    self.length, self.vocab_size = length, vocab_size

  def __call__(self, index) -> dict[str, np.ndarray] | None:
    index = int(index)
    features = formats.record_features(self.tokenizer, self.source[index], "preference",
                                       where=f"record {index}")
    row = pair_rows(features, self.length)
    if row is not None:
      top = max(int(row[f"{s}_input_ids"].max()) for s in SIDES)
      if top >= self.vocab_size:
        raise DataError(f"record {index}: token id {top} from tokenizer {self.tokenizer.name} "
                        f"is outside model.vocab_size={self.vocab_size}")
    return row


def preference_dataset(source, tokenizer, *, seq_len: int, batch_size: int, vocab_size: int,
                       seed: int, shuffle: bool = True, process_index: int = 0,
                       process_count: int = 1) -> grain.IterDataset:
  """Infinite IterDataset of DPO batches from a record source; this process's share only."""
  if len(source) < process_count:
    raise ConfigError(f"{len(source)} preference records cannot be shared by {process_count} "
                      f"processes")
  ds = grain.MapDataset.source(np.arange(len(source)))[process_index::process_count]
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat().map(PreferenceRows(source, tokenizer, length=seq_len + 1,
                                      vocab_size=vocab_size))
  ds = ds.filter(lambda row: row is not None)
  read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
  return ds.to_iter_dataset(read).batch(batch_size, drop_remainder=True)
