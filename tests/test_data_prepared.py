"""Training batches from a prepared corpus (data.source='prepared'): flat token shards read by
slice, as one global stream."""

import json

import ml_collections
import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.config import ConfigError
from jaxtrain.data import sources
from jaxtrain.data.prepare import prepare
from jaxtrain.data.tokenizer import load_tokenizer
from tests.data_helpers import assert_batches_equal, assert_resumes, check_batch, small_config, take
from tests.data_helpers import make_docs, write_jsonl


def _prepare(tmp_path, name="prepared", num_docs=80, seed=0, docs_per_shard=30):
  docs = make_docs(num_docs, seed=seed)
  corpus = write_jsonl(tmp_path / f"{name}.jsonl", docs)
  prepare(corpus, format="jsonl", tokenizer="byte", output=str(tmp_path / name),
          num_workers=1, docs_per_shard=docs_per_shard, log=None)
  return docs, tmp_path / name


def _config(directory):
  c = small_config()
  c.data.source = "prepared"
  c.data.train_paths = str(directory)
  c.data.eval_fraction = 0.2
  return c


def test_batches_from_a_prepared_corpus(tmp_path):
  docs, directory = _prepare(tmp_path)
  c = _config(directory)
  assert data.reads_global_stream(c)
  batches = take(data.make_train_iterator(c), 4)
  for b in batches:
    check_batch(b, rows=4)
  # Every packed piece is a contiguous slice of one of the documents.
  tok = load_tokenizer("byte")
  corpus = [tok.encode_document(d, add_bos=False, add_eos=True).tobytes() for d in docs]
  for b in batches:
    for r in range(4):
      idx = np.flatnonzero(b["segment_ids"][r] == 1)
      piece = np.append(b["inputs"][r, idx], b["targets"][r, idx[-1]]).astype(np.int32)
      assert any(piece.tobytes() in doc for doc in corpus)
  train, evals = data.load_sources(c)
  assert len(train) + len(evals) == len(docs) and len(evals) > 0
  assert_batches_equal(data.make_eval_batches(c), data.make_eval_batches(c))
  assert_resumes(c)


def test_batch_reads_equal_piece_by_piece_reads(tmp_path):
  _, directory = _prepare(tmp_path, docs_per_shard=7)
  corpus = sources.PreparedCorpus(directory)
  pieces = data.piece_index(corpus.doc_lengths(), 16)
  pick = pieces[np.random.default_rng(0).permutation(len(pieces))[:200]]
  np.testing.assert_array_equal(
      corpus.read_pieces(pick), np.concatenate([corpus.read(*p) for p in pick.tolist()]))
  with pytest.raises(IndexError, match="outside its document"):
    corpus.read_pieces([[0, 0, int(corpus.doc_lengths()[0]) + 1]])


def test_rows_of_any_process_split_are_rows_of_the_one_stream(tmp_path):
  _, directory = _prepare(tmp_path)
  c = _config(directory)
  c.train.global_batch_size = 8
  whole = take(data.make_train_iterator(c), 6)
  halves = [take(data.make_train_iterator(c, process_index=p, process_count=2), 6)
            for p in range(2)]
  odd_even = [take(data.make_train_iterator(c, rows=rows), 6) for rows in ([0, 2, 4, 6],
                                                                          [1, 3, 5, 7])]
  for i, batch in enumerate(whole):
    for k, v in batch.items():
      np.testing.assert_array_equal(np.concatenate([halves[0][i][k], halves[1][i][k]]), v)
      np.testing.assert_array_equal(odd_even[0][i][k], v[0::2])
      np.testing.assert_array_equal(odd_even[1][i][k], v[1::2])


def test_eval_paths_are_used_when_given(tmp_path):
  _prepare(tmp_path, "a", num_docs=30)
  _prepare(tmp_path, "b", num_docs=20, seed=1)
  c = _config(tmp_path / "a")
  c.data.eval_paths = str(tmp_path / "b")
  train, evals = data.load_sources(c)
  assert (len(train), len(evals)) == (30, 20)


def test_mixture_with_the_stdlib_corpus_follows_the_weights_and_resumes(tmp_path):
  _, directory = _prepare(tmp_path, num_docs=200)
  c = small_config()
  c.data.mixture = ml_collections.ConfigDict({
      "prose": {"source": "prepared", "train_paths": str(directory), "weight": 0.25},
      "code": {"source": "stdlib_bytes", "weight": 0.75},
  })
  assert data.reads_global_stream(c)
  batches = take(data.make_train_iterator(c), 60)
  for b in batches[:3]:
    check_batch(b, rows=4)
  # Prose rows are mostly letters and spaces; stdlib code has many more symbols.
  rows = [r for b in batches for r in b["inputs"]]
  prose = np.mean([np.isin(r, list(b" abcdefghijklmnopqrstuvwxyz.")).mean() > 0.9 for r in rows])
  assert 0.1 < prose < 0.45, prose
  assert_resumes(c)


def test_missing_train_paths_is_a_config_error():
  c = small_config()
  c.data.source = "prepared"
  with pytest.raises(ConfigError, match=r"data.train_paths='': .*python -m jaxtrain.data.prepare"):
    data.make_train_iterator(c)


def test_arrayrecord_source_is_refused_in_one_line(tmp_path):
  c = small_config()
  c.data.source = "arrayrecord"
  c.data.train_paths = str(tmp_path / "*.arrayrecord")
  with pytest.raises(ConfigError) as e:
    data.make_train_iterator(c)
  message = str(e.value)
  assert "\n" not in message
  assert "re-prepare" in message and "--config.data.source=prepared" in message


def test_an_old_arrayrecord_corpus_is_refused_in_one_line(tmp_path):
  old = tmp_path / "old"
  old.mkdir()
  (old / "shard-00000-of-00001.arrayrecord").write_bytes(b"\0" * 64)
  (old / "manifest.json").write_text(json.dumps({
      "version": 1, "tokenizer": "byte", "vocab_size": 259, "input": "corpus.jsonl",
      "format": "jsonl", "field": "text",
      "shards": [{"file": "shard-00000-of-00001.arrayrecord", "documents": 1, "tokens": 16}]}))
  with pytest.raises(sources.DataError) as e:
    data.make_train_iterator(_config(old))
  assert "\n" not in str(e.value)
  assert "python -m jaxtrain.data.prepare" in str(e.value)


def test_manifest_vocab_larger_than_model(tmp_path):
  _, directory = _prepare(tmp_path, num_docs=10)
  manifest = json.loads((directory / "manifest.json").read_text())
  manifest["vocab_size"] = 128256
  (directory / "manifest.json").write_text(json.dumps(manifest))
  with pytest.raises(ConfigError, match=r"model.vocab_size=384.*token ids up to 128255"):
    data.make_train_iterator(_config(directory))


def test_token_ids_beyond_model_vocab_are_named(tmp_path):
  _, directory = _prepare(tmp_path, num_docs=10)
  manifest = json.loads((directory / "manifest.json").read_text())
  manifest["vocab_size"] = 200  # wrong: the byte ids reach 256
  (directory / "manifest.json").write_text(json.dumps(manifest))
  c = _config(directory)
  c.model.vocab_size = 200
  with pytest.raises(sources.DataError, match=r"outside model.vocab_size=200.*tokenizer"):
    take(data.make_train_iterator(c), 2)
