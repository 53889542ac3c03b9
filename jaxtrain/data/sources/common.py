"""Shared pieces of the document sources: errors, path expansion, the per-process file cache,
and the base class. See `jaxtrain.data.sources` for the overview."""

from __future__ import annotations

import collections
import glob
import math
import os
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from jaxtrain.data.sources import remote_files
from jaxtrain.storage import DataError  # the error every source raises (see its docstring)

# Open files kept per source and process. A corpus of thousands of shards must not exhaust the
# process's file descriptors; grain reads within shuffled windows, so a few files are hot.
MAX_OPEN_FILES = 32




def _has_glob_magic(s: str) -> bool:
  return any(c in s for c in "*?[")


def _expand(pattern_or_paths, what: str) -> list[tuple[str, tuple[int, str] | None]]:
  """(name, None) for each local file and (URL, (size, version)) for each object the paths
  and globs name, in `resolve_paths` order, each once."""
  if isinstance(pattern_or_paths, (str, os.PathLike)):
    patterns = [pattern_or_paths]
  elif isinstance(pattern_or_paths, Sequence):
    patterns = list(pattern_or_paths)
  else:
    raise DataError(f"data.{what}={pattern_or_paths!r}: expected a path, a glob or a list of "
                    f"them")
  if not patterns:
    raise DataError(f"data.{what}: no paths given; set it to a file, a glob or a list of them")
  resolved, seen = [], set()
  for pattern in patterns:
    if not isinstance(pattern, (str, os.PathLike)):
      raise DataError(f"data.{what}: {pattern!r} is not a path; use strings")
    pattern = os.path.expanduser(os.fspath(pattern))
    if "://" in pattern:
      # Object storage (s3://, gs://); imported here, as the storage layer imports this module.
          matches = [(url, (size, version))
                 for url, size, version in remote_files.expand(pattern, what)]
    else:
      matches = [(os.path.abspath(p), None) for p in _local_matches(pattern, what)]
    for name, version in matches:
      if name not in seen:
        seen.add(name)
        resolved.append((name, version))
  return resolved


def _local_matches(pattern: str, what: str) -> list[str]:
  if _has_glob_magic(pattern):
    matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
  elif os.path.isdir(pattern):
    raise DataError(f"data.{what}: {pattern!r} is a directory; name its files with a glob "
                    f"such as '{os.path.join(pattern, '*.jsonl')}'")
  else:
    matches = [pattern] if os.path.isfile(pattern) else []
  if not matches:
    raise DataError(f"data.{what}: no files match {pattern!r} (cwd: {os.getcwd()}); check the "
                    f"path or quote the glob")
  return matches


def resolve_paths(pattern_or_paths, what: str = "paths") -> list[str]:
  """Absolute paths of the files, and URLs of the objects, named by a path, a glob, or a list
  of them.

  Each glob expands recursively (`**`) and sorted, so the document order does not depend on the
  file system's directory order; the list's own order is kept. A file named twice is kept once,
  where first named. Paths are absolute so a pickled source still finds its files if the reading
  process runs in another directory. An s3:// or gs:// URL names an object, or with a glob the
  objects it matches, listed through fsspec (`jaxtrain.storage`), sorted alike.

  Args:
    pattern_or_paths: a path, URL or glob (str or os.PathLike), or a sequence of them.
    what: the config key under `data.` that holds the paths, for error messages.

  Raises:
    DataError: nothing given, a pattern matching no file or object, a directory given as a file,
      a URL that cannot be read (scheme, client package, bucket); one line naming the path.
  """
  return [name for name, _ in _expand(pattern_or_paths, what)]


def resolve_files(pattern_or_paths, what: str = "paths") -> tuple[list[str], list[str]]:
  """(names, local paths) of the files `resolve_paths` names: a local file is read where it is,
  an object from its copy in the local cache (remote_files.py), downloaded now when missing or
  out of date. Sources read the local paths and name the files in messages by their names.
  Where nothing is remote both are the same list, which a source's pickle then holds once."""
  entries = _expand(pattern_or_paths, what)
  names = [name for name, _ in entries]
  remote = [(i, (name, *version)) for i, (name, version) in enumerate(entries) if version]
  if not remote:
    return names, names
  local = list(names)
  for (i, _), path in zip(remote, remote_files.fetch([o for _, o in remote])):
    local[i] = path
  return names, local


