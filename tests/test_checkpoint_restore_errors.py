"""What a run does when a checkpoint does not restore: a recognised corruption sets the step
aside and the one before it is used; anything else (out of memory, a bug, storage that stays
unreachable) stops the run naming the step, with nothing renamed; a run whose checkpoints are all
unreadable never starts over silently. On local disk, on the local S3 server, and with two
processes that see different errors."""

import json
import os
import shutil
import socket
import subprocess
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxtrain import storage
from jaxtrain.checkpointing import checkpointer as checkpoint_lib
from jaxtrain.checkpointing.checkpointer import Checkpointer
from jaxtrain.checkpointing.verdicts import (CheckpointRestoreError, Verdict, classify)
from tests.helpers import REPO
from tests.object_store import s3_server

STEPS = (1, 2, 3)


def _state(step):
  return {"w": jnp.full((256,), float(step), jnp.float32),
          "b": {"c": jnp.arange(64, dtype=jnp.float32) * step}}


def _iterator():
  return iter(grain.MapDataset.range(100).to_iter_dataset())


def _abstract():
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      _state(1))


@pytest.fixture(scope="module")
def s3():
  with s3_server() as (_, bucket):
    yield bucket


@pytest.fixture(params=["local", "s3"])
def directory(request, tmp_path):
  """A checkpoints directory holding complete steps 1, 2 and 3 (each state filled with its
  step number)."""
  if request.param == "local":
    where = str(tmp_path / "checkpoints")
  else:
    bucket = request.getfixturevalue("s3")
    where = f"s3://{bucket}/{tmp_path.name}/checkpoints"
  saver = Checkpointer(where, every_steps=1, max_to_keep=None)
  for step in STEPS:
    saver.save(step, _state(step), _iterator(), {"step": step})
  saver.close()
  return where


def _listing(directory):
  """Step names and, on s3://, which steps have their commit marker: what a set-aside changes."""
  names = sorted(storage.listdir(directory))
  markers = [n for n in names if n.isdigit() and
             storage.exists(f"{directory}/{n}/{checkpoint_lib.checkpoint_mirror.COMMIT_MARKER}")]
  return names, markers


def _failing_restore(monkeypatch, error, *, steps=STEPS, times=None):
  """CheckpointManager.restore raises `error` for `steps` (the first `times` calls of each, or
  always); returns the list of (step) calls made."""
  real = ocp.CheckpointManager.restore
  calls = []

  def restore(self, step, *args, **kwargs):
    calls.append(step)
    if step in steps and (times is None or calls.count(step) <= times):
      raise error
    return real(self, step, *args, **kwargs)
  monkeypatch.setattr(ocp.CheckpointManager, "restore", restore)
  return calls


def _truncate_state(directory, step):
  """Empties every file of `step`'s state (on s3://, the objects on the bucket)."""
  base = f"{directory}/{step}/state"
  if storage.is_url(directory):
    import s3fs  # pylint: disable=import-outside-toplevel
    fs = s3fs.S3FileSystem()
    for key in fs.find(base.removeprefix("s3://")):
      fs.pipe(key, b"")
    fs.invalidate_cache()
    return
  for root, _, files in os.walk(base):
    for name in files:
      open(os.path.join(root, name), "wb").close()


def test_an_out_of_memory_error_stops_the_run_and_renames_nothing(directory, monkeypatch):
  before = _listing(directory)
  calls = _failing_restore(monkeypatch, RuntimeError(
      "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.00GiB"))
  with pytest.raises(CheckpointRestoreError) as e:
    Checkpointer(directory, every_steps=1).restore_latest(_abstract(), _iterator())
  message = str(e.value)
  assert f"checkpoint {directory}/3 could not be restored" in message
  assert "RESOURCE_EXHAUSTED" in message and "nothing was set aside" in message
  assert "\n" not in message
  assert calls == [3]  # the older steps are not tried either: the error is not about step 3
  assert _listing(directory) == before


