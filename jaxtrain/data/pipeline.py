"""Deterministic input pipeline: documents -> pieces -> shuffle -> pack -> batch.

Stages:
  1. source: random access to documents (`data.source` picks one, `data.mixture` several;
     documents.py),
  2. pieces: every document cut into pieces of at most T+1 tokens (T = train.seq_len), so each
     piece gives at most T (input, target) pairs and every target token is predicted once,
  3. shuffle, pack the pieces whole into rows of T, batch.

Two ways through them (`reads_global_stream` says which):
  - Sources whose document lengths are known (`prepared` corpora, the stdlib demo):
    `global_stream.GlobalBatchStream`. Pieces are shuffled across the whole corpus, packed
    block by block (first-fit decreasing) and every global batch is planned from the lengths
    alone, so it is the same for any number of processes; each process reads only its rows.
  - Raw text (tokenized as it is read), or `data.num_shards` > 0: grain. One data shard's
    documents or pieces (shard s of S: s::S; a shard is a process unless data.num_shards fixes
    S, see shards.py), shuffled by `data.seed` and reshuffled every epoch, first-fit packed by
    grain (rows emitted in shuffled groups of `_NUM_PACKING_BINS`), batched to B/S rows.

Batch format, every array [B_local, T] (B_local: the rows this caller loads):
  inputs       int32    token ids
  targets      int32    next token ids (for a piece p: inputs = p[:-1], targets = p[1:])
  loss_mask    float32  1.0 where the target is real, 0.0 on padding
  segment_ids  int32    1, 2, 3, ... per packed piece within the row, 0 on padding
  positions    int32    position within the piece, restarting at 0 per segment; 0 on padding
"""

from __future__ import annotations

from collections.abc import Iterator

import grain
import numpy as np

from jaxtrain.config import ConfigError
from jaxtrain.data import global_stream, packing, sources, text_docs
from jaxtrain.data.documents import DocumentSubset, load_mixture

# The language-model batch, [B, T] each (the module docstring): what the train step and the LM
# objective read.
BATCH_KEYS = ("inputs", "targets", "loss_mask", "segment_ids", "positions")


# Pieces packed together before rows are emitted. More bins pack the short document tails more
# tightly (higher efficiency) at the cost of memory (bins x T tokens) and of mixing more pieces;
# with 64 bins the stdlib corpus packs at 99.9% (T=64), 99.6% (T=256), 99.1% (T=1024).
_NUM_PACKING_BINS = 64
# Offset so the eval shuffle never equals the train shuffle for the same data.seed.
_EVAL_SEED_OFFSET = 1_000_003


def piece_index(doc_lengths_N: np.ndarray, seq_len: int) -> np.ndarray:
  """[P, 3] int64 rows (doc, start, stop): every piece of at most seq_len+1 tokens (see
  `packing.PieceTable`, which addresses them without this table)."""
  return packing.PieceTable(doc_lengths_N, seq_len).all_pieces()


class _ReadPiece:
  """(doc, start, stop) -> {"inputs", "targets"}; a class, not a closure, so it pickles by
  reference into grain's worker processes."""

  def __init__(self, source, vocab_size: int):
    self._source, self._vocab_size = source, vocab_size

  def __call__(self, piece_3):
    doc = int(piece_3[0])
    tokens = self._source.read(doc, int(piece_3[1]), int(piece_3[2]))
    if tokens.size and (tokens.max() >= self._vocab_size or tokens.min() < 0):
      bad = int(tokens.max() if tokens.max() >= self._vocab_size else tokens.min())
      raise sources.DataError(
          f"token id {bad} in document {doc} is outside model.vocab_size={self._vocab_size}: "
          f"the data was tokenized with a different tokenizer than the model's; re-prepare it "
          f"with the model's tokenizer or fix model.vocab_size")
    return {"inputs": tokens[:-1], "targets": tokens[1:],
            "weights": np.ones(len(tokens) - 1, np.float32)}


def _to_batch_format(packed):
  """Grain's packed names -> `BATCH_KEYS`. Inputs and targets are packed identically, so the
  targets' segment ids and positions serve both."""
  segment_ids_BT = packed["targets_segment_ids"].astype(np.int32)
  return {
      "inputs": packed["inputs"].astype(np.int32),
      "targets": packed["targets"].astype(np.int32),
      # Per-token weights (1 for plain text; 0 on prompts for fine-tuning formats), zero on
      # padding.
      "loss_mask": np.where(segment_ids_BT > 0, packed["weights"], 0).astype(np.float32),
      "segment_ids": segment_ids_BT,
      "positions": packed["targets_positions"].astype(np.int32),
  }


def _local_batch_size(config, process_count: int) -> int:
  gbs = config.train.global_batch_size
  if process_count <= 0 or gbs % process_count:
    raise ConfigError(f"train.global_batch_size={gbs}: must be divisible by the process count "
                      f"{process_count}; use a multiple of it")
  return gbs // process_count


def _check_process(process_index: int, process_count: int):
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must be in [0, {process_count})")


