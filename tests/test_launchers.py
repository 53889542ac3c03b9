"""What the launchers that cannot run here produce, for given arguments: the gcloud commands of
`launch/tpu_pod.sh --print`, the JobSet manifests of `launch/gke_jobset.sh`, and the per-task
GPU split of `launch/slurm.sbatch` (with a stand-in srun). Parsed and checked for the fields
that matter: process count, coordinator, image, command line, restart policy."""

import os
import shlex
import shutil
import signal
import subprocess
import time

import pytest
import yaml

from tests.helpers import REPO

# Arguments with a space, a quote and a glob: each must reach jaxtrain.main as one word.
ARGS = ["--config=configs/llama8b.py", "--config.data.train_paths=/data/my corpus",
        "--config.train.note=it's", "--config.data.eval_paths=/data/*.jsonl"]


def _run(argv, env=None, **kwargs):
  return subprocess.run(argv, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True,
                        text=True, timeout=60, check=False, **kwargs)


# --- launch/tpu_pod.sh ----------------------------------------------------------------------

def _tpu_pod(*options, env=None):
  proc = _run(["launch/tpu_pod.sh", "my-v5p-32", "us-east5-a", *options, "--print", "--",
               *ARGS], env)
  assert proc.returncode == 0, proc.stderr
  assert proc.stderr == ""  # --print writes commands only, and nothing runs
  return [shlex.split(line) for line in proc.stdout.splitlines()]


def _remote(command):
  """The words of a `gcloud ... ssh --command=CMD` command's CMD."""
  (cmd,) = [w.split("=", 1)[1] for w in command if w.startswith("--command=")]
  return shlex.split(cmd)


def test_tpu_pod_copies_installs_and_starts_the_cli_on_every_worker():
  commands = _tpu_pod("--setup", env={"PROJECT": "my-project", "REMOTE_DIR": "jt"})
  assert [c[:5] for c in commands] == [["gcloud", "compute", "tpus", "tpu-vm", "scp"]] + [
      ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]] * 3
  scp, unpack, install, start = commands
  assert scp[6] == "my-v5p-32:/tmp/jaxtrain.tgz"
  for command in commands:
    # Every worker of the slice, one process each: JAX reads the process count, ids and the
    # coordinator (worker 0) from the TPU metadata, so no JAX_* variable is set anywhere.
    assert {"--zone=us-east5-a", "--worker=all", "--project=my-project"} <= set(command)
    assert "JAX_" not in " ".join(command)
  assert "my-v5p-32" in unpack and "tar -xzf /tmp/jaxtrain.tgz -C ~/jt" in " ".join(unpack)
  assert _remote(install)[-4:] == ["install", "-q", "-e", ".[tpu,cloud]"]
  words = _remote(start)
  assert words[:7] == ["cd", "~/jt", "&&", "exec", ".venv/bin/python", "-m", "jaxtrain.main"]
  assert words[7:] == ARGS  # through two shells, every argument still one word


def test_tpu_pod_without_setup_installs_nothing_and_uses_gclouds_project():
  commands = _tpu_pod()
  assert len(commands) == 3
  assert not any("install" in " ".join(c) for c in commands)
  assert not any(w.startswith("--project") for c in commands for w in c)
  assert _remote(commands[-1])[1] == "~/jaxtrain"


@pytest.mark.parametrize("argv", [["tpu"], ["tpu", "zone"],
                                  ["tpu", "zone", "--bogus", "--", "x"],
                                  ["tpu", "zone", "--setup", "x"]])
def test_tpu_pod_usage_errors(argv):
  proc = _run(["launch/tpu_pod.sh", *argv])
  assert proc.returncode == 2 and "usage: " in proc.stderr, proc.stderr
  assert proc.stdout == ""


# --- launch/gke_jobset.sh -------------------------------------------------------------------

