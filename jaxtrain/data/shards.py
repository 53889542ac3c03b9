"""Virtual data shards: which rows of every global batch each process loads, and from where.

The stream of global batches must not depend on how many processes read it, or a checkpoint
could not resume exactly on another number of hosts. So the data is cut into a fixed number S
of virtual shards (`data.num_shards`): shard s is the per-process pipeline run as "process s of
S" (pieces s::S, B/S rows per batch), and global batch i is the concatenation of every shard's
batch i in shard order. A process loads exactly the shards whose rows its devices hold, so no
process ever reads another's data, and the same shard gives the same rows wherever it runs.

`data.num_shards=0` means one shard per process: shard p is process p's rows, which is the
pipeline of a single host (S=1) and of multi-process runs before shards existed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from jaxtrain.config import ConfigError
from jaxtrain.parallel.mesh import batch_rows_by_process


@dataclasses.dataclass(frozen=True)
class ShardPlan:
  """This process's share of the data: `shards` (in global row order) of `num_shards`, and
  `writes`, those whose iterator state it saves (each shard is saved by one process)."""
  num_shards: int
  shards: tuple[int, ...]
  writes: tuple[int, ...]

  def train_iterator(self, make_iterator: Callable[..., Iterator], config) -> "ShardedIterator":
    """`make_iterator(config, process_index=s, process_count=S)` for each shard, combined."""
    return ShardedIterator({s: make_iterator(config, process_index=s,
                                             process_count=self.num_shards)
                            for s in self.shards}, self.num_shards, self.writes)

  def eval_batches(self, make_batches: Callable[..., list], config) -> list[dict[str, np.ndarray]]:
    """The eval batches of this process's shards, rows concatenated like the train batches, so
    the eval set too is the same for every process count."""
    per_shard = [make_batches(config, process_index=s, process_count=self.num_shards)
                 for s in self.shards]
    return [concat_rows(batches) for batches in zip(*per_shard)]


def open_data(config, mesh, data_module) -> tuple[Any, list[dict[str, np.ndarray]]]:
  """(train iterator, eval batches) for this process on `mesh`: its rows of one global stream
  where the data module reads one (`reads_global_stream`: the same batches for any process
  count, without shards), else the data shards its devices hold (`plan_for_mesh`)."""
  import jax  # pylint: disable=import-outside-toplevel
  reads_global = getattr(data_module, "reads_global_stream", None)
  if reads_global is not None and reads_global(config):
    rows = batch_rows_by_process(mesh, int(config.train.global_batch_size))[jax.process_index()]
    train_iter = data_module.make_train_iterator(config, rows=rows)
    # Every process holds the same state; one writes it into checkpoints.
    train_iter.saves_state = jax.process_index() == 0
    return train_iter, data_module.make_eval_batches(config, rows=rows)
  shard_plan = plan_for_mesh(config, mesh)
  return (shard_plan.train_iterator(data_module.make_train_iterator, config),
          shard_plan.eval_batches(data_module.make_eval_batches, config))


def plan_for_mesh(config, mesh) -> ShardPlan:
  """This process's ShardPlan for `config` on `mesh` (see `plan`)."""
  import jax  # pylint: disable=import-outside-toplevel  (the data pipeline itself needs no jax)
  batch_size = int(config.train.global_batch_size)
  return plan(int(config.data.num_shards), batch_size, batch_rows_by_process(mesh, batch_size),
              jax.process_index())


def plan(num_shards: int, batch_size: int, rows_by_process: Mapping[int, np.ndarray],
         process_index: int) -> ShardPlan:
  """The shards `process_index` loads, given the global batch rows every process's devices
  hold (`mesh.batch_rows_by_process`) and `data.num_shards` (0: one per process)."""
  processes = sorted(rows_by_process)
  if num_shards == 0:
    # One shard per process, placed wherever that process's devices are.
    expected = batch_size // len(processes)
    for p in processes:
      if len(rows_by_process[p]) != expected:
        raise ConfigError(f"data.num_shards=0: on this mesh process {p} holds "
                          f"{len(rows_by_process[p])} rows of each batch, not "
                          f"global_batch_size/processes={expected} (devices of several "
                          f"processes hold the same rows); set data.num_shards to a multiple "
                          f"of {len(processes)} that divides {batch_size}")
    return ShardPlan(len(processes), (process_index,), (process_index,))
  rows_per_shard = batch_size // num_shards
  owners: dict[int, list[int]] = {s: [] for s in range(num_shards)}
  for p in processes:
    held = np.zeros(batch_size, bool)
    held[rows_by_process[p]] = True
    per_shard = held.reshape(num_shards, rows_per_shard)
    partial = np.flatnonzero(per_shard.any(axis=1) & ~per_shard.all(axis=1))
    if partial.size:
      s = int(partial[0])
      raise ConfigError(f"data.num_shards={num_shards}: on this mesh process {p} holds only part "
                        f"of shard {s}'s rows {s * rows_per_shard}..{(s + 1) * rows_per_shard - 1}"
                        f" of each batch; use more shards (a multiple of mesh.data*mesh.fsdp "
                        f"that divides {batch_size}), so each lies within one process's devices")
    for s in np.flatnonzero(per_shard.all(axis=1)):
      owners[int(s)].append(p)
  mine = tuple(s for s in range(num_shards) if process_index in owners[s])
  writes = tuple(s for s in mine if owners[s][0] == process_index)
  return ShardPlan(num_shards, mine, writes)


def concat_rows(batches) -> dict[str, np.ndarray]:
  """Batches (dicts of [B_i, ...] arrays) joined along rows, in order."""
  batches = list(batches)
  if len(batches) == 1:
    return batches[0]
  return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


class ShardedIterator:
  """Batches of several shards' iterators, rows concatenated in shard order, with the state of
  each shard kept apart, so a checkpoint can hand any shard to any process on resume."""

  def __init__(self, iterators: Mapping[int, Iterator], num_shards: int,
               writes: tuple[int, ...] | None = None):
    self.iterators = dict(sorted(iterators.items()))
    self.num_shards = num_shards
    self.shards = tuple(self.iterators)
    self.writes = self.shards if writes is None else tuple(writes)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return concat_rows(next(it) for it in self.iterators.values())

  def shard_states(self) -> dict[int, Any]:
    """{shard: iterator state} of the shards this process saves."""
    return {s: self.iterators[s].get_state() for s in self.writes}

  def set_shard_states(self, states: Mapping[int, Any]) -> None:
    for s, state in states.items():
      self.iterators[s].set_state(state)

  def get_state(self) -> dict:
    """JSON-serializable state of every shard read here (for tests and scripts)."""
    return {"num_shards": self.num_shards,
            "shards": {str(s): it.get_state() for s, it in self.iterators.items()}}

  def set_state(self, state: dict) -> None:
    if state["num_shards"] != self.num_shards:
      raise ValueError(f"iterator state of {state['num_shards']} shards, this iterator reads "
                       f"{self.num_shards}")
    self.set_shard_states({int(s): st for s, st in state["shards"].items()
                           if int(s) in self.iterators})

  def start_prefetch(self) -> None:
    """Starts grain's background workers (data.num_workers) of every shard now."""
    for it in self.iterators.values():
      if hasattr(it, "start_prefetch"):
        it.start_prefetch()

  def close(self) -> None:
    for it in self.iterators.values():
      if hasattr(it, "close"):
        it.close()
