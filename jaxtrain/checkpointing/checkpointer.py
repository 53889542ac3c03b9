"""Orbax checkpoints of a run: train state, data-iterator state and metadata, saved async.

Layout: WORKDIR/checkpoints/<step>/{state, data, meta}. Orbax writes each checkpoint under a
temporary name and renames it when complete, so a step directory that exists is whole; the
last good checkpoint is never deleted before a newer one is committed (Orbax deletes old ones
only after a save finishes).

data/ holds the data iterator's state: `global_stream.json` for data read as one global stream
(the same on every process; process 0 writes it), else one file per data shard,
`shard_<s>-of-<S>.json` (the grain iterator state), written by one process that reads the
shard (jaxtrain/checkpointing/iterator_state.py). Either way a run on another number of processes
resumes the data stream exactly (jaxtrain/data/global_stream.py, jaxtrain/data/shards.py).

The directory may be a bucket: gs:// Orbax writes and reads directly; s3:// is staged locally and
uploaded step by step, a marker last (jaxtrain/checkpointing/mirror.py).
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

from etils import epath
import jax
from jax.experimental import multihost_utils
import orbax.checkpoint as ocp

from jaxtrain import storage
from jaxtrain.checkpointing import mirror as checkpoint_mirror
from jaxtrain.checkpointing.verdicts import (CheckpointCorrupted, CheckpointRestoreError,  # noqa: F401
                                          PeerFailed, Verdict, agree, classify, describe)
from jaxtrain.config import ConfigError
# DataShardsSave too: tests and tools import the data item's handler and arguments from here.
from jaxtrain.checkpointing.weights import optimizer_name, shape_mismatches
from jaxtrain.checkpointing.iterator_state import (DataShardsHandler, DataShardsRestore,  # noqa: F401
                                      DataShardsSave)
from jaxtrain.data.global_stream import GlobalBatchStream
from jaxtrain.data.shards import ShardedIterator

class Checkpointer:
  """Saves every `every_steps` steps (asynchronously: the loop continues while files are
  written) and restores the latest complete checkpoint onto the given shardings."""

  def __init__(self, directory: str, *, every_steps: int, max_to_keep: int | None = 3,
               keep_period: int | None = None, async_save: bool = True,
               before_upload=None, on_unreadable: str = "stop"):
    """`on_unreadable`: what restore_latest does when no step can be read ("stop" or
    "restart"; checkpoint.on_unreadable). `before_upload`: called on the upload thread after
    each save is started and before the checkpoint counts as complete on a bucket (the run
    directory's push of its metrics, so a bucket never holds a checkpoint newer than its
    metrics)."""
    self.directory = directory.rstrip("/") if storage.is_url(directory) else os.path.abspath(
        directory)
    self.every_steps = every_steps
    self.on_unreadable = on_unreadable
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
    self.manager = _manager(local, options)
    # Restores go through a read-only manager of this process alone: Orbax's restore has
    # barriers of every process, and one process that fails inside it would leave the others
    # waiting there forever; without them, the processes meet only where they agree on the
    # verdict (restore_latest). Each process reads its own shards either way.
    self._reader = _manager(local, ocp.CheckpointManagerOptions(
        read_only=True, create=False, multiprocessing_options=ocp.options.MultiprocessingOptions(
            primary_host=jax.process_index(), active_processes={jax.process_index()})))

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
    place. A step that lacks an item or the state's metadata raises CheckpointCorrupted (Orbax
    would take a state without metadata for a checkpoint of another model); shapes that differ
    from the model config fail with the mismatched parameters named (ConfigError)."""
    step_dir = epath.Path(self._reader.directory) / str(step)
    missing = [name for name in ITEMS if not (step_dir / name).is_dir()]
    if missing:
      raise CheckpointCorrupted(f"{', '.join(missing)} missing from {step_dir}")
    saved = self._reader.item_metadata(step)["state"]
    if saved is None:
      raise CheckpointCorrupted(f"the state's metadata (_METADATA) is missing from {step_dir}")
    saved_optimizer, this_optimizer = optimizer_name(saved), optimizer_name(abstract_state)
    if saved_optimizer != this_optimizer:
      raise ConfigError(f"checkpoint {self.directory}/{step} holds the optimizer state of "
                        f"optim.name={saved_optimizer!r}, this run has optim.name="
                        f"{this_optimizer!r}: resume with {saved_optimizer!r}, or start the "
                        f"new optimizer from the weights alone (checkpoint.init_from) in another "
                        f"--workdir")
    mismatches = shape_mismatches(saved, abstract_state)
    if mismatches:
      shown = [m for m in mismatches if m.startswith("params/")] or mismatches
      raise ConfigError(f"checkpoint {self.directory}/{step} does not match this model config: "
                        f"{'; '.join(shown[:6])}{' ...' if len(shown) > 6 else ''}; use the "
                        f"config it was saved with, or another --workdir")
    restored = self._reader.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=DataShardsRestore(_as_sharded(data_iterator)),
        meta=ocp.args.JsonRestore()))
    return restored.state, restored.meta

  def restore_latest(self, abstract_state: Any, data_iterator) -> tuple[Any, int | None]:
    """(state, step) of the newest checkpoint that restores; (None, None) when there is none.

    Only a recognised corruption (jaxtrain/checkpointing/verdicts.py) makes a step unreadable: it is
    named in a warning and the one before it is tried; the unreadable steps are set aside once an
    older one has restored (so that this run can save those steps again). Any other error stops
    the run (CheckpointRestoreError) naming the step, with nothing renamed; a storage error that
    looks transient is retried once first. When no step can be read the run stops too, listing
    them, unless `on_unreadable="restart"`: then they are set aside and the run starts from
    step 0. A checkpoint of another model (shape mismatch) is a ConfigError: falling back would
    silently train from the wrong weights. Every process reaches the same verdict before anything
    is renamed.
    """
    self._uploader.join()
    steps = self.mirror.complete_steps() if self.mirror else self.manager.all_steps()
    unreadable: list[tuple[int, str]] = []
    for step in sorted(steps, reverse=True):
      state, verdict, error = self._restore_agreed(step, abstract_state, data_iterator)
      if verdict == Verdict.OK:
        for bad, why in unreadable:
          self._set_aside(bad, why)
        return state, step
      if verdict != Verdict.CORRUPT:
        raise CheckpointRestoreError(_stop_message(self._where(step), verdict, error))
      print(f"warning: checkpoint {self._where(step)} is incomplete or corrupted "
            f"({describe(error)}); trying the one before it", flush=True)
      unreadable.append((step, describe(error)))
    if not unreadable:
      return None, None
    listed = "; ".join(f"step {s}: {why}" for s, why in unreadable)
    if self.on_unreadable == "restart":
      for bad, why in unreadable:
        self._set_aside(bad, why)
      print(f"warning: no checkpoint in {self.directory} can be read ({listed}); starting from "
            f"step 0 as checkpoint.on_unreadable=restart says", flush=True)
      return None, None
    raise CheckpointRestoreError(
        f"no checkpoint in {self.directory} can be read ({listed}); nothing was set aside and "
        f"the run did not start over: restore the files, remove those steps, or set "
        f"checkpoint.on_unreadable=restart to set them aside and train from step 0")

  def _restore_agreed(self, step: int, abstract_state: Any,
                      data_iterator) -> tuple[Any, Verdict, BaseException | None]:
    """(state or None, the run's verdict, this process's error) for one step, fetched first on
    s3://. Each process restores through its own reader (no barriers of Orbax's), so one that
    fails leaves the others free to reach the verdict they agree on. A transient verdict is
    retried once."""
    for attempt in range(2):
      state, error = None, None
      try:
        if self.mirror:
          self._fetch(step)
        state, _ = self.restore(step, abstract_state, data_iterator)
      except ConfigError:
        raise  # another model's checkpoint: every process reads the same metadata
      except Exception as e:  # pylint: disable=broad-except  # classified, then agreed
        error = e
      verdict = agree(classify(error) if error else Verdict.OK)
      if verdict != Verdict.TRANSIENT or attempt:
        return state, verdict, error
      print(f"warning: reading checkpoint {self._where(step)} failed ({describe(error)}); "
            f"retrying in {RETRY_DELAY_S:g} s", flush=True)
      time.sleep(RETRY_DELAY_S)
    raise AssertionError("unreachable")

  def _where(self, step: int) -> str:
    return f"{self.directory}/{step}"

  def _fetch(self, step: int) -> None:
    """The bucket's `step` into the staging directory, by process 0; the others take its
    verdict (a failed download fails the step on every process) and see the files after."""
    error = None
    if jax.process_index() == 0:
      try:
        self.mirror.download(step)
      except Exception as e:  # pylint: disable=broad-except  # classified by the caller's agree
        error = e
    verdict = agree(classify(error) if error else Verdict.OK)
    if verdict != Verdict.OK:
      raise error or PeerFailed(verdict)
    self.manager.reload()
    self._reader.reload()

  def _set_aside(self, step: int, why: str) -> None:
    """Takes an unreadable step out of the manager's way (this run saves that step again), kept
    for inspection: renamed locally or on gs://; on s3://, its marker is renamed. Process 0
    renames, after every process has agreed the step is unreadable; the others wait for it."""
    where = self._where(step)
    if self.mirror:
      aside = f"{where}/{checkpoint_mirror.COMMIT_MARKER}.corrupted"
    else:
      aside = f"{where}.corrupted-{int(time.time())}"
    if jax.process_index() == 0:
      print(f"warning: checkpoint {where} set aside as {aside} ({why})", flush=True)
      if self.mirror:
        marker = f"{where}/{checkpoint_mirror.COMMIT_MARKER}"
        storage.write_bytes(aside, b"")
        storage.remove_tree(marker)
      else:
        epath.Path(where).rename(epath.Path(aside))
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"jaxtrain checkpoint {step} set aside")
    self.manager.reload()
    self._reader.reload()

  def wait(self) -> None:
    """Until the last save is committed (and, on s3://, uploaded)."""
    self.manager.wait_until_finished()
    self._uploader.join()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self.manager.close()
      self._reader.close()

  def close_unused(self) -> None:
    """Closes a checkpointer that saved nothing (the run stopped before its first step), and
    removes the local directories it created if they are still empty: a run refused for bad data
    leaves no empty WORKDIR/checkpoints/ behind."""
    self.close()
    created = self._created
    if created and os.path.isdir(created) and not any(
        files for _, _, files in os.walk(created)):
      shutil.rmtree(created, ignore_errors=True)


# A run's checkpoint step: its items.
ITEMS = ("state", "data", "meta")
# Before a storage error that looks transient is retried (once).
RETRY_DELAY_S = 5.0


def _manager(directory: str, options) -> ocp.CheckpointManager:
  # Handlers named up front so metadata (shapes) can be read before restoring.
  return ocp.CheckpointManager(
      directory, options=options, item_names=ITEMS,
      item_handlers={"state": ocp.StandardCheckpointHandler(), "data": DataShardsHandler(),
                     "meta": ocp.JsonCheckpointHandler()})


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


def abstract_like(state_shapes: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying the target shardings: restore lands directly in them, on any
  mesh."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      state_shapes, shardings)


def _stop_message(where: str, verdict: Verdict, error: BaseException | None) -> str:
  """The one line a run stops with when a step cannot be restored for a reason other than
  corruption."""
  what = describe(error)
  if verdict == Verdict.TRANSIENT:
    return (f"checkpoint {where} could not be read, twice ({what}); nothing was set aside: the "
            f"storage looks unreachable, run the same command again once it is")
  return (f"checkpoint {where} could not be restored ({what}); nothing was set aside (the error "
          f"does not say the checkpoint is damaged): fix the cause and run the same command again")
