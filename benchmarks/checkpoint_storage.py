"""Checkpoints on local disk against checkpoints on a bucket: what a save costs the training loop
and how long until the step is complete where it is kept, and what a restore costs.

A state of random float32 arrays (--megabytes in all, in --arrays arrays) is saved through
jaxtrain's Checkpointer (Orbax, asynchronous) to a local directory and to s3:// on an S3 server
started on the loopback interface (moto's, tests/object_store.py: the dev extra), where each step
is written into the staging directory and uploaded once committed
(jaxtrain/checkpointing/mirror.py). For each, three saves:

  blocking  what `save()` takes before the loop continues (the device-to-host copy);
  complete  from the save to its step being complete: committed locally, and for s3:// uploaded
            with its commit marker (`wait()`);
  restore   the newest complete step read back onto the same shardings, from a fresh
            Checkpointer (for s3://: after the staging copy is deleted, as on a new node).

Prints one table; the last line is
`checkpoint_storage: local_complete_s=X s3_complete_s=Y s3_upload_mb_per_s=Z`.

  python benchmarks/checkpoint_storage.py [--megabytes 64] [--arrays 16]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxtrain import storage  # pylint: disable=wrong-import-position
from jaxtrain.checkpointing import checkpointer as checkpoint


class _Stream:
  """The data iterator's state a checkpoint carries beside the arrays (one shard, fixed)."""

  def get_state(self):
    return {"position": 0}

  def set_state(self, state):
    del state


def _state(megabytes: int, arrays: int) -> dict[str, jax.Array]:
  per = max(1, megabytes * 2**20 // 4 // arrays)
  rng = np.random.default_rng(0)
  return {f"w{i}": jax.device_put(rng.standard_normal(per, dtype=np.float32))
          for i in range(arrays)}


def measure(directory: str, state, saves: int = 3) -> dict[str, float]:
  """Median seconds of `blocking`, `complete` and `restore` for checkpoints in `directory`."""
  times = {"blocking": [], "complete": [], "restore": []}
  ckpt = checkpoint.Checkpointer(directory, every_steps=1, max_to_keep=2)
  for step in range(1, saves + 1):
    start = time.perf_counter()
    ckpt.save(step, state, _Stream(), {"step": step})
    times["blocking"].append(time.perf_counter() - start)
    ckpt.wait()
    times["complete"].append(time.perf_counter() - start)
  ckpt.close()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
  for _ in range(2):
    if storage.is_url(directory):
      shutil.rmtree(storage.staging_path(directory), ignore_errors=True)
    start = time.perf_counter()
    fresh = checkpoint.Checkpointer(directory, every_steps=1, max_to_keep=2)
    restored, step = fresh.restore_latest(abstract, _Stream())
    jax.block_until_ready(restored)
    times["restore"].append(time.perf_counter() - start)
    fresh.close()
    assert step == saves and all(np.array_equal(restored[k], state[k]) for k in state)
  return {k: statistics.median(v) for k, v in times.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--megabytes", type=int, default=64)
  parser.add_argument("--arrays", type=int, default=16)
  args = parser.parse_args()
  missing = [m for m in ("moto", "s3fs") if importlib.util.find_spec(m) is None]
  if missing:
    sys.exit(f"error: {', '.join(missing)} not installed; pip install -e '.[dev]'")
  from tests.object_store import s3_server  # pylint: disable=import-outside-toplevel
  state = _state(args.megabytes, args.arrays)
  megabytes = sum(x.nbytes for x in state.values()) / 2**20
  rows = {}
  with tempfile.TemporaryDirectory() as root, contextlib.ExitStack() as stack:
    rows["local"] = measure(os.path.join(root, "checkpoints"), state)
    _, bucket = stack.enter_context(s3_server())
    rows["s3 (local server)"] = measure(f"s3://{bucket}/checkpoints", state)
  print(f"{'where':<18} {'blocking s':>11} {'complete s':>11} {'restore s':>10}   "
        f"({megabytes:.0f} MiB in {args.arrays} arrays, median of 3 saves, 2 restores)")
  for where, t in rows.items():
    print(f"{where:<18} {t['blocking']:>11.3f} {t['complete']:>11.3f} {t['restore']:>10.3f}")
  local, s3 = rows["local"]["complete"], rows["s3 (local server)"]["complete"]
  upload = megabytes / max(s3 - local, 1e-9)
  print(f"checkpoint_storage: local_complete_s={local:.3f} s3_complete_s={s3:.3f} "
        f"s3_upload_mb_per_s={upload:.1f}")


if __name__ == "__main__":
  from jaxtrain import platforms  # pylint: disable=wrong-import-position,import-outside-toplevel
  platforms.choose_jax_platforms()
  main()
