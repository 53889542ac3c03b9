"""Runs that live on a bucket (--workdir=s3://..., jaxtrain/checkpointing/run_directory.py and
checkpointing/mirror.py), against the S3 server the tests start on the loopback interface
(tests/object_store.py): a corpus prepared from raw files on the bucket to the bucket, trained
from there with checkpoints on the bucket, SIGKILLed and resumed on a machine that has lost its
local files, continues bitwise like an uninterrupted local run; a checkpoint whose upload was cut short is never
taken; retention on the bucket; init_from and weights directories on the bucket; one-line
refusals that write nothing."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxtrain import storage
from jaxtrain.checkpointing import checkpointer as checkpoint, mirror as checkpoint_mirror
from jaxtrain.checkpointing import weights as checkpoint_weights
from jaxtrain.data import prepare
from tests.data_helpers import make_docs, write_jsonl
from tests.helpers import (REPO, SMALL_TINY_ARGS, cli_process_command, cli_process_env,
                           main_command, main_env, run_cli, run_generate, run_tiny)
from tests.object_store import s3_server

STEPS = 12
COMMON = [f"--config.train.steps={STEPS}", "--config.train.log_every=1",
          "--config.train.eval_every=6", "--config.optim.warmup_steps=2",
          "--config.checkpoint.every_steps=4"]


@pytest.fixture(scope="module")
def s3():
  with s3_server() as (_, bucket):
    yield f"s3://{bucket}"


@pytest.fixture(scope="module")
def corpus(s3, tmp_path_factory):
  """{"bucket": URL, "local": DIR} of one corpus prepared twice from the same JSONL: by
  `python -m jaxtrain.data.prepare` from raw files on the bucket to the bucket, and from the local
  copy to local disk."""
  raw = tmp_path_factory.mktemp("raw")
  write_jsonl(raw / "docs.jsonl", make_docs(300, seed=5))
  storage.upload_dir(str(raw), f"{s3}/raw")
  local = str(tmp_path_factory.mktemp("prepared"))
  for source, output in ((f"{s3}/raw/*.jsonl", f"{s3}/prepared"),
                         (str(raw / "docs.jsonl"), local)):
    assert prepare.main(["--input", source, "--format=jsonl", "--tokenizer=byte",
                         f"--output={output}", "--num_workers=1", "--docs_per_shard=100"]) == 0
  return {"bucket": f"{s3}/prepared", "local": local}


def _data(path):
  return ["--config.data.source=prepared", f"--config.data.train_paths={path}"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus):
  """The same run on local disk, from the local copy of the corpus, uninterrupted: what every
  bucket run must equal, bitwise."""
  workdir = tmp_path_factory.mktemp("local")
  _, records = run_tiny(workdir, *COMMON, *_data(corpus["local"]))
  return records


def _records(url) -> list[dict]:
  return [json.loads(l) for l in storage.read_bytes(f"{url}/metrics.jsonl").decode().splitlines()]


def _history(records):
  return ([(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r],
          [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r])


def _run_on(url, *overrides):
  """`run_tiny` with its workdir on the bucket: the result, which must succeed."""
  proc = run_cli("--config=configs/tiny.py", f"--workdir={url}", *SMALL_TINY_ARGS, *overrides)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  return proc


def _complete(url) -> list[int]:
  return checkpoint_mirror.CheckpointMirror(f"{url}/checkpoints", max_to_keep=None,
                                            keep_period=None).complete_steps()


def _lose_local_files():
  """What a preempted node loses: every staging copy of this server's buckets."""
  shutil.rmtree(os.environ[storage.STAGING_ENV], ignore_errors=True)


def _kill_once_complete(url, step, data) -> list[int]:
  """Starts the run on `url` (reading `data`) in a jaxtrain.main process of its own, sharing this
  process's compilations (helpers.cli_process_command), and SIGKILLs it as soon as the bucket
  holds a complete checkpoint of `step` or later; returns the complete steps at the kill."""
  proc = subprocess.Popen(cli_process_command("--config=configs/tiny.py", f"--workdir={url}",
                                              *SMALL_TINY_ARGS, *COMMON, *data),
                          cwd=REPO, env=cli_process_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if any(s >= step for s in _complete(url)):
      break
    time.sleep(0.02)
  assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()}"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  return _complete(url)


