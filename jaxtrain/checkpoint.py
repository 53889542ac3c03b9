"""Orbax checkpoints of a run: train state, data-iterator state and metadata, saved async.

Layout: WORKDIR/checkpoints/<step>/{state, data, meta}. Orbax writes each checkpoint under a
temporary name and renames it when complete, so a step directory that exists is whole; the
last good checkpoint is never deleted before a newer one is committed (Orbax deletes old ones
only after a save finishes).

data/ holds the data iterator's state: `global_stream.json` for data read as one global stream
(the same on every process; process 0 writes it), else one file per data shard,
`shard_<s>-of-<S>.json` (the grain iterator state), written by one process that reads the
shard (jaxtrain/checkpoint_data.py). Either way a run on another number of processes resumes the
data stream exactly (jaxtrain/data/global_stream.py, jaxtrain/data/shards.py).

The directory may be a bucket: gs:// Orbax writes and reads directly; s3:// is staged locally and
uploaded step by step, a marker last (jaxtrain/checkpoint_mirror.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Mapping
from typing import Any

from absl import logging as absl_logging
from etils import epath
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxtrain import checkpoint_mirror, storage
from jaxtrain.config import ConfigError
# DataShardsSave too: tests and tools import the data item's handler and arguments from here.
from jaxtrain.checkpoint_data import (DataShardsHandler, DataShardsRestore,  # noqa: F401
                                      DataShardsSave)
from jaxtrain.data.global_stream import GlobalBatchStream
from jaxtrain.data.shards import ShardedIterator
from jaxtrain.models.variables import HEAD_NAMES

class Checkpointer:
  """Saves every `every_steps` steps (asynchronously: the loop continues while files are
  written) and restores the latest complete checkpoint onto the given shardings."""

  def __init__(self, directory: str, *, every_steps: int, max_to_keep: int | None = 3,
               keep_period: int | None = None, async_save: bool = True,
               before_upload=None):
    """`before_upload`: called on the upload thread after each save is started and before the
    checkpoint counts as complete on a bucket (the run directory's push of its metrics, so a
    bucket never holds a checkpoint newer than its metrics)."""
    self.directory = directory.rstrip("/") if storage.is_url(directory) else os.path.abspath(
        directory)
    self.every_steps = every_steps
    self.mirror = None
    local = self.directory
    if checkpoint_mirror.needs_mirror(self.directory):
      self.mirror = checkpoint_mirror.CheckpointMirror(
          self.directory, max_to_keep=max_to_keep, keep_period=keep_period)
      local = self.mirror.local
      if jax.process_index() == 0:  # the bucket, not an earlier staging copy, holds the steps
        checkpoint_mirror.clear_local_steps(local)
      checkpoint_mirror.check_shared_staging(local)
      # The staging directory needs only the newest step: the previous one is uploaded before
      # the next save starts (save() joins the upload).
      max_to_keep, keep_period = 1, None
    self._before_upload = before_upload
    self._uploader = checkpoint_mirror.Uploader()
    # The outermost local directory the manager is about to create (None: it exists, or the
    # checkpoints are on gs://), removed again by close_unused.
    self._created = _first_missing(local)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, keep_period=keep_period,
        enable_async_checkpointing=async_save, create=True)
    # Handlers named up front so metadata (shapes) can be read before restoring.
    self.manager = ocp.CheckpointManager(
        local, options=options, item_names=("state", "data", "meta"),
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "data": DataShardsHandler(),
                       "meta": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    self._uploader.join()
    if self.mirror:
      steps = self.mirror.complete_steps()
      return steps[-1] if steps else None
    return self.manager.latest_step()

  def should_save(self, step: int, last_step: int) -> bool:
    return self.every_steps > 0 and (step % self.every_steps == 0 or step == last_step)

  def save(self, step: int, state: Any, data_iterator, meta: dict) -> None:
    """Starts saving `step`. Waits first for the previous step's upload to a bucket (and raises
    its error): uploads keep pace with saves, one at a time."""
    self._uploader.join()
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=DataShardsSave(_as_sharded(data_iterator)),
        meta=ocp.args.JsonSave(meta)), force=True)
    if self.mirror or self._before_upload:
      self._uploader.start(lambda: self._finish(step))

  def _finish(self, step: int) -> None:
    """On the upload thread: the run directory's push, the commit, then the step's upload."""
    if self._before_upload:
      self._before_upload()
    self.manager.wait_until_finished()
    if self.mirror and jax.process_index() == 0:
      self.mirror.upload(step)

  def restore(self, step: int, abstract_state: Any, data_iterator) -> tuple[Any, dict]:
    """(state on the abstract state's shardings, meta); the data iterator is restored in
    place. Shapes that differ from the model config fail with the mismatched parameters named."""
    mismatches = shape_mismatches(self.manager.item_metadata(step)["state"], abstract_state)
    if mismatches:
      shown = [m for m in mismatches if m.startswith("params/")] or mismatches
      raise ConfigError(f"checkpoint {self.directory}/{step} does not match this model config: "
                        f"{'; '.join(shown[:6])}{' ...' if len(shown) > 6 else ''}; use the "
                        f"config it was saved with, or another --workdir")
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=DataShardsRestore(_as_sharded(data_iterator)),
        meta=ocp.args.JsonRestore()))
    return restored.state, restored.meta

  def restore_latest(self, abstract_state: Any, data_iterator) -> tuple[Any, int | None]:
    """(state, step) of the newest checkpoint that restores; (None, None) when there is none.

    A newest checkpoint with missing or truncated files is named in a warning and the one
    before it is used. A checkpoint of another model (shape mismatch) is an error instead:
    falling back would silently train from the wrong weights.
    """
    self._uploader.join()
    steps = self.mirror.complete_steps() if self.mirror else self.manager.all_steps()
    for step in sorted(steps, reverse=True):
      if self.mirror:
        self._fetch(step)
      try:
        state, _ = self.restore(step, abstract_state, data_iterator)
        return state, step
      except ConfigError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        self._set_aside(step, e)
    return None, None

  def _fetch(self, step: int) -> None:
    """The bucket's `step` into the staging directory (by process 0; the others wait)."""
    if jax.process_index() == 0:
      self.mirror.download(step)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"jaxtrain checkpoint {step} downloaded")
    self.manager.reload()

  def _set_aside(self, step: int, e: Exception) -> None:
    """Takes an unreadable step out of the manager's way (this run saves that step again), kept
    for inspection: renamed locally or on gs://; on s3://, its marker is renamed."""
    where = f"{self.directory}/{step}"
    if self.mirror:
      aside = f"{where}/{checkpoint_mirror.COMMIT_MARKER}.corrupted"
    else:
      aside = f"{where}.corrupted-{int(time.time())}"
    print(f"warning: checkpoint {where} is incomplete or corrupted ({type(e).__name__}: "
          f"{_first_line(e)}); set aside as {aside}, trying the one before it", flush=True)
    if jax.process_index() == 0:
      if self.mirror:
        marker = f"{where}/{checkpoint_mirror.COMMIT_MARKER}"
        storage.write_bytes(aside, b"")
        storage.remove_tree(marker)
      else:
        epath.Path(where).rename(epath.Path(aside))
    self.manager.reload()

  def wait(self) -> None:
    """Until the last save is committed (and, on s3://, uploaded)."""
    self.manager.wait_until_finished()
    self._uploader.join()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self.manager.close()

  def close_unused(self) -> None:
    """Closes a checkpointer that saved nothing (the run stopped before its first step), and
    removes the local directories it created if they are still empty: a run refused for bad data
    leaves no empty WORKDIR/checkpoints/ behind."""
    self.close()
    created = self._created
    if created and os.path.isdir(created) and not any(
        files for _, _, files in os.walk(created)):
      shutil.rmtree(created, ignore_errors=True)