COMMON = {"JOB_NAME": "llama8b", "IMAGE": "us-docker.pkg.dev/p/ml/jaxtrain:v1",
          "ARGS": shlex.join(ARGS)}
TPU = {**COMMON, "NUM_SLICES": "2", "TPU_ACCELERATOR": "tpu-v5p-slice",
       "TPU_TOPOLOGY": "2x2x4", "HOSTS_PER_SLICE": "4", "CHIPS_PER_HOST": "4"}
GPU = {**COMMON, "NUM_HOSTS": "3", "GPUS_PER_HOST": "8"}
needs_envsubst = pytest.mark.skipif(shutil.which("envsubst") is None,
                                    reason="envsubst not installed (apt-get install gettext-base)")


def _render(accelerator, values):
  """launch/gke_jobset.sh ACCELERATOR with exactly `values` of its variables set."""
  env = {k: v for k, v in os.environ.items() if k not in {**TPU, **GPU}}
  return subprocess.run(["launch/gke_jobset.sh", accelerator], cwd=REPO, env={**env, **values},
                        capture_output=True, text=True, timeout=60, check=False)


def _jobset(accelerator, values):
  proc = _render(accelerator, values)
  assert proc.returncode == 0, proc.stderr
  docs = list(yaml.safe_load_all(proc.stdout))
  assert len(docs) == 1, proc.stdout  # just the JobSet for this accelerator
  return docs[0]


def _pod(replicated_job):
  spec = replicated_job["template"]["spec"]
  return spec, spec["template"]["spec"], spec["template"]["spec"]["containers"][0]


def _started_command(container):
  """The argv the container's `bash -c` script execs."""
  assert container["command"][:2] == ["bash", "-c"]
  words = shlex.split(container["command"][2])
  assert words[0] == "exec"
  return words[1:]


@needs_envsubst
def test_gke_gpu_jobset_one_process_per_node_with_the_coordinator_on_pod_0():
  jobset = _jobset("gpu", GPU)
  assert jobset["kind"] == "JobSet" and jobset["metadata"]["name"] == "llama8b"
  (workers,) = jobset["spec"]["replicatedJobs"]
  job, pod, container = _pod(workers)
  assert workers["replicas"] == 1
  assert job["parallelism"] == job["completions"] == 3 and job["completionMode"] == "Indexed"
  # A failed pod fails its job at once (no per-pod retries), and the JobSet restarts every pod
  # together, which resume from the last checkpoint.
  assert job["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
  assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 3
  assert container["image"] == "us-docker.pkg.dev/p/ml/jaxtrain:v1"
  assert _started_command(container) == ["python", "-m", "jaxtrain.main", *ARGS]
  env = {e["name"]: e for e in container["env"]}
  assert env["JAX_COORDINATOR_ADDRESS"]["value"] == "llama8b-workers-0-0.llama8b:8476"
  assert env["JAX_NUM_PROCESSES"]["value"] == "3"
  assert env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
      "metadata.annotations['batch.kubernetes.io/job-completion-index']")
  assert {"containerPort": 8476} in [{k: p[k] for k in ("containerPort",)}
                                     for p in container["ports"]]
  assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}


