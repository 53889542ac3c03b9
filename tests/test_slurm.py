"""launch/slurm.sbatch under a real SLURM: a one-node cluster of this machine's own daemons
(tests/slurm_cluster.py) runs the tiny config as 2 tasks x 4 emulated CPU devices, one mesh:

- the 2-task job trains with the losses of 1 process x 8 devices;
- `scancel --signal=TERM JOBID` (delivered to every task, as SLURM delivers the script's
  `--signal=TERM@300` time-limit warning and a preemption's notice) stops every task after one
  common step, which is saved, and the job exits 0; the same sbatch command resumes it;
- `kill -9` of one task ends the job at once (srun --kill-on-bad-exit); the next submission
  resumes from the last complete checkpoint and ends with the uninterrupted job's losses,
  bitwise.
"""

import json
import os
import signal
import time

import numpy as np
import pytest

from tests import slurm_cluster
from tests.helpers import REPO, SMALL_TINY_ARGS as SMALL, main_command, main_env, run_cli

pytestmark = pytest.mark.slow(seconds=60)

STEPS = 16
MESH = ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]
ARGS = ["--config=configs/tiny.py", *SMALL, *MESH, "--config.train.log_every=1",
        f"--config.train.steps={STEPS}", "--config.train.eval_every=4",
        "--config.optim.warmup_steps=2", f"--config.optim.decay_steps={STEPS}",
        "--config.checkpoint.every_steps=1"]
# 2 tasks on this one node, 4 emulated CPU devices each; data parallel across the tasks.
SBATCH = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--time=30"]
JOB_TIMEOUT_S = 400


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  reason = slurm_cluster.unavailable_reason()
  if reason:
    pytest.skip(reason)
  with slurm_cluster.LocalSlurmCluster(tmp_path_factory.mktemp("slurm")) as c:
    yield c


def _submit(cluster, workdir):
  """sbatch launch/slurm.sbatch ARGS --workdir=WORKDIR, from the repository (the script's
  working directory); the log goes to WORKDIR.log. Returns the job id."""
  env = main_env(env={"JAXTRAIN_CPU_DEVICES": "4", "PYTHON": main_command()[0]})
  return cluster.sbatch(*SBATCH, f"--output={workdir}.log", "launch/slurm.sbatch", *ARGS,
                        "--config.mesh.dcn_data=2", f"--workdir={workdir}",
                        env=env, cwd=REPO)


def _finish(cluster, job, workdir):
  """Waits for the job, which must end COMPLETED with exit code 0; returns its log."""
  fields = cluster.wait(job, JOB_TIMEOUT_S)
  log = _log(workdir)
  assert (fields.get("JobState"), fields.get("ExitCode")) == ("COMPLETED", "0:0"), (fields,
                                                                                    log[-4000:])
  return log


def _log(workdir):
  with open(f"{workdir}.log", encoding="utf-8") as f:
    return f.read()


def _losses(workdir):
  """{step: (loss, grad_norm)} and {step: eval_loss} from metrics.jsonl; a step logged twice (a
  run killed after it, resumed from an earlier checkpoint) must have the same values both
  times."""
  losses, evals = {}, {}
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    for record in map(json.loads, f):
      if "loss" in record:
        record["loss"] = (record["loss"], record["grad_norm"])
      for key, table in (("loss", losses), ("eval_loss", evals)):
        if key in record:
          step = record["step"]
          assert table.setdefault(step, record[key]) == record[key], (key, step, record)
  return losses, evals


def _wait_for_step(cluster, job, workdir, step, timeout_s=JOB_TIMEOUT_S):
  path, deadline = os.path.join(workdir, "metrics.jsonl"), time.time() + timeout_s
  while time.time() < deadline:
    if os.path.exists(path) and step in _losses(workdir)[0]:
      return
    if cluster.ended(cluster.job(job)):
      break
    time.sleep(0.2)
  pytest.fail(f"job {job} did not reach step {step}: {cluster.job(job)}\n"
              f"{_log(workdir)[-4000:] if os.path.exists(f'{workdir}.log') else ''}")


def _saved_steps(workdir):
  return sorted(int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit())


def _assert_bitwise(workdir, want, may_be_unlogged=()):
  """Every loss and eval loss the interrupted and resumed jobs logged in WORKDIR equals the
  uninterrupted job's (`want`), bitwise; every step is logged, but possibly `may_be_unlogged`."""
  (want_loss, want_eval), (got_loss, got_eval) = want, _losses(workdir)
  assert set(range(1, STEPS + 1)) - set(may_be_unlogged) <= set(got_loss) <= set(want_loss)
  assert set(want_eval) - set(may_be_unlogged) <= set(got_eval) <= set(want_eval)
  assert got_loss == {s: want_loss[s] for s in got_loss}
  assert got_eval == {s: want_eval[s] for s in got_eval}


