"""The global stream's parts: the index permutation, pieces, packing, batch assembly, and the
stream's invariants (any split of the rows, resume, epochs, block edges)."""

import json

import numpy as np
import pytest

from jaxtrain.data import global_stream, packing, permutation, pipeline, stdlib_corpus
from jaxtrain.data.sources import DataError
from tests.data_helpers import check_batch


# --- permutation --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64, 1000, 4097])
def test_permute_is_a_bijection_for_every_key(n):
  for key in (0, 1, 2**63 + 5):
    np.testing.assert_array_equal(np.sort(permutation.permute(np.arange(n), n, key)),
                                  np.arange(n))


def test_permute_orders_differ_by_key_and_look_shuffled():
  n = 10_000
  a = permutation.permute(np.arange(n), n, permutation.hash_key(0, 0, 0))
  b = permutation.permute(np.arange(n), n, permutation.hash_key(0, 0, 1))
  assert (a != b).mean() > 0.99
  # Neighbours land far apart, and the order is not close to the identity.
  assert np.median(np.abs(np.diff(a))) > n / 10
  assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.05
  # Any slice is computed alone, the same as within the whole.
  np.testing.assert_array_equal(permutation.permute(np.arange(300, 400), n, 7),
                                permutation.permute(np.arange(n), n, 7)[300:400])
  with pytest.raises(ValueError, match="outside"):
    permutation.permute([n], n, 0)


# --- pieces and packing -------------------------------------------------------------------------


def test_piece_table_matches_a_per_document_cut():
  rng = np.random.default_rng(0)
  lengths = np.concatenate([[0, 1, 2, 65, 64, 66, 129], rng.integers(0, 500, 200)])
  table = packing.PieceTable(lengths, 64)
  expected = [(d, a, min(a + 65, n)) for d, n in enumerate(lengths)
              for a in range(0, max(n - 1, 0), 64)]
  np.testing.assert_array_equal(table.all_pieces(), np.array(expected).reshape(-1, 3))
  np.testing.assert_array_equal(pipeline.piece_index(lengths, 64), table.all_pieces())


def test_pack_rows_places_every_piece_once_within_the_rows():
  rng = np.random.default_rng(1)
  pairs = np.concatenate([np.full(30, 64), rng.integers(1, 64, 300)])
  rng.shuffle(pairs)
  starts, order = packing.pack_rows(pairs, 64)
  np.testing.assert_array_equal(np.sort(order), np.arange(len(pairs)))
  fills = np.add.reduceat(pairs[order], starts[:-1])
  assert (fills <= 64).all()
  # Full pieces are rows of their own; the short ones pack within 3% of the bound.
  row_of = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
  full_rows = row_of[np.flatnonzero(pairs[order] == 64)]
  assert len(full_rows) == 30 and (np.diff(starts)[full_rows] == 1).all()
  assert len(starts) - 1 <= 1.03 * np.ceil(pairs.sum() / 64) + 1


def _reference_rows(read, rows_pieces, seq_len):
  """Batch arrays by the definition, piece by piece."""
  out = {k: np.zeros((len(rows_pieces), seq_len), np.int32)
         for k in ("inputs", "targets", "segment_ids", "positions")}
  for r, pieces in enumerate(rows_pieces):
    offset = 0
    for s, (doc, start, stop) in enumerate(pieces):
      tokens = read(doc, start, stop)
      m = len(tokens) - 1
      out["inputs"][r, offset:offset + m] = tokens[:-1]
      out["targets"][r, offset:offset + m] = tokens[1:]
      out["segment_ids"][r, offset:offset + m] = s + 1
      out["positions"][r, offset:offset + m] = np.arange(m)
      offset += m
  out["loss_mask"] = (out["segment_ids"] > 0).astype(np.float32)
  return out


def test_assemble_rows_equals_the_piece_by_piece_definition():
  src = stdlib_corpus.ByteDocumentSource(
      [str(i) for i in range(6)], [bytes(range(40 + i, 40 + i + n)) for i, n in
                                   enumerate([3, 70, 10, 200, 64, 1])])
  table = packing.PieceTable(src.doc_lengths(), 64)
  pieces = table.all_pieces()
  starts, order = packing.pack_rows(pieces[:, 2] - pieces[:, 1] - 1, 64)
  rows_pieces = [pieces[order[a:b]] for a, b in zip(starts[:-1], starts[1:])]
  rows_Q = np.repeat(np.arange(len(rows_pieces)), np.diff(starts))
  for read_pieces in (src.read_pieces, lambda p: packing.read_pieces_one_by_one(src.read, p)):
    got = packing.assemble_rows(pieces[order], rows_Q, len(rows_pieces), 64, read_pieces)
    want = _reference_rows(src.read, rows_pieces, 64)
    for k, v in want.items():
      np.testing.assert_array_equal(got[k], v, err_msg=k)
  assert (got["segment_ids"] == 1).all(axis=1).sum() >= 3  # full rows took the fast path


