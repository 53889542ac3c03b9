"""Checkpoints on an s3:// bucket, kept through a local staging directory.

Orbax 0.12 writes arrays through TensorStore's own drivers and builds a TensorStore spec for
`gs://` only (anything else is taken for a local path), and its atomic commit on a non-GCS path is
a directory rename, which S3 does not have. So for s3:// Orbax writes each checkpoint into a local
staging directory exactly as it writes a local one (same atomic rename, same async save), and
once that step is committed there, a background thread uploads it:

  1. whatever an earlier, cut-short upload of the same step left under `<url>/<step>/` is removed;
  2. the step's files are copied, concurrently (but for the step's own marker, which Orbax
     writes in the staging copy too);
  3. `<url>/<step>/commit_success.txt` is written last.

A step without the marker is never restored and never counted (a SIGKILL during the upload
leaves the previous step the newest), and the bucket's older steps are deleted, by the run's
retention rule (max_to_keep, keep_every), only after a newer step's marker is written: the last
good checkpoint is never removed before the new one is complete, and a step is deleted marker
first. Restoring downloads the newest complete step into the staging directory and restores from
there.

Readers of a live run (export, generation, init_from; gs:// and local runs too) take its newest
complete step (newest_step) and look for its marker again once they have read it. A deleted
step loses its marker first, so a marker still there means the step was read whole; a marker
gone means the run's retention removed the step meanwhile, and the then newest complete step is
read instead, once (read_newest_step). (On gs:// Orbax deletes a step itself, in its own order:
there a read that fails with the marker gone is retried.)

On several processes, every process writes its shards into the staging directory as Orbax
expects of any checkpoint directory, so there the staging directory (JAXTRAIN_STAGING_DIR) must
be one all processes share (checked at start); process 0 uploads and downloads. gs:// needs none
of this: Orbax writes and reads it directly from every host.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtrain import storage
from jaxtrain.config import ConfigError

COMMIT_MARKER = "commit_success.txt"


def needs_mirror(directory: str) -> bool:
  """Whether Orbax cannot write `directory` itself: an object-storage URL other than gs://."""
  return storage.is_url(directory) and not directory.startswith("gs://")


def steps_to_keep(steps: list[int], max_to_keep: int | None, keep_period: int | None) -> set[int]:
  """The complete steps Orbax's rule keeps: the newest `max_to_keep` (all when None) and every
  multiple of `keep_period`."""
  ordered = sorted(steps)
  keep = set(ordered if not max_to_keep else ordered[-max_to_keep:])
  if keep_period:
    keep |= {s for s in ordered if s % keep_period == 0}
  return keep


class CheckpointMirror:
  """The bucket side of a checkpoints directory: which steps are complete there, a step's upload
  (marker last) and download, and retention."""

  def __init__(self, url: str, *, max_to_keep: int | None, keep_period: int | None):
    self.url = url.rstrip("/")
    self.local = storage.staging_path(self.url)
    self.max_to_keep, self.keep_period = max_to_keep, keep_period

  def step_url(self, step: int) -> str:
    return f"{self.url}/{step}"

  def listed_steps(self) -> list[int]:
    return sorted(int(n) for n in storage.listdir(self.url) if n.isdigit())

  def complete_steps(self) -> list[int]:
    """Steps whose upload finished (marker present), oldest first."""
    return [s for s in self.listed_steps()
            if storage.exists(f"{self.step_url(s)}/{COMMIT_MARKER}")]

  def upload(self, step: int) -> float:
    """Copies the committed local step to the bucket, marker last; then applies retention.
    Returns the seconds the copy took."""
    start = time.perf_counter()
    local_step = os.path.join(self.local, str(step))
    if not os.path.isdir(local_step):
      raise RuntimeError(f"checkpoint step {step} is not in the staging directory {self.local} "
                         f"after its save finished")
    self.remove_step(step)  # a cut-short upload's leftovers
    # Orbax writes a marker of the same name in the staging copy: it must not go up first.
    storage.upload_dir(local_step, self.step_url(step), exclude=(COMMIT_MARKER,))
    storage.write_bytes(f"{self.step_url(step)}/{COMMIT_MARKER}", b"")
    self.prune(newest=step)
    return time.perf_counter() - start

  def prune(self, newest: int) -> None:
    """Deletes the bucket's steps the retention rule drops, and the leftovers of cut-short
    uploads older than `newest`, a complete step."""
    complete = self.complete_steps()
    keep = steps_to_keep(complete, self.max_to_keep, self.keep_period)
    for step in self.listed_steps():
      if step < newest and step not in keep:
        self.remove_step(step)

  def remove_step(self, step: int) -> None:
    """Deletes a step from the bucket, its marker first: a reader (an export, a generation, an
    init_from of this live run) that still finds the marker after reading the step has read it
    whole (read_newest_step)."""
    storage.remove_tree(self.step_url(step), first=(COMMIT_MARKER,))

  def download(self, step: int) -> None:
    """Replaces the staging directory's steps with the bucket's `step`."""
    clear_local_steps(self.local)
    storage.download_dir(self.step_url(step), os.path.join(self.local, str(step)))


