"""`--workdir` on a bucket: the run writes its files (metrics.jsonl, TensorBoard events,
completions, the W&B run id) into a local mirror, which is pushed to the bucket in the background
every `sync_every_s`, before each checkpoint counts as complete, and at the end.

An object store cannot append, and a file copied whole each time it grows would make a run's
upload traffic grow with the square of its length. So each byte goes up about once:

- TensorBoard events: the metrics writer closes its event file and starts another every few
  minutes (metrics.TENSORBOARD_ROTATE_S); each closed file is copied once; the open one, the
  newest of its directory, only with each checkpoint and at the end.
- Files the run appends to (`*.jsonl`, W&B's `.wandb` log) go up by their new bytes
  (storage.append_bytes): on gs:// composed after the bucket's copy; on s3://, once the bucket's
  copy holds 5 MiB, by a multipart upload that copies it on the server and adds the new bytes,
  and while smaller whole (below). The `*.jsonl` files up to their last complete line, so a
  run killed during a push never leaves a torn record on the bucket. A file that is not the one
  whose start the bucket holds (rewritten: a resumed run drops records) is copied whole.
- Any file the periodic pushes copy whole (but a closed event file) waits longer between copies
  the larger it is: on average at most WHOLE_BYTES_PER_PUSH per push and file (a checkpoint's
  push and the last one copy every change).
- W&B: an online run sends its data to W&B itself, so its local files (W&B's cache and logs)
  are not copied; an offline run's (WANDB_MODE=offline: its only copy, for `wandb sync`) go up
  with each checkpoint and at the end. The W&B run id always.

At start the bucket's files (not its checkpoints, which jaxtrain/checkpointing/checkpointer.py
restores step by step, nor the TensorBoard events a resumed run does not read) are pulled into the
mirror, so a resumed run continues the same metrics.jsonl and the same W&B run. A local --workdir is
used as it is, and every method here does nothing for it.
"""

from __future__ import annotations

import math
import os
import shutil
import threading
from typing import NamedTuple

from jaxtrain import storage

# The W&B run's id, kept so that a run resumed in the same workdir logs to the same W&B run
# (train/wandb.py writes it; `_when` says which pushes copy it).
RUN_ID_FILE = os.path.join("wandb", "jaxtrain_run_id")

# Not mirrored: the checkpoints under the workdir are saved and restored by the Checkpointer.
NOT_MIRRORED = ("checkpoints",)
# Not pulled either: a resumed run writes TensorBoard events into a new file and never reads the
# earlier ones, which stay on the bucket (and can be large).
NOT_PULLED = NOT_MIRRORED + ("tensorboard",)
# What a periodic push copies whole of one file, on average: a file of N times this is copied
# at most every N pushes.
WHOLE_BYTES_PER_PUSH = 128 * 2**10
# The bytes kept of the end of what the bucket holds of an appended file: the local file still
# starts with that copy when it holds them at the same offset.
_WINDOW = 4096


class _Sent(NamedTuple):
  """What the bucket holds of an appended file: its first `length` bytes, of the local file
  `inode`, ending with `window`."""
  length: int
  inode: tuple[int, int]
  window: bytes