def _first_missing(path: str) -> str | None:
  """The outermost directory of local `path` that does not exist yet (`path` itself or one of
  its parents), or None when it exists or is a URL."""
  if storage.is_url(path) or os.path.exists(path):
    return None
  missing = path
  while not os.path.exists(os.path.dirname(missing)):
    missing = os.path.dirname(missing)
  return missing


def _as_sharded(data_iterator) -> ShardedIterator | GlobalBatchStream:
  """A plain grain iterator is this process's one shard (data.num_shards=0)."""
  if isinstance(data_iterator, (ShardedIterator, GlobalBatchStream)):
    return data_iterator
  return ShardedIterator({jax.process_index(): data_iterator}, jax.process_count())


def save_params(directory: str, params: Any) -> str:
  """Writes `params` as a weights directory (DIRECTORY/params), the params-only format that
  `checkpoint.init_from` reads (e.g. a converted Hugging Face model). Returns the params path."""
  if checkpoint_mirror.needs_mirror(directory):  # written locally, then uploaded
    staged = storage.staging_path(directory, "save-params")
    shutil.rmtree(staged, ignore_errors=True)
    save_params(staged, params)
    if jax.process_index() == 0:
      storage.upload_dir(staged, directory)
    return storage.join(directory, WEIGHTS_ITEM)
  base = directory if storage.is_url(directory) else os.path.abspath(directory)
  path = storage.join(base, WEIGHTS_ITEM)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, params)
    checkpointer.wait_until_finished()
  return path


