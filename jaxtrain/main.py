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

from absl import app, flags, logging
from ml_collections import config_flags

from jaxtrain.cli_flags import parse_flags

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
  # Entry point: the trainer (JAX and all of jaxtrain) is imported only now, after the process
  # re-executed itself with huge pages (the __main__ block) and the flags parsed.
  from jaxtrain import command  # pylint: disable=import-outside-toplevel
  command.run(config, workdir=_WORKDIR.value or _default_workdir(),
              config_path=config_flags.get_config_filename(flags.FLAGS["config"]),
              dry_run=_DRY_RUN.value, dry_run_target=_DRY_RUN_TARGET.value,
              dry_run_hlo=_DRY_RUN_HLO.value, dry_run_devices=_DRY_RUN_DEVICES.value,
              distributed_flags={"coordinator_address": _COORDINATOR_ADDRESS.value,
                                 "num_processes": _NUM_PROCESSES.value,
                                 "process_id": _PROCESS_ID.value})


if __name__ == "__main__":
  # Before JAX starts: only the CPU backend where there is no accelerator (clean output with the
  # deviceless compilers installed), and huge pages for XLA:CPU's per-step temporaries, which
  # otherwise fault in 4 KiB at a time.
  # (Entry point: two light modules, imported before the re-exec.)
  from jaxtrain import host_memory, platforms  # pylint: disable=import-outside-toplevel
  platforms.choose_jax_platforms()
  host_memory.reexec_with_hugepages()
  app.run(main, flags_parser=parse_flags)