# --- the stream ---------------------------------------------------------------------------------


def _stdlib_train():
  train, _ = stdlib_corpus.load_stdlib_splits(0.02)
  return train


def _stream(source, **kw):
  kw = {"seq_len": 64, "batch_size": 8, "seed": 3, "vocab_size": 257, **kw}
  return global_stream.GlobalBatchStream([(source, 1.0)], **kw)


def test_any_split_of_the_rows_reads_the_same_batches_across_block_edges():
  train = _stdlib_train()
  # Small blocks: batches straddle block edges many times.
  whole = _stream(train, block_pieces=13)
  parts = [_stream(train, block_pieces=13, rows=r) for r in ([0, 1, 2, 3], [4, 5, 6, 7],
                                                              [1, 6], [0, 2, 3, 4, 5, 7])]
  for _ in range(25):
    batch = next(whole)
    check_batch({k: v[:, :64] for k, v in batch.items()}, rows=8)
    got = [next(p) for p in parts]
    for k, v in batch.items():
      np.testing.assert_array_equal(np.concatenate([got[0][k], got[1][k]]), v)
      np.testing.assert_array_equal(got[2][k], v[[1, 6]])
      np.testing.assert_array_equal(got[3][k], v[[0, 2, 3, 4, 5, 7]])


def test_state_resumes_exactly_on_another_split_of_the_rows():
  train = _stdlib_train()
  one = _stream(train, block_pieces=50)
  for _ in range(7):
    next(one)
  state = json.loads(json.dumps(one.get_state()))
  expected = [next(one) for _ in range(9)]
  halves = [_stream(train, block_pieces=50, rows=r) for r in ([0, 1, 2, 3], [4, 5, 6, 7])]
  for h in halves:
    h.set_state(state)
  for batch in expected:
    got = [next(h) for h in halves]
    for k, v in batch.items():
      np.testing.assert_array_equal(np.concatenate([got[0][k], got[1][k]]), v)


def test_each_epoch_trains_on_every_target_once_in_a_new_order():
  # 40 documents; each epoch is one block (the corpus has fewer pieces than BLOCK_PIECES).
  rng = np.random.default_rng(0)
  contents = [bytes(rng.integers(0, 256, int(n)).astype(np.uint8))
              for n in rng.integers(5, 300, 40)]
  src = stdlib_corpus.ByteDocumentSource([str(i) for i in range(40)], contents)
  stream = _stream(src, batch_size=4)
  epoch_rows = stream._plan_block().num_rows  # pylint: disable=protected-access
  batches = [next(stream) for _ in range(2 * epoch_rows // 4 + 2)]
  rows = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
  targets_per_epoch = sum(len(c) for c in contents)  # every byte after the first, plus EOS
  first = rows["loss_mask"][:epoch_rows].sum()
  assert first == targets_per_epoch
  second = slice(epoch_rows, 2 * epoch_rows)
  assert rows["loss_mask"][second].sum() == targets_per_epoch
  assert not np.array_equal(rows["inputs"][:epoch_rows], rows["inputs"][second])
  # The same multiset of (input, target) pairs each epoch.
  def pairs(s):
    m = rows["loss_mask"][s] > 0
    return sorted(zip(rows["inputs"][s][m].tolist(), rows["targets"][s][m].tolist()))
  assert pairs(slice(0, epoch_rows)) == pairs(second)


def test_shuffle_off_reads_documents_in_order():
  src = stdlib_corpus.ByteDocumentSource(["a", "b"], [b"a" * 100, b"b" * 10])
  batch = next(_stream(src, batch_size=4, shuffle=False))
  assert batch["inputs"][0, 0] == ord("a") and (batch["inputs"][0] == ord("a")).all()


def test_states_of_other_pipelines_are_refused():
  stream = _stream(_stdlib_train())
  with pytest.raises(DataError, match="not a global-stream state"):
    stream.set_state({"next_index": 3})
  with pytest.raises(DataError, match="version"):
    stream.set_state({**stream.get_state(), "version": 99})


def test_a_corpus_without_pairs_is_named():
  src = stdlib_corpus.ByteDocumentSource(["a"], [b""])  # one token (EOS): no pair
  with pytest.raises(DataError, match="nothing to train on"):
    _stream(src)
