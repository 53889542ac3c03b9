"""CLI: `python -m jaxtrain.main --config=configs/NAME.py [--config.KEY=VALUE ...] [--workdir=DIR]`.

Parses the config, validates it before anything compiles (a bad value prints one line and exits
with code 2), initializes multi-process JAX when launched that way, and trains; or, with
`--dry_run [--dry_run_devices=N]`, compiles the train step for N devices and reports whether it
fits (jaxtrain/dry_run.py).
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to an ml-collections config file, e.g. configs/tiny.py.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for metrics.jsonl and TensorBoard events "
    "(default: runs/<config name>).")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Compile the train step on abstract inputs and report per-device memory, "
    "FLOPs and which accelerators it fits; train nothing.")
_DRY_RUN_DEVICES = flags.DEFINE_integer(
    "dry_run_devices", None, "Devices to compile the dry run for (default: this process's); "
    "more than present are emulated as CPU devices in a subprocess.")


def _default_workdir() -> str:
  path = config_flags.get_config_filename(flags.FLAGS["config"])
  name = os.path.splitext(os.path.basename(path))[0] if path else "run"
  return os.path.join("runs", name)


def _maybe_initialize_distributed():
  """Multi-process runs: the launcher sets JAX_COORDINATOR_ADDRESS (plus JAX_NUM_PROCESSES and
  JAX_PROCESS_ID where no cluster environment such as SLURM or a TPU pod provides them)."""
  import jax  # pylint: disable=import-outside-toplevel
  if not os.environ.get("JAX_COORDINATOR_ADDRESS"):
    return
  kwargs = {}
  if os.environ.get("JAX_NUM_PROCESSES"):
    kwargs["num_processes"] = int(os.environ["JAX_NUM_PROCESSES"])
  if os.environ.get("JAX_PROCESS_ID"):
    kwargs["process_id"] = int(os.environ["JAX_PROCESS_ID"])
  jax.distributed.initialize(**kwargs)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = _CONFIG.value
  if config is None:
    print("error: --config is required, e.g. --config=configs/tiny.py", file=sys.stderr)
    sys.exit(2)
  # JAX logs backend probing (e.g. "Unable to initialize backend 'tpu'") at INFO; keep the
  # console to the run table and progress lines unless the user asks for more (--verbosity).
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  _maybe_initialize_distributed()
  import jax  # pylint: disable=import-outside-toplevel
  from jaxtrain.config import ConfigError, validate  # pylint: disable=import-outside-toplevel
  from jaxtrain import trainer  # pylint: disable=import-outside-toplevel
  from jaxtrain.health import TrainingHealthError  # pylint: disable=import-outside-toplevel
  from jaxtrain.data.sources import DataError  # pylint: disable=import-outside-toplevel
  workdir = _WORKDIR.value or _default_workdir()
  start = time.perf_counter()
  try:
    if _DRY_RUN.value:
      from jaxtrain import dry_run  # pylint: disable=import-outside-toplevel
      sys.exit(dry_run.main(config, _DRY_RUN_DEVICES.value,
                            config_flags.get_config_filename(flags.FLAGS["config"])))
    mesh_shape = validate(config, jax.device_count(), jax.default_backend())
    # Checks that need the data (tokenizer vs vocab, batch vs process count) raise ConfigError
    # from inside run(), still before anything compiles.
    result = trainer.run(config, workdir, mesh_shape)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    sys.exit(2)
  except DataError as e:
    print(f"data error: {e}", file=sys.stderr)
    sys.exit(2)
  except TrainingHealthError as e:
    print(f"training stopped: {e}", file=sys.stderr)
    sys.exit(1)
  if result["preempted_at"] is not None:
    return  # exit 0: a preempted run that saved its state is not a failure
  if jax.process_index() == 0:
    print(f"done in {time.perf_counter() - start:.1f}s: final loss {result['loss']:.4f}, "
          f"eval loss {result['eval_loss']:.4f}; "
          f"metrics in {os.path.join(workdir, 'metrics.jsonl')}",
          flush=True)


if __name__ == "__main__":
  app.run(main)
