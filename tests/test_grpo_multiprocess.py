"""GRPO on 2 processes (localhost, CPU devices, gloo collectives): the reward and length metrics
in metrics.jsonl are the whole global batch's, so they equal a 1-process run of the same config
(same mesh, same data shards, so the same global stream of prompts and the same sampled
completions), not process 0's share; the 1-process run goes in this process (run_cli). A reward
function failing on one process only makes both skip that batch of rollouts together. One run on
each process count serves both: its reward function fails at step 2 on the last process only (on
2 processes process 1's, never process 0's), so the 1-process run skips that batch too and the
two runs still draw the same prompts and completions at every step."""

import json
import os
import socket
import subprocess
import time

import numpy as np
import pytest

from tests import reward_fixtures

# The runs' processes import this module for its reward function: what would touch JAX's
# configuration on import (tests.conftest, which tests.helpers imports) is imported in the tests.

# configs/grpo_tiny.py shortened: 4 prompts x 4 completions of at most 8 tokens, 3 steps, an
# eval at the last, a reward that a random model's completions get a spread of; mesh (data 2,
# fsdp 2, tensor 2) on 8 CPU devices, and two data shards so both process counts read one
# global stream (tests/test_multihost.py).
ARGS = ["--config=configs/grpo_tiny.py", "--config.train.global_batch_size=4",
        "--config.grpo.num_generations=4", "--config.grpo.max_new_tokens=8",
        "--config.train.seq_len=28", "--config.train.log_every=1", "--config.train.steps=3",
        "--config.train.eval_every=3", "--config.train.eval_batches=2",
        "--config.grpo.reward_fns=tests.reward_fixtures:letters",
        "--config.data.num_shards=2", "--config.mesh.data=2", "--config.mesh.fsdp=2",
        "--config.mesh.tensor=2", "--config.log.tensorboard=False"]
ROLLOUT_KEYS = ("reward_mean", "reward_std", "completion_len_mean")
EVAL_KEYS = ("eval_reward_mean", "eval_completion_len_mean")


_calls = [0]


def fails_on_the_last_process(prompts, completions, **columns):
  """`letters`, except that the last process's second call (step 2's rollouts) raises: on 2
  processes process 1's only, on 1 process its own (the runs' processes import this module as
  "tests.test_grpo_multiprocess:fails_on_the_last_process")."""
  import jax  # pylint: disable=import-outside-toplevel
  _calls[0] += 1
  if jax.process_index() == jax.process_count() - 1 and _calls[0] == 2:
    raise RuntimeError("the grader of the last process timed out")
  return reward_fixtures.letters(prompts, completions, **columns)


def _free_port():
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _launch(workdir, *extra):
  """The run's 2 processes (4 CPU devices each, as launch/local_multiprocess.sh starts them),
  each with its output in WORKDIR/process_<i>.log: [(Popen, log path)]."""
  # pylint: disable=import-outside-toplevel
  from tests.conftest import FAST_XLA_FLAG
  from tests.helpers import REPO, main_command
  os.makedirs(workdir, exist_ok=True)
  port, procs = _free_port(), []
  for i in range(2):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i),
               XLA_FLAGS=f"{FAST_XLA_FLAG} --xla_force_host_platform_device_count=4")
    log_path = os.path.join(workdir, f"process_{i}.log")
    with open(log_path, "w", encoding="utf-8") as log:
      procs.append((subprocess.Popen(main_command(*ARGS, f"--workdir={workdir}",
                                                  "--config.mesh.dcn_data=2", *extra),
                                     cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT),
                    log_path))
  return procs


def _finish(procs, timeout):
  """Process 0's output once both processes ended; a process still running after `timeout`
  seconds (a hang: processes waiting in different collectives) is killed and fails the test."""
  deadline = time.time() + timeout
  try:
    for proc, _ in procs:
      proc.wait(timeout=max(1.0, deadline - time.time()))
  finally:
    for proc, _ in procs:
      if proc.poll() is None:
        proc.kill()  # SIGTERM would be taken for a preemption notice
        proc.wait()
  outs = []
  for i, (proc, path) in enumerate(procs):
    with open(path, encoding="utf-8") as f:
      outs.append(f.read())
    assert proc.returncode == 0, f"process {i}:\n" + outs[i][-4000:]
  return outs[0]


