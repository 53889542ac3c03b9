"""Reading ahead of the global stream for corpora on object storage.

The stream plans a block of pieces at once (global_stream.py), so when a block is planned the
pieces this process will read in the next hundreds of batches are known, in order. A background
thread hands them to their sources' `warm` (PreparedCorpus: one concurrent ranged-read call for a
chunk of pieces, remote_tokens.fetch) while the training loop runs, staying at most
`ahead_pieces` beyond what the stream has consumed so the source's bounded cache keeps what was
fetched until it is read. The reads themselves do not change: a piece not warmed in time (or
dropped from the cache) is fetched by the reader, so batches and their order never depend on
the thread; only the wait for the network moves off the step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

# Pieces fetched ahead of the reader at most, unless a source says how many its cache holds
# (PreparedCorpus.read_ahead_pieces), and per fetch call (its ranged reads run concurrently).
AHEAD_PIECES = 128
CHUNK_PIECES = 32


class ReadAhead:
  """Warms the pieces of the current block ahead of the reader (see the module docstring)."""

  def __init__(self, warm_fns: Sequence[Callable[[np.ndarray], None] | None],
               ahead_pieces: int = AHEAD_PIECES, chunk_pieces: int = CHUNK_PIECES):
    self._warm_fns = list(warm_fns)
    self.ahead_pieces, self.chunk_pieces = ahead_pieces, chunk_pieces
    self._cond = threading.Condition()
    self._pieces_K3 = np.zeros((0, 3), np.int64)
    self._component_K = np.zeros(0, np.int64)
    self._consumed = self._warmed = 0
    self._stopped = False
    self._thread: threading.Thread | None = None
    self.chunks_warmed = 0  # for tests and benchmarks

  def start_block(self, pieces_K3: np.ndarray, component_K: np.ndarray) -> None:
    """The pieces this process reads next, in the order it reads them (the rest of a block)."""
    with self._cond:
      self._pieces_K3, self._component_K = pieces_K3, component_K
      self._consumed = self._warmed = 0
      self._stopped = False
      self._cond.notify_all()
      if self._thread is None or not self._thread.is_alive():
        self._thread = threading.Thread(target=self._run, name="jaxtrain-read-ahead",
                                        daemon=True)
        self._thread.start()

  def consumed(self, n: int) -> None:
    """The reader has taken the next `n` pieces."""
    with self._cond:
      self._consumed += n
      self._cond.notify_all()

  def close(self) -> None:
    """Ends the thread (the stream is done with)."""
    with self._cond:
      self._stopped = True
      self._cond.notify_all()

  def _next_chunk(self):
    with self._cond:
      def ready():
        lo = max(self._warmed, self._consumed)
        return self._stopped or (lo < len(self._pieces_K3)
                                 and lo < self._consumed + self.ahead_pieces)
      self._cond.wait_for(ready)
      if self._stopped:
        return None
      lo = max(self._warmed, self._consumed)
      hi = min(len(self._pieces_K3), lo + self.chunk_pieces, self._consumed + self.ahead_pieces)
      self._warmed = hi
      return self._pieces_K3[lo:hi], self._component_K[lo:hi]

  def _run(self) -> None:
    while (chunk := self._next_chunk()) is not None:
      pieces_K3, component_K = chunk
      for c in np.unique(component_K).tolist():
        warm = self._warm_fns[c]
        if warm is None:
          continue
        try:
          warm(pieces_K3[component_K == c])
        except Exception:  # pylint: disable=broad-except
          # The reader fetches these pieces itself and reports the failure where it can say
          # which batch and file; a warming error is only a missed head start.
          pass
      self.chunks_warmed += 1
