"""`--workdir` on a bucket: the run writes its files (metrics.jsonl, TensorBoard events,
completions, the W&B run id) into a local mirror, which is pushed to the bucket in the background
every `sync_every_s`, before each checkpoint counts as complete, and at the end.

An object store cannot append, so a file is copied whole each time it has changed; files the run
appends to line by line (`*.jsonl`) are copied up to their last complete line, so a run killed
during a push never leaves a torn record on the bucket. At start the bucket's files (not its
checkpoints, which jaxtrain/checkpoint.py restores step by step, nor the TensorBoard events a
resumed run does not read) are pulled into the mirror, so a
resumed run continues the same metrics.jsonl and the same W&B run. A local --workdir is used as
it is, and every method here does nothing for it.
"""

from __future__ import annotations

import os
import shutil
import threading

from jaxtrain import storage

# Not mirrored: the checkpoints under the workdir are saved and restored by the Checkpointer.
NOT_MIRRORED = ("checkpoints",)
# Not pulled either: a resumed run writes TensorBoard events into a new file and never reads the
# earlier ones, which stay on the bucket (and can be large).
NOT_PULLED = NOT_MIRRORED + ("tensorboard",)


class RunDirectory:
  """The local directory a run writes (`local`), mirrored to `url` when the workdir is one."""

  def __init__(self, workdir: str, *, sync_every_s: float = 30.0):
    self.url = workdir.rstrip("/") if storage.is_url(workdir) else None
    self.local = storage.staging_path(self.url, "workdir") if self.url else workdir
    self.sync_every_s = sync_every_s
    self._pushed: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) pushed
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

  def push(self) -> None:
    """Copies the files changed since the last push to the bucket (thread-safe)."""
    if not self.url:
      return
    with self._lock:
      changed = {rel: _stamp(os.path.join(self.local, rel)) for rel in self._files()}
      changed = {rel: stamp for rel, stamp in changed.items() if self._pushed.get(rel) != stamp}
      for rel in [r for r in changed if r.endswith(".jsonl")]:
        with open(os.path.join(self.local, rel), "rb") as f:
          data = f.read()
        storage.write_bytes(f"{self.url}/{rel.replace(os.sep, '/')}",
                            data[:data.rfind(b"\n") + 1])
      whole = [r for r in changed if not r.endswith(".jsonl")]
      if whole:  # the rest in one concurrent copy
        storage.upload_dir(self.local, self.url, only=whole)
      self._pushed.update(changed)

  def start(self) -> None:
    """Pushes every `sync_every_s` on a background thread until close()."""
    if not self.url or self._thread is not None:
      return

    def loop():
      while not self._stop.wait(self.sync_every_s):
        try:
          self.push()
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
