"""Preference pairs -> DPO batches: deterministic, checkpointable, one pair per row.

Records are JSONL `{"prompt": ..., "chosen": ..., "rejected": ...}` (the "preference" kind of
`formats`; the prompt a string or a list of chat messages). Each side becomes one row of
`seq_len + 1` ids, right-padded, in the format of `jaxtrain.objectives.dpo.loss`:

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
from jaxtrain.data import sources
from jaxtrain.data.documents import held_out_indices, tokenizer_for
from jaxtrain.data.sources.common import DataError, record_location

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
                                       where=record_location(self.source, index))
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


class RecordSubset:
  """Some records of a record source, by index (the train or eval side of a held-out split)."""

  def __init__(self, source, indices_N: np.ndarray):
    self.source, self.indices_N = source, np.asarray(indices_N, dtype=np.int64)

  def __len__(self) -> int:
    return len(self.indices_N)

  def __getitem__(self, i):
    return self.source[int(self.indices_N[int(i)])]

  def location(self, i) -> str:
    """Where record i of the subset is in the source (its file and line for JSONL)."""
    return record_location(self.source, int(self.indices_N[int(i)]))


def load_record_splits(config, *, needs: str, what: str):
  """(train, eval) JSONL record sources from `data.train_paths` (and `data.eval_paths`, or a
  held-out `data.eval_fraction` of the training records). `needs` says who needs them and `what`
  the records are, for the config errors."""
  d = config.data
  if d.source != "jsonl":
    raise ConfigError(f"data.format={d.format!r}: needs data.source='jsonl' ({what}), got "
                      f"{d.source!r}")
  if not d.train_paths:
    raise ConfigError(f"data.train_paths='': {needs} needs JSONL files of {what}; set "
                      f"data.train_paths to a path or glob")

  def records(paths, which):
    return sources.JsonlSource(paths, field=None, on_bad_record=d.on_bad_record, what=which)
  train = records(d.train_paths, "train_paths")
  if d.eval_paths:
    return train, records(d.eval_paths, "eval_paths")
  train_N, eval_N = held_out_indices(len(train), float(d.eval_fraction))
  return RecordSubset(train, train_N), RecordSubset(train, eval_N)


def load_splits(config):
  """(train, eval) record sources of preference pairs (see `load_record_splits`)."""
  return load_record_splits(config, needs="DPO",
                            what="preference pairs {prompt, chosen, rejected}")


def local_batch_size(config, process_count: int) -> int:
  """train.global_batch_size / process_count (ConfigError when it does not divide)."""
  gbs = config.train.global_batch_size
  if gbs % process_count:
    raise ConfigError(f"train.global_batch_size={gbs}: must be divisible by the process count "
                      f"{process_count}")
  return gbs // process_count


def make_train_iterator(config, *, process_index: int = 0, process_count: int = 1):
  """Infinite, checkpointable iterator over this process's DPO batches
  (`jaxtrain.objectives.dpo.loss`'s format; train.global_batch_size pairs per step over all
  processes)."""
  train, _ = load_splits(config)
  tok = tokenizer_for(config.data.tokenizer)
  ds = preference_dataset(train, tok, seq_len=config.train.seq_len,
                          batch_size=local_batch_size(config, process_count),
                          vocab_size=config.model.vocab_size, seed=int(config.data.seed),
                          process_index=process_index, process_count=process_count)
  return iter(ds)


# Offset so the eval order never equals the train order for the same data.seed.
_EVAL_SEED_OFFSET = 1_000_003


def make_eval_batches(config, *, process_index: int = 0,
                      process_count: int = 1) -> list[dict[str, np.ndarray]]:
  """Exactly `train.eval_batches` batches of held-out pairs, identical at every evaluation."""
  _, evals = load_splits(config)
  tok = tokenizer_for(config.data.tokenizer)
  ds = preference_dataset(evals, tok, seq_len=config.train.seq_len,
                          batch_size=local_batch_size(config, process_count),
                          vocab_size=config.model.vocab_size,
                          seed=int(config.data.seed) + _EVAL_SEED_OFFSET,
                          process_index=process_index, process_count=process_count)
  it = iter(ds)
  return [next(it) for _ in range(config.train.eval_batches)]


def summary(config) -> list[tuple[str, str]]:
  """Start-table rows: the preference files and their train/eval pair counts."""
  train, evals = load_splits(config)
  base = train.source if isinstance(train, RecordSubset) else train
  what = base.describe() if hasattr(base, "describe") else "preference pairs"
  return [("data", f"{what}: {len(train):,} train / {len(evals):,} eval preference pairs")]
