"""Directory arguments of `python -m jaxtrain.interop.hf` on object storage (s3://, gs://).

The conversions read and write local files (memory-mapped safetensors, Orbax), so a directory on
a bucket goes through a local staging directory (storage.staging_path): what a command reads is
downloaded there first, only the files it needs; what it writes is written there and then
uploaded with the file that marks the directory whole last (config.py of a weights directory,
config.json of a Hugging Face directory), so a reader that finds that file finds the rest.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os

from jaxtrain import storage
from jaxtrain.checkpointing import mirror as checkpoint_mirror
from jaxtrain.checkpointing.weights import WEIGHTS_ITEM
from jaxtrain.config import ConfigError
from jaxtrain.interop.hf_config import HFFormatError
from jaxtrain.interop.hf_io import TOKENIZER_FILES
from jaxtrain.interop.hf_weights import INDEX_FILE, PICKLE_PATTERNS

# A run's checkpoint read for export is staged apart from the URL's own staging directory, where
# a run on this host keeps the checkpoints and workdir files it uploads (checkpointing/mirror.py,
# run_directory.py); no bucket can be named this (a leading underscore), so nothing else is.
EXPORT_AREA = "_hf-export"


def check(url: str, key: str) -> None:
  """StorageError (one line, starting with `key`) for a scheme jaxtrain does not read, a client
  package not installed, or a bucket that does not exist."""
  storage.check_url(url, key)
  storage.check_bucket(url, key)


def fresh_staging(url: str) -> str:
  """The staging directory of `url`, emptied: what is written there is exactly what is
  uploaded."""
  local = storage.staging_path(url)
  storage.remove_tree(local)
  os.makedirs(local)
  return local


def download_hf_dir(url: str) -> str:
  """Downloads what an import reads of the Hugging Face directory at `url` (config.json, the
  safetensors and their index, the tokenizer files) into its staging directory; returns that."""
  check(url, "--hf_dir")
  names = storage.listdir(url)
  expected = "expected a Hugging Face model directory (config.json and *.safetensors)"
  if not names:
    raise HFFormatError(f"--hf_dir={url}: nothing there; {expected}")
  if "config.json" not in names:
    raise HFFormatError(f"--hf_dir={url}: has no config.json; {expected}")
  pickles = [n for n in names if any(fnmatch.fnmatch(n, p) for p in PICKLE_PATTERNS)]
  if pickles and not any(n.endswith(".safetensors") for n in names):
    # Said here since pickle files are not downloaded (below), where the local check sees them.
    raise HFFormatError(f"--hf_dir={url}: weights are pickle files ({', '.join(pickles[:3])}); "
                        f"convert to safetensors first; pickle files can run code, so jaxtrain "
                        f"does not load them")
  # A model repository often holds other copies of the weights as well (original/, *.bin,
  # *.gguf): only what the import reads is downloaded.
  wanted = {n for n in names
            if n in ("config.json", INDEX_FILE, *TOKENIZER_FILES) or n.endswith(".safetensors")}
  local = fresh_staging(url)
  storage.download_dir(url, local, exclude=tuple(sorted(set(names) - wanted)))
  return local


def existing_weights(url: str, overwrite: bool) -> list[str]:
  """hf_io.existing_weights on a bucket: the weights and config.json already at `url`; an error
  unless they may be replaced."""
  existing = sorted(n for n in storage.listdir(url)
                    if n.endswith(".safetensors") or n in ("config.json", INDEX_FILE))
  if existing and not overwrite:
    raise HFFormatError(f"--out={url}: already holds {', '.join(existing[:3])}; choose an empty "
                        f"directory, or replace them with --overwrite")
  return existing


def replace(url: str, local: str, existing: list[str], last: str) -> None:
  """Uploads the directory written at `local` to `url`, `last` after every other file; the
  `existing` files there (an --overwrite) are deleted first, as a local export deletes them, so
  neither a stale shard nor the old `last` outlives the upload."""
  for name in existing:
    storage.remove_tree(storage.join(url, name))
  storage.upload_dir(local, url, last=(last,))


def download_checkpoint(url: str) -> str:
  """Downloads what an export reads of `url` into a staging directory laid out as the bucket is,
  and returns it: all of a weights directory or a checkpoint step; of a run's workdir or
  checkpoints directory only its newest complete step (and its config.py, if it has one), not
  the rest of the run (other steps, TensorBoard events, metrics)."""
  check(url, "--checkpoint")
  names = storage.listdir(url)
  scheme, _, rest = url.partition("://")
  local = storage.staging_path(f"{scheme}://{EXPORT_AREA}/{rest}")
  if WEIGHTS_ITEM in names or "state" in names:
    storage.remove_tree(local)
    storage.download_dir(url, local)
    return local

  def download(step):  # the step alone, in place of anything an earlier try left
    storage.remove_tree(local)
    storage.download_dir(storage.join(url, step), os.path.join(local, *step.split("/")))
  # A live run's retention may remove the step while it downloads: then the newest once more.
  step, _ = checkpoint_mirror.read_newest_step(url, download, names=names)
  if step is None:
    raise HFFormatError(f"--checkpoint={url}: nothing to export: holds neither params/ (a weights "
                        f"directory), state/ (a checkpoint step) nor <step>/state (a run's "
                        f"workdir or checkpoints directory); give one of those")
  if "config.py" in names:
    storage.write_bytes(os.path.join(local, "config.py"),
                        storage.read_bytes(storage.join(url, "config.py")))
  return local


@contextlib.contextmanager
def as_urls(places: dict[str, str]):
  """A one-line error raised inside names the bucket URL where it names the staging directory
  (`places`: staging directory -> URL) that the user never gave."""
  try:
    yield
  except (ConfigError, storage.StorageError) as e:
    text = str(e)
    for local in sorted(places, key=len, reverse=True):  # a nested directory before its parent
      text = text.replace(local, places[local])
    if text == str(e):
      raise
    raise type(e)(text) from None
