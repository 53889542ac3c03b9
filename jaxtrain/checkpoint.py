"""Orbax checkpoints of a run: train state, data-iterator state and metadata, saved async.

Layout: WORKDIR/checkpoints/<step>/{state, data, meta}. Orbax writes each checkpoint under a
temporary name and renames it when complete, so a step directory that exists is whole; the
last good checkpoint is never deleted before a newer one is committed (Orbax deletes old ones
only after a save finishes).
"""

from __future__ import annotations

import os
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from jaxtrain.config import ConfigError


class Checkpointer:
  """Saves every `every_steps` steps (asynchronously: the loop continues while files are
  written) and restores the latest complete checkpoint onto the given shardings."""

  def __init__(self, directory: str, *, every_steps: int, max_to_keep: int | None = 3,
               keep_period: int | None = None, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    self.every_steps = every_steps
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, keep_period=keep_period,
        enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "data", "meta"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def should_save(self, step: int, last_step: int) -> bool:
    return self.every_steps > 0 and (step % self.every_steps == 0 or step == last_step)

  def save(self, step: int, state: Any, data_iterator, meta: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iterator),
        meta=ocp.args.JsonSave(meta)), force=True)

  def restore(self, step: int, abstract_state: Any, data_iterator) -> tuple[Any, dict]:
    """(state on the abstract state's shardings, meta); the data iterator is restored in
    place. Shapes that differ from the model config fail with the mismatched parameters named."""
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state),
          data=grain.checkpoint.CheckpointRestore(data_iterator),
          meta=ocp.args.JsonRestore()))
    except ValueError as e:
      raise ConfigError(f"checkpoint {self.directory}/{step} does not match this model config "
                        f"({_first_line(e)}); use the config it was saved with, or another "
                        f"--workdir") from None
    return restored.state, restored.meta

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(state_shapes: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying the target shardings: restore lands directly in them, on any
  mesh."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      state_shapes, shardings)


def _first_line(e: Exception) -> str:
  return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