def step_is_complete(step_dir: str, marked: bool | None = None) -> bool:
  """Whether a step directory holds a whole checkpoint: its state/ and, when `marked` (None: on a
  bucket), the commit marker (Orbax's on gs://, the uploader's on s3://). Locally Orbax's
  rename made any step directory whole."""
  if marked is None:
    marked = storage.is_url(step_dir)
  if marked:
    marker = storage.join(step_dir, COMMIT_MARKER)
    # Asked of the store itself: a listing cached in this process may predate a deletion.
    if not (storage.object_version(marker) is not None if storage.is_url(marker)
            else os.path.exists(marker)):
      return False
  return storage.isdir(storage.join(step_dir, "state"))


def newest_step(directory: str, names: list[str] | None = None) -> tuple[str, bool] | None:
  """(path relative to `directory` of its run's newest complete step, whether that step holds the
  commit marker), or None. The run's steps are under `directory` or `directory`/checkpoints (the
  first that has a complete one: a workdir or its checkpoints directory). Complete: a step with
  the marker, else, where no step there has one (steps on local disk, or copied from it: Orbax's
  rename marks a local step whole), the newest with state/. `names`: the listing of `directory`,
  when the caller has it. The one rule of export, generation and init_from."""
  names = storage.listdir(directory) if names is None else names
  for prefix in ("", "checkpoints/"):
    listed = names if not prefix else (
        storage.listdir(storage.join(directory, "checkpoints")) if "checkpoints" in names else [])
    steps = sorted((int(n) for n in listed if n.isdigit()), reverse=True)
    for step in steps:
      if storage.exists(storage.join(directory, f"{prefix}{step}", COMMIT_MARKER)):
        return f"{prefix}{step}", True
    for step in steps:
      if storage.isdir(storage.join(directory, f"{prefix}{step}", "state")):
        return f"{prefix}{step}", False
  return None


def read_newest_step(directory: str, read, *, names: list[str] | None = None, discard=None):
  """(the step read, relative to `directory`; read(it)) for `directory`'s newest complete step
  (newest_step), or (None, None) when it has none. `read(step)` downloads (or reads) it.

  A live run's retention may delete that step while it is read: the read then fails, or ends
  with the step's marker gone (the marker is deleted first: CheckpointMirror.remove_step). Then
  `discard(step)` drops what was read, a note says so, and the then newest complete step is read
  instead, once. A step still complete after a failed read failed for another reason, which is
  raised. On several processes (an init_from) process 0 names the step, and the processes agree
  on whether it was removed, so that all of them read the same one."""
  found = _agreed(newest_step(directory, names))
  for attempt in range(2):
    if found is None:
      return None, None
    step, marked = found
    try:
      result, error = read(step), None
    except Exception as e:  # pylint: disable=broad-except  # re-raised unless the step is gone
      result, error = None, e
    removed = not step_is_complete(storage.join(directory, step), marked)
    removed, failed_elsewhere = _agreed_outcome(removed, error is not None)
    if not removed:
      if error is not None:
        raise error
      if failed_elsewhere:
        raise storage.StorageError(f"{storage.join(directory, step)}: another process of this run "
                                   f"could not read it (its error is in that process's output)")
      return step, result
    if discard is not None:
      discard(step)
    newer = _agreed(newest_step(directory))
    if attempt or newer is None or newer[0] == step:
      if error is not None:
        raise error
      raise storage.StorageError(f"{storage.join(directory, step)}: the step was removed while "
                                 f"it was read, and no newer complete step is there")
    if jax.process_index() == 0:
      print(f"note: step {_number(step)} of {directory} was removed while it was read (the "
            f"run's retention); reading step {_number(newer[0])} instead", flush=True)
    found = newer
  raise AssertionError("unreachable")


