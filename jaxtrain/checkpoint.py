"""Orbax checkpoints of a run: train state, data-iterator state and metadata, saved async.

Layout: WORKDIR/checkpoints/<step>/{state, data, meta}. Orbax writes each checkpoint under a
temporary name and renames it when complete, so a step directory that exists is whole; the
last good checkpoint is never deleted before a newer one is committed (Orbax deletes old ones
only after a save finishes).

data/ holds the data iterator's state: `global_stream.json` for data read as one global stream
(the same on every process; process 0 writes it), else one file per data shard,
`shard_<s>-of-<S>.json` (the grain iterator state), written by one process that reads the
shard. Either way a run on another number of processes resumes the data stream exactly
(jaxtrain/data/global_stream.py, jaxtrain/data/shards.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import time
from collections.abc import Mapping
from typing import Any

from absl import logging as absl_logging
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxtrain.config import ConfigError
from jaxtrain.data.global_stream import GlobalBatchStream
from jaxtrain.data.shards import ShardedIterator
from jaxtrain.models.variables import HEAD_NAMES

GLOBAL_STREAM_FILE = "global_stream.json"


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
    # Handlers named up front so metadata (shapes) can be read before restoring.
    self.manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=("state", "data", "meta"),
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "data": DataShardsHandler(),
                       "meta": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def should_save(self, step: int, last_step: int) -> bool:
    return self.every_steps > 0 and (step % self.every_steps == 0 or step == last_step)

  def save(self, step: int, state: Any, data_iterator, meta: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=DataShardsSave(_as_sharded(data_iterator)),
        meta=ocp.args.JsonSave(meta)), force=True)

  def restore(self, step: int, abstract_state: Any, data_iterator) -> tuple[Any, dict]:
    """(state on the abstract state's shardings, meta); the data iterator is restored in
    place. Shapes that differ from the model config fail with the mismatched parameters named."""
    mismatches = shape_mismatches(self.manager.item_metadata(step)["state"], abstract_state)
    if mismatches:
      shown = [m for m in mismatches if m.startswith("params/")] or mismatches
      raise ConfigError(f"checkpoint {self.directory}/{step} does not match this model config: "
                        f"{'; '.join(shown[:6])}{' ...' if len(shown) > 6 else ''}; use the "
                        f"config it was saved with, or another --workdir")
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=DataShardsRestore(_as_sharded(data_iterator)),
        meta=ocp.args.JsonRestore()))
    return restored.state, restored.meta

  def restore_latest(self, abstract_state: Any, data_iterator) -> tuple[Any, int | None]:
    """(state, step) of the newest checkpoint that restores; (None, None) when there is none.

    A newest checkpoint with missing or truncated files is named in a warning and the one
    before it is used. A checkpoint of another model (shape mismatch) is an error instead:
    falling back would silently train from the wrong weights.
    """
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        state, _ = self.restore(step, abstract_state, data_iterator)
        return state, step
      except ConfigError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        # Kept for inspection, but out of the manager's way: this run saves that step again.
        aside = f"{self.directory}/{step}.corrupted-{int(time.time())}"
        print(f"warning: checkpoint {self.directory}/{step} is incomplete or corrupted "
              f"({type(e).__name__}: {_first_line(e)}); moved to {aside}, trying the one "
              f"before it", flush=True)
        if jax.process_index() == 0:
          os.rename(f"{self.directory}/{step}", aside)
        self.manager.reload()
    return None, None

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def _as_sharded(data_iterator) -> ShardedIterator | GlobalBatchStream:
  """A plain grain iterator is this process's one shard (data.num_shards=0)."""
  if isinstance(data_iterator, (ShardedIterator, GlobalBatchStream)):
    return data_iterator
  return ShardedIterator({jax.process_index(): data_iterator}, jax.process_count())


class DataShardsHandler:
  """Orbax CheckpointHandler for a ShardedIterator: one JSON file per data shard.

  Reads checkpoints of grain's own handler too (`process_<p>-of-<P>.json`): process p of P
  there is shard p of P here.
  """

  def save(self, directory, item=None, args=None):
    it = item or args.item
    if isinstance(it, GlobalBatchStream):
      if it.saves_state:
        (directory / GLOBAL_STREAM_FILE).write_text(json.dumps(it.get_state(), indent=1))
      return
    for shard, state in it.shard_states().items():
      (directory / _shard_file(shard, it.num_shards)).write_text(json.dumps(state, indent=1))

  def restore(self, directory, item=None, args=None):
    it = item or args.item
    if isinstance(it, GlobalBatchStream):
      path = directory / GLOBAL_STREAM_FILE
      if not path.exists():
        raise ConfigError(_not_global_message(directory))
      it.set_state(json.loads(path.read_text()))
      return it
    states = {}
    for shard in it.shards:
      for name in (_shard_file(shard, it.num_shards), f"process_{shard}-of-{it.num_shards}.json"):
        if (directory / name).exists():
          states[shard] = json.loads((directory / name).read_text())
          break
      else:
        raise ConfigError(_missing_shard_message(directory, shard, it.num_shards))
    it.set_shard_states(states)
    it.start_prefetch()
    return it

  # The rest of Orbax's CheckpointHandler protocol: nothing to report or clean up.
  def structure(self, directory):
    del directory

  def metadata(self, directory):
    del directory

  def finalize(self, directory):
    del directory

  def close(self):
    pass

  @classmethod
  def typestr(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


@ocp.args.register_with_handler(DataShardsHandler, for_save=True)
@dataclasses.dataclass
class DataShardsSave(ocp.args.CheckpointArgs):
  item: ShardedIterator


@ocp.args.register_with_handler(DataShardsHandler, for_restore=True)
@dataclasses.dataclass
class DataShardsRestore(ocp.args.CheckpointArgs):
  item: ShardedIterator


def _not_global_message(directory) -> str:
  saved = sorted(p.name for p in directory.iterdir())
  return (f"checkpoint {directory.parent}: its data state ({', '.join(saved) or 'none'}) is "
          f"per data shard, from a run with data.num_shards > 0 or from an earlier jaxtrain, "
          f"and this run reads its data as one global stream (data.num_shards=0), so the data "
          f"cannot resume exactly; resume with the run's own --config.data.num_shards, or "
          f"start a new run from its weights with --config.checkpoint.init_from="
          f"{directory.parent}")


def _shard_file(shard: int, num_shards: int) -> str:
  return f"shard_{shard}-of-{num_shards}.json"


def _missing_shard_message(directory, shard: int, num_shards: int) -> str:
  saved = sorted({int(m.group(1)) for p in directory.iterdir()
                  if (m := re.fullmatch(r"(?:shard|process)_\d+-of-(\d+)\.json", p.name))})
  if not saved:
    if (directory / GLOBAL_STREAM_FILE).exists():
      return (f"checkpoint {directory.parent}: its data was read as one global stream "
              f"(data.num_shards=0), and this run reads {num_shards} data shards "
              f"(data.num_shards={num_shards}), so the data cannot resume exactly; resume "
              f"with --config.data.num_shards=0")
    return f"checkpoint {directory}: no data-iterator state for data shard {shard}"
  was = saved[0]
  return (f"checkpoint {directory.parent}: its data stream was saved as {was} data shards, "
          f"this run reads {num_shards} (data.num_shards, 0: one per process), so the data "
          f"cannot resume exactly; run with --config.data.num_shards={was} on a process count "
          f"that divides {was}")


def save_params(directory: str, params: Any) -> str:
  """Writes `params` as a weights directory (DIRECTORY/params), the params-only format that
  `checkpoint.init_from` reads (e.g. a converted Hugging Face model). Returns the params path."""
  path = os.path.join(os.path.abspath(directory), WEIGHTS_ITEM)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, params)
    checkpointer.wait_until_finished()
  return path


def load_params(path: str, abstract_params: Any) -> tuple[Any, str]:
  """(params on the abstract params' shardings, the directory they came from).

  `path` is a weights directory (with params/), a run's checkpoint step directory (with
  state/: only its params are read, never the optimizer state), a run's checkpoints directory
  or its workdir (then the latest complete step). Shapes that differ from the model config fail
  with the mismatched parameters named. Multi-token-prediction modules the weights hold beyond
  the model's `mtp_depth` (an imported DeepSeek-V3 fine-tuned without them) are not read."""
  item, subtree = _weights_item(path)
  checkpointer = ocp.PyTreeCheckpointer()
  with _quiet_orbax():  # reading one item of a managed checkpoint: its metadata is a level up
    saved = checkpointer.metadata(item).item_metadata.tree
  saved = saved[subtree] if subtree else saved
  saved, left_out = _without_extra_prediction_modules(saved, abstract_params)
  saved, abstract_read, new_heads = _new_heads(saved, abstract_params)
  mismatches = shape_mismatches(saved, abstract_read)
  if mismatches:
    raise ConfigError(f"checkpoint.init_from={path!r}: the weights in {item} do not match this "
                      f"model config: {'; '.join(mismatches[:6])}"
                      f"{' ...' if len(mismatches) > 6 else ''}")
  target = {subtree: abstract_read} if subtree else abstract_read
  with _quiet_orbax():
    restored = checkpointer.restore(item, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=bool(subtree) or left_out or new_heads))
  restored = restored[subtree] if subtree else restored
  if new_heads:  # the read params in the model's tree, and the new heads' zeros
    read = {_path_name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(restored)}

    def fill(p, spec):
      name = _path_name(p)
      if name in read:
        return read[name]
      return jax.jit(lambda: jnp.zeros(spec.shape, spec.dtype), out_shardings=spec.sharding)()
    restored = jax.tree_util.tree_map_with_path(fill, abstract_params)
  return restored, item