def test_sbatch_trains_like_one_process_stops_on_term_and_resumes_bitwise(cluster, tmp_path):
  """One job's life, in the order a user meets it (one test: every stage is a job on the one
  cluster, and the later ones compare against the first)."""
  # 1. The uninterrupted 2-task job, and a 1-process x 8-device run beside it (in this process,
  #    run_cli: the same CLI without a new interpreter's imports and compiles).
  job = _submit(cluster, tmp_path / "two_tasks")
  one = run_cli(*ARGS, f"--workdir={tmp_path / 'one_process'}", devices=8)
  assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
  log = _finish(cluster, job, tmp_path / "two_tasks")
  assert "1 node(s) x 2 task(s) x 4 CPU devices" in log
  assert "8 × cpu (2 process(es))" in log  # one mesh over both tasks, from SLURM's variables
  (loss1, eval1), uninterrupted = _losses(tmp_path / "one_process"), _losses(tmp_path / "two_tasks")
  loss2, eval2 = uninterrupted
  assert sorted(loss2) == sorted(loss1) == list(range(1, STEPS + 1))
  print("step  1 process x 8 (loss, grad_norm)   2 SLURM tasks x 4")
  for step in sorted(loss1):
    print(f"{step:4d}  {loss1[step][0]:.7f} {loss1[step][1]:.7f}  "
          f"{loss2[step][0]:.7f} {loss2[step][1]:.7f}")
  # Not bitwise: the gradient reductions over data x fsdp sum in another order when they cross
  # processes (gloo); step 1, before any update, already differs in the 7th digit. Loss and
  # gradient norm at every step.
  np.testing.assert_allclose([loss2[s] for s in loss1], list(loss1.values()), rtol=1e-5)
  np.testing.assert_allclose([eval2[s] for s in eval1], list(eval1.values()), rtol=1e-5)

  # 2. scancel --signal=TERM: every task stops after one common step and saves it; exit 0.
  workdir = tmp_path / "run"
  job = _submit(cluster, workdir)
  _wait_for_step(cluster, job, workdir, 2)
  cluster.command("scancel", "--signal=TERM", str(job))
  log = _finish(cluster, job, workdir)  # COMPLETED 0:0: a preempted run that saved is no failure
  stopped = [line for line in log.splitlines() if line.startswith("stopping after step")]
  assert len(stopped) == 1, log[-4000:]  # process 0 reports it, for both tasks
  assert "on the preemption notice" in stopped[0]
  stop_step = int(stopped[0].split()[3])
  assert 2 <= stop_step <= STEPS - 4, stopped  # room for the kill below
  assert _saved_steps(workdir)[-1] == stop_step
  assert max(_losses(workdir)[0]) == stop_step  # no task ran past the common step
  print(f"scancel --signal=TERM: both tasks stopped after step {stop_step}, saved, exit 0")

  # 3. The same command again resumes there; kill -9 of task 1 a few steps later ends the job
  #    at once (srun --kill-on-bad-exit, not the 60 s heartbeat timeout).
  job = _submit(cluster, workdir)
  _wait_for_step(cluster, job, workdir, stop_step + 3)
  victim = cluster.task_pids(job, marker="jaxtrain.main")
  assert sorted(victim) == [0, 1], victim
  os.kill(victim[1], signal.SIGKILL)
  killed_at = time.time()
  in_flight = [n for n in os.listdir(workdir / "checkpoints") if not n.isdigit()]
  fields = cluster.wait(job, 60)
  ended_after = time.time() - killed_at
  log = _log(workdir)
  assert f"resumed from step {stop_step}" in log, log[-4000:]
  assert fields["JobState"] == "FAILED" and fields["ExitCode"] != "0:0", (fields, log[-3000:])
  assert ended_after < 30, (ended_after, log[-3000:])
  assert "task 1: Killed" in log, log[-3000:]
  print(f"kill -9 of task 1 after step {max(_losses(workdir)[0])}: job {fields['JobState']} "
        f"{fields['ExitCode']} {ended_after:.1f} s later; being written then: {in_flight}")

  # 4. The next submission resumes from the last complete checkpoint (a checkpoint every step:
  #    the kill likely came while one was being written, which must not be taken) and ends
  #    with the uninterrupted job's losses, bitwise.
  complete = _saved_steps(workdir)
  assert complete[-1] >= stop_step + 1, complete
  log = _finish(cluster, _submit(cluster, workdir), workdir)
  resumed = [line for line in log.splitlines() if "resumed from step" in line]
  assert f"resumed from step {complete[-1]}" in resumed[-1], (complete, log[-4000:])
  # The loop logs a step after dispatching the next one, so the kill may have come after the
  # last checkpoint's step was saved but before its metrics were written: that step alone may
  # be missing from metrics.jsonl.
  _assert_bitwise(workdir, uninterrupted, may_be_unlogged=(complete[-1],))
  print(f"resubmitted: resumed from step {complete[-1]}; steps 1-{STEPS} equal the "
        f"uninterrupted job's bitwise")
