"""Weights & Biases: the W&B side of the metrics writer (`log.wandb=True`).

The run gets the scalars TensorBoard gets, under the same names (`train/loss`, `eval/loss`, ...)
at the same steps (W&B's step is the training step), and the run table and the resolved config as
its config. Only process 0 logs: the trainer makes the metrics writer there alone.

`wandb` is an optional dependency (the `wandb` extra), imported only when a run asks for it;
config_checks refuses `log.wandb=True` without it before anything compiles. W&B's own settings
come from its environment variables: WANDB_MODE=offline keeps the run under WORKDIR/wandb/ with no
network (`wandb sync` uploads it later), WANDB_API_KEY logs in, and so on.
"""

from __future__ import annotations

import os
import secrets
import string
import sys
from typing import Any, Mapping, Sequence

from jaxtrain.checkpointing.run_directory import RUN_ID_FILE



def _new_run_id() -> str:
  # Eight base-36 digits, as W&B's own ids (lowercase: W&B ids are case-sensitive, URLs not).
  return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _run_id(workdir: str, resumed: bool) -> str:
  """The id stored in `workdir` when the run resumes from a checkpoint there, else a new one
  (stored): a run that starts at step 0 in an old workdir is a new run, as its metrics.jsonl is."""
  path = os.path.join(workdir, RUN_ID_FILE)
  if resumed and os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      run_id = f.read().strip()
    if run_id:
      return run_id
  run_id = _new_run_id()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.write(run_id + "\n")
  return run_id


class WandbLogger:
  """One W&B run: `log` the scalars of one step, `close` to finish it."""

  def __init__(self, config, workdir: str, table_rows: Sequence[tuple[str, str]], *,
               resumed: bool):
    """Starts (or, `resumed` from a checkpoint in `workdir`, continues) the W&B run named by
    `config.log` (wandb_project, wandb_run_name, wandb_entity). Its config is the run table
    (`run_table`: {row name: value}) and every section of `config`."""
    import wandb  # pylint: disable=import-outside-toplevel  # optional: the `wandb` extra
    workdir = os.path.abspath(workdir)
    log = config.log
    self._run = wandb.init(
        project=log.wandb_project,
        name=log.wandb_run_name or os.path.basename(workdir),
        entity=log.wandb_entity or None,
        dir=workdir,  # W&B writes its files to WORKDIR/wandb/
        id=_run_id(workdir, resumed),
        resume="allow",
        config={"run_table": {str(k): str(v) for k, v in table_rows}, **config.to_dict()})

  def log(self, step: int, scalars: Mapping[str, Any]):
    """`scalars` ({"train/loss": 2.3, ...}, floats) at training step `step`. W&B ignores a step
    below one it already has (a resumed run's steps after its checkpoint, which the interrupted
    run logged) and keeps what it has."""
    self._run.log(dict(scalars), step=step)

  def close(self):
    """Finishes the run; as failed when called while an exception propagates (the trainer's
    `finally`), so a crashed training run does not show as finished in W&B."""
    if self._run is not None:
      self._run.finish(exit_code=1 if sys.exc_info()[0] is not None else 0)
      self._run = None