def test_a_transient_read_error_is_retried_once(directory, monkeypatch, capsys):
  monkeypatch.setattr(checkpoint_lib, "RETRY_DELAY_S", 0.0)
  calls = _failing_restore(monkeypatch, ValueError(
      "UNAVAILABLE: Error reading local file: connection reset"), times=1)
  state, step = Checkpointer(directory, every_steps=1).restore_latest(_abstract(), _iterator())
  assert step == 3 and calls == [3, 3]
  np.testing.assert_array_equal(state["w"], np.full((256,), 3.0))
  assert f"reading checkpoint {directory}/3 failed (ValueError: UNAVAILABLE" in (
      capsys.readouterr().out)


def test_a_read_error_that_persists_stops_the_run_after_one_retry(directory, monkeypatch):
  monkeypatch.setattr(checkpoint_lib, "RETRY_DELAY_S", 0.0)
  before = _listing(directory)
  calls = _failing_restore(monkeypatch, ConnectionResetError("Connection reset by peer"))
  with pytest.raises(CheckpointRestoreError, match=r"/3 could not be read, twice \("
                     r"ConnectionResetError: Connection reset by peer\); nothing was set aside"):
    Checkpointer(directory, every_steps=1).restore_latest(_abstract(), _iterator())
  assert calls == [3, 3]
  assert _listing(directory) == before


def test_a_truncated_step_is_set_aside_and_the_one_before_it_is_used(directory, capsys):
  _truncate_state(directory, 3)
  checkpointer = Checkpointer(directory, every_steps=1)
  state, step = checkpointer.restore_latest(_abstract(), _iterator())
  assert step == 2
  np.testing.assert_array_equal(state["w"], np.full((256,), 2.0))
  out = capsys.readouterr().out
  assert f"warning: checkpoint {directory}/3 is incomplete or corrupted" in out
  names, markers = _listing(directory)
  if storage.is_url(directory):  # the marker renamed; the files stay for inspection
    assert markers == ["1", "2"] and "3" in names
  else:
    assert [n for n in names if n.isdigit()] == ["1", "2"]
    assert any(n.startswith("3.corrupted-") for n in names)
  # The run saves step 3 again where the unreadable one was.
  checkpointer.save(3, _state(3), _iterator(), {"step": 3})
  checkpointer.close()
  state, step = Checkpointer(directory, every_steps=1).restore_latest(_abstract(), _iterator())
  assert step == 3


def test_a_run_whose_checkpoints_are_all_unreadable_never_starts_over_silently(directory):
  for step in STEPS:
    _truncate_state(directory, step)
  before = _listing(directory)
  with pytest.raises(CheckpointRestoreError) as e:
    Checkpointer(directory, every_steps=1).restore_latest(_abstract(), _iterator())
  message = str(e.value)
  assert message.startswith(f"no checkpoint in {directory} can be read (step 3: ")
  assert "step 2: " in message and "step 1: " in message
  assert "checkpoint.on_unreadable=restart" in message and "\n" not in message
  assert _listing(directory) == before
  # Asked for, the run sets them aside and starts from step 0.
  restarting = Checkpointer(directory, every_steps=1, on_unreadable="restart")
  assert restarting.restore_latest(_abstract(), _iterator()) == (None, None)
  assert _listing(directory)[1] == [] if storage.is_url(directory) else not [
      n for n in _listing(directory)[0] if n.isdigit()]


