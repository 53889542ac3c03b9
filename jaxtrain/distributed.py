"""Multi-process runs: when to call `jax.distributed.initialize`, with what, and naming a process.

Every process runs the same CLI; the process layout comes from, first match wins:
  1. flags `--coordinator_address`, `--num_processes`, `--process_id`, else the environment
     variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (what launch/ sets);
  2. SLURM, when the job step runs more than one task: JAX reads SLURM_* itself;
  3. a Cloud TPU VM (a TPU pod worker, on GCE or GKE): JAX asks the TPU metadata for the workers;
otherwise the run is one process and nothing is initialized (the single-host path, unchanged).

Hang safety comes from JAX's coordination service: every process sends heartbeats to the
coordinator (process 0); a process silent for `heartbeat_timeout_s` is declared dead and every
other process is terminated with an error saying so, instead of waiting forever in a collective.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import socket
import sys
from collections.abc import Mapping

_FLAG_ENV = (("coordinator_address", "JAX_COORDINATOR_ADDRESS"),
             ("num_processes", "JAX_NUM_PROCESSES"),
             ("process_id", "JAX_PROCESS_ID"))
# What JAX's own SLURM detection needs (jax._src.clusters.slurm_cluster).
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
               "SLURM_LOCALID")


class DistributedError(RuntimeError):
  """A process layout that cannot work (e.g. a process id without a process count)."""


@dataclasses.dataclass(frozen=True)
class Layout:
  """How this process joins a multi-process run: `source` names where the layout came from
  (for messages); `kwargs` go to jax.distributed.initialize (empty: JAX detects them)."""
  source: str
  kwargs: dict


def detect(flags: Mapping[str, object] | None = None,
           env: Mapping[str, str] | None = None) -> Layout | None:
  """The multi-process layout of this process, or None for a single-process run.

  `flags` holds the CLI values (None where not given); `env` defaults to os.environ.
  """
  env = os.environ if env is None else env
  flags = flags or {}
  given = {}
  for name, var in _FLAG_ENV:
    value = flags.get(name)
    if value is None and env.get(var):
      value = env[var]
    if value is not None:
      given[name] = value
  if given:
    return _explicit(given, env)
  if _slurm_present(env):
    # A batch script's own step has one task; `srun` steps have SLURM_STEP_NUM_TASKS tasks.
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", env["SLURM_NTASKS"]))
    return Layout("SLURM", {}) if tasks > 1 else None
  if _on_cloud_tpu_vm(env):
    # One TPU VM host alone is a 1-process "pod": harmless, and JAX needs the metadata query
    # to tell it from a pod worker.
    return Layout("Cloud TPU", {})
  return None


def _explicit(given: dict, env: Mapping[str, str]) -> Layout:
  missing = [n for n, _ in _FLAG_ENV if n not in given]
  if "coordinator_address" in missing:
    raise DistributedError(
        "--num_processes/--process_id (or JAX_NUM_PROCESSES/JAX_PROCESS_ID) given without a "
        "coordinator: set --coordinator_address=HOST:PORT (or JAX_COORDINATOR_ADDRESS), the "
        "address of process 0")
  kwargs = {"coordinator_address": str(given["coordinator_address"])}
  if ":" not in kwargs["coordinator_address"]:
    raise DistributedError(f"coordinator address {kwargs['coordinator_address']!r}: give "
                           f"HOST:PORT, e.g. 10.0.0.1:1234 (the port process 0 listens on)")
  for name in ("num_processes", "process_id"):
    if name in given:
      try:
        kwargs[name] = int(given[name])
      except ValueError:
        raise DistributedError(f"{name}={given[name]!r}: must be an integer") from None
  if missing and not (_slurm_present(env) or _on_cloud_tpu_vm(env)):
    raise DistributedError(
        f"coordinator {kwargs['coordinator_address']} given but not "
        f"{' or '.join('--' + m for m in missing)} (or "
        f"{', '.join(v for n, v in _FLAG_ENV if n in missing)}), and no SLURM or TPU "
        f"environment provides them; set them on every process")
  if "num_processes" in kwargs and "process_id" in kwargs and not (
      0 <= kwargs["process_id"] < kwargs["num_processes"]):
    raise DistributedError(f"process_id={kwargs['process_id']}: must be in [0, num_processes="
                           f"{kwargs['num_processes']})")
  return Layout("flags/environment", kwargs)


def _slurm_present(env: Mapping[str, str]) -> bool:
  return all(env.get(v) for v in _SLURM_VARS)


def _on_cloud_tpu_vm(env: Mapping[str, str]) -> bool:
  """A Cloud TPU VM: libtpu installed and TPU chips attached (accel or vfio devices). GKE TPU
  pods also name their slice's workers (TPU_WORKER_HOSTNAMES or TPU_PROCESS_ADDRESSES)."""
  if any(env.get(v) for v in ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES",
                              "MEGASCALE_COORDINATOR_ADDRESS")):
    return True
  if importlib.util.find_spec("libtpu") is None:
    return False
  return os.path.exists("/dev/accel0") or (os.path.isdir("/dev/vfio")
                                          and len(os.listdir("/dev/vfio")) > 1)


