"""The output directory of `python -m jaxtrain.data.prepare`: its files and its manifest.

Names the shard files, clears an earlier run's files out of a reused directory (and a failed
run's temporaries), and writes `manifest.json` last and atomically, so that a directory without
one holds a run that did not finish. `read_manifest` checks that a prepared corpus is complete.
"""

from __future__ import annotations

# `input` and `format` name the arguments as the command line does.
# pylint: disable=redefined-builtin

import json
import os
import re
from typing import Any

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