@pytest.mark.slow
def test_a_killed_run_on_a_bucket_resumes_bitwise(s3, corpus, uninterrupted):
  """prepare -> train from the bucket -> checkpoints to the bucket -> SIGKILL -> resume on a
  node without the first one's files: the losses of the uninterrupted local run, bitwise."""
  url = f"{s3}/killed"
  data = _data(corpus["bucket"])
  complete = _kill_once_complete(url, 4, data)
  assert complete and complete[-1] < STEPS
  _lose_local_files()  # the new node starts from the bucket alone
  proc = _run_on(url, *COMMON, *data)
  assert f"resumed from step {complete[-1]}: {url}/checkpoints/{complete[-1]}" in proc.stdout
  assert f"metrics in {url}/metrics.jsonl" in proc.stdout
  train, evals = _history(_records(url))
  want_train, want_evals = _history(uninterrupted)
  assert [s for s, *_ in train] == list(range(1, STEPS + 1))  # each step once
  assert train == want_train  # losses and gradient norms bitwise equal
  assert evals == want_evals
  # Retention on the bucket as locally (max_to_keep=3): steps 4, 8 and 12, each complete.
  assert _complete(url) == [4, 8, 12]
  assert storage.listdir(f"{url}/checkpoints") == ["12", "4", "8"]
  # Both runs' TensorBoard events: the killed run's stay on the bucket (not pulled, not lost).
  assert len([n for n in storage.listdir(f"{url}/tensorboard") if n.startswith("events")]) == 2


@pytest.mark.slow
def test_a_cut_short_upload_is_never_taken(s3, corpus, uninterrupted):
  """The newest step lost its marker (the upload was cut before it) and part of its files: the
  resumed run starts from the step before it, re-saves the step, and still equals the
  uninterrupted run."""
  url = f"{s3}/cut"
  data = _data(corpus["bucket"])
  _run_on(url, *COMMON, *data)
  assert _complete(url) == [4, 8, 12]
  storage.remove_tree(f"{url}/checkpoints/12/{checkpoint_mirror.COMMIT_MARKER}")
  storage.remove_tree(f"{url}/checkpoints/12/state")
  assert _complete(url) == [4, 8]
  _lose_local_files()
  proc = _run_on(url, *COMMON, *data)
  assert "resumed from step 8:" in proc.stdout
  assert _history(_records(url)) == _history(uninterrupted)
  assert _complete(url) == [4, 8, 12]  # step 12 saved again, whole


def test_retention_keeps_the_newest_and_the_periodic_steps():
  keep = checkpoint_mirror.steps_to_keep
  assert keep([4, 8, 12, 16], 2, None) == {12, 16}
  assert keep([4, 8, 12, 16], 1, 8) == {8, 16}
  assert keep([4, 8], None, None) == {4, 8}


def test_a_failed_upload_stops_the_run_at_its_next_save(s3, tmp_path, monkeypatch):
  """An upload error is not swallowed: the next save (or close) raises it; the step it failed on
  has no marker, so it never counts."""
  abstract = {"w": jax.ShapeDtypeStruct((4,), np.float32)}
  state = {"w": np.arange(4, dtype=np.float32)}
  url = f"{s3}/failing/checkpoints"
  ckpt = checkpoint.Checkpointer(url, every_steps=1, max_to_keep=2)
  real_write = storage.write_bytes

  def refuse_marker(path, data):
    if path.endswith(checkpoint_mirror.COMMIT_MARKER):
      raise OSError("connection reset")
    real_write(path, data)
  monkeypatch.setattr(storage, "write_bytes", refuse_marker)
  ckpt.save(1, state, _Iterator(), {"step": 1})
  with pytest.raises(RuntimeError, match="checkpoint upload failed: OSError: connection reset"):
    ckpt.wait()
  assert ckpt.mirror.complete_steps() == [] and ckpt.latest_step() is None
  monkeypatch.setattr(storage, "write_bytes", real_write)
  ckpt.save(2, {"w": state["w"] + 1}, _Iterator(), {"step": 2})
  ckpt.close()
  fresh = checkpoint.Checkpointer(url, every_steps=1, max_to_keep=2)
  restored, step = fresh.restore_latest(abstract, _Iterator())
  fresh.close()
  assert step == 2 and np.array_equal(np.asarray(restored["w"]), state["w"] + 1)


class _Iterator:
  """A data iterator (one shard of this process) with a fixed state."""

  def get_state(self):
    return {"position": 0}

  def set_state(self, state):
    assert state == {"position": 0}


@pytest.mark.slow
def test_weights_and_init_from_on_a_bucket(s3, tmp_path):
  """save_params to a bucket and load_params back; a run started with
  checkpoint.init_from=<a run's workdir on the bucket> starts from its newest complete step."""
  params = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  storage.write_bytes(f"{s3}/weights/config.py", b"# written by the test\n")
  assert checkpoint_weights.save_params(f"{s3}/weights", params) == f"{s3}/weights/params"
  loaded, _ = checkpoint_weights.load_params(f"{s3}/weights", abstract)
  assert all(np.array_equal(np.asarray(loaded[k]), params[k]) for k in params)
  assert checkpoint_weights.saved_config(f"{s3}/weights") is None

  source = f"{s3}/source"
  _run_on(source, "--config.train.steps=4", "--config.checkpoint.every_steps=4")
  local = tmp_path / "local_source"
  storage.download_dir(f"{source}/checkpoints/4", str(local / "4"))
  proc, records = run_tiny(tmp_path / "fine_tune", "--config.train.steps=2",
                           f"--config.checkpoint.init_from={source}")
  _, want = run_tiny(tmp_path / "fine_tune_local", "--config.train.steps=2",
                     f"--config.checkpoint.init_from={local / '4'}")
  assert [r["loss"] for r in records if "loss" in r] == [r["loss"] for r in want if "loss" in r]
  assert checkpoint_weights.saved_config(source)["train"]["steps"] == 4
  # Generation from the run on the bucket: what the downloaded step generates.
  prompt = ["--prompt=The quick", "--max_new_tokens=8", "--temperature=0"]
  from_bucket = run_generate(f"--checkpoint={source}", *prompt)
  assert from_bucket.returncode == 0, from_bucket.stderr[-2000:]
  from_local = run_generate(f"--checkpoint={local / '4'}", *prompt)
  assert from_bucket.stdout == from_local.stdout and "--- prompt: 'The quick'" in from_bucket.stdout


