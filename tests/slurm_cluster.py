"""A one-node SLURM cluster made of this machine's own daemons, for tests of the SLURM launcher.

`LocalSlurmCluster(root)` writes a munge key and a `slurm.conf` under `root`, starts `munged`,
`slurmctld` and `slurmd` for them in the foreground (so it holds their pids), waits until the
node is idle, and on `stop()` ends exactly those three processes. Nothing system-wide is used:
its own munge socket, state and spool directories, and free ports; the client commands reach it
through `SLURM_CONF` in `env`. Needs root (slurmd starts tasks as the submitting user) and
Debian's `slurm-wlm` and `munge` packages (`.ci/run` installs them).

Also a command line for trying the launcher by hand:
  python -m tests.slurm_cluster DIR      # starts the cluster, prints its SLURM_CONF, runs until
                                        # Ctrl-C, then stops the daemons it started
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "sinfo", "scontrol", "scancel")


def unavailable_reason() -> str | None:
  """Why a local cluster cannot run here (one line), or None when it can."""
  missing = [b for b in (*DAEMONS, *CLIENTS) if shutil.which(b) is None]
  if missing:
    return (f"SLURM not installed ({', '.join(missing)} not found): apt-get install slurm-wlm "
            f"munge")
  if os.geteuid() != 0:
    return "a local SLURM cluster needs root (slurmd starts the tasks)"
  return None


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class LocalSlurmCluster:
  """One node (this host, named `localhost`), `cpus` CPUs (default: this machine's, at least 2),
  one partition."""

  def __init__(self, root: os.PathLike, cpus: int | None = None):
    self.root = Path(root).resolve()
    self.cpus = cpus or max(2, os.cpu_count() or 1)
    self.node = socket.gethostname().split(".")[0]
    self.conf = self.root / "slurm.conf"
    self.env = dict(os.environ, SLURM_CONF=str(self.conf))
    self._procs: dict[str, subprocess.Popen] = {}
    # munged wants every directory above its socket searchable by all (pytest's temporary
    # directories are not), and a socket path is limited to 108 bytes: a short one under /tmp.
    self._munge_dir = Path(tempfile.mkdtemp(prefix="jaxtrain-munge-"))

  # -- lifecycle --------------------------------------------------------------------------------

  def start(self, timeout_s: float = 60) -> LocalSlurmCluster:
    reason = unavailable_reason()
    if reason:
      raise RuntimeError(reason)
    self._write_files()
    try:
      self._spawn("munged", ["munged", "--foreground", f"--key-file={self.root / 'munge.key'}",
                             f"--socket={self._munge_socket}",
                             f"--pid-file={self.root / 'munged.pid'}",
                             f"--seed-file={self.root / 'munged.seed'}",
                             f"--log-file={self.root / 'munged.log'}"])
      self._wait_for(lambda: self._munge_socket.exists(), timeout_s, "munged's socket")
      self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
      self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf)])
      self._wait_for(self._node_idle, timeout_s, "the node to be idle")
    except BaseException:
      self.stop()
      raise
    return self

  def stop(self) -> None:
    """Ends the daemons this object started (by pid), slurmd first."""
    for name in reversed(DAEMONS):
      proc = self._procs.pop(name, None)
      if proc is None or proc.poll() is not None:
        continue
      proc.send_signal(signal.SIGTERM)
      try:
        proc.wait(timeout=15)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shutil.rmtree(self._munge_dir, ignore_errors=True)

  def __enter__(self) -> LocalSlurmCluster:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  # -- jobs -------------------------------------------------------------------------------------

  def command(self, *argv: str, env: dict | None = None, cwd=None,
              check: bool = True) -> subprocess.CompletedProcess:
    """Runs a SLURM client command against this cluster (its SLURM_CONF on top of `env`)."""
    return subprocess.run(argv, env={**(env or os.environ), "SLURM_CONF": str(self.conf)},
                          cwd=cwd, capture_output=True, text=True, timeout=180, check=check)

  def sbatch(self, *argv: str, env: dict | None = None, cwd=None) -> int:
    """Submits `sbatch ARGV`; returns the job id."""
    out = self.command("sbatch", "--parsable", *argv, env=env, cwd=cwd).stdout
    return int(out.strip().split(";")[0])

  def job(self, job_id: int) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, ExitCode, ...). A query that fails (slurmctld
    slow to answer on a loaded machine, or the job forgotten) gives {"QueryError": why}."""
    try:
      proc = self.command("scontrol", "--oneliner", "show", "job", str(job_id), check=False)
    except subprocess.TimeoutExpired as e:
      return {"QueryError": str(e)}
    if proc.returncode != 0:
      return {"QueryError": (proc.stderr or proc.stdout).strip()}
    fields = {}
    for word in proc.stdout.split():
      key, _, value = word.partition("=")
      fields.setdefault(key, value)
    return fields

  def wait(self, job_id: int, timeout_s: float) -> dict[str, str]:
    """Waits until the job has ended; returns its last `job` fields."""
    deadline = time.time() + timeout_s
    while True:
      fields = self.job(job_id)
      if self.ended(fields):
        return fields
      if time.time() > deadline:
        raise TimeoutError(f"job {job_id} still {fields.get('JobState')} after {timeout_s} s "
                           f"{fields.get('QueryError', '')}")
      time.sleep(0.5)

  @staticmethod
  def ended(fields: dict[str, str]) -> bool:
    """Whether `job` fields say the job has ended (a failed query says nothing: not ended)."""
    return "JobState" in fields and fields["JobState"] not in (
        "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING",
        "SIGNALING", "STAGE_OUT")

  @staticmethod
  def task_pids(job_id: int, marker: str = "") -> dict[int, int]:
    """{SLURM_PROCID: pid} of the job's task processes whose command line contains `marker`
    (not srun or a shell, whose command lines name the task's too)."""
    found = {}
    for entry in Path("/proc").iterdir():
      if not entry.name.isdigit():
        continue
      try:
        environ = dict(v.partition("=")[::2] for v in
                       (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in v)
        cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
      except OSError:
        continue  # gone, or not ours to read
      program = os.path.basename(cmdline.split(" ", 1)[0])
      if (environ.get("SLURM_JOB_ID") == str(job_id) and "SLURM_PROCID" in environ
          and program not in ("srun", "bash", "sh") and marker in cmdline):
        found[int(environ["SLURM_PROCID"])] = int(entry.name)
    return found

  # -- internals --------------------------------------------------------------------------------

  @property
  def _munge_socket(self) -> Path:
    return self._munge_dir / "socket"

  def _write_files(self) -> None:
    # munged checks permissions: its key readable by its owner only, and no directory on the way
    # writable by others.
    for d in (self.root, self._munge_dir, self.root / "state", self.root / "spool"):
      d.mkdir(parents=True, exist_ok=True)
      d.chmod(0o755)
    key = self.root / "munge.key"
    if not key.exists():
      key.write_bytes(os.urandom(1024))
      key.chmod(0o400)
    r = self.root
    # A random first job id: JAX's SLURM detection derives the coordinator port from the job
    # id, so two clusters on one machine (two test sessions) do not pick the same ports.
    settings = {
        "ClusterName": "jaxtraintest",
        "SlurmctldHost": f"{self.node}(127.0.0.1)",
        "SlurmctldPort": _free_port(), "SlurmdPort": _free_port(),
        "SlurmUser": "root", "SlurmdUser": "root",
        "AuthType": "auth/munge", "CredType": "cred/munge",
        "AuthInfo": f"socket={self._munge_socket}",
        "StateSaveLocation": r / "state", "SlurmdSpoolDir": r / "spool",
        "SlurmctldPidFile": r / "slurmctld.pid", "SlurmdPidFile": r / "slurmd.pid",
        "SlurmctldLogFile": r / "slurmctld.log", "SlurmdLogFile": r / "slurmd.log",
        "ProctrackType": "proctrack/linuxproc", "TaskPlugin": "task/none",
        "SelectType": "select/cons_tres", "SelectTypeParameters": "CR_CPU",
        "MpiDefault": "none", "SwitchType": "switch/none",
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none",
        "ReturnToService": 2, "SlurmdParameters": "config_overrides",
        "FirstJobId": random.randrange(1000, 1_000_000), "KillWait": 2,
        # The tests load both CPUs fully; slurmctld may answer late, and the default 10 s
        # would fail client commands.
        "MessageTimeout": 60,
    }
    lines = [f"{k}={v}" for k, v in settings.items()]
    # The node is named `localhost` (slurmd finds it by NodeHostname): JAX's SLURM detection
    # takes the coordinator's host from the node list, and that name resolves on any machine.
    lines += [f"NodeName=localhost NodeHostname={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} "
              f"State=UNKNOWN",
              "PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP"]
    self.conf.write_text("\n".join(lines) + "\n", encoding="utf-8")

  def _spawn(self, name: str, argv: list[str]) -> None:
    log = open(self.root / f"{name}.out", "w", encoding="utf-8")  # pylint: disable=consider-using-with
    with log:
      self._procs[name] = subprocess.Popen(argv, env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)

  def _node_idle(self) -> bool:
    proc = self.command("sinfo", "--noheader", "--Node", "--format=%T", check=False)
    return proc.returncode == 0 and proc.stdout.strip() == "idle"

  def _wait_for(self, ready, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not ready():
      dead = [n for n, p in self._procs.items() if p.poll() is not None]
      if dead or time.time() > deadline:
        logs = "".join(f"\n--- {n}.out\n" + (self.root / f"{n}.out").read_text()[-2000:]
                       for n in self._procs)
        raise RuntimeError(f"local SLURM cluster: gave up waiting for {what}"
                           f"{' (' + ', '.join(dead) + ' exited)' if dead else ''}{logs}")
      time.sleep(0.2)


def main(argv: list[str]) -> int:
  if len(argv) != 1:
    print(__doc__.split("Also a command line")[1], file=sys.stderr)
    return 2
  # SIGTERM (timeout, kill) stops the daemons too: it unwinds through the `with` below.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
  with LocalSlurmCluster(argv[0]) as cluster:
    print(f"export SLURM_CONF={cluster.conf}   # node {cluster.node}, {cluster.cpus} CPUs; "
          f"Ctrl-C stops the daemons", flush=True)
    try:
      signal.pause()
    except KeyboardInterrupt:
      pass
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