def _new_heads(saved: dict, abstract_params):
  """(saved tree, params to read, whether heads start new): a reward model's score head or
  PPO's value head that the weights (a language model's) do not hold starts at zero; a reward
  model reads everything but the vocabulary head it does not have."""
  if not isinstance(saved, Mapping) or not isinstance(abstract_params, Mapping):
    return saved, abstract_params, False
  new = [k for k in NEW_HEADS if k in abstract_params and k not in saved]
  if not new:
    return saved, abstract_params, False
  saved = {k: v for k, v in saved.items() if k != "head_DV" or k in abstract_params}
  read = type(abstract_params)({k: v for k, v in abstract_params.items() if k not in new})
  return saved, read, True


def _without_extra_prediction_modules(saved: dict, abstract_params) -> tuple[dict, bool]:
  """(the saved tree without the prediction modules the model has no place for, whether any
  were left out): Decoder.mtp[k] is saved as mtp/k."""
  modules = saved.get("mtp") if isinstance(saved, dict) else None
  if not modules:
    return saved, False
  try:
    depth = len(abstract_params["mtp"])
  except (KeyError, TypeError):  # no prediction modules in the model
    depth = 0
  kept = {k: v for k, v in modules.items() if int(k) < depth}
  if len(kept) == len(modules):
    return saved, False
  trimmed = {k: v for k, v in saved.items() if k != "mtp"}
  if kept:
    trimmed["mtp"] = kept
  return trimmed, True


