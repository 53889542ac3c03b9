"""One stream of global batches from documents of known length, whatever reads it.

Every process computes the same plan: which pieces (doc, start, stop) form each row of each
global batch. The plan is a function of the documents' lengths, `data.seed` and the position in
the stream only, so it needs no tokens and no communication. A process then reads the tokens of
only the rows its devices hold. Hence the batches, the losses and the checkpointed position are
the same on 1, 2, 4, ... processes, and a run resumes exactly on another process count.

The plan, block by block (a block is `block_pieces` consecutive piece slots):
  1. each slot takes a component of the mixture (a seeded weighted draw per block; one
     component: all of them), and the component's next piece in its epoch order, a seeded
     permutation of all its pieces (`permutation.permute`, a new one each epoch), so shuffling
     is global across the corpus, piece by piece;
  2. the block's pieces are packed into rows (`packing.pack_rows`) and the rows shuffled;
  3. global batch i is the next `train.global_batch_size` rows, across block edges.

The state is the block, the row within it and each component's piece count at the block's
start: a few integers, JSON, the same on every process.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxtrain.data import lookahead, packing, permutation
from jaxtrain.data.sources import DataError

# Piece slots planned at once. Larger blocks pack document tails tighter and mix more pieces
# per shuffle of rows; the plan of one block costs a few milliseconds and 8192 x 24 bytes.
BLOCK_PIECES = 8192
STATE_VERSION = 1


@dataclasses.dataclass
class _Block:
  pieces_K3: np.ndarray  # (doc, start, stop) per slot
  component_K: np.ndarray  # the mixture component of each slot
  row_starts_R1: np.ndarray
  row_pieces: np.ndarray  # slots, row by row

  @property
  def num_rows(self) -> int:
    return len(self.row_starts_R1) - 1


class GlobalBatchStream:
  """Iterator over this process's rows of the global batches (see module doc).

  Args:
    components: [(source, weight)]; a source has `doc_lengths()` and `read(doc, start, stop)`.
    seq_len, batch_size: T and the global batch's rows B.
    rows: the rows of every global batch this process loads, sorted (default: all).
    seed: the shuffle and mixture seed.
    shuffle: False keeps the pieces in document order and the rows in packing order.
    vocab_size: ids at or above it raise `DataError` (data tokenized for another model).
  """

  def __init__(self, components: Sequence[tuple[Any, float]], *, seq_len: int, batch_size: int,
               rows: Sequence[int] | None = None, seed: int = 0, shuffle: bool = True,
               vocab_size: int | None = None, block_pieces: int = BLOCK_PIECES):
    self.sources = [s for s, _ in components]
    weights = np.asarray([w for _, w in components], dtype=np.float64)
    self.weights = weights / weights.sum()
    self.seq_len, self.batch_size = int(seq_len), int(batch_size)
    self.rows = np.arange(batch_size) if rows is None else np.asarray(sorted(rows), np.int64)
    if self.rows.size == 0 or self.rows[0] < 0 or self.rows[-1] >= batch_size:
      raise ValueError(f"rows {rows!r}: need a non-empty subset of [0, {batch_size})")
    self.seed, self.shuffle = int(seed), bool(shuffle)
    self.vocab_size = vocab_size
    self.tables = [packing.PieceTable(s.doc_lengths(), seq_len) for s in self.sources]
    for table, source in zip(self.tables, self.sources):
      if len(table) == 0:
        what = source.describe() if hasattr(source, "describe") else type(source).__name__
        raise DataError(f"{what}: no document has 2 or more tokens, so there is nothing to "
                        f"train on")
    total = sum(len(t) for t in self.tables)
    # A corpus smaller than a block is planned an epoch at a time (one component).
    self.block_pieces = int(min(block_pieces, total))
    # Sources may read many pieces at once (`read_pieces`); else one `read` per piece.
    self._readers = [getattr(s, "read_pieces", None) or functools.partial(
        packing.read_pieces_one_by_one, s.read) for s in self.sources]
    self._state = {"block": 0, "row": 0, "cursors": [0] * len(self.sources)}
    self._block: _Block | None = None
    # Sources on object storage are read ahead of the step (lookahead.py); local ones need not.
    remote = [s for s in self.sources if getattr(s, "remote", False)]
    self.read_ahead = lookahead.ReadAhead(
        [getattr(s, "warm", None) for s in self.sources],
        ahead_pieces=min(getattr(s, "read_ahead_pieces", None) or lookahead.AHEAD_PIECES
                         for s in remote)) if remote else None
    # Whether this process writes the (process-independent) state into checkpoints.
    self.saves_state = True

  def close(self) -> None:
    """Ends the read-ahead thread, if any; reading again starts another (the current block is
    planned again, as after set_state: the same pieces)."""
    if self.read_ahead:
      self.read_ahead.close()
      self._block = None

  def __del__(self):
    if getattr(self, "read_ahead", None):
      self.read_ahead.close()

  # --- state ---------------------------------------------------------------------------------

  def get_state(self) -> dict[str, Any]:
    return {"kind": "global_stream", "version": STATE_VERSION, "block": self._state["block"],
            "row": self._state["row"], "cursors": list(self._state["cursors"])}

  def set_state(self, state: dict[str, Any]) -> None:
    if not isinstance(state, dict) or state.get("kind") != "global_stream":
      raise DataError(f"data iterator state {str(state)[:80]!r} is not a global-stream state: "
                      f"it was saved by a per-shard pipeline (an earlier jaxtrain, or "
                      f"data.num_shards > 0), so this data cannot resume from it")
    if state.get("version") != STATE_VERSION or len(state["cursors"]) != len(self.sources):
      raise DataError(f"data iterator state of version {state.get('version')} with "
                      f"{len(state['cursors'])} components; this stream is version "
                      f"{STATE_VERSION} with {len(self.sources)}")
    self._state = {"block": int(state["block"]), "row": int(state["row"]),
                   "cursors": [int(c) for c in state["cursors"]]}
    self._block = None

  # --- plan ------------------------------------------------------------------------------------

  def _plan_block(self) -> _Block:
    b, cursors = self._state["block"], self._state["cursors"]
    k = self.block_pieces
    if len(self.sources) == 1:
      component_K = np.zeros(k, np.int64)
    else:
      rng = np.random.default_rng([self.seed, b, 0x4D49])  # "MI": the mixture draw
      component_K = rng.choice(len(self.sources), size=k, p=self.weights)
    pieces_K3 = np.empty((k, 3), np.int64)
    for c, table in enumerate(self.tables):
      slots = np.flatnonzero(component_K == c)
      pieces_K3[slots] = table.lookup(self._epoch_order(c, cursors[c], len(slots)))
    row_starts, row_pieces = packing.pack_rows(pieces_K3[:, 2] - pieces_K3[:, 1] - 1,
                                               self.seq_len)
    if self.shuffle:
      order = np.random.default_rng([self.seed, b, 0x524F]).permutation(len(row_starts) - 1)
      sizes = np.diff(row_starts)[order]
      row_pieces = row_pieces[packing.ranges(row_starts[order], row_starts[order + 1])]
      row_starts = np.concatenate([[0], np.cumsum(sizes)])
    return _Block(pieces_K3, component_K, row_starts, row_pieces)

  def _epoch_order(self, c: int, cursor: int, n: int) -> np.ndarray:
    """Piece numbers of component c at stream positions [cursor, cursor + n)."""
    size = len(self.tables[c])
    positions = np.arange(cursor, cursor + n, dtype=np.int64)
    if not self.shuffle:
      return positions % size
    epoch_N, within_N = np.divmod(positions, size)
    out = np.empty(n, np.int64)
    for epoch in np.unique(epoch_N):
      at = epoch_N == epoch
      out[at] = permutation.permute(within_N[at], size,
                                    permutation.hash_key(self.seed, c, int(epoch)))
    return out

  def _advance_block(self) -> None:
    counts = np.bincount(self._block.component_K, minlength=len(self.sources))
    self._state = {"block": self._state["block"] + 1, "row": 0,
                   "cursors": [int(x + n) for x, n in zip(self._state["cursors"], counts)]}
    self._block = None

  # --- batches ---------------------------------------------------------------------------------

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    # Walk the batch's B rows block by block; keep the pieces of the rows this process loads.
    rows_B = self.rows
    pieces, components, row_ids = [], [], []
    i = 0  # global rows of this batch consumed so far
    while i < self.batch_size:
      if self._block is None:
        self._block = self._plan_block()
        if self.read_ahead:
          self._read_ahead_from(self._block, self._state["row"], i)
      block, r0 = self._block, self._state["row"]
      n = min(self.batch_size - i, block.num_rows - r0)
      mine = rows_B[(rows_B >= i) & (rows_B < i + n)]
      block_rows = mine - i + r0
      slots = block.row_pieces[packing.ranges(block.row_starts_R1[block_rows],
                                              block.row_starts_R1[block_rows + 1])]
      pieces.append(block.pieces_K3[slots])
      components.append(block.component_K[slots])
      if self.read_ahead:
        self.read_ahead.consumed(len(slots))
      # This process's row index (0.. len(rows)-1) of each piece.
      row_ids.append(np.repeat(np.searchsorted(rows_B, mine), np.diff(
          block.row_starts_R1)[block_rows]))
      i += n
      self._state["row"] += n
      if self._state["row"] == block.num_rows:
        self._advance_block()
    return self._read(np.concatenate(pieces), np.concatenate(components),
                      np.concatenate(row_ids))

  def _read_ahead_from(self, block: _Block, r0: int, i: int) -> None:
    """Hands the read-ahead thread the pieces of `block` this process will read, in order:
    block row r >= r0 is row (i + r - r0) mod B of a global batch, kept if it is one of ours."""
    rows_R = np.arange(r0, block.num_rows)
    mine = rows_R[np.isin((i + rows_R - r0) % self.batch_size, self.rows)]
    slots = block.row_pieces[packing.ranges(block.row_starts_R1[mine],
                                            block.row_starts_R1[mine + 1])]
    self.read_ahead.start_block(block.pieces_K3[slots], block.component_K[slots])

  def _read(self, pieces_Q3, component_Q, rows_Q) -> dict[str, np.ndarray]:
    if len(self.sources) == 1:
      read = self._readers[0]
    else:
      # The component rides in the doc number, so any subset of the pieces reads by itself.
      shift = max(len(t.lengths_N) for t in self.tables)
      pieces_Q3 = pieces_Q3.copy()
      pieces_Q3[:, 0] += component_Q * shift

      def read(pieces):
        component, doc = np.divmod(pieces[:, 0], shift)
        sizes = pieces[:, 2] - pieces[:, 1]
        token_start = np.cumsum(sizes) - sizes
        out = np.empty(int(sizes.sum()), np.int32)
        for c in np.unique(component).tolist():
          at = np.flatnonzero(component == c)
          mine = np.stack([doc[at], pieces[at, 1], pieces[at, 2]], axis=1)
          out[packing.ranges(token_start[at], token_start[at] + sizes[at])] = \
              self._readers[c](mine)
        return out
    batch = packing.assemble_rows(pieces_Q3, rows_Q, len(self.rows), self.seq_len, read)
    if self.vocab_size is not None:
      top = int(batch["targets"].max(initial=0))
      top = max(top, int(batch["inputs"].max(initial=0)))
      if top >= self.vocab_size:
        raise DataError(f"token id {top} is outside model.vocab_size={self.vocab_size}: the "
                        f"data was tokenized with a different tokenizer than the model's; "
                        f"re-prepare it with the model's tokenizer or fix model.vocab_size")
    return batch
