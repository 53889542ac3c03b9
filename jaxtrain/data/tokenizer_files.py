"""Tokenizer files named by s3:// or gs:// URLs (`hf:s3://...`, `sentencepiece:gs://...`): the
tokenizer libraries read only local files, so the file and the files read beside it are copied
into the staging directory of their directory (jaxtrain/storage.py) and read from there."""

from __future__ import annotations

import os
from collections.abc import Sequence

from jaxtrain import storage
from jaxtrain.config import ConfigError


def hf_url(url: str) -> str:
  """The URL of the tokenizer.json that `url` (a .json object or a directory) names."""
  url = url.rstrip("/")
  return url if url.endswith(".json") else url + "/tokenizer.json"


def staged(url: str, name: str, siblings: Sequence[str] = ()) -> str:
  """The local copy of the tokenizer file at `url`, with the `siblings` beside it that exist
  there (and without those that do not), in the staging directory of its directory; returns the
  file's local path. The tokenizer libraries read only local files."""
  directory, base = url.rsplit("/", 1)
  local = storage.staging_path(directory)
  try:
    if not storage.isfile(url):
      raise ConfigError(f"tokenizer {name}: {url} does not exist; expected a tokenizer file "
                        f"there (a tokenizer.json, or a directory holding one, for hf:)")
    for n in (base, *siblings):
      path = os.path.join(local, n)
      if n != base and not storage.isfile(f"{directory}/{n}"):
        if os.path.exists(path):  # an earlier copy of a file no longer there must not be read
          os.remove(path)
        continue
      write_whole(path, storage.read_bytes(f"{directory}/{n}"))
  except storage.StorageError as e:  # a bucket or credentials the user can fix, said as config
    raise ConfigError(f"tokenizer {name}: {e}") from None
  return os.path.join(local, base)


def write_whole(path: str, data: bytes) -> None:
  """Writes `path` through a temporary file renamed over it, so processes staging the same
  tokenizer at once (hosts sharing JAXTRAIN_STAGING_DIR) never read a partly written file."""
  import tempfile  # pylint: disable=import-outside-toplevel
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".staging-")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
  except BaseException:
    os.remove(tmp)
    raise