def _damage(step_dir, how):
  files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs]
  pick = lambda pred: [f for f in files if pred(os.path.relpath(f, step_dir))]
  if how == "array files truncated":
    for f in pick(lambda p: "/d/" in p):
      os.truncate(f, os.path.getsize(f) // 2)
  elif how == "array files overwritten":
    for f in pick(lambda p: "/d/" in p):
      with open(f, "r+b") as out:
        out.write(b"\xff" * os.path.getsize(f))
  elif how == "database manifest garbled":
    for f in pick(lambda p: p.endswith("manifest.ocdbt")):
      with open(f, "wb") as out:
        out.write(b"garbage" * 16)
  elif how == "array files removed":
    for f in pick(lambda p: "/d/" in p):
      os.remove(f)
  elif how == "state metadata removed":
    os.remove(os.path.join(step_dir, "state", "_METADATA"))
  elif how == "state metadata garbled":
    with open(os.path.join(step_dir, "state", "_METADATA"), "w", encoding="utf-8") as out:
      out.write("{not json")
  elif how in ("state item removed", "data item removed", "meta item removed"):
    shutil.rmtree(os.path.join(step_dir, how.split()[0]))
  elif how == "data item garbled":
    for f in pick(lambda p: p.startswith("data/") and p.endswith(".json")):
      with open(f, "w", encoding="utf-8") as out:
        out.write("{not json")


@pytest.mark.parametrize("how", [
    "array files truncated", "array files overwritten", "database manifest garbled",
    "array files removed", "state metadata removed", "state metadata garbled",
    "state item removed", "data item removed", "meta item removed", "data item garbled"])
def test_what_orbax_raises_for_a_damaged_step_is_recognised(tmp_path, how, capsys):
  """Real damage, Orbax's real errors: each is a corruption (step 3 set aside, step 2 used),
  never a reason to stop, nor taken for a checkpoint of another model."""
  where = str(tmp_path / "checkpoints")
  saver = Checkpointer(where, every_steps=1, max_to_keep=None)
  for step in (2, 3):
    saver.save(step, _state(step), _iterator(), {"step": step})
  saver.close()
  _damage(os.path.join(where, "3"), how)
  state, step = Checkpointer(where, every_steps=1).restore_latest(_abstract(), _iterator())
  assert step == 2, capsys.readouterr().out
  np.testing.assert_array_equal(state["b"]["c"], np.arange(64) * 2.0)
  assert f"checkpoint {where}/3 is incomplete or corrupted" in capsys.readouterr().out


def test_errors_are_classified_by_what_they_say_of_the_checkpoint():
  import json as json_lib  # pylint: disable=import-outside-toplevel,reimport
  corrupt = [json_lib.JSONDecodeError("Expecting value", "", 0), FileNotFoundError("x/d/1"),
             ValueError('NOT_FOUND: Error opening "zarr" driver: Error reading "a/.zarray"'),
             ValueError("OUT_OF_RANGE: Error reading Byte range [0, 290) of local file"),
             ValueError("DATA_LOSS: Error decoding local file manifest.ocdbt"),
             ValueError('FAILED_PRECONDITION: Error reading "a/0" in OCDBT database at local '
                        'file "ck/1/state/": Truncated Zstd-compressed stream; at byte 0')]
  transient = [ConnectionResetError("reset"), TimeoutError("timed out"),
               ValueError("UNAVAILABLE: Error reading gs://b/x"),
               ValueError("DEADLINE_EXCEEDED: read took too long")]
  fatal = [RuntimeError("RESOURCE_EXHAUSTED: Out of memory"), MemoryError(),
           TypeError("unsupported operand"), PermissionError("denied"),
           KeyError("params"), ValueError("PERMISSION_DENIED: 403"),
           ValueError("FAILED_PRECONDITION: the mesh has 3 devices")]
  for errors, verdict in ((corrupt, Verdict.CORRUPT), (transient, Verdict.TRANSIENT),
                          (fatal, Verdict.FATAL)):
    for error in errors:
      assert classify(error) == verdict, error
  # Wrapped: the cause decides where the wrapper says nothing; a wrapper that names an out of
  # memory error decides for itself.
  try:
    try:
      raise FileNotFoundError("state/d/0")
    except FileNotFoundError:
      raise storage.StorageError("s3://b/ck/3: no such object") from None
  except storage.StorageError as wrapped:
    assert classify(wrapped) == Verdict.CORRUPT
  oom = RuntimeError("RESOURCE_EXHAUSTED: while restoring")
  oom.__cause__ = FileNotFoundError("x")
  assert classify(oom) == Verdict.FATAL
  assert classify(ExceptionGroup("reads", [FileNotFoundError("a"), ValueError(
      "UNAVAILABLE: b")])) == Verdict.TRANSIENT


# --- Two processes: the verdict is agreed before anything is renamed. ---

_WORKER = r"""
import json, os, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
process, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
import grain, jax.numpy as jnp, numpy as np, orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtrain.checkpointing.checkpointer import Checkpointer
from jaxtrain.checkpointing.verdicts import CheckpointRestoreError

mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
sharding = NamedSharding(mesh, P("data"))
def state(step):
  return {"w": jax.jit(lambda: jnp.full((64,), float(step)), out_shardings=sharding)()}
iterator = lambda: iter(grain.MapDataset.range(10).to_iter_dataset())
saver = Checkpointer(directory, every_steps=1, max_to_keep=None)
for step in (1, 2, 3):
  saver.save(step, state(step), iterator(), {"step": step})
saver.close()
multihost_utils.sync_global_devices("saved")
case = None
real = ocp.CheckpointManager.restore
def restore(self, step, *args, **kwargs):
  # Only process 1 meets the error, and only for step 3: process 0 alone would restore it.
  if process == 1 and step == 3:
    raise (RuntimeError("RESOURCE_EXHAUSTED: Out of memory") if case == "oom" else
           ValueError("DATA_LOSS: Error reading local file: checksum mismatch"))
  return real(self, step, *args, **kwargs)
ocp.CheckpointManager.restore = restore
abstract = {"w": jax.ShapeDtypeStruct((64,), jnp.float32, sharding=sharding)}
def restore_latest():
  # A run's restore: a Checkpointer of its own, as each run starts with.
  try:
    restored, step = Checkpointer(directory, every_steps=1).restore_latest(abstract, iterator())
    w = float(np.asarray(jax.experimental.multihost_utils.process_allgather(restored["w"], tiled=True)).min())
    assert np.array_equal(np.asarray(jax.experimental.multihost_utils.process_allgather(restored["w"], tiled=True)), np.full((64,), float(step)))
    return {"step": step, "w": w}
  except CheckpointRestoreError as e:
    return {"error": str(e)}
results = {}
case = "oom"
results["oom"] = restore_latest()
multihost_utils.sync_global_devices("oom verdict")  # both done: the directory as oom left it
results["after_oom"] = sorted(os.listdir(directory))
multihost_utils.sync_global_devices("listed")
case = "corrupt"
results["corrupt"] = restore_latest()
print("RESULT " + json.dumps(results), flush=True)
"""


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _two_processes(tmp_path, directory):
  """Each process's results of the worker: {"oom": ..., "after_oom": the directory's names,
  "corrupt": ...}."""
  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  env.pop("XLA_FLAGS", None)  # the worker sets its own device count
  procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port), directory],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for i in range(2)]
  results = []
  for proc in procs:
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
    results.append(json.loads(lines[0][len("RESULT "):]) if lines else None)
  return results


@pytest.mark.slow(seconds=10)
def test_two_processes_agree_on_the_verdict_before_anything_is_renamed(tmp_path):
  """Process 1 alone cannot read step 3. Out of memory: both stop, nothing renamed. A data
  loss: both set step 3 aside (once) and restore step 2. Both cases in the same two processes,
  one after the other (each restore by a Checkpointer of its own, as a run's), after they saved
  steps 1-3."""
  directory = str(tmp_path / "checkpoints")
  results = _two_processes(tmp_path, directory)
  assert all(results), results
  oom = [r["oom"] for r in results]
  assert all(r and "checkpoint" in r["error"] and "RESOURCE_EXHAUSTED" in r["error"] or
             r and "another process" in r["error"] for r in oom), oom
  assert f"{directory}/3 could not be restored" in oom[0]["error"]
  assert [r["after_oom"] for r in results] == [["1", "2", "3"]] * 2
  corrupt = [r["corrupt"] for r in results]
  assert corrupt == [{"step": 2, "w": 2.0}] * 2, corrupt
  names = sorted(os.listdir(directory))
  assert names[:2] == ["1", "2"] and len(names) == 3 and names[2].startswith("3.corrupted-")
