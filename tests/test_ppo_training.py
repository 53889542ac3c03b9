"""PPO end to end through the CLI (in this process): the rollouts' metrics, a resumed run that
trains on the same rollouts and minibatches bit for bit, and the settings PPO refuses."""

import json
import os

import pytest

from tests.helpers import assert_one_line_config_error, run_cli, shipped_config

STEPS = 8  # two batches of rollouts of 2 epochs x 2 minibatches
SMALL = ["--config=configs/ppo_tiny.py", "--config.train.global_batch_size=8",
         "--config.grpo.max_new_tokens=8", "--config.train.seq_len=28",
         "--config.train.log_every=1", f"--config.train.steps={STEPS}",
         "--config.train.eval_every=100", "--config.train.eval_batches=1",
         "--config.checkpoint.every_steps=4", "--config.ppo.epochs=2",
         "--config.ppo.kl_coef=0.01",  # the reference and its KL penalty too
         "--config.grpo.reward_fns=tests.reward_fixtures:letters"]


def _train_records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [r for r in map(json.loads, f) if "loss" in r]


def _run(workdir, *extra):
  proc = run_cli(*SMALL, f"--workdir={workdir}", *extra)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc


@pytest.mark.slow(seconds=30)
def test_ppo_logs_its_metrics_and_resumes_on_the_same_rollouts(tmp_path):
  proc = _run(tmp_path / "whole")
  assert "PPO, epsilon 0.2" in proc.stdout and "value head (PPO)" in proc.stdout
  whole = _train_records(tmp_path / "whole")
  assert [r["step"] for r in whole] == list(range(1, STEPS + 1))
  for key in ("value_loss", "clip_fraction", "value_clip_fraction", "reward_mean", "reward_std",
              "kl", "explained_variance", "advantage_mean", "logprob_mismatch",
              "completion_len_mean", "generation_share"):
    assert all(key in r for r in whole), key
  # The sampler's and the trainer's log-probs of the sampled tokens: float32 round-off on CPU.
  assert all(0.0 <= r["logprob_mismatch"] < 1e-4 for r in whole)
  # A batch of rollouts serves 4 steps: its metrics repeat; the next batch is new.
  assert whole[0]["reward_mean"] == whole[3]["reward_mean"] != whole[4]["reward_mean"]
  # The first batch's first step is at the sampling policy: no ratio clipped yet.
  assert whole[0]["clip_fraction"] == 0.0

  _run(tmp_path / "split", "--config.train.steps=4")  # stops at the step-4 checkpoint
  proc = _run(tmp_path / "split")
  assert "resumed from step 4" in proc.stdout
  split = _train_records(tmp_path / "split")
  key = lambda r: (r["step"], r["loss"], r["grad_norm"], r["reward_mean"], r["value_loss"],
                   r["explained_variance"])
  assert [key(r) for r in split] == [key(r) for r in whole]  # bitwise


@pytest.mark.parametrize("changes,words", [
    ({"model.value_head": False}, ["train.objective='ppo' without a value head",
                                    "model.value_head=True"]),
    ({"data.format": "preference"}, ["train.objective='ppo'", "data.format='preference'"]),
    ({"ppo.epochs": 0}, ["ppo.epochs=0", "at least 1"]),
    ({"ppo.lam": 1.5}, ["ppo.lam=1.5"]),
    ({"train.steps": 10}, ["ppo.epochs x ppo.minibatches = 8", "train.steps=10"]),
    ({"mesh.context": 2}, ["mesh.context=2", "train.objective='ppo'"]),
])
def test_settings_ppo_cannot_train_with_are_one_line_errors(changes, words):
  assert_one_line_config_error(shipped_config("ppo_tiny", **changes), 1, words)
