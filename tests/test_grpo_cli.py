"""GRPO through the CLI: a killed run resumes drawing the same completions (bitwise equal losses
and rewards), completions are written every eval, and a failing reward function stops the run
with one line and the last step saved, or is skipped when asked. The runs that need no process
of their own run in this one (tests.helpers.run_cli); the killed run is a real process."""

import json
import os

import pytest

from tests import reward_fixtures
from tests.helpers import kill_cli_process_after_step, run_cli

STEPS = 8
# A smaller demo: 4 prompts x 4 completions of at most 8 tokens per step.
SMALL = ["--config=configs/grpo_tiny.py", "--config.train.global_batch_size=4",
         "--config.grpo.num_generations=4", "--config.grpo.max_new_tokens=8",
         "--config.train.seq_len=28", "--config.train.log_every=1",
         f"--config.train.steps={STEPS}", "--config.train.eval_every=4",
         "--config.train.eval_batches=1", "--config.checkpoint.every_steps=4",
         "--config.grpo.reward_fns=tests.reward_fixtures:letters",
         "--config.grpo.warmup_steps=2"]


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _run(workdir, *extra):
  proc = run_cli(*SMALL, f"--workdir={workdir}", *extra)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc


@pytest.mark.slow(seconds=20)
def test_killed_grpo_run_resumes_with_the_same_completions(tmp_path):
  proc = _run(tmp_path / "whole")
  assert "GRPO, epsilon 0.2" in proc.stdout and "reward " in proc.stdout
  whole = _records(tmp_path / "whole")
  train = [r for r in whole if "loss" in r]
  assert [r["step"] for r in train] == list(range(1, STEPS + 1))
  # Steps 1-2 are the supervised warm-up (no sampled completions, so no rewards to report, and
  # no sampler log-probs to compare).
  assert "reward_mean" not in train[1] and "reward_mean" in train[2]
  assert "logprob_mismatch" not in train[1] and "logprob_mismatch" in train[2]
  for key in ("reward_mean", "reward_std", "kl", "clip_fraction", "completion_len_mean",
              "generation_share", "logprob_mismatch"):
    assert key in train[-1], key
  # The sampler's and the trainer's log-probs of the sampled tokens: float32 round-off on CPU.
  assert all(0.0 <= r["logprob_mismatch"] < 1e-4 for r in train[2:])
  assert 0.0 < train[-1]["generation_share"] < 1.0
  samples = [json.loads(l) for l in open(tmp_path / "whole" / "completions.jsonl",
                                          encoding="utf-8")]
  assert {s["step"] for s in samples} == {4, 8} and all("completion" in s for s in samples)
  assert "eval reward mean" in proc.stdout

  # The killed run is a process of its own (SIGKILL after step 6, the step-4 checkpoint
  # written); it resumes here.
  kill_cli_process_after_step(tmp_path / "split", 6, *SMALL)
  proc = _run(tmp_path / "split")
  assert "resumed from step 4" in proc.stdout
  split = [r for r in _records(tmp_path / "split") if "loss" in r]
  key = lambda r: (r["step"], r["loss"], r.get("grad_norm"), r.get("reward_mean"), r["kl"],
                   r.get("completion_len_mean"), r.get("logprob_mismatch"))
  assert [key(r) for r in split] == [key(r) for r in train]  # bitwise: the same rollouts


@pytest.mark.slow
def test_reward_failures_stop_with_one_line_or_are_skipped(tmp_path, monkeypatch):
  # The fixtures count their calls in this process: each run here starts from none.
  calls = reward_fixtures._calls  # pylint: disable=protected-access
  monkeypatch.setitem(calls, "fails_on_third_call", 0)
  proc = run_cli(*SMALL, f"--workdir={tmp_path / 'stop'}", "--config.checkpoint.every_steps=100",
                 "--config.grpo.warmup_steps=0",
                 "--config.grpo.reward_fns=tests.reward_fixtures:fails_on_third_call")
  assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
  errors = [l for l in proc.stderr.splitlines() if "reward error" in l]
  assert len(errors) == 1, proc.stderr[-2000:]
  assert ("tests.reward_fixtures:fails_on_third_call returned nan for completion 1"
          in errors[0]), errors
  # Nothing lost: the two finished steps are checkpointed before the run stops.
  assert sorted(os.listdir(tmp_path / "stop" / "checkpoints")) == ["2"]

  monkeypatch.setitem(calls, "flaky", 0)
  proc = _run(tmp_path / "skip", "--config.grpo.reward_fns=tests.reward_fixtures:flaky",
              "--config.grpo.on_reward_error=skip", "--config.train.eval_every=100",
              "--config.grpo.warmup_steps=0")
  assert "RuntimeError: the grader timed out; batch of rollouts skipped" in proc.stdout
  train = [r for r in _records(tmp_path / "skip") if "loss" in r]
  assert len(train) == STEPS and train[-1]["reward_errors"] >= 2
