"""What `python -m jaxtrain.main` does once its flags are parsed (main.py): join the peers of a
multi-process run, validate the config before anything compiles, then dry-run or train, and map
each kind of failure to its one-line message and exit code (2: the input is wrong, 1: the run
failed).
"""

from __future__ import annotations

import sys
import time
import traceback

import jax

from jaxtrain import distributed, hardware, storage
from jaxtrain.checkpointing.verdicts import CheckpointRestoreError
from jaxtrain.cli_flags import first_line
from jaxtrain.config import ConfigError
from jaxtrain.dryrun import command as dry_run_command
from jaxtrain.objectives.grpo.rewards import RewardError
from jaxtrain.parallel.mesh import num_slices
from jaxtrain.storage import DataError
from jaxtrain.train import loop
from jaxtrain.train.health import TrainingHealthError
from jaxtrain.train.preflight import DoesNotFitError
from jaxtrain.validation.checks import validate
from jaxtrain.validation.multihost import check_distributed
from jaxtrain.validation.storage import check_run_storage


def initialize_distributed(config, distributed_flags: dict) -> None:
  """Joins the multi-process run this process was launched into, if any (before JAX starts a
  backend). `distributed_flags`: the --coordinator_address, --num_processes and --process_id
  values (None: from the environment)."""
  try:
    check_distributed(config)
    layout = distributed.detect(distributed_flags)
    d = config.distributed
    distributed.initialize(layout, heartbeat_timeout_s=d.heartbeat_timeout_s,
                           initialization_timeout_s=d.initialization_timeout_s,
                           shutdown_timeout_s=d.shutdown_timeout_s)
  except ConfigError as e:
    distributed.exit_with_error("config error", str(e), 2)
  except distributed.DistributedError as e:
    distributed.exit_with_error("distributed error", str(e), 2)


def check_precision(config, device) -> None:
  """precision.matmul against the chip the run landed on (FP8 needs FP8 matmul units); CPU
  computes any precision (by converting)."""
  chip = None if device.platform == "cpu" else hardware.chip_of_device_kind(device.device_kind)
  refusal = hardware.precision_refusal(config.precision.matmul, chip)
  if refusal:
    raise ConfigError(refusal)


def run(config, *, workdir: str, config_path: str | None, dry_run: bool = False,
        dry_run_target: str | None = None, dry_run_hlo: str | None = None,
        dry_run_devices: int | None = None, distributed_flags: dict | None = None) -> None:
  """Trains `config` into `workdir` (or, with `dry_run`, compiles its step for its target and
  exits with the verdict), exiting with a one-line error on bad input or a failed run."""
  if not dry_run:  # a dry run compiles for emulated devices in one process
    initialize_distributed(config, distributed_flags or {})
  start = time.perf_counter()
  try:
    if dry_run_hlo and not dry_run:
      raise ConfigError(f"--dry_run_hlo={dry_run_hlo}: only with --dry_run (it writes the dry "
                        f"run's compiled step)")
    if dry_run:
      sys.exit(dry_run_command.main(config, dry_run_devices, dry_run_target, config_path,
                                    hlo_path=dry_run_hlo))
    try:
      mesh_shape = validate(config, jax.device_count(), jax.default_backend(),
                            num_processes=jax.process_count(), num_slices=num_slices())
      check_precision(config, jax.devices()[0])
      check_run_storage(config, workdir)
    except ConfigError as e:
      # Every process checks the same config against the same global devices, so all fail
      # here alike: they leave together, each saying so, through JAX's shutdown barrier.
      distributed.exit_with_error("config error", str(e), 2, peers_fail_too=True)
    # Checks that need the data (tokenizer vs vocab, batch vs process count) raise ConfigError
    # from inside run(), still before anything compiles.
    result = loop.run(config, workdir, mesh_shape, config_path)
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
    # Every process agreed on the verdict (jaxtrain/checkpointing/verdicts.py): they stop together.
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
