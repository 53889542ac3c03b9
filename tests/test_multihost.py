"""Multi-host training: process layout detection, multi-host config errors, virtual data shards,
and real multi-process runs on localhost (CPU devices, gloo collectives): train on 2 processes,
resume on 1 with the uninterrupted run's losses and gradient norms; a dead or hung process stops
the others. The one-process runs they are compared with run in the test process (run_cli)."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from etils import epath

from jaxtrain import data, distributed
from jaxtrain.checkpointing.checkpointer import DataShardsHandler, DataShardsRestore, DataShardsSave
from jaxtrain.config import ConfigError
from jaxtrain.data import shards
from jaxtrain.parallel.mesh import batch_rows_by_process, make_mesh
from jaxtrain.validation.checks import validate
from tests.conftest import FAST_XLA_FLAG
from tests.helpers import (REPO, SMALL_TINY_ARGS, assert_curves_close,
                           assert_one_line_config_error, main_command, run_cli, small_config)
from tests.data_helpers import assert_batches_equal, take
from tests.data_helpers import small_config as small_data_config

SMALL = SMALL_TINY_ARGS

# --- where the process layout comes from ---------------------------------------------------

SLURM = {"SLURM_JOB_ID": "17", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "2",
         "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}


def test_single_process_needs_no_initialization():
  assert distributed.detect({}, {}) is None
  assert distributed.detect({}, {**SLURM, "SLURM_NTASKS": "1"}) is None
  # `python` inside an sbatch script: the batch step has one task of the allocation's two.
  assert distributed.detect({}, {**SLURM, "SLURM_STEP_NUM_TASKS": "1"}) is None


def test_layout_from_environment_and_flags():
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
         "JAX_PROCESS_ID": "3"}
  layout = distributed.detect({}, env)
  assert layout.kwargs == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4,
                           "process_id": 3}
  flags = {"coordinator_address": "h:1", "num_processes": 2, "process_id": 0}
  assert distributed.detect(flags, env).kwargs == {"coordinator_address": "h:1",
                                                   "num_processes": 2, "process_id": 0}


def test_slurm_and_tpu_pods_are_detected_by_jax():
  assert distributed.detect({}, SLURM) == distributed.Layout("SLURM", {})
  assert distributed.detect({}, {"TPU_WORKER_HOSTNAMES": "w-0,w-1"}).kwargs == {}
  # Under SLURM the coordinator alone may be given: JAX reads the rest from SLURM_*.
  layout = distributed.detect({"coordinator_address": "n1:999"}, SLURM)
  assert layout.kwargs == {"coordinator_address": "n1:999"}


@pytest.mark.parametrize("flags,words", [
    ({"coordinator_address": "h:1"}, ["--num_processes or --process_id", "JAX_NUM_PROCESSES"]),
    ({"num_processes": 2, "process_id": 0}, ["without a coordinator", "--coordinator_address"]),
    ({"coordinator_address": "h", "num_processes": 2, "process_id": 0}, ["HOST:PORT"]),
    ({"coordinator_address": "h:1", "num_processes": 2, "process_id": 2}, ["process_id=2",
                                                                          "[0, num_processes=2)"]),
])
def test_incomplete_layout_is_refused(flags, words):
  with pytest.raises(distributed.DistributedError) as e:
    distributed.detect(flags, {})
  for w in words:
    assert w in str(e.value), (w, str(e.value))


# --- multi-host config keys ----------------------------------------------------------------

BAD = [
    # (overrides, processes, slices, words the message must contain)
    ({"mesh.dcn_data": 0}, 2, 1, ["mesh.dcn_data=0", "positive"]),
    ({"mesh.dcn_data": 2, "mesh.data": 1}, 2, 1, ["mesh.dcn_data=2", "mesh.data=1",
                                                  "multiple of 2"]),
    ({"mesh.dcn_fsdp": 3, "mesh.fsdp": 4, "mesh.data": 2}, 3, 1, ["mesh.dcn_fsdp=3",
                                                                  "mesh.fsdp=4"]),
    ({"mesh.dcn_data": 2, "mesh.data": 2, "mesh.fsdp": -1}, 4, 1,
     ["mesh.dcn_data*mesh.dcn_stage*mesh.dcn_fsdp=2*1*1=2", "4 processes"]),
    ({"mesh.dcn_stage": 2, "mesh.stage": 1}, 2, 1, ["mesh.dcn_stage=2", "mesh.stage=1"]),
    ({"mesh.dcn_data": 2, "mesh.data": 2, "mesh.fsdp": -1}, 1, 1, ["single process",
                                                                   "mesh.dcn_data=1"]),
    ({"mesh.data": 2, "mesh.fsdp": -1}, 2, 2, ["=1", "2 TPU slices"]),
    ({"data.num_shards": 3}, 1, 1, ["data.num_shards=3", "train.global_batch_size=8"]),
    ({"data.num_shards": 2}, 4, 1, ["data.num_shards=2", "multiple of the 4 processes"]),
    ({"data.num_shards": -1}, 1, 1, ["data.num_shards=-1", ">= 0"]),
    ({"train.global_batch_size": 12, "mesh.fsdp": 4, "mesh.tensor": 2}, 8, 1,
     ["train.global_batch_size=12", "8 processes"]),
    ({"distributed.heartbeat_timeout_s": 0}, 2, 1, ["distributed.heartbeat_timeout_s=0"]),
]


@pytest.mark.parametrize("overrides,processes,slices,words", BAD,
                         ids=[str(b[0]) for b in BAD])
def test_bad_multihost_config_names_key_value_and_fix(overrides, processes, slices, words):
  config = small_config()
  config.mesh.fsdp = -1
  for key, value in overrides.items():
    group, name = key.split(".")
    config[group][name] = value
  assert_one_line_config_error(config, 8, words, num_processes=processes, num_slices=slices)


def test_good_multihost_configs_validate():
  config = small_config()
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
  config.mesh.dcn_data, config.data.num_shards = 2, 4
  assert validate(config, 8, num_processes=2).data == 2
  config.mesh.dcn_data, config.mesh.dcn_fsdp = 1, 2
  validate(config, 8, num_processes=2)
  config.mesh.dcn_fsdp = 1
  validate(config, 8, num_processes=4)  # 1*1: one flat mesh over the processes
  config.mesh.dcn_data = 2
  validate(config, 8)  # dry runs (no process count) do not check the host groups
  # Pipeline stages across the hosts, the rest within each.
  config.mesh.data, config.mesh.stage, config.mesh.dcn_data, config.mesh.dcn_stage = 1, 2, 1, 2
  assert validate(config, 8, num_processes=2).stage == 2


def test_hybrid_mesh_needs_as_many_groups_as_dcn_axes():
  # One process, no slices: one group, so a DCN axis of 2 cannot be formed.
  with pytest.raises(ValueError, match="must equal the product of dcn_mesh_shape"):
    make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, dcn={"data": 2})
  mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, dcn={"data": 1, "fsdp": 1})
  assert list(batch_rows_by_process(mesh, 8)) == [0]
  assert batch_rows_by_process(mesh, 8)[0].tolist() == list(range(8))


# --- virtual data shards -------------------------------------------------------------------

def _halves(batch, processes=2):
  per = batch // processes
  return {p: np.arange(p * per, (p + 1) * per) for p in range(processes)}


def test_shard_plan_gives_each_process_the_shards_of_its_rows():
  rows = _halves(8)
  assert shards.plan(4, 8, rows, 0) == shards.ShardPlan(4, (0, 1), (0, 1))
  assert shards.plan(4, 8, rows, 1) == shards.ShardPlan(4, (2, 3), (2, 3))
  assert shards.plan(0, 8, rows, 1) == shards.ShardPlan(2, (1,), (1,))
  assert shards.plan(0, 8, {0: np.arange(8)}, 0) == shards.ShardPlan(1, (0,), (0,))
  # Interleaved rows (fsdp across hosts inside a data axis): shards follow the rows.
  interleaved = {0: np.array([0, 1, 4, 5]), 1: np.array([2, 3, 6, 7])}
  assert shards.plan(4, 8, interleaved, 1).shards == (1, 3)
  # Replicas (batch rows on the devices of both processes): both read, one saves.
  replicated = {0: np.arange(8), 1: np.arange(8)}
  assert shards.plan(2, 8, replicated, 1) == shards.ShardPlan(2, (0, 1), ())
  with pytest.raises(ConfigError, match=r"data.num_shards=1: .* process 0 holds only part"):
    shards.plan(1, 8, rows, 0)


def _small_data_config():
  c = small_data_config()
  c.train.global_batch_size = 8
  return c


def test_global_batches_do_not_depend_on_the_process_count():
  c = _small_data_config()
  one = shards.plan(4, 8, {0: np.arange(8)}, 0)
  two = [shards.plan(4, 8, _halves(8), p) for p in (0, 1)]
  whole = take(one.train_iterator(data.make_train_iterator, c), 3)
  per_process = [take(p.train_iterator(data.make_train_iterator, c), 3) for p in two]
  assert_batches_equal(whole, [shards.concat_rows(b) for b in zip(*per_process)])
  evals = [p.eval_batches(data.make_eval_batches, c) for p in two]
  assert_batches_equal(one.eval_batches(data.make_eval_batches, c),
                       [shards.concat_rows(b) for b in zip(*evals)])
  # One shard per process reads what the process-sharded pipeline always read.
  legacy = data.make_train_iterator(c, process_index=1, process_count=2)
  ours = shards.plan(0, 8, _halves(8), 1).train_iterator(data.make_train_iterator, c)
  assert_batches_equal(take(ours, 2), take(legacy, 2))


def test_sharded_iterator_state_resumes_exactly():
  c = _small_data_config()
  plan = shards.plan(2, 8, {0: np.arange(8)}, 0)
  it = plan.train_iterator(data.make_train_iterator, c)
  take(it, 2)
  state = json.loads(json.dumps(it.get_state()))
  expected = take(it, 3)
  resumed = plan.train_iterator(data.make_train_iterator, c)
  resumed.set_state(state)
  assert_batches_equal(take(resumed, 3), expected)


@pytest.mark.slow
def test_shards_with_grain_workers_resume_and_match_one_shard_per_process():
  """data.num_workers is per shard: 2 shards in one process, each with its worker process,
  give the batches of 2 processes with one shard each, and resume exactly."""
  c = _small_data_config()
  c.data.num_workers = 1
  plan = shards.plan(2, 8, {0: np.arange(8)}, 0)
  it = plan.train_iterator(data.make_train_iterator, c)
  try:
    first = take(it, 2)
    state = json.loads(json.dumps(it.get_state()))
    expected = take(it, 2)
  finally:
    it.close()
  per_process = []
  for p in (0, 1):
    one = shards.plan(2, 8, _halves(8), p).train_iterator(data.make_train_iterator, c)
    try:
      per_process.append(take(one, 4))
    finally:
      one.close()
  assert_batches_equal(first + expected, [shards.concat_rows(b) for b in zip(*per_process)])
  resumed = plan.train_iterator(data.make_train_iterator, c)
  try:
    resumed.set_state(state)
    assert_batches_equal(take(resumed, 2), expected)
  finally:
    resumed.close()


def test_checkpointed_shards_restore_on_another_process_count(tmp_path):
  """Two processes save one shard each into the same directory; one process reads both."""
  c = _small_data_config()
  directory = epath.Path(tmp_path)
  iterators = [shards.plan(2, 8, _halves(8), p).train_iterator(data.make_train_iterator, c)
               for p in (0, 1)]
  for it in iterators:
    take(it, 2)
    DataShardsHandler().save(directory, args=DataShardsSave(it))
  expected = [shards.concat_rows(b) for b in zip(*(take(it, 2) for it in iterators))]
  assert sorted(p.name for p in directory.iterdir()) == ["shard_0-of-2.json",
                                                          "shard_1-of-2.json"]
  one = shards.plan(2, 8, {0: np.arange(8)}, 0).train_iterator(data.make_train_iterator, c)
  DataShardsHandler().restore(directory, args=DataShardsRestore(one))
  assert_batches_equal(take(one, 2), expected)
  # Another shard count cannot continue this stream: the error names the one to use.
  other = shards.plan(4, 8, {0: np.arange(8)}, 0).train_iterator(data.make_train_iterator, c)
  with pytest.raises(ConfigError, match=r"saved as 2 data shards.*--config.data.num_shards=2"):
    DataShardsHandler().restore(directory, args=DataShardsRestore(other))


def test_checkpoints_of_grains_own_handler_still_restore(tmp_path):
  """Before data shards, data/ held grain's process_<p>-of-<P>.json: shard p of P now."""
  c = _small_data_config()
  it = data.make_train_iterator(c)
  take(it, 2)
  (tmp_path / "process_0-of-1.json").write_text(json.dumps(it.get_state()))
  expected = take(it, 2)
  restored = shards.plan(0, 8, {0: np.arange(8)}, 0).train_iterator(data.make_train_iterator, c)
  DataShardsHandler().restore(epath.Path(tmp_path), args=DataShardsRestore(restored))
  assert_batches_equal(take(restored, 2), expected)


