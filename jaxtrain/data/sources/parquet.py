"""Parquet files via pyarrow: random access by row through row groups."""

from __future__ import annotations


import numpy as np

from jaxtrain.data.sources.common import (DataError, FileCache, Source, check_nonempty, doc_index,
                                          resolve_files)



def _open_parquet(path: str):
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top  # optional dependency
  return pq.ParquetFile(path)


class ParquetSource(Source):
  """One document per row of a string column of Parquet files.

  Construction reads only the files' footers (schema, row groups). `__getitem__` decodes the
  row group holding the row, one column only, and keeps the last one: grain reads within
  shuffled windows, so consecutive reads often share a row group. Random access over the whole
  corpus decodes a row group per document; keep row groups small (a few MB) for such use.
  """

  kind = "parquet"

  def __init__(self, pattern_or_paths, *, column: str = "text", what: str = "paths"):
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    # paths: what messages name (a URL for an object); local_paths: where each is read.
    self.paths, self.local_paths = resolve_files(pattern_or_paths, what)
    self.column = column
    rg_file, rg_index, rg_rows = [], [], []
    for f, (path, local) in enumerate(zip(self.paths, self.local_paths)):
      try:
        meta = pq.read_metadata(local)
      except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
      schema = meta.schema.to_arrow_schema()
      if column not in schema.names:
        raise DataError(f"{path}: no column {column!r}; available columns: "
                        f"{', '.join(schema.names)}; set data.field to the text column")
      col_type = schema.field(column).type
      if not (pa.types.is_string(col_type) or pa.types.is_large_string(col_type)
              or pa.types.is_string_view(col_type)):
        raise DataError(f"{path}: column {column!r} has type {col_type}, not string; set "
                        f"data.field to a text column")
      for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        if n:  # an empty row group would share its start with the next one
          rg_file.append(f)
          rg_index.append(g)
          rg_rows.append(n)
    self._rg_file_G = np.array(rg_file, dtype=np.int64)
    self._rg_index_G = np.array(rg_index, dtype=np.int64)
    # Row group g holds global rows [rg_starts_G1[g], rg_starts_G1[g+1]).
    self._rg_starts_G1 = np.concatenate(([0], np.cumsum(rg_rows, dtype=np.int64)))
    self._files = FileCache(_open_parquet)
    self._cached = None  # (row group, pyarrow Array); set per process
    check_nonempty(self.kind, self.paths, len(self), what)

  def __len__(self) -> int:
    return int(self._rg_starts_G1[-1])

  def __getstate__(self):
    state = self.__dict__.copy()
    state["_cached"] = None  # a decoded row group is large and cheap to re-read
    return state

  def __getitem__(self, i) -> str:
    row = doc_index(i, len(self))
    g = int(np.searchsorted(self._rg_starts_G1, row, side="right")) - 1
    f = int(self._rg_file_G[g])
    with self._files.lock:
      cached = self._cached
      if cached is None or cached[0] != g:
        pf = self._files.get(f, self.local_paths[f])
        table = pf.read_row_group(int(self._rg_index_G[g]), columns=[self.column])
        cached = self._cached = (g, table.column(0).combine_chunks())
    value = cached[1][row - int(self._rg_starts_G1[g])].as_py()
    if value is None:
      file_row = row - int(self._rg_starts_G1[np.searchsorted(self._rg_file_G, f)])
      raise DataError(f"{self.paths[f]}: row {file_row} of column {self.column!r} is null; drop "
                      f"null rows from the file")
    return value

  def _describe_extra(self) -> str:
    return f", column {self.column!r}"
