"""Pure functions of the global stream: pieces of documents, rows packed from pieces, and the
batch arrays of packed rows.

A piece is (doc, start, stop): at most T+1 consecutive tokens of one document (T =
train.seq_len), giving stop-start-1 (input, target) pairs. Consecutive pieces of a document
overlap by one token, so every token after a document's first is a target exactly once. A row
holds whole pieces whose pairs sum to at most T; the rest of the row is padding.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


class PieceTable:
  """The pieces of documents with known lengths, addressed by a piece number in [0, len), in
  document order. Only per-document counts are stored (not one row per piece), so a corpus of
  billions of tokens costs 16 bytes per document."""

  def __init__(self, doc_lengths_N, seq_len: int):
    self.lengths_N = np.asarray(doc_lengths_N, dtype=np.int64)
    self.seq_len = int(seq_len)
    pieces_N = np.maximum(self.lengths_N - 1 + seq_len - 1, 0) // seq_len  # ceil((len-1) / T)
    self._ends_N = np.cumsum(pieces_N)
    self._firsts_N = self._ends_N - pieces_N

  def __len__(self) -> int:
    return int(self._ends_N[-1]) if len(self._ends_N) else 0

  def lookup(self, piece_K) -> np.ndarray:
    """[K, 3] int64 rows (doc, start, stop) of piece numbers `piece_K`."""
    piece_K = np.asarray(piece_K, dtype=np.int64)
    doc_K = np.searchsorted(self._ends_N, piece_K, side="right")
    start_K = (piece_K - self._firsts_N[doc_K]) * self.seq_len
    stop_K = np.minimum(start_K + self.seq_len + 1, self.lengths_N[doc_K])
    return np.stack([doc_K, start_K, stop_K], axis=1)

  def all_pieces(self) -> np.ndarray:
    """[P, 3] every piece (small corpora and tests)."""
    return self.lookup(np.arange(len(self)))


def pack_rows(pairs_K, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Packs pieces with `pairs_K` (input, target) pairs each into rows of `seq_len` slots.

  Returns (row_starts_R1, pieces_K): row r holds the pieces `pieces_K[row_starts_R1[r]:
  row_starts_R1[r+1]]` (indices into pairs_K), in that order. Full pieces take a row each;
  shorter ones are packed first-fit decreasing, which packs document tails within a few percent
  of optimal (rows are emitted full rows first, then packed rows; callers shuffle them).
  """
  pairs_K = np.asarray(pairs_K, dtype=np.int64)
  if pairs_K.size and (pairs_K.min() < 1 or pairs_K.max() > seq_len):
    raise ValueError(f"pack_rows: piece sizes must be in [1, {seq_len}]")
  full_F = np.flatnonzero(pairs_K == seq_len)
  short_S = np.flatnonzero(pairs_K < seq_len)
  short_S = short_S[np.argsort(-pairs_K[short_S], kind="stable")]
  free_B = np.zeros(len(short_S), dtype=np.int64)  # at most one bin per short piece
  bin_S = np.empty(len(short_S), dtype=np.int64)
  num_bins = 0
  for s, need in enumerate(pairs_K[short_S]):
    fits = free_B[:num_bins] >= need
    b = int(fits.argmax()) if num_bins and fits.any() else num_bins
    if b == num_bins:
      free_B[b] = seq_len
      num_bins += 1
    free_B[b] -= need
    bin_S[s] = b
  # Pieces of a bin in their packing order (a stable sort by bin keeps it).
  order = np.argsort(bin_S, kind="stable")
  counts_B = np.bincount(bin_S, minlength=num_bins)
  row_sizes = np.concatenate([np.ones(len(full_F), np.int64), counts_B])
  row_starts = np.concatenate([[0], np.cumsum(row_sizes)])
  return row_starts, np.concatenate([full_F, short_S[order]])


def ranges(starts_N, stops_N) -> np.ndarray:
  """The concatenation of arange(start, stop) for each pair, vectorized."""
  starts_N, stops_N = np.asarray(starts_N, np.int64), np.asarray(stops_N, np.int64)
  sizes_N = stops_N - starts_N
  return np.repeat(starts_N - (np.cumsum(sizes_N) - sizes_N), sizes_N) + np.arange(sizes_N.sum())


