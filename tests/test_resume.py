"""Checkpoint and resume of whole runs: after a hard kill, the resumed run's losses and gradient
norms equal an uninterrupted run's at every step (CPU, bitwise); a checkpoint restores on
another mesh; corrupted, foreign and non-finite cases."""

import json
import os
import random
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from tests.helpers import (REPO, SMALL_TINY_ARGS, assert_curves_close, cli_process_command,
                           cli_process_env, logged_curves, metrics_records, run_cli, run_tiny)

SMALL = SMALL_TINY_ARGS
STEPS = 12
COMMON = [f"--config.train.steps={STEPS}", "--config.train.log_every=1",
          "--config.train.eval_every=6", "--config.optim.warmup_steps=2",
          "--config.checkpoint.every_steps=4"]


def _history(workdir):
  """([(step, loss, grad_norm)] of the train records, [(step, eval_loss)]) of metrics.jsonl."""
  records = metrics_records(workdir)
  train = [(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r]
  evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
  return train, evals


def _args(workdir):
  return ["--config=configs/tiny.py", f"--workdir={workdir}", *SMALL, *COMMON]


def _saving(workdir) -> bool:
  """Whether Orbax is writing a checkpoint now (its temporary directory exists)."""
  ckpt_dir = os.path.join(workdir, "checkpoints")
  return os.path.isdir(ckpt_dir) and any("tmp" in n for n in os.listdir(ckpt_dir))


def kill_after_step(workdir, step, during_save=False, args=None):
  """Starts a run (of `args`, default the tiny one here) in a jaxtrain.main process of its own
  that shares this process's compilations (helpers.cli_process_command) and SIGKILLs it once
  metrics.jsonl shows `step` (and, with `during_save`, at the next moment a checkpoint is half
  written)."""
  args = _args(workdir) if args is None else args
  proc = subprocess.Popen(cli_process_command(*args), cwd=REPO, env=cli_process_env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + 300
  reached = False
  while time.time() < deadline and proc.poll() is None:
    if not reached and os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        steps = [json.loads(l).get("step", 0) for l in f if l.strip().endswith("}")]
      reached = bool(steps) and max(steps) >= step
    if reached and (not during_save or _saving(workdir)):
      break
    time.sleep(0.002 if reached else 0.01)
  assert proc.poll() is None, "the run finished before it could be killed"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  return during_save and _saving(workdir)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The uninterrupted run of COMMON on one device (checkpoints 4, 8 and 12): its workdir, for
  the tests to read or copy, never to change."""
  workdir = tmp_path_factory.mktemp("uninterrupted")
  run_tiny(workdir, *COMMON)
  return workdir


def _copy_run(source, workdir):
  shutil.copytree(source, workdir, dirs_exist_ok=True)


@pytest.mark.slow
@pytest.mark.parametrize("seed,during_save", [(0, False), (2, True)])
def test_resume_after_sigkill_matches_uninterrupted(tmp_path, uninterrupted, seed, during_save):
  kill_step = random.Random(seed).randint(2, STEPS - 2)
  torn = kill_after_step(tmp_path, kill_step, during_save)
  ckpt_dir = tmp_path / "checkpoints"
  committed = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit()) if ckpt_dir.exists() else []
  if during_save:
    assert torn, "the kill did not land while a checkpoint was being written"
  proc, _ = run_tiny(tmp_path, *COMMON)  # the same command again, here in the test process
  print(f"killed after step {kill_step} (during a save: {torn}); committed {committed}")
  train, evals = _history(tmp_path)
  want_train, want_evals = _history(uninterrupted)
  assert [s for s, *_ in train] == list(range(1, STEPS + 1))  # each step once
  assert train == want_train  # bitwise equal losses and gradient norms
  assert evals == want_evals
  # A save cut short by the kill leaves only a temporary directory, never a committed step.
  if committed:
    assert f"resumed from step {committed[-1]}" in proc.stdout
  else:
    assert "resumed from step" not in proc.stdout


@pytest.mark.slow
def test_restore_on_another_mesh(tmp_path, uninterrupted):
  """A (2,2,2) run over 8 devices matches one device's at every step (loss, gradient norm and
  eval loss, rtol 1e-5); its step-6 checkpoint resumed on 1 device continues within the same
  tolerance of the uninterrupted one-device run."""
  mesh = ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]
  eight = tmp_path / "eight"
  run_tiny(eight, *COMMON[:-1], "--config.checkpoint.every_steps=6", *mesh, devices=8)
  want = logged_curves(uninterrupted, ("loss", "grad_norm"))
  assert len(want["loss"]) == STEPS
  assert_curves_close(logged_curves(eight), want, rtol=1e-5)
  want_evals = [e for _, e in _history(uninterrupted)[1]]
  assert len(want_evals) == 2
  np.testing.assert_allclose([e for _, e in _history(eight)[1]], want_evals, rtol=1e-5)
  # Step 6 as the newest checkpoint of a (2,2,2) run: resumed on 1 device to step 12.
  resumed = tmp_path / "resumed"
  _copy_run(eight, resumed)
  shutil.rmtree(resumed / "checkpoints" / str(STEPS))
  assert sorted(os.listdir(resumed / "checkpoints")) == ["6"]
  proc, _ = run_tiny(resumed, *COMMON[:-1], "--config.checkpoint.every_steps=6")
  assert "resumed from step 6" in proc.stdout
  got = logged_curves(resumed)
  assert len(got["loss"]) == STEPS
  assert_curves_close(got, want, rtol=1e-5)


@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused(tmp_path, uninterrupted):
  shutil.copytree(uninterrupted / "checkpoints", tmp_path / "checkpoints")
  proc = run_cli(*_args(tmp_path), "--config.model.mlp_dim=256")
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "does not match this model config" in proc.stderr
  # Nor is another optimizer's state read into this one's (different trees; one line).
  proc = run_cli(*_args(tmp_path), "--config.optim.name=muon")
  assert proc.returncode == 2, proc.stderr[-2000:]
  line = proc.stderr.strip().splitlines()[-1]
  assert ("holds the optimizer state of optim.name='adamw', this run has optim.name='muon'"
          in line), proc.stderr[-2000:]


def _wait_for_step(proc, workdir, step):
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        if any(json.loads(l).get("step", 0) >= step for l in f if l.strip().endswith("}")):
          return
    time.sleep(0.02)
  raise AssertionError("the run never reached the step")


@pytest.mark.slow
def test_sigterm_saves_exits_0_and_resume_continues(tmp_path):
  # COMMON's schedule (decay_steps=STEPS): the train step the other runs here compiled.
  args = ["--config.train.steps=2000", f"--config.optim.decay_steps={STEPS}",
          "--config.optim.warmup_steps=2", "--config.train.log_every=1",
          "--config.train.eval_every=1000", "--config.checkpoint.every_steps=1000"]
  # A jaxtrain.main process of its own, sharing this process's compilations.
  cmd = cli_process_command("--config=configs/tiny.py", f"--workdir={tmp_path}", *SMALL, *args)
  proc = subprocess.Popen(cmd, cwd=REPO, env=cli_process_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  _wait_for_step(proc, tmp_path, 3)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0, out[-2000:]
  stopped = [l for l in out.splitlines() if l.startswith("stopping after step")]
  assert stopped and "SIGTERM" in stopped[0], out[-2000:]
  step = int(stopped[0].split()[3])
  assert (tmp_path / "checkpoints" / str(step)).is_dir()
  # The same command, asked to go two steps further, resumes where the first stopped.
  args[0] = f"--config.train.steps={step + 2}"
  resumed, records = run_tiny(tmp_path, *args[1:], args[0])
  assert f"resumed from step {step}" in resumed.stdout
  assert [r["step"] for r in records if "loss" in r] == list(range(1, step + 3))


@pytest.mark.slow
def test_consecutive_non_finite_steps_stop_the_run(tmp_path):
  proc = run_cli("--config=configs/tiny.py", f"--workdir={tmp_path}", *SMALL,
                 "--config.train.steps=30", "--config.train.log_every=1",
                 "--config.optim.learning_rate=1e35", "--config.optim.warmup_steps=0",
                 "--config.train.max_consecutive_bad_steps=3",
                 "--config.checkpoint.every_steps=2")
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert "3 consecutive steps" in proc.stderr and "last checkpoint" in proc.stderr
  assert any(r.get("skipped") == 1.0 for r in metrics_records(tmp_path))


@pytest.mark.slow
def test_corrupted_latest_checkpoint_falls_back_to_the_previous(tmp_path, uninterrupted):
  _copy_run(uninterrupted, tmp_path)
  state_dir = tmp_path / "checkpoints" / str(STEPS) / "state"
  for root, _, files in os.walk(state_dir):
    for name in files:  # truncate every file of the newest checkpoint's state
      open(os.path.join(root, name), "wb").close()
  proc, records = run_tiny(tmp_path, *COMMON)
  assert (f"checkpoint {tmp_path / 'checkpoints'}/{STEPS} is incomplete or corrupted"
          in proc.stdout)
  assert "resumed from step 8" in proc.stdout
  assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
  assert _history(tmp_path) == _history(uninterrupted)  # the steps redone, bitwise


@pytest.mark.slow
def test_a_run_whose_checkpoints_are_all_unreadable_stops_unless_told_to_restart(
    tmp_path, uninterrupted):
  """Never a silent start from step 0: the run exits 1 naming every step and renames nothing;
  with checkpoint.on_unreadable=restart it sets them aside and trains from step 0."""
  _copy_run(uninterrupted, tmp_path)
  for step in (4, 8, STEPS):
    for root, _, files in os.walk(tmp_path / "checkpoints" / str(step) / "state"):
      for name in files:
        open(os.path.join(root, name), "wb").close()
  before = sorted(os.listdir(tmp_path / "checkpoints"))
  proc = run_cli("--config=configs/tiny.py", f"--workdir={tmp_path}", *SMALL, *COMMON)
  assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
  error = [l for l in proc.stderr.splitlines() if l.startswith("checkpoint error:")]
  assert len(error) == 1, proc.stderr[-2000:]
  assert f"no checkpoint in {tmp_path / 'checkpoints'} can be read (step {STEPS}: " in error[0]
  assert "step 8: " in error[0] and "step 4: " in error[0]
  assert "checkpoint.on_unreadable=restart" in error[0]
  assert sorted(os.listdir(tmp_path / "checkpoints")) == before
  proc, records = run_tiny(tmp_path, *COMMON, "--config.train.steps=2",
                           "--config.checkpoint.on_unreadable=restart")
  assert "starting from step 0 as checkpoint.on_unreadable=restart says" in proc.stdout
  assert "resumed from" not in proc.stdout
  assert [r["step"] for r in records if "loss" in r][-2:] == [1, 2]
  assert sum(n.endswith(tuple("0123456789")) and ".corrupted-" in n
             for n in os.listdir(tmp_path / "checkpoints")) == 3


@pytest.mark.slow
def test_init_from_another_runs_checkpoint(tmp_path, uninterrupted):
  """Params only: the new run starts at step 0 with a fresh optimizer and schedule."""
  first = [r for r in metrics_records(uninterrupted) if "loss" in r]
  proc, second = run_tiny(tmp_path, "--config.train.log_every=1",
                          "--config.train.eval_every=100", "--config.optim.warmup_steps=2",
                          f"--config.optim.decay_steps={STEPS}", "--config.train.steps=2",
                          f"--config.checkpoint.init_from={uninterrupted}")
  assert (f"initialized params from {uninterrupted / 'checkpoints' / str(STEPS) / 'state'}"
          in proc.stdout)
  second = [r for r in second if "loss" in r]
  assert [r["step"] for r in second] == [1, 2]
  assert second[0]["learning_rate"] == first[0]["learning_rate"]  # the schedule restarts
  # The same first batch, seen by trained weights: the loss is where the first run left off.
  assert second[0]["loss"] < first[0]["loss"] - 0.5
  assert abs(second[0]["loss"] - first[-1]["loss"]) < 0.5


def test_a_checkpointer_that_saved_nothing_leaves_no_empty_directories(tmp_path):
  """A run refused for bad data in its first batch (after the checkpointer opened) removes the
  directories the checkpointer created, and only those."""
  from jaxtrain.checkpointing.checkpointer import (  # pylint: disable=import-outside-toplevel
      Checkpointer)
  unused = Checkpointer(str(tmp_path / "new_workdir" / "checkpoints"), every_steps=1)
  assert (tmp_path / "new_workdir" / "checkpoints").is_dir()
  unused.close_unused()
  assert not (tmp_path / "new_workdir").exists()
  (tmp_path / "workdir").mkdir()
  (tmp_path / "workdir" / "metrics.jsonl").write_text("{}\n")
  unused = Checkpointer(str(tmp_path / "workdir" / "checkpoints"), every_steps=1)
  unused.close_unused()
  assert sorted(os.listdir(tmp_path / "workdir")) == ["metrics.jsonl"]
