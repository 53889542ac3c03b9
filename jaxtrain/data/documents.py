"""Which documents a run reads: the registered sources (`data.source`), their loading (cached
per process), the fixed held-out eval split, and mixtures of sources (`data.mixture`). Stage 1
of the input pipeline (pipeline.py); tokenizers are parsed once per process here
(`tokenizer_for`), for the pipeline, the preference and prompt data and the GRPO rollouts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import ml_collections
import numpy as np

from jaxtrain.config import ConfigError
from jaxtrain.data import packing, sources, stdlib_corpus, text_docs
from jaxtrain.data import tokenizer as tokenizer_lib
from jaxtrain.data.sources import prepared as prepared_source


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
  tok = tokenizer_for(d.tokenizer)

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
def tokenizer_for(spec: str):
  # Parsed once per process: the vocab check and every split's loader share it.
  return tokenizer_lib.load_tokenizer(spec)


def _tokenizer_vocab(config) -> int:
  return tokenizer_for(config.data.tokenizer).vocab_size


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
    # A source on object storage is read ahead of the step (lookahead.py).
    self.remote = bool(getattr(source, "remote", False))
    self.read_ahead_pieces = getattr(source, "read_ahead_pieces", None)

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

  def warm(self, pieces_Q3: np.ndarray) -> None:
    """Fetches ahead the pieces `read_pieces` will read soon (a source on object storage)."""
    if hasattr(self.source, "warm"):
      pieces_Q3 = np.array(pieces_Q3, np.int64)
      pieces_Q3[:, 0] = self.indices_N[pieces_Q3[:, 0]]
      self.source.warm(pieces_Q3)

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