@pytest.mark.parametrize("flag,words", [
    ("--workdir=s3://no-such-bucket/run", ["--workdir: s3://no-such-bucket/run: the bucket",
                                           "does not exist"]),
    ("--workdir=hdfs://cluster/run", ["--workdir: 'hdfs://cluster/run': the scheme 'hdfs://' is "
                                      "not supported"]),
    ("--config.checkpoint.init_from={s3}/nothing-here", ["checkpoint.init_from=", "nothing there"]),
    ("--config.checkpoint.directory=s3://no-such-bucket/ckpt",
     ["checkpoint.directory: s3://no-such-bucket/ckpt: the bucket 'no-such-bucket' does not"]),
])
def test_bad_bucket_paths_are_one_line_and_write_nothing(s3, tmp_path, monkeypatch, flag, words):
  monkeypatch.chdir(tmp_path)
  flag = flag.format(s3=s3)
  workdir = [] if flag.startswith("--workdir") else [f"--workdir={s3}/refused"]
  proc = run_cli(f"--config={REPO}/configs/tiny.py", *workdir, flag, cwd=tmp_path)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("config error: "), proc.stderr
  for word in words:
    assert word in lines[0]
  assert os.listdir(tmp_path) == [] and storage.listdir(f"{s3}/refused") == []


def test_no_credentials_is_one_line(s3, tmp_path, monkeypatch):
  for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
    monkeypatch.delenv(key)
  monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
  monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
  import s3fs  # pylint: disable=import-outside-toplevel
  s3fs.S3FileSystem.clear_instance_cache()
  try:
    proc = run_cli(f"--config={REPO}/configs/tiny.py", f"--workdir={s3}/no-creds", cwd=tmp_path)
  finally:
    s3fs.S3FileSystem.clear_instance_cache()
  assert proc.returncode == 2
  line = proc.stderr.strip()
  assert "\n" not in line and "no credentials for s3://" in line, line


# --- several processes ----------------------------------------------------------------------

TWO_PROCESS = [*SMALL_TINY_ARGS, "--config.mesh.data=2", "--config.mesh.fsdp=-1",
               "--config.train.log_every=1", "--config.train.eval_every=3",
               "--config.optim.warmup_steps=2", "--config.checkpoint.every_steps=3"]


def _two_processes(url, *args, env=None):
  """launch/local_multiprocess.sh 2 -- the tiny run on `url` (4 CPU devices each); the
  completed process, its output captured."""
  command = ["launch/local_multiprocess.sh", "2", "--", "--config=configs/tiny.py",
             f"--workdir={url}", *TWO_PROCESS, *args]
  env = main_env(env={"PYTHON": sys.executable, **(env or {})})
  return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                        check=False)


@pytest.mark.slow
def test_two_processes_checkpoint_to_a_bucket_and_one_resumes(s3):
  """Two processes write one checkpoint through the staging directory they share, process 0
  uploads it; a one-process run on a node without the staging files resumes from the bucket."""
  url = f"{s3}/two"
  proc = _two_processes(url, "--config.train.steps=3")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert _complete(url) == [3]
  _lose_local_files()
  resumed = run_cli("--config=configs/tiny.py", f"--workdir={url}", *TWO_PROCESS,
                    "--config.train.steps=6", devices=8)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert f"resumed from step 3: {url}/checkpoints/3" in resumed.stdout
  assert [r["step"] for r in _records(url) if "loss" in r] == [1, 2, 3, 4, 5, 6]
  assert _complete(url) == [3, 6]


@pytest.mark.slow
def test_processes_that_do_not_share_the_staging_directory_are_refused(s3, tmp_path):
  """Hosts whose staging directories differ cannot write one checkpoint: refused at start with
  the fix, on every process, before any step."""
  port = _free_port()
  procs = []
  for i in range(2):
    env = main_env(4, env={"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                           "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i),
                           storage.STAGING_ENV: str(tmp_path / f"host{i}")})
    procs.append(subprocess.Popen(
        main_command("--config=configs/tiny.py", f"--workdir={s3}/unshared", *TWO_PROCESS,
                     "--config.train.steps=3"),
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 2, out[-3000:]
    assert "which the processes of this run do not share; set JAXTRAIN_STAGING_DIR" in out
  assert _complete(f"{s3}/unshared") == []


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
