"""Fine-tuning end to end through the CLI: the tiny SFT and DPO configs train (loss falls, DPO's
reward accuracy rises) and resume exactly, the frozen DPO reference rebuilt on resume."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(config, workdir, *overrides):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  cmd = [sys.executable, "-m", "jaxtrain.main", f"--config=configs/{config}",
         f"--workdir={workdir}", *overrides]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  train = [r for r in records if "loss" in r]
  evals = [r for r in records if "eval_loss" in r]
  return proc.stdout, train, evals


@pytest.mark.slow
def test_sft_loss_on_completions_falls(tmp_path):
  out, train, evals = _run("sft_tiny.py", tmp_path, "--config.train.steps=40",
                           "--config.train.eval_every=20")
  assert "whole records" in out and "packing efficiency" in out
  assert train[-1]["loss"] < train[0]["loss"] - 0.8, [r["loss"] for r in train]
  assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]


@pytest.mark.slow
def test_dpo_reward_accuracy_rises_and_resume_is_exact(tmp_path):
  steps = ["--config.train.log_every=5", "--config.train.eval_every=10",
           "--config.optim.decay_steps=30", "--config.checkpoint.every_steps=15"]
  out, train, evals = _run("dpo_tiny.py", tmp_path / "whole", *steps, "--config.train.steps=30")
  assert "preference pairs" in out and "DPO, beta 0.1" in out
  # At step 0 the policy is the reference: every margin is 0 and no pair counts as won. Each
  # logged value is one batch of 16 pairs, so the check averages the last three.
  accuracy = [r["reward_accuracy"] for r in train]
  assert sum(accuracy[-3:]) / 3 > 0.7, accuracy
  assert train[-1]["loss"] < train[0]["loss"] < 0.7
  assert evals[-1]["eval_reward_accuracy"] > 0.75 and evals[-1]["eval_reward_margin"] > 0
  for key in ("chosen_rewards", "rejected_rewards", "reward_margin"):
    assert key in train[-1]

  # Interrupted at 15 and resumed in a new process: the reference is rebuilt (here from the
  # seed's random init) and the run continues step for step.
  _run("dpo_tiny.py", tmp_path / "split", *steps, "--config.train.steps=15")
  out, resumed, _ = _run("dpo_tiny.py", tmp_path / "split", *steps, "--config.train.steps=30")
  assert "resumed from step 15" in out
  want = {r["step"]: r["loss"] for r in train}
  got = {r["step"]: r["loss"] for r in resumed}
  assert sorted(got) == sorted(want)
  for step in (20, 25, 30):
    assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step
