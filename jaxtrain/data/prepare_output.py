"""The output directory of `python -m jaxtrain.data.prepare`: its files and its manifest.

Names the shard files, clears an earlier run's files out of a reused directory (and a failed
run's temporaries), and writes `manifest.json` last and atomically, so that a directory without
one holds a run that did not finish. `read_manifest` checks that a prepared corpus is complete.

An output on object storage (s3://, gs://) is built in a local staging directory and, once
finished, published: the earlier run's files at the URL removed (its manifest first), the shards
uploaded, the manifest last, so that there too a prefix without one holds no finished corpus.
"""

from __future__ import annotations

# `input` and `format` name the arguments as the command line does.
# pylint: disable=redefined-builtin

import json
import os
import re
from typing import Any

from jaxtrain import storage
from jaxtrain.data.sources import DataError
from jaxtrain.data.sources import prepared

MANIFEST_NAME = prepared.MANIFEST_NAME
MANIFEST_VERSION = prepared.MANIFEST_VERSION
# Every file a run writes into DIR (shards, indexes, temporaries of a crashed run), and those of
# the version-1 format (.arrayrecord with .lengths.npy sidecars). Only these are removed when DIR
# is reused, so DIR never mixes shards of two runs and an old run's files do not linger.
_OWN_FILE_RE = re.compile(r"shard-\d{5,}-of-\d{5,}(\.bin|\.idx\.npy|\.arrayrecord(\.lengths\.npy)?)"
                          r"(\.tmp-\d+.*)?|manifest\.json\.tmp-\d+")


def shard_name(index: int, num_shards: int) -> str:
  """The shard's file prefix: `write_token_shard` adds `.bin` and `.idx.npy`."""
  return f"shard-{index:05d}-of-{num_shards:05d}"


def check_output(output: str, overwrite: bool) -> str:
  """Absolute output directory; DataError when it is a file or already holds a finished run."""
  output = os.path.abspath(os.path.expanduser(os.fspath(output)))
  if os.path.exists(output) and not os.path.isdir(output):
    raise DataError(f"output {output} is a file; name a directory for the shards")
  if os.path.exists(os.path.join(output, MANIFEST_NAME)) and not overwrite:
    raise DataError(f"output {output} already holds a prepared corpus ({MANIFEST_NAME}); pass "
                    f"--overwrite (overwrite=True) to replace it, or choose another directory")
  return output


def check_remote_output(url: str, overwrite: bool) -> str:
  """The output URL (no trailing /), checked before any work: one-line DataError for a scheme or
  bucket that cannot be written, a URL naming an object, or a finished corpus there already
  (without `overwrite`)."""
  url = url.rstrip("/")
  storage.check_url(url, "output")
  storage.check_bucket(url, "output")
  if storage.isfile(url):
    raise DataError(f"output {url} is an object; name a prefix (a directory) for the shards")
  if storage.isfile(storage.join(url, MANIFEST_NAME)) and not overwrite:
    raise DataError(f"output {url} already holds a prepared corpus ({MANIFEST_NAME}); pass "
                    f"--overwrite (overwrite=True) to replace it, or choose another URL")
  return url


def clear_output(output: str) -> int:
  """Creates `output`, removing the manifest and shards of an earlier run; files removed."""
  os.makedirs(output, exist_ok=True)
  # The manifest goes first: if removal stops midway, DIR must not look complete.
  removed = 0
  manifest = os.path.join(output, MANIFEST_NAME)
  if os.path.exists(manifest):
    os.remove(manifest)
    removed += 1
  for name in sorted(os.listdir(output)):
    if _OWN_FILE_RE.fullmatch(name):
      os.remove(os.path.join(output, name))
      removed += 1
  return removed


def remove_temporaries(output: str) -> None:
  """Drops the temporaries of workers killed midway (a failed run); finished shards stay."""
  for name in os.listdir(output):
    if _OWN_FILE_RE.fullmatch(name) and ".tmp-" in name:
      try:
        os.remove(os.path.join(output, name))
      except FileNotFoundError:
        pass  # a worker still running removed or renamed it


