"""Prompt records -> GRPO prompt batches: deterministic, checkpointable, one prompt per row.

Records are JSONL `{"prompt": ..., <other fields>}` (the "prompt" kind of `formats`; the prompt a
string or a list of chat messages). The other fields are the record's columns, handed to the
reward functions (e.g. a reference `answer`). A batch holds the prompts' ids, not the rollouts:
those are sampled with the current weights in the training loop (jaxtrain.objectives.grpo.rollouts).

  prompt_ids      int32  [N, P]  the prompt's ids, right-padded with 0
  prompt_lengths  int32  [N]     its length (>= 1)
  record_index    int32  [N]     the record's index in its split (train or eval), for its text
                                 and columns

P = train.seq_len - grpo.max_new_tokens, so a prompt and its completion fit one training row.
A longer prompt is skipped (its completion would have no room), as DPO skips pairs it cannot
fit.
"""

from __future__ import annotations

import grain
import numpy as np

from jaxtrain.config import ConfigError
from jaxtrain.data import formats
from jaxtrain.data.documents import tokenizer_for
from jaxtrain.data.preference import RecordSubset, load_record_splits, local_batch_size
from jaxtrain.data.sources.common import DataError, record_location

BATCH_KEYS = ("prompt_ids", "prompt_lengths", "record_index")


def max_prompt_tokens(config) -> int:
  """The longest prompt a row has room for: train.seq_len - grpo.max_new_tokens."""
  return int(config.train.seq_len) - int(config.grpo.max_new_tokens)


class PromptRows:
  """Record index -> one padded prompt row (or None when it does not fit), with the vocabulary
  checked. A class so it pickles into grain's worker processes."""

  def __init__(self, source, tokenizer, *, length: int, vocab_size: int):
    self.source, self.tokenizer = source, tokenizer
    self.length, self.vocab_size = length, vocab_size

  def __call__(self, index) -> dict[str, np.ndarray] | None:
    index = int(index)
    ids = formats.prompt_ids(self.tokenizer, self.source[index], where=record_location(self.source, index))
    if len(ids) == 0 or len(ids) > self.length:
      return None
    top = int(ids.max())
    if top >= self.vocab_size:
      raise DataError(f"record {index}: token id {top} from tokenizer {self.tokenizer.name} is "
                      f"outside model.vocab_size={self.vocab_size}")
    return {"prompt_ids": np.pad(ids, (0, self.length - len(ids))),
            "prompt_lengths": np.int32(len(ids)), "record_index": np.int32(index)}


def prompt_dataset(source, tokenizer, *, length: int, batch_size: int, vocab_size: int,
                   seed: int, shuffle: bool = True, process_index: int = 0,
                   process_count: int = 1) -> grain.IterDataset:
  """Infinite IterDataset of prompt batches from a record source; this process's share only."""
  if len(source) < process_count:
    raise ConfigError(f"{len(source)} prompt records cannot be shared by {process_count} "
                      f"processes")
  ds = grain.MapDataset.source(np.arange(len(source)))[process_index::process_count]
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat().map(PromptRows(source, tokenizer, length=length, vocab_size=vocab_size))
  ds = ds.filter(lambda row: row is not None)
  read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
  return ds.to_iter_dataset(read).batch(batch_size, drop_remainder=True)


def load_splits(config):
  """(train, eval) record sources of prompts (see preference.load_record_splits)."""
  return load_record_splits(config, needs="GRPO", what="prompt records {prompt, ...}")


def _dataset(config, source, seed: int, process_index: int, process_count: int):
  tok = tokenizer_for(config.data.tokenizer)
  return prompt_dataset(source, tok, length=max_prompt_tokens(config),
                        batch_size=local_batch_size(config, process_count),
                        vocab_size=config.model.vocab_size, seed=seed,
                        process_index=process_index, process_count=process_count)


def make_train_iterator(config, *, process_index: int = 0, process_count: int = 1):
  """Infinite, checkpointable iterator over this process's prompt batches
  (train.global_batch_size prompts per step over all processes)."""
  train, _ = load_splits(config)
  return iter(_dataset(config, train, int(config.data.seed), process_index, process_count))


# Offset so the eval order never equals the train order for the same data.seed.
_EVAL_SEED_OFFSET = 1_000_003


def make_eval_batches(config, *, process_index: int = 0,
                      process_count: int = 1) -> list[dict[str, np.ndarray]]:
  """Exactly `train.eval_batches` batches of held-out prompts, identical at every evaluation."""
  _, evals = load_splits(config)
  it = iter(_dataset(config, evals, int(config.data.seed) + _EVAL_SEED_OFFSET, process_index,
                     process_count))
  return [next(it) for _ in range(config.train.eval_batches)]


def summary(config) -> list[tuple[str, str]]:
  """Start-table rows: the prompt files and their train/eval record counts."""
  train, evals = load_splits(config)
  base = train.source if isinstance(train, RecordSubset) else train
  what = base.describe() if hasattr(base, "describe") else "prompt records"
  return [("data", f"{what}: {len(train):,} train / {len(evals):,} eval prompts")]
