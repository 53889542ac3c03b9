"""Plain text files, one document per file."""

from __future__ import annotations



from jaxtrain.data.sources.common import DataError, Source, doc_index, resolve_files



class TextFileSource(Source):
  """One document per plain text file (UTF-8), in `resolve_paths` order.

  Files are read whole at `__getitem__`, so nothing is read at construction (objects on a bucket
  are downloaded then, remote_files.py) and the source costs one path per document (two for
  objects: the URL, and its local copy's path).
  """

  kind = "text"

  def __init__(self, pattern_or_paths, *, on_decode_error: str = "fail", what: str = "paths"):
    """Args:
      pattern_or_paths: see `resolve_paths`.
      on_decode_error: "fail" raises `DataError` at invalid UTF-8; "replace" substitutes U+FFFD.
      what: config key under `data.` for error messages.
    """
    if on_decode_error not in ("fail", "replace"):
      raise DataError(f"on_decode_error={on_decode_error!r}: choose 'fail' or 'replace'")
    # paths: what messages name (a URL for an object); local_paths: where each is read.
    self.paths, self.local_paths = resolve_files(pattern_or_paths, what)
    self.on_decode_error = on_decode_error

  def __len__(self) -> int:
    return len(self.paths)

  def __getitem__(self, i) -> str:
    d = doc_index(i, len(self.paths))
    path = self.paths[d]
    with open(self.local_paths[d], "rb") as f:
      raw = f.read()
    if self.on_decode_error == "replace":
      return raw.decode("utf-8", errors="replace")
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise DataError(f"{path}: invalid UTF-8 at byte offset {e.start} ({e.reason}); re-encode "
                      f"the file as UTF-8 or use on_decode_error='replace'") from None
