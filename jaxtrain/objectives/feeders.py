"""What the training loop asks for each step's device batch and each evaluation.

`Feeder` serves objectives whose batches come straight from the data (language modelling, DPO):
the host batch becomes a global array, eval is the mean loss over the eval batches. GRPO's
(jaxtrain.objectives.grpo.rollouts.Rollouts) samples its batches with the current weights instead.
The loop talks only to this interface (`Objective.make_feeder`).
"""

from __future__ import annotations

from typing import Callable, Iterable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxtrain.parallel.mesh import BATCH_AXES, batch_sharding


def to_global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """The one place where host data enters devices: this process's rows become its shards of a
  global [B, ...] array split over (data, fsdp)."""
  return {k: jax.make_array_from_process_local_data(batch_sharding(mesh, v.ndim), v)
          for k, v in local_batch.items()}


def local_rows(x: jax.Array, mesh: Mesh) -> np.ndarray:
  """This process's rows of a global batch-sharded array, in the order it fed them (the
  inverse of to_global_batch)."""
  if jax.process_count() == 1:
    return np.asarray(x)
  spec = P(BATCH_AXES, *([None] * (x.ndim - 1)))
  return np.asarray(multihost_utils.global_array_to_host_local_array(x, mesh, spec))


def evaluate(setup, state, eval_batches: Iterable[dict]) -> dict[str, float]:
  """{"eval_loss": mean loss, ...}: the mean over the objective's units (tokens, pairs), plus
  the means of its metrics as eval_<name> (DPO: eval_reward_accuracy, ...)."""
  with jax.set_mesh(setup.mesh):
    sums = [setup.eval_step(state.params, to_global_batch(b, setup.mesh), state.frozen)
            for b in eval_batches]
  total, count, aux = 0.0, 0.0, {}
  for loss_sum, n, metric_sums in jax.device_get(sums):
    total += float(loss_sum)
    count += float(n)
    for k, v in metric_sums.items():
      aux[k] = aux.get(k, 0.0) + float(v)
  count = max(count, 1.0)
  return {"eval_loss": total / count, **{f"eval_{k}": v / count for k, v in aux.items()}}


class Feeder:
  """One host batch per step from the data iterator, as a global device batch."""

  def __init__(self, setup):
    self.setup = setup

  def next_batch(self, state, step: int, next_local: Callable[[], dict]):
    """(device batch for `step`, host-measured metrics for its log record); `next_local()`
    gives the data iterator's next host batch (the loop times the wait)."""
    del state, step
    return to_global_batch(next_local(), self.setup.mesh), {}

  def at_boundary(self, step: int) -> bool:
    """Whether a checkpoint or a stop after `step` resumes exactly (between data batches)."""
    del step
    return True

  def evaluate(self, state, step: int, eval_batches) -> dict[str, float | None]:
    """{"eval_loss": ..., "eval_<metric>": ...} of the current weights."""
    del step
    return evaluate(self.setup, state, eval_batches)