def write_manifest(output: str, manifest: dict[str, Any]) -> None:
  """Writes the manifest under a temporary name and renames it, so it is whole or absent."""
  path = os.path.join(output, MANIFEST_NAME)
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(manifest, f, indent=2)
    f.write("\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def make_manifest(*, input, format, field, tok, tokenizer_spec, dtype, add_bos, add_eos,
                  docs_per_shard, on_bad_record, shards, skipped) -> dict[str, Any]:
  return {
      "version": MANIFEST_VERSION,
      "tokenizer": tokenizer_spec,
      "tokenizer_name": tok.name,
      "vocab_size": int(tok.vocab_size),
      "token_dtype": dtype,
      "bos_id": tok.bos_id,
      "eos_id": tok.eos_id,
      "add_bos": bool(add_bos),
      "add_eos": bool(add_eos),
      "input": (os.fspath(input) if isinstance(input, (str, os.PathLike))
                else [os.fspath(p) for p in input]),
      "format": format,
      "field": None if format == "text" else field,
      "docs_per_shard": docs_per_shard,
      "on_bad_record": on_bad_record,
      "shards": shards,
      "totals": {
          "documents": sum(s["documents"] for s in shards),
          "tokens": sum(s["tokens"] for s in shards),
          "shards": len(shards),
      },
      "skipped_records": skipped,
  }


def read_manifest(directory: str) -> dict[str, Any]:
  """The manifest of a prepared corpus in `directory`, checked to be complete.

  Checks what the manifest lists (both files of every shard), not the files' contents:
  `PreparedCorpus(directory)` checks those too.

  Raises:
    DataError: no manifest (not prepared, or a run that did not finish), an unreadable,
      malformed or unknown-version manifest (version 1: the old ArrayRecord format, with the
      command that re-prepares it), or a shard file it lists that is missing.
  """
  return prepared.load_manifest(directory)[1]


def corpus_files(manifest: dict[str, Any]) -> list[str]:
  """The files of a finished corpus: every shard's two files, then the manifest."""
  return [shard["file"] + suffix for shard in manifest["shards"]
          for suffix in (prepared.BIN_SUFFIX, prepared.IDX_SUFFIX)] + [MANIFEST_NAME]


def publish(staging: str, url: str, manifest: dict[str, Any], overwrite: bool, log) -> None:
  """Uploads the corpus finished in `staging` to `url`, replacing an earlier run's files there.

  Only now, with the new corpus complete, is an earlier one removed: its manifest first, so
  that from here until the new manifest is uploaded (last) readers see an unfinished corpus,
  never a manifest beside missing or foreign shards; then its files that the upload does not
  overwrite. Other objects under `url` are left alone, as `clear_output` leaves other files.
  """
  files = corpus_files(manifest)
  old = [n for n in storage.listdir(url) if n == MANIFEST_NAME or _OWN_FILE_RE.fullmatch(n)]
  if MANIFEST_NAME in old and not overwrite:
    # Checked at the start too; another job has finished a corpus there since.
    raise DataError(f"output {url} now holds a prepared corpus ({MANIFEST_NAME}), written while "
                    f"this one was built; pass --overwrite (overwrite=True) to replace it, or "
                    f"choose another URL")
  if MANIFEST_NAME in old:
    storage.remove_files([storage.join(url, MANIFEST_NAME)])
  stale = [n for n in old if n not in files]
  if stale:
    storage.remove_files([storage.join(url, n) for n in stale])
  if old:
    removed = len(stale) + (MANIFEST_NAME in old)
    kept = len(old) - removed
    log(f"removed {removed} file{'s' if removed != 1 else ''} of an earlier run from {url}"
        + (f"; the upload overwrites its other {kept}" if kept else ""))
  size = sum(os.path.getsize(os.path.join(staging, f)) for f in files)
  log(f"uploading {len(files)} files ({size / 2**20:.1f} MiB) to {url}")
  storage.upload_dir(staging, url, last=(MANIFEST_NAME,), only=files)


def remove_staging(staging: str) -> None:
  """Removes a run's files from its staging directory, and the directory when nothing else is
  in it (a downloaded input object's copy may be: remote_files.py caches under the same tree)."""
  if not os.path.isdir(staging):
    return
  for name in os.listdir(staging):
    if name == MANIFEST_NAME or _OWN_FILE_RE.fullmatch(name):
      try:
        os.remove(os.path.join(staging, name))
      except FileNotFoundError:
        pass
  try:
    os.rmdir(staging)
  except OSError:
    pass  # not empty: files that are not this run's