def check_mixture_weights(weights: Mapping[str, float]) -> dict[str, float]:
  """Validates per-source mixture weights; returns them normalized to sum to 1.

  Raises:
    DataError: no sources, or a weight that is not a finite positive number (the message names
      the source).
  """
  if not weights:
    raise DataError("data.mixture: no sources; give at least one source with a positive weight")
  for name, w in weights.items():
    # bool is an int, but `True` as a weight is a config mistake, not a weight of 1.
    if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)):
      raise DataError(f"data.mixture: weight of source {name!r} is {w!r}; use a positive number")
    if not math.isfinite(w) or w <= 0:
      raise DataError(f"data.mixture: weight of source {name!r} is {w}; weights must be finite "
                      f"and > 0 (remove the source to leave it out)")
  total = float(sum(weights.values()))
  return {name: float(w) / total for name, w in weights.items()}


def check_nonempty(kind: str, paths: Sequence[str], num_docs: int, what: str, hint: str = ""):
  if num_docs == 0:
    shown = paths[0] if len(paths) == 1 else f"{len(paths)} files ({paths[0]}, ...)"
    raise DataError(f"data.{what}: empty corpus: {kind} {shown} contains no documents"
                    f"{hint}; check the paths")




class FileCache:
  """Per-process LRU of open files, keyed by file index; pickles empty.

  Callers hold `lock` for the whole use of a handle: handles are shared by grain's read threads
  (seek + readline is not atomic), and eviction closes a handle.
  """

  def __init__(self, opener, capacity: int = MAX_OPEN_FILES):
    self._opener = opener  # a module-level function, so the cache pickles by reference
    self._capacity = capacity
    self._reset()

  def _reset(self):
    self.lock = threading.Lock()
    self._files = collections.OrderedDict()
    self._pid = os.getpid()

  def get(self, index: int, path: str):
    """The open file for `path`; call with `lock` held."""
    if self._pid != os.getpid():
      # Forked: the inherited handles share file offsets with the parent. Drop, don't close
      # (closing could flush or release state the parent still uses).
      self._reset()
    f = self._files.get(index)
    if f is None:
      if len(self._files) >= self._capacity:
        _, old = self._files.popitem(last=False)
        old.close()
      f = self._files[index] = self._opener(path)
    else:
      self._files.move_to_end(index)
    return f

  def close(self):
    with self.lock:
      for f in self._files.values():
        f.close()
      self._files.clear()

  def __getstate__(self):
    return {"_opener": self._opener, "_capacity": self._capacity}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._reset()


def open_binary(path: str):
  return open(path, "rb")  # pylint: disable=consider-using-with  # closed by FileCache


def doc_index(i, n: int) -> int:
  # grain passes numpy integers; operator-style indexing accepts any __index__.
  i = i.__index__()
  if i < 0:
    i += n
  if not 0 <= i < n:
    raise IndexError(f"document {i} out of range for a source of {n} documents")
  return i


class Source:
  """Shared `describe()` / `__repr__` for the sources below."""

  kind = ""
  paths: list[str]

  def _describe_extra(self) -> str:
    return ""

  def describe(self) -> str:
    """One line: kind, number of files and documents."""
    files = "file" if len(self.paths) == 1 else "files"
    return f"{self.kind}: {len(self.paths)} {files}, {len(self)} documents{self._describe_extra()}"

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.describe()})"

  def __len__(self) -> int:
    raise NotImplementedError

  def location(self, i) -> str:
    """Where document `i` is, for error messages ("record i" unless a source knows better)."""
    return f"record {int(i)}"


def record_location(source, i) -> str:
  """`source.location(i)` ("FILE:LINE" for JSONL records), else "record i": where a data error
  in record i of `source` points the user."""
  locate = getattr(source, "location", None)
  return locate(i) if locate is not None else f"record {int(i)}"