class RunDirectory:
  """The local directory a run writes (`local`), mirrored to `url` when the workdir is one."""

  def __init__(self, workdir: str, *, sync_every_s: float = 30.0):
    self.url = workdir.rstrip("/") if storage.is_url(workdir) else None
    self.local = storage.staging_path(self.url, "workdir") if self.url else workdir
    self.sync_every_s = sync_every_s
    self._pushed: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) pushed
    self._sent: dict[str, _Sent] = {}  # appended files: what the bucket holds
    self._pushes = 0  # periodic pushes so far
    self._copied_at: dict[str, int] = {}  # relative path -> the push that last copied it whole
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def pull(self) -> None:
    """Replaces the local mirror with the bucket's files (process 0 only writes the workdir)."""
    if not self.url:
      return
    shutil.rmtree(self.local, ignore_errors=True)
    storage.download_dir(self.url, self.local, exclude=NOT_PULLED)
    self._pushed = {rel: _stamp(os.path.join(self.local, rel)) for rel in self._files()}
    for rel in self._pushed:
      if _appended(rel):
        path = os.path.join(self.local, rel)
        with open(path, "rb") as f:
          data = f.read()
        self._sent[rel] = _Sent(len(data), _inode(path), data[-_WINDOW:])

  def push(self) -> None:
    """Copies every change since the last push to the bucket (thread-safe): what the run's
    checkpoint and its end need there."""
    self._push(periodic=False)

  def _push(self, periodic: bool) -> None:
    """A push; `periodic` (every sync_every_s): without the files only a checkpoint's and the
    last push copy (the open TensorBoard event file, an offline W&B run), and large files copied
    whole less often."""
    if not self.url:
      return
    with self._lock:
      self._pushes += periodic
      files = self._files()
      open_events = _open_event_files(files)
      whole = {}
      for rel in files:
        when = _when(rel, open_events)
        if when == "never" or (when == "final" and periodic):
          continue
        try:
          stamp = _stamp(os.path.join(self.local, rel))
        except FileNotFoundError:  # gone since the listing (a temporary file)
          continue
        if self._pushed.get(rel) == stamp:
          continue
        if _appended(rel):
          if self._push_appended(rel, periodic):
            self._pushed[rel] = stamp
        elif "tfevents" in rel or not (periodic and self._wait_to_copy(rel, stamp[0])):
          whole[rel] = stamp  # (a closed event file is copied at once: it is final)
      if whole:  # the rest in one concurrent copy
        storage.upload_dir(self.local, self.url, only=sorted(whole))
        self._pushed.update(whole)
        self._copied_at.update({rel: self._pushes for rel in whole})

  def _push_appended(self, rel: str, periodic: bool) -> bool:
    """Sends an appended file's new bytes, or the whole file where the bucket's copy is not its
    start or cannot be appended to; False when a periodic push leaves the whole copy for later."""
    path, url = os.path.join(self.local, rel), f"{self.url}/{rel.replace(os.sep, '/')}"
    sent, inode = self._sent.get(rel), _inode(path)
    with open(path, "rb") as f:
      if sent and sent.inode == inode and sent.length >= len(sent.window):
        f.seek(sent.length - len(sent.window))
        if f.read(len(sent.window)) == sent.window:  # the file still starts with the copy
          tail = _complete(rel, f.read())
          if storage.append_bytes(url, tail, size=sent.length):
            self._sent[rel] = _Sent(sent.length + len(tail), inode,
                                    (sent.window + tail)[-_WINDOW:])
            return True
      size = os.fstat(f.fileno()).st_size
      # A copy that makes the bucket's large enough to be appended to is not put off: the
      # pushes after it send new bytes alone.
      entering = sent is not None and sent.length < storage.S3_MIN_PART <= size
      if periodic and not entering and self._wait_to_copy(rel, size):
        return False
      f.seek(0)
      data = _complete(rel, f.read())
    storage.write_bytes(url, data)
    self._sent[rel] = _Sent(len(data), inode, data[-_WINDOW:])
    self._copied_at[rel] = self._pushes
    return True

  def _wait_to_copy(self, rel: str, size: int) -> bool:
    """Whether a periodic push leaves copying `rel` whole for a later one: a file of N times
    WHOLE_BYTES_PER_PUSH waits N pushes after its last whole copy."""
    last = self._copied_at.get(rel)
    return last is not None and self._pushes - last < math.ceil(size / WHOLE_BYTES_PER_PUSH)

  def start(self) -> None:
    """Pushes every `sync_every_s` on a background thread until close()."""
    if not self.url or self._thread is not None:
      return

    def loop():
      while not self._stop.wait(self.sync_every_s):
        try:
          self._push(periodic=True)
        except Exception as e:  # pylint: disable=broad-except  # retried at the next push
          print(f"warning: pushing {self.local} to {self.url} failed ({type(e).__name__}: "
                f"{str(e)[:200]}); retrying in {self.sync_every_s:.0f}s", flush=True)
    self._thread = threading.Thread(target=loop, name="jaxtrain-workdir-sync", daemon=True)
    self._thread.start()

  def close(self) -> None:
    """Stops the background pushes and pushes the last changes."""
    if not self.url:
      return
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    self.push()

  def _files(self) -> list[str]:
    if not os.path.isdir(self.local):
      return []
    return storage.local_files(self.local, NOT_MIRRORED)


def _stamp(path: str) -> tuple[int, int]:
  st = os.stat(path)
  return st.st_size, st.st_mtime_ns


def _inode(path: str) -> tuple[int, int]:
  st = os.stat(path)
  return st.st_dev, st.st_ino


def _appended(rel: str) -> bool:
  """Files the run (or W&B) only appends to."""
  return rel.endswith((".jsonl", ".wandb"))


def _complete(rel: str, data: bytes) -> bytes:
  """What of an appended file's bytes goes up: of `*.jsonl` up to the last complete line."""
  return data[:data.rfind(b"\n") + 1] if rel.endswith(".jsonl") else data


def _open_event_files(files: list[str]) -> set[str]:
  """The TensorBoard event file each directory's writer still appends to: the newest (names
  begin with the second the file was opened)."""
  newest: dict[str, str] = {}
  for rel in files:
    directory, name = os.path.split(rel)
    if "tfevents" in name and name > newest.get(directory, ""):
      newest[directory] = name
  return {os.path.join(d, n) for d, n in newest.items()}


def _when(rel: str, open_events: set[str]) -> str:
  """Which pushes copy `rel`: "every" one, only the "final" ones (a checkpoint's, the last), or
  "never"."""
  parts = rel.split(os.sep)
  if parts[0] == "wandb" and rel != RUN_ID_FILE:
    # An offline run's directory is its only copy; an online run's is W&B's cache of what it
    # sent itself.
    return "final" if len(parts) > 2 and parts[1].startswith("offline-run-") else "never"
  return "final" if rel in open_events else "every"