def load_params(path: str, abstract_params: Any) -> tuple[Any, str]:
  """(params on the abstract params' shardings, the directory they came from).

  `path` is a weights directory (with params/), a run's checkpoint step directory (with
  state/: only its params are read, never the optimizer state), a run's checkpoints directory
  or its workdir (then the latest complete step). Shapes that differ from the model config fail
  with the mismatched parameters named. Multi-token-prediction modules the weights hold beyond
  the model's `mtp_depth` (an imported DeepSeek-V3 fine-tuned without them) are not read."""
  item, subtree = _weights_item(path)
  checkpointer = ocp.PyTreeCheckpointer()
  with _quiet_orbax():  # reading one item of a managed checkpoint: its metadata is a level up
    saved = checkpointer.metadata(item).item_metadata.tree
  saved = saved[subtree] if subtree else saved
  saved, left_out = _without_extra_prediction_modules(saved, abstract_params)
  saved, abstract_read, new_heads = _new_heads(saved, abstract_params)
  mismatches = shape_mismatches(saved, abstract_read)
  if mismatches:
    raise ConfigError(f"checkpoint.init_from={path!r}: the weights in {item} do not match this "
                      f"model config: {'; '.join(mismatches[:6])}"
                      f"{' ...' if len(mismatches) > 6 else ''}")
  target = {subtree: abstract_read} if subtree else abstract_read
  with _quiet_orbax():
    restored = checkpointer.restore(item, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=bool(subtree) or left_out or new_heads))
  restored = restored[subtree] if subtree else restored
  if new_heads:  # the read params in the model's tree, and the new heads' zeros
    read = {_path_name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(restored)}

    def fill(p, spec):
      name = _path_name(p)
      if name in read:
        return read[name]
      return jax.jit(lambda: jnp.zeros(spec.shape, spec.dtype), out_shardings=spec.sharding)()
    restored = jax.tree_util.tree_map_with_path(fill, abstract_params)
  return restored, item


def _new_heads(saved: dict, abstract_params):
  """(saved tree, params to read, whether heads start new): a reward model's score head or
  PPO's value head that the weights (a language model's) do not hold starts at zero; a reward
  model reads everything but the vocabulary head it does not have."""
  if not isinstance(saved, Mapping) or not isinstance(abstract_params, Mapping):
    return saved, abstract_params, False
  new = [k for k in NEW_HEADS if k in abstract_params and k not in saved]
  if not new:
    return saved, abstract_params, False
  saved = {k: v for k, v in saved.items() if k != "head_DV" or k in abstract_params}
  read = type(abstract_params)({k: v for k, v in abstract_params.items() if k not in new})
  return saved, read, True


def _without_extra_prediction_modules(saved: dict, abstract_params) -> tuple[dict, bool]:
  """(the saved tree without the prediction modules the model has no place for, whether any
  were left out): Decoder.mtp[k] is saved as mtp/k."""
  modules = saved.get("mtp") if isinstance(saved, dict) else None
  if not modules:
    return saved, False
  try:
    depth = len(abstract_params["mtp"])
  except (KeyError, TypeError):  # no prediction modules in the model
    depth = 0
  kept = {k: v for k, v in modules.items() if int(k) < depth}
  if len(kept) == len(modules):
    return saved, False
  trimmed = {k: v for k, v in saved.items() if k != "mtp"}
  if kept:
    trimmed["mtp"] = kept
  return trimmed, True