@needs_envsubst
def test_gke_tpu_jobset_one_job_per_slice_joined_by_megascale():
  jobset = _jobset("tpu", TPU)
  (slices,) = jobset["spec"]["replicatedJobs"]
  job, pod, container = _pod(slices)
  assert slices["replicas"] == 2  # one job per slice
  assert job["parallelism"] == job["completions"] == 4  # one pod per TPU VM host
  assert job["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
  assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 3
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                 "cloud.google.com/gke-tpu-topology": "2x2x4"}
  assert container["resources"]["limits"] == {"google.com/tpu": 4}
  assert container["image"] == TPU["IMAGE"]
  assert _started_command(container) == ["python", "-m", "jaxtrain.main", *ARGS]
  env = {e["name"]: e for e in container["env"]}
  # Within a slice JAX reads the hosts from GKE's TPU_WORKER_* variables; slices are joined by
  # the MEGASCALE_* ones, coordinated by slice 0's first pod.
  assert env["MEGASCALE_COORDINATOR_ADDRESS"]["value"] == "llama8b-slice-0-0.llama8b"
  assert "replicatedjob-replicas" in env["MEGASCALE_NUM_SLICES"]["valueFrom"]["fieldRef"][
      "fieldPath"]
  assert "job-index" in env["MEGASCALE_SLICE_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
  assert not any(name.startswith("JAX_") for name in env)


@needs_envsubst
@pytest.mark.parametrize("accelerator,values,words", [
    ("gpu", {**GPU, "NUM_HOSTS": ""}, ["NUM_HOSTS is not set"]),
    ("gpu", {**GPU, "GPUS_PER_HOST": "eight"}, ["GPUS_PER_HOST=eight", "positive integer"]),
    ("tpu", {**TPU, "NUM_SLICES": "0"}, ["NUM_SLICES=0", "positive integer"]),
    ("tpu", {**TPU, "TPU_TOPOLOGY": ""}, ["TPU_TOPOLOGY is not set"]),
    ("tpu", {**TPU, "JOB_NAME": "Llama_8B"}, ["JOB_NAME=Llama_8B", "lowercase"]),
    ("gpu", {**GPU, "ARGS": "--a\n--b"}, ["ARGS", "one line"]),
])
def test_gke_jobset_refuses_bad_values_in_one_line(accelerator, values, words):
  proc = _render(accelerator, values)
  assert proc.returncode == 2 and proc.stdout == "", proc.stdout
  assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("gke_jobset: error: ")
  for word in words:
    assert word in proc.stderr, (word, proc.stderr)


# --- launch/slurm.sbatch outside SLURM: the per-task GPU split and its refusals ---------------

def _sbatch_script(tmp_path, env, script="launch/slurm.sbatch"):
  """Runs launch/slurm.sbatch with a stand-in `srun` that starts the task command once per task
  of this node (SLURM_LOCALID 0..k-1), and a stand-in Python that prints what each task sees."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  (bin_dir / "srun").write_text(
      "#!/usr/bin/env bash\n"
      "while [[ $1 == --* ]]; do shift; done\n"
      "for ((l = 0; l < SLURM_NTASKS / SLURM_JOB_NUM_NODES; l++)); do\n"
      "  SLURM_LOCALID=$l \"$@\"\ndone\n")
  (bin_dir / "python").write_text(
      "#!/usr/bin/env bash\n"
      "echo \"task ${SLURM_LOCALID}: ids=${JAX_LOCAL_DEVICE_IDS:-} platforms=${JAX_PLATFORMS:-}"
      " flags=${XLA_FLAGS:-} argv=$*\"\n")
  for f in ("srun", "python"):
    (bin_dir / f).chmod(0o755)
  base = {k: v for k, v in os.environ.items()
          if not k.startswith(("SLURM_", "JAX", "XLA_FLAGS"))}
  return subprocess.run(["bash", script, "--config=configs/tiny.py"], cwd=REPO,
                        env={**base, "PATH": f"{bin_dir}:{base['PATH']}",
                             "PYTHON": str(bin_dir / "python"), "SLURM_JOB_ID": "7", **env},
                        capture_output=True, text=True, timeout=60, check=False)


def test_slurm_sbatch_splits_each_nodes_gpus_over_its_tasks(tmp_path):
  proc = _sbatch_script(tmp_path, {"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "4",
                                   "SLURM_GPUS_ON_NODE": "8"})
  assert proc.returncode == 0, proc.stderr
  assert "2 node(s) x 2 task(s) x 4 GPUs" in proc.stderr
  assert proc.stdout.splitlines() == [
      "task 0: ids=0,1,2,3 platforms= flags= argv=-m jaxtrain.main --config=configs/tiny.py",
      "task 1: ids=4,5,6,7 platforms= flags= argv=-m jaxtrain.main --config=configs/tiny.py"]
  # One task per node (the default): it drives all of the node's GPUs. The script's former
  # name still works.
  proc = _sbatch_script(tmp_path, {"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "2",
                                   "SLURM_GPUS_ON_NODE": "8"}, script="launch/slurm_gpu.sbatch")
  assert proc.stdout.startswith("task 0: ids=0,1,2,3,4,5,6,7 "), proc.stdout + proc.stderr


def test_slurm_sbatch_cpu_emulation(tmp_path):
  proc = _sbatch_script(tmp_path, {"SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2",
                                   "JAXTRAIN_CPU_DEVICES": "4"})
  assert proc.returncode == 0, proc.stderr
  assert "1 node(s) x 2 task(s) x 4 CPU devices" in proc.stderr
  for line in proc.stdout.splitlines():
    assert "ids= platforms=cpu flags= --xla_force_host_platform_device_count=4" in line, line


@pytest.mark.parametrize("env,words", [
    ({"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "3", "SLURM_GPUS_ON_NODE": "8"},
     ["3 tasks on 2 nodes", "--ntasks-per-node"]),
    ({"SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "3", "SLURM_GPUS_ON_NODE": "8"},
     ["8 GPUs per node", "3 tasks per node"]),
    ({"SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "1", "SLURM_GPUS_ON_NODE": "0"},
     ["no GPUs on this node", "--gpus-per-node", "JAXTRAIN_CPU_DEVICES"]),
    ({"SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "1", "JAXTRAIN_CPU_DEVICES": "four"},
     ["JAXTRAIN_CPU_DEVICES=four"]),
])
def test_slurm_sbatch_refuses_layouts_it_cannot_run(tmp_path, env, words):
  proc = _sbatch_script(tmp_path, env)
  assert proc.returncode == 2 and proc.stdout == "", proc.stdout
  assert proc.stderr.startswith("slurm.sbatch: error: ") and proc.stderr.count("\n") == 1
  for word in words:
    assert word in proc.stderr, (word, proc.stderr)


def test_slurm_sbatch_passes_a_sigterm_of_the_batch_shell_to_the_tasks(tmp_path):
  """`--signal=B:TERM@N` or `scancel --batch --signal=TERM` signal only the batch shell: it asks
  SLURM to signal every task (`scancel --signal=TERM JOBID`), keeps waiting while they save,
  and exits with srun's status."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  calls = tmp_path / "scancel_calls"
  # srun stands in for the tasks: it ends (status 0) once scancel has signalled them.
  (bin_dir / "srun").write_text(
      "#!/usr/bin/env bash\n"
      f"touch {tmp_path}/srun_started\n"
      f"while [[ ! -e {calls} ]]; do sleep 0.05; done\nsleep 0.3\nexit 0\n")
  (bin_dir / "scancel").write_text(f"#!/usr/bin/env bash\necho \"$*\" >> {calls}\n")
  (bin_dir / "python").write_text("#!/usr/bin/env bash\n")
  for f in ("srun", "scancel", "python"):
    (bin_dir / f).chmod(0o755)
  base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX"))}
  proc = subprocess.Popen(
      ["bash", "launch/slurm.sbatch", "--config=configs/tiny.py"], cwd=REPO,
      env={**base, "PATH": f"{bin_dir}:{base['PATH']}", "PYTHON": str(bin_dir / "python"),
           "SLURM_JOB_ID": "41", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2",
           "JAXTRAIN_CPU_DEVICES": "4"},
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 30
  while not (tmp_path / "srun_started").exists():
    assert proc.poll() is None and time.time() < deadline, proc.communicate()
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=30)
  assert proc.returncode == 0, err
  assert calls.read_text() == "--signal=TERM 41\n"
  assert "SIGTERM: passing it to every task" in err
