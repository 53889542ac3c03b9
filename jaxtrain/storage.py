"""Paths that may be object-storage URLs: `s3://BUCKET/...` and `gs://BUCKET/...` beside local
paths, through fsspec (s3fs, gcsfs: the `cloud` extra).

Credentials and endpoints are the client libraries' own: AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_PROFILE / instance roles and AWS_ENDPOINT_URL (an S3-compatible
server) for s3://; Application Default Credentials (GOOGLE_APPLICATION_CREDENTIALS, a VM's
service account) for gs://. Every failure a user can fix is one line naming the URL and the fix
(`StorageError`, a DataError): a scheme we do not read, the extra not installed, a bucket that
does not exist, no credentials, an object that is not there.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import posixpath
import shutil
import tempfile
import time

# Scheme -> the fsspec implementation's package (in the `cloud` extra).
SCHEMES = {"s3": "s3fs", "gs": "gcsfs"}
CLOUD_EXTRA = 'pip install -e ".[cloud]"'


class DataError(ValueError):
  """Unusable input data or data paths; the message names the file, the problem and the fix.

  Defined here, on the ground floor, because a path that cannot be read is the first data error
  (StorageError); the data sources raise it too (`jaxtrain.data.sources.DataError`)."""


class StorageError(DataError):
  """A path that cannot be read or written as asked; the message is one line with the fix."""


def is_url(path) -> bool:
  """Whether `path` names object storage (`scheme://...`) rather than a local file."""
  return "://" in os.fspath(path)


def check_url(url: str, key: str = "") -> None:
  """Raises StorageError (one line, starting with `key`) for a URL whose scheme jaxtrain does not
  read, or whose client package is not installed."""
  where = f"{key}: " if key else ""
  scheme, _, rest = url.partition("://")
  if scheme not in SCHEMES:
    raise StorageError(f"{where}{url!r}: the scheme {scheme + '://'!r} is not supported; use a "
                       f"local path, s3://BUCKET/... or gs://BUCKET/...")
  if not rest.split("/", 1)[0]:
    raise StorageError(f"{where}{url!r}: no bucket; write {scheme}://BUCKET/PATH")
  if importlib.util.find_spec(SCHEMES[scheme]) is None:
    raise StorageError(f"{where}{url!r} needs the {SCHEMES[scheme]} package; install the cloud "
                       f"extra: {CLOUD_EXTRA}")


def _filesystem(url: str):
  """(fsspec filesystem, the path within it) of a URL."""
  check_url(url)
  import fsspec  # pylint: disable=import-outside-toplevel  # the cloud extra brings it
  return fsspec.core.url_to_fs(url)


def _explain(url: str, e: Exception) -> StorageError:
  """The one-line StorageError for a client failure on `url`."""
  bucket = url.partition("://")[2].split("/", 1)[0]
  text = " ".join(f"{type(e).__name__}: {e}".split())
  if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
    return StorageError(f"{url}: the bucket {bucket!r} does not exist (or is not visible to "
                        f"these credentials); create it or fix the URL")
  if "NoCredentials" in text or "credentials" in text.lower():
    scheme = url.partition("://")[0]
    how = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run on a machine "
           "with an instance role" if scheme == "s3" else
           "run `gcloud auth application-default login`, set GOOGLE_APPLICATION_CREDENTIALS, or "
           "run on a VM with a service account")
    return StorageError(f"{url}: no credentials for {scheme}://; {how} ({text[:120]})")
  if isinstance(e, FileNotFoundError):
    return StorageError(f"{url}: no such object")
  return StorageError(f"{url}: {text[:200]}")


def _call(url: str, what):
  """what(fs, path) with the client's failures turned into one-line StorageErrors."""
  fs, path = _filesystem(url)
  try:
    return what(fs, path)
  except StorageError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # the clients raise many kinds
    raise _explain(url, e) from None


def join(base: str, *names: str) -> str:
  """`base` / names, for URLs and local paths alike."""
  if is_url(base):
    return posixpath.join(base, *names)
  return os.path.join(base, *names)


def parent(path: str) -> str:
  """The directory that holds `path` (a URL's parent is a URL)."""
  if is_url(path):
    return posixpath.dirname(path.rstrip("/"))
  return os.path.dirname(os.path.abspath(path))


def exists(path: str) -> bool:
  if not is_url(path):
    return os.path.exists(path)
  return bool(_call(path, lambda fs, p: fs.exists(p)))


