"""Tests for the stdlib byte corpus and the Grain packing pipeline (numpy + grain, no devices)."""

import math
import os

import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.data import pipeline
from jaxtrain.data import stdlib_corpus
from tests.data_helpers import (T, assert_batches_equal, assert_resumes, check_batch,
                                small_config, take)

# --- corpus -----------------------------------------------------------------------------------


def test_source_read_appends_eos_and_slices():
  src = stdlib_corpus.ByteDocumentSource(["a", "b"], [b"hi", b"xyz"])
  np.testing.assert_array_equal(src.doc_lengths(), [3, 4])
  np.testing.assert_array_equal(src[0], [ord("h"), ord("i"), 256])
  np.testing.assert_array_equal(src.read(1, 1, 3), [ord("y"), ord("z")])
  np.testing.assert_array_equal(src.read(1, 2), [ord("z"), 256])
  assert src.read(1).dtype == np.int32
  assert src.num_tokens() == 7


def test_unigram_entropy():
  assert math.isclose(stdlib_corpus.unigram_entropy([np.array([0, 1, 2, 3])]), math.log(4))
  assert stdlib_corpus.unigram_entropy([np.array([5, 5]), np.array([5])]) == 0.0


def test_split_is_disjoint_complete_and_order_independent():
  c = small_config()
  train, evals = data.load_sources(c)
  names_train, names_eval = set(train.names), set(evals.names)
  assert not names_train & names_eval
  all_paths = stdlib_corpus.list_stdlib_files()
  assert names_train | names_eval == set(all_paths)
  assert not any("site-packages" in p for p in all_paths)
  # Roughly eval_fraction of the files, and the same split for any file order.
  assert 0 < len(names_eval) < 4 * c.data.eval_fraction * len(all_paths)
  _, evals_rev = stdlib_corpus.split_paths(reversed(all_paths), c.data.eval_fraction)
  assert set(evals_rev) == names_eval
  assert stdlib_corpus.BYTE_VOCAB_SIZE == 257


def test_piece_index_covers_every_target_once():
  lengths = np.array([1, 2, T, T + 1, T + 2, 2 * T + 1, 3 * T + 5])
  pieces = data.piece_index(lengths, T)
  assert (pieces[:, 2] - pieces[:, 1] <= T + 1).all()
  assert (pieces[:, 2] - pieces[:, 1] >= 2).all()
  for doc, n in enumerate(lengths):
    mine = pieces[pieces[:, 0] == doc]
    # Target positions covered: start+1 .. stop-1 of each piece; together exactly 1 .. n-1.
    covered = np.concatenate([np.arange(a + 1, b) for _, a, b in mine] or [np.zeros(0, int)])
    np.testing.assert_array_equal(covered, np.arange(1, n))


# --- pipeline ---------------------------------------------------------------------------------


def test_train_batch_format():
  it = data.make_train_iterator(small_config())
  for batch in take(it, 3):
    check_batch(batch, rows=4)
  assert data.packing_stats(take(it, 5))["packing_efficiency"] > 0.9


def test_eval_batches_format_and_identical_across_calls():
  c = small_config()
  first = data.make_eval_batches(c)
  assert len(first) == c.train.eval_batches
  for batch in first:
    check_batch(batch, rows=4)
  assert_batches_equal(first, data.make_eval_batches(c))


def test_rows_match_the_corpus():
  # Each packed piece must be a contiguous slice of some train document.
  train, _ = data.load_sources(small_config())
  text = b"\x00".join(train.read(i)[:-1].astype(np.uint8).tobytes() for i in range(len(train)))
  batch = next(data.make_train_iterator(small_config()))
  seg = batch["segment_ids"][0]
  idx = np.flatnonzero(seg == 1)
  piece = np.append(batch["inputs"][0, idx], batch["targets"][0, idx[-1]])
  body = piece[piece != stdlib_corpus.EOS_ID].astype(np.uint8).tobytes()
  assert body in text


def test_determinism_and_seed():
  c = small_config()
  assert_batches_equal(take(data.make_train_iterator(c), 3), take(data.make_train_iterator(c), 3))
  c2 = small_config()
  c2.data.seed = 1
  other = next(data.make_train_iterator(c2))
  assert not np.array_equal(other["inputs"], next(data.make_train_iterator(c))["inputs"])


def test_get_state_set_state_resumes():
  assert_resumes(small_config())


def test_process_sharding():
  c = small_config()
  b0 = take(data.make_train_iterator(c, process_index=0, process_count=2), 2)
  b1 = take(data.make_train_iterator(c, process_index=1, process_count=2), 2)
  for b in b0 + b1:
    check_batch(b, rows=2)
  rows0 = {r.tobytes() for b in b0 for r in b["inputs"]}
  rows1 = {r.tobytes() for b in b1 for r in b["inputs"]}
  assert not rows0 & rows1
  e0 = data.make_eval_batches(c, process_index=0, process_count=2)
  e1 = data.make_eval_batches(c, process_index=1, process_count=2)
  assert len(e0) == len(e1) == 2 and e0[0]["inputs"].shape == (2, T)
  assert not np.array_equal(e0[0]["inputs"], e1[0]["inputs"])
  with pytest.raises(ValueError, match="global_batch_size"):
    data.make_train_iterator(c, process_index=0, process_count=3)


def test_epochs_cover_everything():
  # 8 documents, each exactly one full row. The packer holds 64 bins, so it emits rows in groups
  # of 64 pieces = 8 epochs, shuffled within the group: epochs blur at their edges, but every
  # group of 64 rows holds each document exactly 8 times.
  docs = [bytes([i + 1]) * T for i in range(8)]
  src = stdlib_corpus.ByteDocumentSource([str(i) for i in range(8)], docs)
  it = iter(data.packed_batch_dataset(src, small_config(), seed=0, shuffle=True))
  order = [int(b["inputs"][r, 0]) for b in take(it, 32) for r in range(4)]
  assert pipeline._NUM_PACKING_BINS == 64  # pylint: disable=protected-access
  for group in (order[:64], order[64:]):
    np.testing.assert_array_equal(np.bincount(group, minlength=9)[1:], [8] * 8)
  assert order[:64] != order[64:]


def test_bad_vocab_size_raises():
  c = small_config()
  c.model.vocab_size = 256
  with pytest.raises(ValueError, match=r"model\.vocab_size=256.*257"):
    data.make_train_iterator(c)


def test_unknown_source_raises():
  c = small_config()
  c.data.source = "nope"
  with pytest.raises(ValueError, match=r"data\.source='nope'.*stdlib_bytes"):
    data.make_eval_batches(c)


def test_summary_rows():
  rows = dict(data.summary(small_config()))
  assert "train /" in rows["data"] and "eval documents" in rows["data"]
  assert "have more than 64 tokens" in rows["long documents"]
  train, _ = data.load_sources(small_config())
  assert 2.5 < data.unigram_entropy(train[i] for i in range(len(train))) < 4.0


@pytest.mark.skipif(os.environ.get("JAXTRAIN_SKIP_MP_TEST") == "1",
                    reason="JAXTRAIN_SKIP_MP_TEST=1")
def test_multiprocess_workers():
  # Spawns 2 worker processes (each imports grain, so jax): ~10 s on 2 cores. Workers serve the
  # sharded grain path (raw text, or data.num_shards > 0); the global stream reads in-process.
  c = small_config()
  c.data.num_workers = 2
  c.data.num_shards = 1
  it = data.make_train_iterator(c)
  try:
    batches = take(it, 3)
    state = it.get_state()
  finally:
    it.close()
  for b in batches:
    check_batch(b, rows=4)
  assert state