def _ensure_absl_flags_parsed():
  """grain's worker processes read absl flags; reading unparsed flags raises. A CLI using
  `app.run` has parsed them already; library callers (tests, notebooks) have not."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def packed_batch_dataset(source, config, *, seed: int, shuffle: bool, process_index: int = 0,
                         process_count: int = 1, num_workers: int = 0) -> grain.IterDataset:
  """Infinite IterDataset of batches in `BATCH_KEYS` format from any document source.

  `source` is a token source (`doc_lengths()` and `read(doc, start, stop)`, see
  `stdlib_corpus.ByteDocumentSource`), a `text_docs.TokenizedText`, or a list of
  `(source, weight)` whose pieces are mixed in proportion to the weights before packing. Sources
  must pickle when num_workers > 0.
  """
  _check_process(process_index, process_count)
  seq_len = config.train.seq_len
  batch_size = _local_batch_size(config, process_count)
  parts = source if isinstance(source, list) else [(source, 1.0)]
  streams = []
  for i, (part, _) in enumerate(parts):
    pieces = _text_pieces if isinstance(part, text_docs.TokenizedText) else _token_pieces
    # Each component gets its own shuffle seed, so equal corpora do not mirror each other.
    streams.append(pieces(part, config, seed=seed + i, shuffle=shuffle,
                          process_index=process_index, process_count=process_count))
  it = streams[0] if len(streams) == 1 else grain.IterDataset.mix(
      streams, [w for _, w in parts])
  it = grain.experimental.FirstFitPackIterDataset(
      it, length_struct={"inputs": seq_len, "targets": seq_len, "weights": seq_len},
      num_packing_bins=_NUM_PACKING_BINS, seed=seed, shuffle_bins=shuffle)
  it = it.batch(batch_size, drop_remainder=True).map(_to_batch_format)
  if num_workers > 0:
    _ensure_absl_flags_parsed()
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
  return it


# Reading is numpy slicing or tokenizing under the GIL: read threads only add contention (B=16,
# T=256: 730 batches/s with none, 180 with 2, 120 with grain's default 16). Background work,
# where wanted, comes from data.num_workers processes.
_READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def _text_pieces(docs, config, *, seed, shuffle, process_index, process_count):
  """Documents shuffled, tokenized when read, cut into pieces (lengths are unknown up front)."""
  if len(docs) < process_count:
    raise ValueError(f"data.train_paths: {len(docs)} documents cannot be shared by "
                     f"{process_count} processes")
  ds = grain.MapDataset.source(np.arange(len(docs)))[process_index::process_count]
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat().map(text_docs.ReadDocument(docs, int(config.model.vocab_size)))
  return grain.experimental.FlatMapIterDataset(ds.to_iter_dataset(_READ_OPTIONS),
                                               text_docs.SplitIntoPieces(config.train.seq_len))


def _token_pieces(source, config, *, seed, shuffle, process_index, process_count):
  """Pieces of pre-tokenized documents, shuffled piece by piece (lengths are known)."""
  pieces_P3 = piece_index(source.doc_lengths(), config.train.seq_len)
  if len(pieces_P3) < process_count:
    raise ValueError(f"data.source={config.data.source!r}: {len(pieces_P3)} pieces cannot be "
                     f"shared by {process_count} processes")
  # Shard before shuffling: each process owns a fixed, disjoint slice of the pieces and shuffles
  # it independently, so no process ever reads another's data.
  ds = grain.MapDataset.source(pieces_P3)[process_index::process_count]
  if shuffle:
    ds = ds.shuffle(seed=seed)
  # repeat() after shuffle(): grain folds the epoch into the shuffle seed, so each epoch gets a
  # different order while staying deterministic. Eval repeats too, so a tiny split still fills
  # the requested number of batches.
  ds = ds.repeat().map(_ReadPiece(source, int(config.model.vocab_size)))
  return ds.to_iter_dataset(_READ_OPTIONS)


def reads_global_stream(config) -> bool:
  """Whether `config`'s training data is one global stream (`global_stream`): the same global
  batches for any number of processes. True when every source's document lengths are known
  before reading (prepared corpora, the stdlib corpus) and data.num_shards is 0 (the default);
  raw text is tokenized as it is read, so its lengths are not known ahead and it is read in
  data shards (`shards.py`)."""
  if int(config.data.num_shards):
    return False
  return all(not isinstance(train, text_docs.TokenizedText) for _, train, _ in
             load_mixture(config))


def _stream_rows(config, process_index: int, process_count: int, rows) -> np.ndarray:
  """The global batch rows a caller loads: `rows` as given, else process p of P's contiguous
  block of B/P rows."""
  if rows is not None:
    return np.asarray(rows, np.int64)
  _check_process(process_index, process_count)
  local = _local_batch_size(config, process_count)
  return np.arange(process_index * local, (process_index + 1) * local)


def _global_stream(config, components, *, seed: int, process_index: int, process_count: int,
                   rows) -> global_stream.GlobalBatchStream:
  return global_stream.GlobalBatchStream(
      components, seq_len=int(config.train.seq_len),
      batch_size=int(config.train.global_batch_size),
      rows=_stream_rows(config, process_index, process_count, rows), seed=seed, shuffle=True,
      vocab_size=int(config.model.vocab_size))


def make_train_iterator(config, *, process_index: int = 0, process_count: int = 1, rows=None):
  """Infinite iterator over training batches (see module doc for the format), with
  `get_state()` / `set_state()` for exact resumption (the state is JSON-serializable).

  Sources of known document lengths (`reads_global_stream`): this caller's `rows` of every
  global batch of one `global_stream.GlobalBatchStream` (default: block `process_index` of
  `process_count`), the same stream for any split of the rows; read in-process (no workers:
  it reads faster than workers could hand batches over).

  Raw text, or data.num_shards > 0: shard `process_index` of `process_count` through grain
  (ShardPlan.train_iterator combines several). Deterministic given `data.seed`, the shard index
  and count and `data.num_workers` (grain's multiprocessing packs per worker, so changing the
  worker count changes the stream). With workers, call `close()` when done; spawned workers
  re-import `__main__`, so scripts need an `if __name__ == "__main__":` guard.
  """
  train_source = [(train, w) for w, train, _ in load_mixture(config)]
  if reads_global_stream(config):
    return _global_stream(config, train_source, seed=int(config.data.seed),
                          process_index=process_index, process_count=process_count, rows=rows)
  ds = packed_batch_dataset(train_source, config, seed=int(config.data.seed), shuffle=True,
                            process_index=process_index, process_count=process_count,
                            num_workers=int(config.data.num_workers))
  return iter(ds)


def make_eval_batches(config, *, process_index: int = 0, process_count: int = 1,
                      rows=None) -> list[dict[str, np.ndarray]]:
  """Exactly `train.eval_batches` batches of the eval split, identical every call (the rows
  chosen as for `make_train_iterator`).

  A fixed-seed shuffle of the eval pieces (independent of training progress), so every
  evaluation scores the same tokens and losses are comparable across steps. Built in-process:
  a few batches do not justify starting workers.
  """
  eval_source = [(evals, w) for w, _, evals in load_mixture(config)]
  seed = int(config.data.seed) + _EVAL_SEED_OFFSET
  if reads_global_stream(config):
    it = _global_stream(config, eval_source, seed=seed, process_index=process_index,
                        process_count=process_count, rows=rows)
  else:
    it = iter(packed_batch_dataset(eval_source, config, seed=seed, shuffle=True,
                                   process_index=process_index, process_count=process_count))
  return [next(it) for _ in range(config.train.eval_batches)]


def packing_stats(batches) -> dict[str, float]:
  """Packing efficiency (mean loss_mask: fraction of target slots that are real tokens) and
  mean packed pieces per row, over an iterable of batches."""
  real = slots = segments = rows = 0
  for b in batches:
    real += float(b["loss_mask"].sum())
    slots += b["loss_mask"].size
    segments += int(b["segment_ids"].max(axis=1).sum())
    rows += b["segment_ids"].shape[0]
  return {"packing_efficiency": real / max(slots, 1), "pieces_per_row": segments / max(rows, 1)}


def summary(config, *, sample_docs: int = 256) -> list[tuple[str, str]]:
  """Rows for the run's start table: each source, its train/eval documents, and how many
  documents are longer than train.seq_len (split into several pieces; exact where lengths are
  known, estimated from the first `sample_docs` documents of raw sources)."""
  rows = []
  seq_len = config.train.seq_len
  for weight, train, evals in load_mixture(config):
    base = train.source if isinstance(train, (text_docs.TokenizedText, DocumentSubset)) else train
    what = base.describe() if hasattr(base, "describe") else config.data.source
    prefix = f"{weight:.0%} " if weight < 1 else ""
    rows.append(("data", f"{prefix}{what}: {len(train):,} train / {len(evals):,} eval documents"))
    if isinstance(train, text_docs.TokenizedText):
      n = min(sample_docs, len(train))
      long_docs = sum(len(train[i]["targets"]) > seq_len for i in range(n))
      rows.append(("long documents", f"{long_docs} of the first {n} have more than {seq_len} "
                                     f"tokens (split into pieces)"))
    else:
      lengths = np.asarray(train.doc_lengths())
      long_docs = int((lengths - 1 > seq_len).sum())
      rows.append(("long documents", f"{long_docs:,} of {len(lengths):,} have more than "
                                     f"{seq_len} tokens (split into pieces)"))
  rows.append(("data stream", _stream_description(config)))
  return rows


def _stream_description(config) -> str:
  if reads_global_stream(config):
    text = "one global stream: the same batches for any number of processes"
    if int(config.data.num_workers):
      text += (f" (read in-process; data.num_workers={config.data.num_workers} applies to "
               f"raw text only)")
    return text
  shards = int(config.data.num_shards)
  if shards:
    return (f"{shards} data shards: the same batches for any process count that divides "
            f"{shards}")
  return ("one data shard per process: raw text is tokenized as it is read, so its batches "
          "change with the process count; set data.num_shards (or prepare the corpus) to fix "
          "them")


def _take(it: Iterator, n: int):
  for _ in range(n):
    yield next(it)