def check_bucket(url: str, key: str = "") -> None:
  """StorageError (one line, starting with `key`) when the URL's bucket does not exist or these
  credentials cannot see it: said before anything looks for objects in it, which would only find
  none."""
  scheme, _, rest = url.partition("://")
  bucket = rest.split("/", 1)[0]
  if not _call(f"{scheme}://{bucket}", lambda fs, p: fs.exists(p)):
    where = f"{key}: " if key else ""
    # exists() answers False for any failure: a listing says why (no credentials, no bucket).
    def listing(fs, _):
      try:
        fs.ls(f"{scheme}://{bucket}", refresh=True)
      except FileNotFoundError:  # gcsfs's answer to any 404, a missing bucket's too: said below
        pass
    try:
      _call(url, listing)
    except StorageError as e:
      raise StorageError(f"{where}{e}") from None
    raise StorageError(f"{where}{url}: the bucket {bucket!r} does not exist (or these "
                       f"credentials cannot see it); create it or fix the URL")


def isdir(path: str) -> bool:
  if not is_url(path):
    return os.path.isdir(path)
  return bool(_call(path, lambda fs, p: fs.isdir(p)))


def isfile(path: str) -> bool:
  if not is_url(path):
    return os.path.isfile(path)
  return bool(_call(path, lambda fs, p: fs.isfile(p)))


def size(path: str) -> int:
  if not is_url(path):
    return os.path.getsize(path)
  return int(_call(path, lambda fs, p: fs.size(p)))


def read_bytes(path: str) -> bytes:
  if not is_url(path):
    with open(path, "rb") as f:
      return f.read()
  return _call(path, lambda fs, p: fs.cat_file(p))


def read_ranges_many(requests: list[tuple[str, int, int]]) -> list[bytes]:
  """The bytes [start, end) of each (path, start, end), all fetched concurrently in one call per
  filesystem (the objects of one bucket and scheme share a client)."""
  out: list[bytes | None] = [None] * len(requests)
  groups: dict[str, list[int]] = {}
  for i, (path, _, _) in enumerate(requests):
    key = path.partition("://")[0] + "://" + path.partition("://")[2].split("/", 1)[0] \
        if is_url(path) else ""
    groups.setdefault(key, []).append(i)
  for key, members in groups.items():
    if not key:  # local files
      for i in members:
        path, start, end = requests[i]
        with open(path, "rb") as f:
          f.seek(start)
          out[i] = f.read(end - start)
      continue

    def fetch(fs, _, members=members):
      paths = [fs._strip_protocol(requests[i][0]) for i in members]  # pylint: disable=protected-access
      return fs.cat_ranges(paths, [requests[i][1] for i in members],
                           [requests[i][2] for i in members], on_error="raise")
    for i, data in zip(members, _call(requests[members[0]][0], fetch)):
      out[i] = data
  return out


def read_ranges(path: str, ranges: list[tuple[int, int]]) -> list[bytes]:
  """The bytes [start, end) of each range of one object, fetched concurrently (one request per
  range: the caller coalesces neighbours)."""
  return read_ranges_many([(path, start, end) for start, end in ranges])


# --- Whole directories: what checkpoints, workdirs and weights directories on a bucket need. ---

STAGING_ENV = "JAXTRAIN_STAGING_DIR"


def staging_path(url: str, *parts: str) -> str:
  """The local directory where a URL's files are staged (written before an upload, read after a
  download): `$JAXTRAIN_STAGING_DIR/<scheme>/<bucket>/<path>`, by default under the system's temp
  directory. A run on several hosts stages checkpoints for s3:// in it, so there it must be a
  directory all hosts share (jaxtrain/checkpointing/mirror.py)."""
  root = os.environ.get(STAGING_ENV) or os.path.join(
      tempfile.gettempdir(), f"jaxtrain-staging-{os.getuid() if hasattr(os, 'getuid') else 0}")
  scheme, _, rest = url.partition("://")
  return os.path.join(os.path.abspath(os.path.expanduser(root)), scheme,
                      *[p for p in rest.split("/") if p not in ("", ".", "..")], *parts)


def listdir(path: str) -> list[str]:
  """Names (not paths) of the entries directly under `path`; [] when it does not exist."""
  if not is_url(path):
    return sorted(os.listdir(path)) if os.path.isdir(path) else []

  def names(fs, p):
    try:
      entries = fs.ls(p, detail=False, refresh=True)
    except FileNotFoundError:
      return []
    return sorted({posixpath.basename(e.rstrip("/")) for e in entries} - {""})
  return _call(path, names)