def read_pieces_one_by_one(read: Callable[[int, int, int], np.ndarray], pieces_Q3) -> np.ndarray:
  """The tokens of pieces (doc, start, stop), concatenated, through a source's `read`: the
  fallback for sources without a vectorized `read_pieces`."""
  if not len(pieces_Q3):
    return np.zeros(0, np.int32)
  return np.concatenate([read(d, a, b) for d, a, b in np.asarray(pieces_Q3).tolist()])


def assemble_rows(pieces_Q3, rows_Q, num_rows: int, seq_len: int,
                  read_pieces: Callable[[np.ndarray], np.ndarray]) -> dict[str, np.ndarray]:
  """Batch arrays ([num_rows, seq_len], `BATCH_KEYS`) of pieces (doc, start, stop) placed in rows
  `rows_Q` (non-decreasing; pieces of a row in their order). `read_pieces(pieces_Q3)` returns
  the pieces' tokens concatenated. Vectorized: no Python loop over pieces or rows."""
  pieces_Q3 = np.asarray(pieces_Q3, np.int64).reshape(-1, 3)
  rows_Q = np.asarray(rows_Q, np.int64)
  pairs_Q = pieces_Q3[:, 2] - pieces_Q3[:, 1] - 1
  shape = (num_rows, seq_len)
  inputs_BT, targets_BT = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
  segment_ids_BT, positions_BT = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
  # Rows that are one whole piece (most rows of long documents) are one 2-D copy each.
  full_Q = (pairs_Q == seq_len) & (np.bincount(rows_Q, minlength=num_rows)[rows_Q] == 1)
  if full_Q.any():
    full_rows = rows_Q[full_Q]
    tokens_FT1 = np.asarray(read_pieces(pieces_Q3[full_Q])).reshape(-1, seq_len + 1)
    inputs_BT[full_rows] = tokens_FT1[:, :-1]
    targets_BT[full_rows] = tokens_FT1[:, 1:]
    segment_ids_BT[full_rows] = 1
    positions_BT[full_rows] = np.arange(seq_len, dtype=np.int32)
  if not full_Q.all():
    _scatter_packed(pieces_Q3[~full_Q], rows_Q[~full_Q], pairs_Q[~full_Q], num_rows, seq_len,
                    read_pieces, (inputs_BT, targets_BT, segment_ids_BT, positions_BT))
  return {
      "inputs": inputs_BT,
      "targets": targets_BT,
      "loss_mask": (segment_ids_BT > 0).astype(np.float32),
      "segment_ids": segment_ids_BT,
      "positions": positions_BT,
  }


def _scatter_packed(pieces_Q3, rows_Q, pairs_Q, num_rows, seq_len, read_pieces, out_BT):
  """Writes pieces packed several to a row (or short) into the [num_rows, seq_len] outputs."""
  inputs, targets, segment_ids, positions = (a.reshape(-1) for a in out_BT)
  tokens = np.asarray(read_pieces(pieces_Q3))
  # Where each piece's tokens start in `tokens`, and its first slot within its row.
  token_start_Q = np.cumsum(pairs_Q + 1) - (pairs_Q + 1)
  per_row = np.bincount(rows_Q, minlength=num_rows)
  first_of_row_Q = np.repeat(np.cumsum(per_row) - per_row, per_row)
  pairs_before_Q = np.cumsum(pairs_Q) - pairs_Q
  offset_Q = pairs_before_Q - pairs_before_Q[first_of_row_Q]
  # One entry per (input, target) pair.
  piece_of = np.repeat(np.arange(len(pairs_Q)), pairs_Q)
  within = np.arange(int(pairs_Q.sum())) - pairs_before_Q[piece_of]
  slots = (rows_Q * seq_len + offset_Q)[piece_of] + within
  source = token_start_Q[piece_of] + within
  inputs[slots] = tokens[source]
  targets[slots] = tokens[source + 1]
  # Segment ids count the pieces of each row from 1.
  segment_ids[slots] = (np.arange(len(pairs_Q)) - first_of_row_Q + 1)[piece_of]
  positions[slots] = within
