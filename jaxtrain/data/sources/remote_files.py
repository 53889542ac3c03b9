"""Raw document files (JSONL, text, Parquet) named by s3:// or gs:// URLs: their expansion into
objects, and the local cache the sources read them from.

The raw sources read by seeking within a file (a JSONL line, a Parquet row group), from several
processes, so an object is not read in place: each one a source names is downloaded whole, once,
and the source's readers read the copy like any local file.

The cache. The copy of `s3://BUCKET/dir/docs.jsonl` is
`$JAXTRAIN_STAGING_DIR/s3/BUCKET/dir/docs.jsonl@VERSION` (`storage.staging_path`; by default
under the system's temp directory), VERSION a digest of the object's size and ETag (gs://: its
generation) as listed when the source is built. An unchanged object is not downloaded again; a
rewritten one gets a new VERSION and a new copy beside the old, which a run still reading it
keeps reading whole (old copies stay until the directory is deleted). A download is written
under a temporary name and renamed when complete, so a killed download is never taken for the
file, and processes (or hosts sharing the directory) fetching the same object at once each
rename a whole copy into place.

Downloads happen where a source is built: in the process that builds it, before grain's or
prepare's worker processes start, which are handed the local paths.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

from jaxtrain import storage
from jaxtrain.storage import DataError


def expand(pattern: str, what: str) -> list[tuple[str, int, str]]:
  """(URL, size, version) of the objects a URL names: the object itself, or those its glob
  matches (`**` any depth), sorted by URL.

  Raises:
    DataError: one line naming `data.<what>` and the URL: a scheme jaxtrain does not read, the
      client package missing, a bucket that does not exist, no object there, a glob matching
      none.
  """
  key = f"data.{what}"
  storage.check_url(pattern, key)
  storage.check_bucket(pattern, key)
  if any(c in pattern for c in "*?["):
    found = storage.glob_objects(pattern)
    if not found:
      raise DataError(f"{key}: no objects match {pattern!r}; check the URL and the glob")
    return found
  version = storage.object_version(pattern)
  if version is None:
    if storage.isdir(pattern):
      raise DataError(f"{key}: {pattern!r} is a directory; name its files with a glob such as "
                      f"'{storage.join(pattern.rstrip('/'), '*.jsonl')}'")
    raise DataError(f"{key}: {pattern} does not exist (no such object); check the URL")
  return [(pattern, *version)]


def cache_path(url: str, size: int, version: str) -> str:
  """Where the copy of this version of the object at `url` is kept (see the module docstring)."""
  digest = hashlib.sha256(f"{size}:{version}".encode()).hexdigest()[:12]
  return f"{storage.staging_path(url)}@{digest}"


def fetch(objects: list[tuple[str, int, str]]) -> list[str]:
  """The local copy of each (URL, size, version), downloading those not yet cached (all at
  once, concurrently).

  Raises:
    DataError: a download failed (one line naming the object), or an object's size changed
      between its listing and its download (rewritten meanwhile: run again).
  """
  paths = [cache_path(*o) for o in objects]
  missing = [(o, p) for o, p in zip(objects, paths)
             if not (os.path.isfile(p) and os.path.getsize(p) == o[1])]
  if not missing:
    return paths
  temps = []
  try:
    for _, path in missing:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      # A name of this process's own, in the copy's directory, so that the rename is atomic.
      fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path),
                                 prefix=os.path.basename(path) + ".tmp-")
      os.close(fd)
      temps.append(tmp)
    storage.download_files([o[0] for o, _ in missing], temps)
    for ((url, size, _), path), tmp in zip(missing, temps):
      if os.path.getsize(tmp) != size:
        raise DataError(f"{url}: {os.path.getsize(tmp):,} bytes downloaded, but {size:,} were "
                        f"listed: the object was rewritten meanwhile; run again")
      os.replace(tmp, path)
  finally:
    for tmp in temps:
      if os.path.exists(tmp):
        os.remove(tmp)
  return paths