@contextlib.contextmanager
def _quiet_orbax():
  """Orbax warns that a step's metadata file is missing when one item of a CheckpointManager
  step is read on its own (the file sits in the step directory); the read is still complete."""
  previous = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.ERROR)
  try:
    yield
  finally:
    absl_logging.set_verbosity(previous)


WEIGHTS_ITEM = "params"
# Heads a model can have that a language model's weights lack: they start at zero.
NEW_HEADS = HEAD_NAMES


def saved_config(path: str) -> dict | None:
  """The resolved config (a dict) a run saved with the checkpoint that `load_params(path)` reads,
  or None for a weights directory (its config is the user's, e.g. its config.py)."""
  item, subtree = _weights_item(path)
  meta = storage.join(storage.parent(item), "meta", "metadata")
  if not subtree or not storage.exists(meta):
    return None
  return json.loads(storage.read_bytes(meta))["config"]


def _weights_item(path: str) -> tuple[str, str | None]:
  """(Orbax item directory, key of the params subtree in it or None) for an init_from path.

  On s3:// the item's directory is downloaded into the staging directory (once per process) and
  the local copy returned; gs:// is read by Orbax directly."""
  if not storage.is_url(path):
    path = os.path.abspath(path)
  if storage.isdir(storage.join(path, WEIGHTS_ITEM)):
    item, subtree = storage.join(path, WEIGHTS_ITEM), None
  elif storage.isdir(storage.join(path, "state")):
    item, subtree = storage.join(path, "state"), "params"
  else:
    for directory in (path, storage.join(path, "checkpoints")):
      steps = [int(n) for n in storage.listdir(directory) if n.isdigit() and
               _complete_step(storage.join(directory, n))]
      if steps:
        item, subtree = storage.join(directory, str(max(steps)), "state"), "params"
        break
    else:
      raise ConfigError(f"checkpoint.init_from={path!r}: holds neither params/ (converted "
                        f"weights) nor a run's checkpoint (<step>/state); give a checkpoint step "
                        f"directory, a run's workdir, or a directory written by "
                        f"checkpoint.save_params")
  if checkpoint_mirror.needs_mirror(item):
    item = _staged_copy(item)
  return item, subtree


def _complete_step(step_dir: str) -> bool:
  """A step directory that holds a whole checkpoint: locally Orbax's rename made it whole; on a
  bucket the step's commit marker (Orbax's on gs://, the uploader's on s3://) says so."""
  if not storage.isdir(storage.join(step_dir, "state")):
    return False
  return (not storage.is_url(step_dir)
          or storage.exists(storage.join(step_dir, checkpoint_mirror.COMMIT_MARKER)))


_STAGED: dict[str, str] = {}


def _staged_copy(item_url: str) -> str:
  """A local copy of an Orbax item on s3:// (with its step's or weights directory's other files:
  meta/, config.py), made once per process in a directory of its own, so processes that share a
  host never write one copy together."""
  if item_url not in _STAGED:
    parent = storage.parent(item_url)
    local = storage.staging_path(parent, f"read-by-process-{jax.process_index()}")
    shutil.rmtree(local, ignore_errors=True)
    storage.download_dir(parent, local)
    _STAGED[item_url] = os.path.join(local, os.path.basename(item_url))
  return _STAGED[item_url]


def abstract_like(state_shapes: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying the target shardings: restore lands directly in them, on any
  mesh."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      state_shapes, shardings)


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def shape_mismatches(saved_tree: Any, abstract_state: Any) -> list[str]:
  """'path: checkpoint (shape) vs model (shape)' for every leaf that differs or is missing."""
  def shapes(tree):
    return {_path_name(p): tuple(leaf.shape)
            for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}
  saved, wanted = shapes(saved_tree), shapes(abstract_state)
  out = [f"{k}: checkpoint {saved[k]} vs model {wanted[k]}"
         for k in sorted(wanted) if k in saved and saved[k] != wanted[k]]
  out += [f"{k}: not in the checkpoint" for k in sorted(set(wanted) - set(saved))]
  out += [f"{k}: not in the model" for k in sorted(set(saved) - set(wanted))]
  return out


def _first_line(e: Exception) -> str:
  return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