def _number(step: str) -> str:
  return step.rsplit("/", 1)[-1]


def _agreed(found: tuple[str, bool] | None) -> tuple[str, bool] | None:
  """Process 0's newest_step on every process (one process: `found`): a live run may complete a
  step between two processes' listings."""
  if jax.process_count() == 1:
    return found
  if found is None:
    code = np.array([-1, 0, 0], np.int64)
  else:
    code = np.array([int(_number(found[0])), found[0].startswith("checkpoints/"), found[1]],
                    np.int64)
  step, under, marked = (int(x) for x in multihost_utils.broadcast_one_to_all(code))
  return None if step < 0 else (f"{'checkpoints/' if under else ''}{step}", bool(marked))


def _agreed_outcome(removed: bool, failed: bool) -> tuple[bool, bool]:
  """(whether any process found the step removed, whether another process's read failed)."""
  if jax.process_count() == 1:
    return removed, False
  seen = np.asarray(multihost_utils.process_allgather(np.array([removed, failed], np.int32)))
  seen = seen.reshape(-1, 2)
  others = np.delete(seen, jax.process_index(), axis=0)
  return bool(seen[:, 0].any()), bool(others[:, 1].any())


def clear_local_steps(local: str) -> None:
  """Removes every step (and Orbax temporary) directory from a staging directory: the bucket,
  not the staging copy, says which checkpoints exist."""
  for name in os.listdir(local) if os.path.isdir(local) else []:
    path = os.path.join(local, name)
    if os.path.isdir(path):
      shutil.rmtree(path, ignore_errors=True)


def check_shared_staging(local: str) -> None:
  """On several processes: raises ConfigError unless every process sees the staging directory
  process 0 writes to (checkpoint shards of all processes go into one directory)."""
  if jax.process_count() == 1:
    return
  nonce = int(multihost_utils.broadcast_one_to_all(
      np.int64(time.time_ns() % (2**62)) if jax.process_index() == 0 else np.int64(0)))
  probe = os.path.join(local, ".shared-staging-probe")
  if jax.process_index() == 0:
    os.makedirs(local, exist_ok=True)
    with open(probe, "w", encoding="utf-8") as f:
      f.write(str(nonce))
  multihost_utils.sync_global_devices("jaxtrain staging probe written")
  try:
    with open(probe, encoding="utf-8") as f:
      seen = int(f.read().strip() or -1)
  except OSError:
    seen = -1
  shared = bool(multihost_utils.process_allgather(np.int32(seen == nonce)).all())
  if not shared:
    raise ConfigError(f"checkpoints on s3:// are staged in {local}, which the processes of this "
                      f"run do not share; set {storage.STAGING_ENV} to a directory on a file "
                      f"system all hosts mount (or use a gs:// or shared local "
                      f"checkpoint.directory)")


class Uploader:
  """One background upload at a time: `start(fn)` runs fn on a thread after the previous one has
  finished; `join()` waits for it and re-raises its error, so a failed upload stops the run at
  its next save instead of passing silently."""

  def __init__(self):
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None

  def start(self, fn) -> None:
    self.join()

    def run():
      try:
        fn()
      except BaseException as e:  # pylint: disable=broad-except  # re-raised by join()
        self._error = e
    self._thread = threading.Thread(target=run, name="jaxtrain-checkpoint-upload", daemon=True)
    self._thread.start()

  def join(self) -> None:
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self._error is not None:
      error, self._error = self._error, None
      raise RuntimeError(f"checkpoint upload failed: {type(error).__name__}: {error}") from error
