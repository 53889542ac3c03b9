"""Training batches from pre-tokenized ArrayRecord shards (data.source='arrayrecord')."""

import json

import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.config import ConfigError
from jaxtrain.data import sources
from tests.test_data import check_batch, small_config, take, assert_batches_equal, T


def _write_shards(tmp_path, num_docs=60, vocab=300, seed=0, manifest_vocab=None):
  rng = np.random.default_rng(seed)
  docs = [rng.integers(1, 256, int(rng.integers(T // 2, 3 * T))).astype(np.int32)
          for _ in range(num_docs)]
  for d in docs:
    d[-1] = 256  # an EOS-like last token, never an input after packing
  half = num_docs // 2
  sources.write_array_record_shard(str(tmp_path / "s-0.arrayrecord"), docs[:half])
  sources.write_array_record_shard(str(tmp_path / "s-1.arrayrecord"), docs[half:])
  if manifest_vocab is not None:
    (tmp_path / "manifest.json").write_text(json.dumps({"version": 1,
                                                        "vocab_size": manifest_vocab}))
  return docs


def _config(tmp_path):
  c = small_config()
  c.data.source = "arrayrecord"
  c.data.train_paths = str(tmp_path / "*.arrayrecord")
  c.data.eval_fraction = 0.2
  return c


def test_batches_from_shards(tmp_path):
  docs = _write_shards(tmp_path)
  c = _config(tmp_path)
  it = data.make_train_iterator(c)
  batches = take(it, 4)
  for b in batches:
    check_batch(b, rows=4)
  # Every packed piece is a contiguous slice of one of the documents.
  corpus = b"|".join(d.astype(np.uint8).tobytes() for d in docs)
  seg = batches[0]["segment_ids"][0]
  idx = np.flatnonzero(seg == 1)
  piece = np.append(batches[0]["inputs"][0, idx], batches[0]["targets"][0, idx[-1]])
  assert piece.astype(np.uint8).tobytes() in corpus
  train, evals = data.load_sources(c)
  assert len(train) + len(evals) == len(docs) and len(evals) > 0
  assert_batches_equal(data.make_eval_batches(c), data.make_eval_batches(c))


def test_eval_paths_are_used_when_given(tmp_path):
  _write_shards(tmp_path)
  c = _config(tmp_path)
  c.data.train_paths = str(tmp_path / "s-0.arrayrecord")
  c.data.eval_paths = str(tmp_path / "s-1.arrayrecord")
  train, evals = data.load_sources(c)
  assert (len(train), len(evals)) == (30, 30)


def test_missing_train_paths_is_a_config_error():
  c = small_config()
  c.data.source = "arrayrecord"
  with pytest.raises(ConfigError, match="data.train_paths"):
    data.make_train_iterator(c)


def test_no_matching_shards(tmp_path):
  c = _config(tmp_path)
  with pytest.raises(sources.DataError, match="no files match"):
    data.make_train_iterator(c)


def test_manifest_vocab_larger_than_model(tmp_path):
  _write_shards(tmp_path, manifest_vocab=128256)
  with pytest.raises(ConfigError, match=r"model.vocab_size=384.*token ids up to 128255"):
    data.make_train_iterator(_config(tmp_path))


def test_token_ids_beyond_model_vocab_are_named(tmp_path):
  _write_shards(tmp_path)
  c = _config(tmp_path)
  c.model.vocab_size = 200  # ids reach 256
  with pytest.raises(sources.DataError, match=r"outside model.vocab_size=200.*tokenizer"):
    take(data.make_train_iterator(c), 2)
