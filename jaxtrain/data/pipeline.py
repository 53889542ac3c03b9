"""Deterministic input pipeline: documents -> pieces -> shuffle -> pack -> batch.

Stages:
  1. source: random access to documents (`data.source` picks one, `data.mixture` several),
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

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import grain
import ml_collections
import numpy as np

from jaxtrain.config import ConfigError
from jaxtrain.data import global_stream, packing, sources, stdlib_corpus, text_docs
from jaxtrain.data.sources import prepared as prepared_source
from jaxtrain.data import tokenizer as tokenizer_lib


# Pieces packed together before rows are emitted. More bins pack the short document tails more
# tightly (higher efficiency) at the cost of memory (bins x T tokens) and of mixing more pieces;
# with 64 bins the stdlib corpus packs at 99.9% (T=64), 99.6% (T=256), 99.1% (T=1024).
_NUM_PACKING_BINS = 64
# Offset so the eval shuffle never equals the train shuffle for the same data.seed.
_EVAL_SEED_OFFSET = 1_000_003


@dataclasses.dataclass(frozen=True)
class SourceSpec:
  """A registered document source: how to load it and the smallest vocab that covers it."""
  load: Callable[[Any], tuple[Any, Any]]  # config -> (train, eval) token sources
  min_vocab_size: Callable[[Any], int]  # config -> smallest model.vocab_size that covers the ids


def _load_stdlib(config):
  return stdlib_corpus.load_stdlib_splits(float(config.data.eval_fraction))


def _require_train_paths(config):
  if not config.data.train_paths:
    raise ConfigError(f"data.train_paths='': data.source={config.data.source!r} needs files, "
                      f"e.g. --config.data.train_paths=prepared/ (a directory written by "
                      f"`python -m jaxtrain.data.prepare`) or --config.data.train_paths="
                      f"'corpus/*.jsonl'")


def _load_prepared(config):
  """A corpus written by `python -m jaxtrain.data.prepare` (data.train_paths: its directory).
  Without data.eval_paths, a fixed, hash-chosen data.eval_fraction of the training documents is
  held out for eval."""
  _require_train_paths(config)
  train = sources.PreparedCorpus(config.data.train_paths, what="train_paths")
  if config.data.eval_paths:
    return train, sources.PreparedCorpus(config.data.eval_paths, what="eval_paths")
  return split_documents(train, float(config.data.eval_fraction))


def _prepared_vocab(config) -> int:
  """The vocab size of the tokenizer the corpus was prepared with: its manifest alone (the
  corpus's index files are read once, when the sources load)."""
  _require_train_paths(config)
  _, manifest = prepared_source.load_manifest(config.data.train_paths, "data.train_paths: ")
  return int(manifest.get("vocab_size", 0))


def _arrayrecord_retired(config):
  raise ConfigError(
      f"data.source='arrayrecord': ArrayRecord shards, which were read a whole document per "
      f"piece, are no longer read; re-prepare the corpus (python -m jaxtrain.data.prepare "
      f"--input ... --format ... --tokenizer ... --output DIR) and train with "
      f"--config.data.source=prepared --config.data.train_paths=DIR"
      f"{' (was ' + repr(config.data.train_paths) + ')' if config.data.train_paths else ''}")


def _make_text_source(config, paths: str, what: str):
  d = config.data
  if d.source == "text":
    return sources.TextFileSource(paths, on_decode_error=d.on_decode_error, what=what)
  if d.source == "jsonl":
    # Records with several fields (chat, prompt/completion) are passed whole to the formatter.
    field = d.field if d.format == "text" else None
    return sources.JsonlSource(paths, field=field, on_bad_record=d.on_bad_record, what=what)
  return sources.ParquetSource(paths, column=d.field, what=what)


def _load_text(config):
  """Text files, JSONL or Parquet, tokenized with data.tokenizer as documents are read."""
  _require_train_paths(config)
  d = config.data
  tok = _tokenizer(d.tokenizer)

  if d.format not in ("text", "prompt_completion", "chat"):
    raise ConfigError(f"data.format={d.format!r}: choose text, prompt_completion or chat "
                      f"(preference pairs are for DPO, not for the language-model loss)")
  if d.format != "text" and d.source != "jsonl":
    raise ConfigError(f"data.format={d.format!r}: needs data.source='jsonl' (records with "
                      f"fields), got {d.source!r}")
  # data.add_bos/add_eos apply to plain text; chat and prompt/completion follow the template.
  flags = ({"add_bos": d.add_bos, "add_eos": d.add_eos} if d.format == "text" else {})

  def docs(paths, what):
    return text_docs.TokenizedText(_make_text_source(config, paths, what), tok, kind=d.format,
                                   **flags)
  train = docs(d.train_paths, "train_paths")
  if d.eval_paths:
    return train, docs(d.eval_paths, "eval_paths")
  return split_documents(train, float(d.eval_fraction))


@functools.lru_cache(maxsize=8)
def _tokenizer(spec: str):
  # Parsed once per process: the vocab check and every split's loader share it.
  return tokenizer_lib.load_tokenizer(spec)


def _tokenizer_vocab(config) -> int:
  return _tokenizer(config.data.tokenizer).vocab_size


SOURCES = {
    "stdlib_bytes": SourceSpec(load=_load_stdlib,
                               min_vocab_size=lambda _: stdlib_corpus.BYTE_VOCAB_SIZE),
    "prepared": SourceSpec(load=_load_prepared, min_vocab_size=_prepared_vocab),
    "text": SourceSpec(load=_load_text, min_vocab_size=_tokenizer_vocab),
    "jsonl": SourceSpec(load=_load_text, min_vocab_size=_tokenizer_vocab),
    "parquet": SourceSpec(load=_load_text, min_vocab_size=_tokenizer_vocab),
}


class DocumentSubset:
  """A view of some documents of a token source, with the same protocol (for held-out splits)."""

  def __init__(self, source, indices_N: np.ndarray):
    self.source, self.indices_N = source, np.asarray(indices_N, dtype=np.int64)

  def __len__(self) -> int:
    return len(self.indices_N)

  def doc_lengths(self) -> np.ndarray:
    return np.asarray(self.source.doc_lengths())[self.indices_N]

  def num_tokens(self) -> int:
    return int(self.doc_lengths().sum())

  def read(self, i: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    return self.source.read(int(self.indices_N[i]), start, stop)

  def read_pieces(self, pieces_Q3: np.ndarray) -> np.ndarray:
    """Pieces (doc, start, stop) of this subset's documents, concatenated (see
    `global_stream`)."""
    pieces_Q3 = np.array(pieces_Q3, np.int64)
    pieces_Q3[:, 0] = self.indices_N[pieces_Q3[:, 0]]
    if hasattr(self.source, "read_pieces"):
      return self.source.read_pieces(pieces_Q3)
    return packing.read_pieces_one_by_one(self.source.read, pieces_Q3)

  def __getitem__(self, i: int) -> np.ndarray:
    return self.read(i)


def split_documents(source, eval_fraction: float):
  """(train, eval) by a fixed hash of each document's index: the same split on every run and
  process, independent of data.seed, and spread over the whole corpus."""
  train_N, eval_N = held_out_indices(len(source), eval_fraction)
  if isinstance(source, text_docs.TokenizedText):
    return source.subset(train_N), source.subset(eval_N)
  return DocumentSubset(source, train_N), DocumentSubset(source, eval_N)


def held_out_indices(n: int, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """(train, eval) document indices; see `split_documents`."""
  # Knuth's multiplicative hash spreads consecutive indices uniformly over [0, 2^32).
  frac_N = ((np.arange(n, dtype=np.uint64) * np.uint64(2654435761)) % np.uint64(2**32)) / 2**32
  is_eval_N = frac_N < eval_fraction
  if is_eval_N.all() or not is_eval_N.any():
    raise ConfigError(f"data.eval_fraction={eval_fraction}: leaves {int((~is_eval_N).sum())} "
                      f"train and {int(is_eval_N.sum())} eval documents of {n}; both must be "
                      f"non-empty (or set data.eval_paths)")
  return np.flatnonzero(~is_eval_N), np.flatnonzero(is_eval_N)


def _source_spec(config) -> SourceSpec:
  name = config.data.source
  if name == "arrayrecord":
    _arrayrecord_retired(config)
  if name not in SOURCES:
    raise ConfigError(f"data.source={name!r}: unknown data source; choose one of "
                      f"{', '.join(sorted(SOURCES))}")
  spec = SOURCES[name]
  needed = spec.min_vocab_size(config)
  if config.model.vocab_size < needed:
    raise ConfigError(f"model.vocab_size={config.model.vocab_size}: data.source={name!r} has "
                      f"token ids up to {needed - 1} (its tokenizer's vocabulary); use a vocab "
                      f"size >= {needed} or data prepared with the model's tokenizer")
  return spec


@functools.lru_cache(maxsize=4)
def _load_cached(data_items: tuple):
  # In memory only: the train iterator, eval batches and `describe` each need the corpus, and
  # reading (or indexing) it once per process keeps startup short.
  config = ml_collections.ConfigDict({"data": dict(data_items)})
  return SOURCES[config.data.source].load(config)


def load_sources(config):
  """(train, eval) document sources for `config.data`, after validating source and vocab."""
  _source_spec(config)
  items = {k: v for k, v in config.data.to_dict().items() if k != "mixture"}
  return _load_cached(tuple(sorted(items.items())))


def load_mixture(config) -> list[tuple[float, Any, Any]]:
  """[(weight, train, eval)] of the sources in `data.mixture`, or of `data` alone.

  Each entry of data.mixture (a name -> dict of data.* keys plus `weight`) overrides the
  top-level data.* keys for that component, e.g. its own source, train_paths and format; the
  weights are normalized to sum to 1.
  """
  mixture = config.data.get("mixture")
  if not mixture:
    train, evals = load_sources(config)
    return [(1.0, train, evals)]
  weights = {}
  for name, part in mixture.items():
    if "weight" not in part:
      raise ConfigError(f"data.mixture.{name}: has no weight; give each component a positive "
                        f"weight, e.g. data.mixture.{name}.weight=0.5")
    weights[name] = part["weight"]
  weights = sources.check_mixture_weights(weights)
  components = []
  for name, part in mixture.items():
    unknown = set(part) - set(config.data) - {"weight"}
    if unknown:
      raise ConfigError(f"data.mixture.{name}: unknown keys {sorted(unknown)}; a component "
                        f"takes data.* keys (source, train_paths, field, format, tokenizer, ...) "
                        f"and weight")
    data_items = {k: v for k, v in config.data.items() if k != "mixture"}
    data_items.update({k: v for k, v in part.items() if k != "weight"})
    component = ml_collections.ConfigDict({"data": data_items, "model": config.model.to_dict()})
    train, evals = load_sources(component)
    components.append((weights[name], train, evals))
  return components


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
