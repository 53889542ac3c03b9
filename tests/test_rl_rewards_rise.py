"""GRPO and PPO learn: on their tiny shipped configs (configs/grpo_tiny.py, configs/ppo_tiny.py,
as shipped but shorter, the learning-rate schedule with them), the mean reward of the sampled
completions rises well clear of where a policy that does not learn stays, and so does the
greedy reward on held-out prompts (docs/finetuning.md records the full runs).

Each run is about the shortest in which the rise is clear of the step-to-step noise. The same
runs with optim.learning_rate=1e-12 (the config refuses 0), on 2 CPU cores, 2026-12-06:
GRPO's first three steps 0.027, its last four 0.023, eval 0.000; PPO's first two batches of
rollouts 0.019, its last four 0.025, eval 0.0015. Trained: GRPO 0.031 -> 0.093, eval 0.083;
PPO 0.019 -> 0.061, eval 0.176.

Each run is a process of its own compiled with XLA's optimizations (no FAST_XLA_FLAG, like
conftest's reward_tiny_workdir): over tens of steps the faster steps more than pay for the slower
compile (GRPO: 31 s against 42 s in this process; PPO: about 65 s against 130 s). At backend
optimization level 1 rather than the default 2 (OPTIMIZED): every logged metric of both runs is
the same bit for bit, and the CPU time drops by a quarter (2026-12-07, 2 cores: GRPO 32 s
against 45 s, PPO 62 s against 79 s). With XLA:CPU's classic emitters, as in the suite's own
flags: the same metrics bit for bit again, in 10-13% less CPU time (2026-12-08: GRPO 28 s
against 31 s, PPO 53 s against 61 s)."""

import json
import os

import numpy as np
import pytest

from jaxtrain import compat
from tests.helpers import run_main

# Evaluation only at the last step (the CLI's rule), on one batch of held-out prompts.
SHORT = ["--config.train.log_every=1", "--config.train.eval_every=100000",
         "--config.train.eval_batches=1"]
GRPO_ARGS = ["--config=configs/grpo_tiny.py", "--config.train.steps=16", *SHORT]
PPO_ARGS = ["--config=configs/ppo_tiny.py", "--config.train.steps=160", *SHORT]
OPTIMIZED = f"--xla_backend_optimization_level=1 {compat.cpu_classic_emitter_flag()}".strip()


def _train(workdir, args):
  """(each training step's mean reward of the sampled completions, the last step's greedy
  reward on held-out prompts)."""
  proc = run_main(*args, f"--workdir={workdir}", env={"XLA_FLAGS": OPTIMIZED})
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  sampled = [r["reward_mean"] for r in records if "loss" in r and "reward_mean" in r]
  evals = [r["eval_reward_mean"] for r in records if "eval_reward_mean" in r]
  return sampled, evals[-1]


@pytest.mark.slow(seconds=35)
def test_grpo_tiny_reward_rises(tmp_path):
  """16 steps of 16 prompts x 8 completions, a new batch of rollouts every step."""
  rewards, greedy = _train(tmp_path, GRPO_ARGS)
  assert len(rewards) == 16
  first, last = np.mean(rewards[:3]), np.mean(rewards[-4:])
  assert last > first + 0.03, (first, last, rewards)
  assert greedy > 0.04, greedy


@pytest.mark.slow(seconds=70)
def test_ppo_tiny_reward_rises(tmp_path):
  """160 steps: 20 batches of rollouts of 128 prompts (4 epochs x 2 minibatches each); a batch's
  reward is logged at each of its 8 steps."""
  rewards, greedy = _train(tmp_path, PPO_ARGS)
  rewards = rewards[::8]  # one per batch of rollouts
  assert len(rewards) == 20
  first, last = np.mean(rewards[:2]), np.mean(rewards[-4:])
  assert last > first + 0.02, (first, last, rewards)
  assert greedy > 0.08, greedy