def write_bytes(path: str, data: bytes) -> None:
  if not is_url(path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
      f.write(data)
    return
  _call(path, lambda fs, p: fs.pipe_file(p, data))


def remove_tree(path: str, *, first: tuple[str, ...] = ()) -> None:
  """Deletes `path` and everything under it; nothing when it does not exist. The files named in
  `first` (paths relative to `path`: a checkpoint step's commit marker) are deleted before the
  rest, so a reader that finds them still there finds everything else too."""
  if not is_url(path):
    for name in first:
      with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        os.remove(os.path.join(path, name))
    shutil.rmtree(path, ignore_errors=True)
    return

  def remove(fs, p):
    files = fs.find(p)
    base = p.rstrip("/")
    lead = [f for f in files if posixpath.relpath(f, base) in first]
    for group in (lead, [f for f in files if f not in lead]):
      if group:  # the first group's deletes are answered before the second's start
        fs.rm(group)
  _call(path, remove)


# S3's smallest part of a multipart upload but the last one: an object smaller than this cannot
# be the copied first part of an append.
S3_MIN_PART = 5 * 2**20


def append_bytes(path: str, data: bytes, *, size: int) -> bool:
  """Appends `data` to the object at `path`, which holds `size` bytes, on the server side where
  the store can, sending only `data`; readers see the old object or the new one, never a part.
  On s3:// an object of at least S3_MIN_PART bytes: a multipart upload whose first part is
  copied from the object itself and whose second is `data`. On gs://: `data` as an object of
  its own, composed after the object into it. False, with nothing changed, where it cannot (a
  smaller object on s3://, another size than `size`, a gs:// object composed of the most parts
  GCS allows): the caller then writes the whole object. A local file is appended to."""
  if not data:
    return True
  if not is_url(path):
    with open(path, "ab") as f:
      f.write(data)
    return True
  if path.startswith("gs://"):
    return bool(_call(path, lambda fs, p: _compose(fs, p, data, size)))
  if not path.startswith("s3://") or size < S3_MIN_PART:
    return False

  def append(fs, p):
    fs.invalidate_cache(p)
    if int(fs.info(p).get("size") or -1) != size:
      return False
    bucket, key, _ = fs.split_path(p)
    upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    where = dict(Bucket=bucket, Key=key, UploadId=upload)
    try:
      copied = fs.call_s3("upload_part_copy", **where, PartNumber=1,
                          CopySource={"Bucket": bucket, "Key": key},
                          CopySourceRange=f"bytes=0-{size - 1}")
      sent = fs.call_s3("upload_part", **where, PartNumber=2, Body=data)
      fs.call_s3("complete_multipart_upload", **where, MultipartUpload={"Parts": [
          {"PartNumber": 1, "ETag": copied["CopyPartResult"]["ETag"]},
          {"PartNumber": 2, "ETag": sent["ETag"]}]})
    except BaseException:
      with contextlib.suppress(Exception):
        fs.call_s3("abort_multipart_upload", **where)
      raise
    finally:
      fs.invalidate_cache(p)
    return True
  return bool(_call(path, append))


def _compose(fs, p: str, data: bytes, size: int) -> bool:
  """append_bytes on gs://. A composed object counts its parts, at most 1024: past that (or
  wherever else the compose is refused) the caller's whole write starts again from one."""
  fs.invalidate_cache(p)
  if int(fs.info(p).get("size") or -1) != size:
    return False
  part = f"{p}.append-{os.getpid()}-{time.time_ns()}"
  fs.pipe_file(part, data)
  try:
    fs.merge(p, [p, part])
  except Exception:  # pylint: disable=broad-except  # the caller writes the object whole
    return False
  finally:
    with contextlib.suppress(Exception):
      fs.rm(part)
    fs.invalidate_cache(p)
  return True


def local_files(local_dir: str, exclude: tuple[str, ...]) -> list[str]:
  """Paths relative to `local_dir` of its files, sorted, without those under `exclude`d
  top-level names."""
  out = []
  for root, dirs, files in os.walk(local_dir):
    rel_root = os.path.relpath(root, local_dir)
    if rel_root == ".":
      dirs[:] = [d for d in dirs if d not in exclude]
    out += [os.path.normpath(os.path.join(rel_root, f)) for f in files
            if rel_root != "." or f not in exclude]
  return sorted(out)


def upload_dir(local_dir: str, url: str, *, last: tuple[str, ...] = (),
               exclude: tuple[str, ...] = (), only: list[str] | None = None) -> list[str]:
  """Copies the files under `local_dir` to the same relative paths under `url`, concurrently;
  the files named in `last` (relative paths) after all others, so a reader that waits for them
  sees the rest complete. `only` limits the copy to those relative paths. Returns the relative
  paths copied."""
  rel = [p for p in (only if only is not None else local_files(local_dir, exclude))
         if os.path.isfile(os.path.join(local_dir, p))]
  first = [p for p in rel if p not in last]
  then = [p for p in last if p in rel]

  def put(fs, base):
    for group in (first, then):
      if group:
        fs.put([os.path.join(local_dir, p) for p in group],
               [posixpath.join(base, p.replace(os.sep, "/")) for p in group])
  _call(url, put)
  return rel


def download_dir(url: str, local_dir: str, *, exclude: tuple[str, ...] = ()) -> list[str]:
  """Copies every object under `url` to the same relative paths under `local_dir` (created),
  concurrently, leaving out those under `exclude`d top-level names. Returns the relative paths.
  Raises StorageError when nothing is there."""
  def get(fs, base):
    base = base.rstrip("/")
    remote = [f for f in fs.find(base) if not f.endswith("/")]
    # find() caches every listing under `base`, which other clients (Orbax's own) then change:
    # later exists()/isdir() calls must ask the store again.
    fs.invalidate_cache(base)
    rel = [posixpath.relpath(f, base) for f in remote]
    keep = [(r, f) for r, f in zip(rel, remote) if r.split("/", 1)[0] not in exclude]
    for r, _ in keep:
      os.makedirs(os.path.dirname(os.path.join(local_dir, r)), exist_ok=True)
    if keep:
      fs.get([f for _, f in keep], [os.path.join(local_dir, r) for r, _ in keep])
    return [r for r, _ in keep]
  os.makedirs(local_dir, exist_ok=True)
  return _call(url, get)


# --- Objects one by one and by glob: what raw data files on a bucket need. ---


def _object_version(info: dict) -> str:
  """What changes when an object is rewritten, from its listing entry: the ETag (s3://), the
  generation (gs://), else a checksum or the modification time."""
  for key in ("ETag", "etag", "generation", "md5Hash", "crc32c", "LastModified", "mtime",
              "updated"):
    if info.get(key) is not None:
      return str(info[key])
  return ""


def glob_objects(pattern: str) -> list[tuple[str, int, str]]:
  """(URL, size, version) of every object a glob URL matches (`*`, `?`, `[...]`, and `**` for
  any depth, as Python's recursive glob), sorted by URL; [] when none match. The version is
  the object's ETag or generation: it changes when the object is rewritten."""
  scheme = pattern.partition("://")[0]

  def match(fs, p):
    fs.invalidate_cache()  # a listing cached earlier in this process may predate a rewrite
    return fs.glob(p, detail=True)
  found = _call(pattern, match)
  return sorted((f"{scheme}://{name.lstrip('/')}", int(info.get("size") or 0),
                 _object_version(info))
                for name, info in found.items() if info.get("type") == "file")


def object_version(url: str) -> tuple[int, str] | None:
  """(size, version) of the object at `url` (see glob_objects); None when there is no object
  there (nothing, or only a prefix of other objects)."""
  def stat(fs, p):
    fs.invalidate_cache(p)  # an entry cached earlier in this process may predate a rewrite
    try:
      info = fs.info(p)
    except FileNotFoundError:
      return None
    return (int(info.get("size") or 0), _object_version(info)) if info.get(
        "type") == "file" else None
  return _call(url, stat)


def download_files(urls: list[str], local_paths: list[str]) -> None:
  """Copies each object in `urls` to the local path beside it (its directory must exist),
  concurrently."""
  by_scheme: dict[str, list[tuple[str, str]]] = {}
  for url, local in zip(urls, local_paths):
    by_scheme.setdefault(url.partition("://")[0], []).append((url, local))
  for pairs in by_scheme.values():
    # A failure names the first object; the client's own text, which _explain keeps, names
    # the one that failed.
    label = pairs[0][0] if len(pairs) == 1 else f"{pairs[0][0]} (and {len(pairs) - 1} more)"
    fs, _ = _filesystem(pairs[0][0])
    try:
      fs.get([u.partition("://")[2] for u, _ in pairs], [p for _, p in pairs])
    except Exception as e:  # pylint: disable=broad-except  # the clients raise many kinds
      raise _explain(label, e) from None


def remove_files(urls: list[str]) -> None:
  """Deletes the objects in `urls`, concurrently (s3://: a request per thousand)."""
  by_scheme: dict[str, list[str]] = {}
  for url in urls:
    by_scheme.setdefault(url.partition("://")[0], []).append(url)
  for group in by_scheme.values():
    _call(group[0], lambda fs, _, group=group: fs.rm([u.partition("://")[2] for u in group]))
