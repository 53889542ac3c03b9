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

import importlib.util
import os
import posixpath

from jaxtrain.data.sources.common import DataError

# Scheme -> the fsspec implementation's package (in the `cloud` extra).
SCHEMES = {"s3": "s3fs", "gs": "gcsfs"}
CLOUD_EXTRA = 'pip install -e ".[cloud]"'


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
    return StorageError(f"{url}: no credentials for {url.partition('://')[0]}://; set "
                        f"AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE (s3), or "
                        f"GOOGLE_APPLICATION_CREDENTIALS (gs) ({text[:120]})")
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


def read_ranges(path: str, ranges: list[tuple[int, int]]) -> list[bytes]:
  """The bytes [start, end) of each range of one object, fetched concurrently (one request per
  range: the caller coalesces neighbours)."""
  if not ranges:
    return []
  if not is_url(path):
    with open(path, "rb") as f:
      out = []
      for start, end in ranges:
        f.seek(start)
        out.append(f.read(end - start))
      return out

  def fetch(fs, p):
    return fs.cat_ranges([p] * len(ranges), [s for s, _ in ranges], [e for _, e in ranges])
  return list(_call(path, fetch))