# --- real processes ------------------------------------------------------------------------

# Compile time dominates these runs on CPU; XLA's backend optimizations halve it and do not
# change the losses beyond float rounding.
FAST_XLA = FAST_XLA_FLAG
STEPS, SPLIT = 6, 3
# The default data config: one global stream, the same batches for any process count.
SPLIT_MESH = [*SMALL, "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
              "--config.train.log_every=1", f"--config.train.eval_every={SPLIT}",
              "--config.optim.warmup_steps=2", f"--config.optim.decay_steps={STEPS}",
              f"--config.checkpoint.every_steps={SPLIT}"]


def _env(devices=None, **extra):
  flags = FAST_XLA + (f" --xla_force_host_platform_device_count={devices}" if devices else "")
  # PYTHON: the interpreter local_multiprocess.sh runs, this one.
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PYTHON=sys.executable, **extra)


def _main(workdir, *args):
  return main_command("--config=configs/tiny.py", f"--workdir={workdir}", *args)


def _local(num_processes, workdir, *args):
  """launch/local_multiprocess.sh NUM -- jaxtrain.main args (8/NUM CPU devices each)."""
  return ["launch/local_multiprocess.sh", str(num_processes), "--",
          *_main(workdir, *args)[3:]]


def _records(workdir):
  """({"loss": [...], "grad_norm": [...]} at the logged train steps, {step: eval_loss}, the
  logged steps) of WORKDIR/metrics.jsonl, written by one process (process 0), each step once."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  train = [r for r in records if "loss" in r]
  steps = [r["step"] for r in train]
  assert steps == sorted(set(steps)), steps  # one writer (process 0), each step once
  return ({key: [r[key] for r in train] for key in ("loss", "grad_norm")},
          {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}, steps)


def _start(command, log_path, env):
  """Popen of `command` with its output in the file `log_path` (a pipe nobody reads while the
  test process trains would fill and stall it)."""
  with open(log_path, "w", encoding="utf-8") as log:
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _cli_in_this_process(workdir, *args):
  """The one-process run of `_main(workdir, *args)` on this process's 8 CPU devices, in this
  process (run_cli); it must succeed. Its stdout."""
  proc = run_cli("--config=configs/tiny.py", f"--workdir={workdir}", *args, devices=8)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


@contextlib.contextmanager
def _stopped_on_error(launcher):
  """Should the block fail, the launcher's processes are stopped (it forwards SIGTERM to every
  one of them) rather than left running."""
  try:
    yield
  except BaseException:
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=60)
    raise


def _finish(proc, log_path, timeout=240):
  proc.wait(timeout=timeout)
  with open(log_path, encoding="utf-8") as f:
    out = f.read()
  assert proc.returncode == 0, out[-4000:]
  return out


@pytest.mark.slow(seconds=20)
def test_two_processes_resume_as_one_process_with_the_uninterrupted_losses(tmp_path):
  """2 processes x 4 CPU devices, mesh (2,2,2) with dcn_data=2 and the default data config,
  train 3 steps and checkpoint; 1 process x 8 devices resumes for 3 more; the losses, gradient
  norms and eval losses equal an uninterrupted 1-process run at every step."""
  # The uninterrupted run (in this process) and the 2-process run are independent: side by side.
  log = tmp_path / "two.log"
  two = _start(_local(2, tmp_path / "two", *SPLIT_MESH, "--config.mesh.dcn_data=2",
                      f"--config.train.steps={SPLIT}"), log, _env())
  with _stopped_on_error(two):
    _cli_in_this_process(tmp_path / "one", *SPLIT_MESH, f"--config.train.steps={STEPS}")
  out_two = _finish(two, log)
  assert "8 × cpu (2 process(es))" in out_two
  saved = tmp_path / "two" / "checkpoints" / str(SPLIT) / "data"
  assert [n for n in os.listdir(saved) if n.endswith(".json")] == ["global_stream.json"]
  resumed = _cli_in_this_process(tmp_path / "two", *SPLIT_MESH, f"--config.train.steps={STEPS}")
  assert f"resumed from step {SPLIT}" in resumed
  want, want_eval, want_steps = _records(tmp_path / "one")
  got, got_eval, got_steps = _records(tmp_path / "two")
  assert got_steps == want_steps == list(range(1, STEPS + 1))
  assert sorted(got_eval) == sorted(want_eval) == [SPLIT, STEPS]
  print("step  uninterrupted (1 process)  2 processes -> 1 process   (loss, grad_norm)")
  for i, step in enumerate(want_steps):
    print(f"{step:4d}  {want['loss'][i]:.7f} {want['grad_norm'][i]:.7f}  "
          f"{got['loss'][i]:.7f} {got['grad_norm'][i]:.7f}")
  assert_curves_close(got, want, rtol=1e-5)
  np.testing.assert_allclose([got_eval[s] for s in sorted(want_eval)],
                             [want_eval[s] for s in sorted(want_eval)], rtol=1e-5)


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start_pair(workdir, *args):
  port, procs = _free_port(), []
  for i in range(2):
    env = _env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(i))
    log = open(workdir / f"process_{i}.log", "w+", encoding="utf-8")  # pylint: disable=consider-using-with
    procs.append((subprocess.Popen(_main(workdir, *args), cwd=REPO, env=env, stdout=log,
                                   stderr=subprocess.STDOUT), log))
  return procs


def _wait_for_step(workdir, procs, step, timeout=180):
  path, deadline = workdir / "metrics.jsonl", time.time() + timeout
  while time.time() < deadline:
    if any(p.poll() is not None for p, _ in procs):
      break
    if path.exists() and f'"step": {step},' in path.read_text():
      return
    time.sleep(0.2)
  pytest.fail(f"the run did not reach step {step}:\n" + "".join(_tail(log) for _, log in procs))


def _tail(log, chars=3000):
  log.seek(0)
  return log.read()[-chars:]


HEARTBEAT_S = 5


@pytest.mark.slow
@pytest.mark.parametrize("victim,how", [(1, signal.SIGKILL), (0, signal.SIGSTOP)],
                         ids=["process-1-killed", "coordinator-hung"])
def test_dead_or_hung_process_stops_the_other_within_the_timeout(tmp_path, victim, how):
  """A killed process breaks the collective its peer waits in; a hung one (SIGSTOP: no crash,
  no closed socket) is found by the heartbeat timeout. Either way the survivor exits non-zero,
  saying what happened, within distributed.heartbeat_timeout_s (plus slack for a loaded CI)."""
  procs = _start_pair(tmp_path, *SMALL, "--config.mesh.data=2", "--config.train.steps=100000",
                      "--config.train.log_every=1", "--config.train.eval_every=100000",
                      f"--config.distributed.heartbeat_timeout_s={HEARTBEAT_S}")
  try:
    _wait_for_step(tmp_path, procs, 2)
    procs[victim][0].send_signal(how)
    start = time.time()
    survivor, log = procs[1 - victim]
    rc = survivor.wait(timeout=HEARTBEAT_S + 30)
    elapsed = time.time() - start
    out = _tail(log, 20000)
    assert rc != 0, out[-3000:]
    assert elapsed < HEARTBEAT_S + 20, elapsed
    # JAX's coordination service reports a dead peer (killed: its connection closes; hung: its
    # heartbeats stop) by terminating the survivor with a message that says so; a killed peer
    # may first break the collective the survivor waits in, which the CLI reports itself. Which
    # comes first is a race between two threads; each way names the cause.
    jax_terminated = "another task died" in out or "stopped sending heartbeats" in out
    if how == signal.SIGKILL:
      cli_reported = (f"process {1 - victim}/2 on {socket.gethostname()}: error:" in out
                      and "another process of this run probably died" in out)
      assert cli_reported or jax_terminated, out[-3000:]
    else:
      assert jax_terminated, out[-3000:]
  finally:
    for p, log in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGKILL)
      p.wait()
      log.close()


@pytest.mark.slow
def test_config_error_names_process_and_host_and_the_launcher_fails(tmp_path):
  proc = subprocess.run(_local(2, tmp_path, *SMALL, "--config.mesh.data=2",
                               "--config.mesh.dcn_data=4"),
                        cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=120)
  assert proc.returncode == 2, proc.stdout[-3000:]
  host = socket.gethostname()
  assert f"process 0/2 on {host}: config error: mesh.dcn_data=4" in proc.stdout
  assert f"[process 1] process 1/2 on {host}: config error: mesh.dcn_data=4" in proc.stdout
  assert "local_multiprocess: process 0 exited with status 2" in proc.stdout


@pytest.mark.slow
def test_context_parallel_across_two_processes_matches_one(tmp_path):
  """2 processes x 4 CPU devices: data spans the processes (dcn_data=2) and each process holds
  a context=2 x fsdp=2 group, so the ring stays within a process; the losses and gradient norms
  equal one process with the same mesh (in the test process, while the two run)."""
  args = [*SMALL, "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.context=2",
          "--config.mesh.tensor=1", "--config.attention.context_parallel=ring",
          "--config.train.log_every=1", "--config.train.steps=3",
          "--config.train.eval_every=3", "--config.optim.warmup_steps=2"]
  log = tmp_path / "two.log"
  two = _start(_local(2, tmp_path / "two", *args, "--config.mesh.dcn_data=2"), log, _env())
  with _stopped_on_error(two):
    _cli_in_this_process(tmp_path / "one", *args)
  out_two = _finish(two, log)
  assert "8 × cpu (2 process(es))" in out_two and "context=2" in out_two
  want, _, want_steps = _records(tmp_path / "one")
  got, _, got_steps = _records(tmp_path / "two")
  assert got_steps == want_steps == [1, 2, 3]
  assert_curves_close(got, want, rtol=1e-5)