def initialize(layout: Layout | None, *, heartbeat_timeout_s: int,
               initialization_timeout_s: int, shutdown_timeout_s: int) -> None:
  """jax.distributed.initialize for `layout` (nothing for None). Call before any other JAX use.

  heartbeat_timeout_s bounds how long the others wait for a process that died or hangs;
  initialization_timeout_s how long a process waits for all others to connect at start;
  shutdown_timeout_s how long a finished process waits for the rest at exit.
  """
  if layout is None:
    return
  import jax  # pylint: disable=import-outside-toplevel  (single-process runs need no init)
  try:
    jax.distributed.initialize(**layout.kwargs,
                               heartbeat_timeout_seconds=int(heartbeat_timeout_s),
                               initialization_timeout=int(initialization_timeout_s),
                               shutdown_timeout_seconds=int(shutdown_timeout_s))
  except Exception as e:  # pylint: disable=broad-except
    where = layout.kwargs.get("coordinator_address", "the address JAX detected")
    raise DistributedError(
        f"could not join the multi-process run ({layout.source} layout, coordinator {where}) "
        f"within distributed.initialization_timeout_s={initialization_timeout_s}: "
        f"{type(e).__name__}: {_first_line(e)}; check that every process started, that they "
        f"agree on the coordinator address and process count, and that process 0 is reachable "
        f"on that port") from e


def whereabouts() -> str:
  """'process I/N on HOST' for messages of a multi-process run, '' for a single process."""
  if "jax" not in sys.modules:
    return ""
  import jax  # pylint: disable=import-outside-toplevel
  # Not initialized: a single process (asking jax.process_count() would start a backend).
  if not jax.distributed.is_initialized() or jax.process_count() == 1:
    return ""
  return f"process {jax.process_index()}/{jax.process_count()} on {socket.gethostname()}"


def exit_with_error(kind: str, message: str, code: int, *, peers_fail_too: bool = False) -> None:
  """Prints `kind: message` on stderr (prefixed by the process and host when there are several)
  and exits with `code`.

  In a multi-process run the exit skips JAX's shutdown barrier: waiting there for processes
  that may be stuck in a collective with this one would only delay the error; they see this
  process gone (a failed collective, or its heartbeats stopping) and stop too. Unless
  `peers_fail_too`: an error every process meets at the same point (a bad config) exits through
  the barrier, so that no process is stopped before it has printed its own error.
  """
  where = whereabouts()
  print(f"{where + ': ' if where else ''}{kind}: {message}", file=sys.stderr, flush=True)
  if where and not peers_fail_too:
    sys.stdout.flush()
    os._exit(code)  # pylint: disable=protected-access
  sys.exit(code)


def explain_runtime_error(e: BaseException) -> str:
  """A hint for errors that mean another process died: the failed collective or the
  coordination service says so only deep inside the message."""
  text = str(e)
  peer_lost = ("Connection reset", "Connection closed", "heartbeat", "Broken pipe",
               "unhealthy", "UNAVAILABLE", "Socket closed")
  if any(p in text for p in peer_lost):
    return ("; another process of this run probably died or lost its network connection "
            "(see its log): a multi-process run stops when any process stops")
  return ""


def _first_line(e: BaseException) -> str:
  text = str(e).strip()
  return text.splitlines()[0][:300] if text else type(e).__name__