@contextlib.contextmanager
def _quiet_orbax():
  """Orbax warns that a step's metadata file is missing when one item of a CheckpointManager
  step is read on its own (the file sits in the step directory); the read is still complete."""
  previous = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.ERROR)
  try:
    yield
  finally:
    absl_logging.set_verbosity(previous)


WEIGHTS_ITEM = "params"
# Heads a model can have that a language model's weights lack: they start at zero.
NEW_HEADS = HEAD_NAMES


def saved_config(path: str) -> dict | None:
  """The resolved config (a dict) a run saved with the checkpoint that `load_params(path)` reads,
  or None for a weights directory (its config is the user's, e.g. its config.py)."""
  item, subtree = _weights_item(path)
  meta = os.path.join(os.path.dirname(item), "meta", "metadata")
  if not subtree or not os.path.exists(meta):
    return None
  with open(meta, encoding="utf-8") as f:
    return json.load(f)["config"]


def _weights_item(path: str) -> tuple[str, str | None]:
  """(Orbax item directory, key of the params subtree in it or None) for an init_from path."""
  path = os.path.abspath(path)
  if os.path.isdir(os.path.join(path, WEIGHTS_ITEM)):
    return os.path.join(path, WEIGHTS_ITEM), None
  if os.path.isdir(os.path.join(path, "state")):
    return os.path.join(path, "state"), "params"
  for directory in (path, os.path.join(path, "checkpoints")):
    steps = [int(n) for n in (os.listdir(directory) if os.path.isdir(directory) else [])
             if n.isdigit() and os.path.isdir(os.path.join(directory, n, "state"))]
    if steps:
      return os.path.join(directory, str(max(steps)), "state"), "params"
  raise ConfigError(f"checkpoint.init_from={path!r}: holds neither params/ (converted weights) "
                    f"nor a run's checkpoint (<step>/state); give a checkpoint step directory, a "
                    f"run's workdir, or a directory written by checkpoint.save_params")


def abstract_like(state_shapes: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying the target shardings: restore lands directly in them, on any
  mesh."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      state_shapes, shardings)


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def shape_mismatches(saved_tree: Any, abstract_state: Any) -> list[str]:
  """'path: checkpoint (shape) vs model (shape)' for every leaf that differs or is missing."""
  def shapes(tree):
    return {_path_name(p): tuple(leaf.shape)
            for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}
  saved, wanted = shapes(saved_tree), shapes(abstract_state)
  out = [f"{k}: checkpoint {saved[k]} vs model {wanted[k]}"
         for k in sorted(wanted) if k in saved and saved[k] != wanted[k]]
  out += [f"{k}: not in the checkpoint" for k in sorted(set(wanted) - set(saved))]
  out += [f"{k}: not in the model" for k in sorted(set(saved) - set(wanted))]
  return out


def _first_line(e: Exception) -> str:
  return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
