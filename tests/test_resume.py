"""Checkpoint and resume of whole runs: after a hard kill, the resumed run's losses equal an
uninterrupted run's at every step (CPU, bitwise)."""

import json
import os
import random
import signal
import subprocess
import time

import numpy as np
import pytest

from tests.helpers import REPO, main_command, main_env, run_main
from tests.test_end_to_end import SMALL, _run

STEPS = 12
COMMON = [f"--config.train.steps={STEPS}", "--config.train.log_every=1",
          "--config.train.eval_every=6", "--config.optim.warmup_steps=2",
          "--config.checkpoint.every_steps=4"]


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  train = [(r["step"], r["loss"]) for r in records if "loss" in r]
  evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
  return train, evals


def _args(workdir):
  return ["--config=configs/tiny.py", f"--workdir={workdir}", *SMALL, *COMMON]


def _saving(workdir) -> bool:
  """Whether Orbax is writing a checkpoint now (its temporary directory exists)."""
  ckpt_dir = os.path.join(workdir, "checkpoints")
  return os.path.isdir(ckpt_dir) and any("tmp" in n for n in os.listdir(ckpt_dir))


def kill_after_step(workdir, step, during_save=False, args=None):
  """Starts a run (of `args`, default the tiny one here) and SIGKILLs it once metrics.jsonl
  shows `step` (and, with `during_save`, at the next moment a checkpoint is half written)."""
  args = _args(workdir) if args is None else args
  proc = subprocess.Popen(main_command(*args), cwd=REPO, env=main_env(),
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
  workdir = tmp_path_factory.mktemp("uninterrupted")
  _run(workdir, *COMMON)
  return _losses(workdir)


@pytest.mark.slow
@pytest.mark.parametrize("seed,during_save", [(0, False), (1, False), (2, True)])
def test_resume_after_sigkill_matches_uninterrupted(tmp_path, uninterrupted, seed, during_save):
  kill_step = random.Random(seed).randint(2, STEPS - 2)
  torn = kill_after_step(tmp_path, kill_step, during_save)
  ckpt_dir = tmp_path / "checkpoints"
  committed = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit()) if ckpt_dir.exists() else []
  if during_save:
    assert torn, "the kill did not land while a checkpoint was being written"
  proc, _ = _run(tmp_path, *COMMON)
  print(f"killed after step {kill_step} (during a save: {torn}); committed {committed}")
  train, evals = _losses(tmp_path)
  assert [s for s, _ in train] == list(range(1, STEPS + 1))  # each step once
  assert train == uninterrupted[0]  # bitwise equal losses
  assert evals == uninterrupted[1]
  # A save cut short by the kill leaves only a temporary directory, never a committed step.
  if committed:
    assert f"resumed from step {committed[-1]}" in proc.stdout
  else:
    assert "resumed from step" not in proc.stdout


@pytest.mark.slow
def test_restore_on_another_mesh(tmp_path):
  """Saved on (2,2,2) over 8 devices, resumed on 1 device: losses continue within tolerance."""
  _run(tmp_path / "a", *COMMON[:-1], "--config.checkpoint.every_steps=6",
       "--config.train.steps=6", "--config.optim.decay_steps=12", "--config.mesh.data=2",
       "--config.mesh.fsdp=2", "--config.mesh.tensor=2", devices=8)
  proc, _ = _run(tmp_path / "a", *COMMON[:-1], "--config.checkpoint.every_steps=6",
                 "--config.optim.decay_steps=12")
  assert "resumed from step 6" in proc.stdout
  _, reference = _run(tmp_path / "b", *COMMON[:-1], "--config.optim.decay_steps=12")
  ref = [r["loss"] for r in reference if "loss" in r]
  got = [loss for _, loss in _losses(tmp_path / "a")[0]]
  np.testing.assert_allclose(got, ref, rtol=1e-5)


@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused(tmp_path):
  _run(tmp_path, *COMMON[:-1], "--config.checkpoint.every_steps=2", "--config.train.steps=2")
  proc = run_main(*_args(tmp_path), "--config.model.mlp_dim=256", timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "does not match this model config" in proc.stderr


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
  args = ["--config.train.steps=2000", "--config.optim.decay_steps=2000",
          "--config.train.log_every=1", "--config.train.eval_every=1000",
          "--config.checkpoint.every_steps=1000"]
  cmd = main_command("--config=configs/tiny.py", f"--workdir={tmp_path}", *SMALL)
  proc = subprocess.Popen(cmd + args, cwd=REPO, env=main_env(), stdout=subprocess.PIPE,
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
  resumed, records = _run(tmp_path, *args[1:], args[0])
  assert f"resumed from step {step}" in resumed.stdout
  assert [r["step"] for r in records if "loss" in r] == list(range(1, step + 3))


@pytest.mark.slow
def test_consecutive_non_finite_steps_stop_the_run(tmp_path):
  proc = run_main("--config=configs/tiny.py", f"--workdir={tmp_path}", *SMALL,
                  "--config.train.steps=30", "--config.train.log_every=1",
                  "--config.optim.learning_rate=1e35", "--config.optim.warmup_steps=0",
                  "--config.train.max_consecutive_bad_steps=3",
                  "--config.checkpoint.every_steps=2", timeout=300)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert "3 consecutive steps" in proc.stderr and "last checkpoint" in proc.stderr
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl", encoding="utf-8")]
  assert any(r.get("skipped") == 1.0 for r in records)


@pytest.mark.slow
def test_corrupted_latest_checkpoint_falls_back_to_the_previous(tmp_path):
  args = ["--config.checkpoint.every_steps=2", "--config.train.log_every=1",
          "--config.train.eval_every=100", "--config.optim.decay_steps=8"]
  _run(tmp_path, *args, "--config.train.steps=4")
  state_dir = tmp_path / "checkpoints" / "4" / "state"
  for root, _, files in os.walk(state_dir):
    for name in files:  # truncate every file of the newest checkpoint's state
      open(os.path.join(root, name), "wb").close()
  proc, records = _run(tmp_path, *args, "--config.train.steps=6")
  assert f"checkpoint {tmp_path / 'checkpoints'}/4 is incomplete or corrupted" in proc.stdout
  assert "resumed from step 2" in proc.stdout
  assert [r["step"] for r in records if "loss" in r] == list(range(1, 7))


@pytest.mark.slow
def test_init_from_another_runs_checkpoint(tmp_path):
  """Params only: the new run starts at step 0 with a fresh optimizer and schedule."""
  base = ["--config.train.log_every=1", "--config.train.eval_every=100",
          "--config.optim.decay_steps=8"]
  _, first = _run(tmp_path / "a", *base, "--config.checkpoint.every_steps=4",
                  "--config.train.steps=8")
  proc, second = _run(tmp_path / "b", *base, "--config.train.steps=2",
                      f"--config.checkpoint.init_from={tmp_path / 'a'}")
  assert f"initialized params from {tmp_path / 'a' / 'checkpoints' / '8' / 'state'}" in proc.stdout
  first = [r for r in first if "loss" in r]
  second = [r for r in second if "loss" in r]
  assert [r["step"] for r in second] == [1, 2]
  assert second[0]["learning_rate"] == first[0]["learning_rate"]  # the schedule restarts
  # The same first batch, seen by trained weights: the loss is where run a left off.
  assert second[0]["loss"] < first[0]["loss"] - 0.5
  assert abs(second[0]["loss"] - first[-1]["loss"]) < 0.5