def _records(workdir):
  """(train records, eval records) of WORKDIR/metrics.jsonl."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  return ([r for r in records if "loss" in r], [r for r in records if "eval_loss" in r])


# Both runs: skip the batch whose rewards failed; the eval at the last step (3).
FAILING = ["--config.grpo.on_reward_error=skip",
           "--config.grpo.reward_fns=tests.test_grpo_multiprocess:fails_on_the_last_process"]


@pytest.mark.slow(seconds=40)
def test_two_processes_log_the_global_batchs_metrics_and_skip_a_failed_batch_together(tmp_path):
  """The 2-process run against the 1-process one (in this process, at the same time), both
  with process 1's (the last process's) reward function failing at step 2. Its metrics are the
  global batch's: equal to the 1-process run's at every step. And the failure on one process:
  with grpo.on_reward_error='skip' both processes drop that batch of rollouts and draw the next
  prompts together (one alone would leave the other waiting in a different collective), and the
  run finishes with reward_errors 1. (Without that, they hung: process 0 in the train step's
  collectives, process 1 in the next rollouts'.) Two tests once, each with a 2-process run of
  its own: every assertion of both is here."""
  from tests.helpers import run_cli  # pylint: disable=import-outside-toplevel
  two = _launch(tmp_path / "two", *FAILING)
  try:
    _calls[0] = 0  # this process's count: the 1-process run's calls only
    one = run_cli(*ARGS, *FAILING, f"--workdir={tmp_path / 'one'}", devices=8)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
  finally:
    out = _finish(two, timeout=300)
  assert "8 × cpu (2 process(es))" in out
  want_train, want_eval = _records(tmp_path / "one")
  got_train, got_eval = _records(tmp_path / "two")
  assert [r["step"] for r in got_train] == [r["step"] for r in want_train] == [1, 2, 3]
  print("step  1 process: reward_mean reward_std completion_len_mean | 2 processes")
  for want, got in zip(want_train, got_train):
    print(f"{want['step']:4d}  " + " ".join(f"{want[k]:.6f}" for k in ROLLOUT_KEYS) + "  |  "
          + " ".join(f"{got[k]:.6f}" for k in ROLLOUT_KEYS))
  print("eval  " + " ".join(f"{want_eval[-1][k]:.6f}" for k in EVAL_KEYS) + "  |  "
        + " ".join(f"{got_eval[-1][k]:.6f}" for k in EVAL_KEYS))
  # The same completions on both (the losses agree to float rounding, the rewards exactly):
  # gathered from both processes in the global batch's row order, the statistics are the
  # 1-process run's to the last bit.
  np.testing.assert_allclose([r["loss"] for r in got_train], [r["loss"] for r in want_train],
                             rtol=1e-5, atol=1e-7)
  for key in ROLLOUT_KEYS:
    assert [r[key] for r in got_train] == [r[key] for r in want_train], key
  for key in EVAL_KEYS:  # (greedy completions of the random init: no letters, reward 0)
    assert got_eval[-1][key] == want_eval[-1][key], key
  assert len({r["reward_mean"] for r in want_train}) > 1  # rewards that move
  assert all(r["reward_std"] > 0 for r in want_train)
  # The sampler's log-probs came back from both processes' rows, aligned with the trainer's.
  assert all(0.0 <= r["logprob_mismatch"] < 1e-4 for r in got_train)

  # Process 1 alone failed at step 2; process 0 says so, and both skipped that batch.
  assert ("warning: step 2: a reward function failed on another process of this run" in out
          and "batch of rollouts skipped" in out), out[-3000:]
  assert [r["reward_errors"] for r in got_train] == [r["reward_errors"] for r in want_train] == [
      0, 1, 1]
