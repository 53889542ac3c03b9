"""CLI: `python -m jaxtrain.main --config=configs/NAME.py [--config.KEY=VALUE ...] [--workdir=DIR]`.

Parses the config, validates it before anything compiles (a bad value prints one line and exits
with code 2), initializes multi-process JAX when launched that way (jaxtrain/distributed.py;
errors then name the process and host), checks that the compiled step fits the devices'
memory before any weight is allocated, and trains; or, with `--dry_run`, compiles the train step
for the config's `target` (or `--dry_run_target=NAME`) with that target's own compiler and
reports whether it fits (jaxtrain/dryrun/).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from absl import app, flags, logging
from ml_collections import config_flags

from jaxtrain.cli_flags import first_line, parse_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to an ml-collections config file, e.g. configs/tiny.py.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for metrics.jsonl, TensorBoard events and checkpoints: a local "
    "path, or s3://BUCKET/PATH or gs://BUCKET/PATH (the cloud extra) "
    "(default: runs/<config name>).")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Compile the train step for the config's target on abstract inputs, with "
    "the target's own compiler, and report per-device memory, FLOPs and whether it fits; train "
    "nothing.")
_DRY_RUN_TARGET = flags.DEFINE_string(
    "dry_run_target", None, "Target to compile the dry run for instead of the config's "
    "`target`: h100x8, h200x64, a100x16, l4x1, b200x8, v4-N, v5p-N, v5e-N, v6e-N or cpu.")
_DRY_RUN_HLO = flags.DEFINE_string(
    "dry_run_hlo", None, "With --dry_run: write the compiled step's optimized HLO text to this "
    "file (what the target's compiler made of the step: its fusions, collectives, matmul types).")
_DRY_RUN_DEVICES = flags.DEFINE_integer(
    "dry_run_devices", None, "Model an unnamed accelerator on N emulated CPU devices (XLA:CPU, "
    "an estimate) instead of compiling for a target.")
# Multi-process runs; each defaults to its JAX_* environment variable, and all three are found
# automatically under SLURM and on Cloud TPU pods (see docs/launch.md).
_COORDINATOR_ADDRESS = flags.DEFINE_string(
    "coordinator_address", None, "HOST:PORT of process 0's coordination service "
    "(default: $JAX_COORDINATOR_ADDRESS).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Processes in the run (default: $JAX_NUM_PROCESSES).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's index in [0, num_processes) (default: $JAX_PROCESS_ID).")


def _default_workdir() -> str:
  path = config_flags.get_config_filename(flags.FLAGS["config"])
  name = os.path.splitext(os.path.basename(path))[0] if path else "run"
  return os.path.join("runs", name)


def _initialize_distributed(config):
  """Joins the multi-process run this process was launched into, if any (before JAX starts)."""
  from jaxtrain import distributed  # pylint: disable=import-outside-toplevel
  from jaxtrain.config import ConfigError  # pylint: disable=import-outside-toplevel
  from jaxtrain.config_checks import check_distributed  # pylint: disable=import-outside-toplevel
  try:
    check_distributed(config)
    layout = distributed.detect({"coordinator_address": _COORDINATOR_ADDRESS.value,
                                 "num_processes": _NUM_PROCESSES.value,
                                 "process_id": _PROCESS_ID.value})
    d = config.distributed
    distributed.initialize(layout, heartbeat_timeout_s=d.heartbeat_timeout_s,
                           initialization_timeout_s=d.initialization_timeout_s,
                           shutdown_timeout_s=d.shutdown_timeout_s)
  except ConfigError as e:
    distributed.exit_with_error("config error", str(e), 2)
  except distributed.DistributedError as e:
    distributed.exit_with_error("distributed error", str(e), 2)


def _check_precision(config, device) -> None:
  """precision.matmul against the chip the run landed on (FP8 needs FP8 matmul units); CPU
  computes any precision (by converting)."""
  from jaxtrain.config import ConfigError  # pylint: disable=import-outside-toplevel
  from jaxtrain.dryrun import targets  # pylint: disable=import-outside-toplevel
  chip = None if device.platform == "cpu" else targets.chip_of_device_kind(device.device_kind)
  refusal = targets.precision_refusal(config.precision.matmul, chip)
  if refusal:
    raise ConfigError(refusal)


def main(argv):
  del argv  # parse_flags refused positional arguments
  config = _CONFIG.value
  if config is None:
    print("error: --config is required, e.g. --config=configs/tiny.py", file=sys.stderr)
    sys.exit(2)
  # JAX logs backend probing (e.g. "Unable to initialize backend 'tpu'") at INFO; keep the
  # console to the run table and progress lines unless the user asks for more (--verbosity).
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if not _DRY_RUN.value:  # a dry run compiles for emulated devices in one process
    _initialize_distributed(config)
  import jax  # pylint: disable=import-outside-toplevel
  from jaxtrain import distributed  # pylint: disable=import-outside-toplevel
  from jaxtrain.config import ConfigError  # pylint: disable=import-outside-toplevel
  from jaxtrain.config_checks import validate  # pylint: disable=import-outside-toplevel
  from jaxtrain.storage_checks import check_run_storage  # pylint: disable=import-outside-toplevel
  from jaxtrain.parallel.mesh import num_slices  # pylint: disable=import-outside-toplevel
  from jaxtrain import storage, trainer  # pylint: disable=import-outside-toplevel
  from jaxtrain.health import TrainingHealthError  # pylint: disable=import-outside-toplevel
  from jaxtrain.data.sources import DataError  # pylint: disable=import-outside-toplevel
  from jaxtrain.rewards import RewardError  # pylint: disable=import-outside-toplevel
  from jaxtrain.preflight import DoesNotFitError  # pylint: disable=import-outside-toplevel
  from jaxtrain.checkpoint_verdicts import CheckpointRestoreError  # pylint: disable=import-outside-toplevel
  workdir = _WORKDIR.value or _default_workdir()
  start = time.perf_counter()
  try:
    if _DRY_RUN_HLO.value and not _DRY_RUN.value:
      raise ConfigError(f"--dry_run_hlo={_DRY_RUN_HLO.value}: only with --dry_run (it writes "
                        f"the dry run's compiled step)")
    if _DRY_RUN.value:
      from jaxtrain.dryrun import command  # pylint: disable=import-outside-toplevel
      sys.exit(command.main(config, _DRY_RUN_DEVICES.value, _DRY_RUN_TARGET.value,
                            config_flags.get_config_filename(flags.FLAGS["config"]),
                            hlo_path=_DRY_RUN_HLO.value))
    try:
      mesh_shape = validate(config, jax.device_count(), jax.default_backend(),
                            num_processes=jax.process_count(), num_slices=num_slices())
      _check_precision(config, jax.devices()[0])
      check_run_storage(config, workdir)
    except ConfigError as e:
      # Every process checks the same config against the same global devices, so all fail
      # here alike: they leave together, each saying so, through JAX's shutdown barrier.
      distributed.exit_with_error("config error", str(e), 2, peers_fail_too=True)
    # Checks that need the data (tokenizer vs vocab, batch vs process count) raise ConfigError
    # from inside run(), still before anything compiles.
    result = trainer.run(config, workdir, mesh_shape,
                         config_flags.get_config_filename(flags.FLAGS["config"]))
  except DoesNotFitError as e:
    distributed.exit_with_error("does not fit", str(e), 2, peers_fail_too=True)
  except ConfigError as e:
    distributed.exit_with_error("config error", str(e), 2)
  except DataError as e:
    distributed.exit_with_error("data error", str(e), 2)
  except TrainingHealthError as e:
    distributed.exit_with_error("training stopped", str(e), 1)
  except RewardError as e:
    distributed.exit_with_error("reward error", str(e), 1)
  except CheckpointRestoreError as e:
    # Every process agreed on the verdict (jaxtrain/checkpoint_verdicts.py): they stop together.
    distributed.exit_with_error("checkpoint error", str(e), 1, peers_fail_too=True)
  except Exception as e:  # pylint: disable=broad-except
    if not distributed.whereabouts():
      raise  # one process: the usual traceback and exit code
    traceback.print_exc()
    distributed.exit_with_error("error", f"{type(e).__name__}: {first_line(e)}"
                                f"{distributed.explain_runtime_error(e)}", 1)
  if result["preempted_at"] is not None:
    return  # exit 0: a preempted run that saved its state is not a failure
  if jax.process_index() == 0:
    evals = ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in result.items()
                      if k.startswith("eval_") and isinstance(v, float))
    print(f"done in {time.perf_counter() - start:.1f}s: final loss {result['loss']:.4f}"
          f"{', ' + evals if evals else ''}; metrics in {storage.join(workdir, 'metrics.jsonl')}",
          flush=True)


if __name__ == "__main__":
  # Before JAX starts: only the CPU backend where there is no accelerator (clean output with the
  # deviceless compilers installed), and huge pages for XLA:CPU's per-step temporaries, which
  # otherwise fault in 4 KiB at a time.
  from jaxtrain import host_memory, platforms  # pylint: disable=import-outside-toplevel
  platforms.choose_jax_platforms()
  host_memory.reexec_with_hugepages()
  app.run(main, flags_parser=parse_flags)
