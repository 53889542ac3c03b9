"""Weights directories: the params-only checkpoints that `checkpoint.init_from` reads and
`save_params` writes (a converted Hugging Face model), and a run's checkpoint read for its params
alone (init_from, export, generate), on local disk or a bucket. A bucket run's newest complete
step is resolved by checkpoint_mirror.read_newest_step, which reads the next one should the run's
retention remove it meanwhile.

Also the shape comparison that both this and a run's resume (jaxtrain/checkpointing/checkpointer.py)
refuse a checkpoint of another model with.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

from absl import logging as absl_logging
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxtrain import storage
from jaxtrain.checkpointing import mirror as checkpoint_mirror
from jaxtrain.config import ConfigError
from jaxtrain.models.variables import HEAD_NAMES


def save_params(directory: str, params: Any) -> str:
  """Writes `params` as a weights directory (DIRECTORY/params), the params-only format that
  `checkpoint.init_from` reads (e.g. a converted Hugging Face model). Returns the params path."""
  if checkpoint_mirror.needs_mirror(directory):  # written locally, then uploaded
    staged = storage.staging_path(directory, "save-params")
    shutil.rmtree(staged, ignore_errors=True)
    save_params(staged, params)
    if jax.process_index() == 0:
      storage.upload_dir(staged, directory)
    return storage.join(directory, WEIGHTS_ITEM)
  base = directory if storage.is_url(directory) else os.path.abspath(directory)
  path = storage.join(base, WEIGHTS_ITEM)
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
  the model's `mtp_depth` (an imported DeepSeek-V3 fine-tuned without them) are not read.
  A run's newest step that its live run's retention removes while it is read (downloaded from
  s3://, read in place on gs://) is replaced by the then newest, once, with a note."""
  return _weights_item(path, lambda item, subtree: _read_params(path, item, subtree,
                                                                abstract_params))


def _read_params(path: str, item: str, subtree: str | None,
                 abstract_params: Any) -> tuple[Any, str]:
  """load_params of the Orbax item `item` (its params under `subtree`)."""
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
  meta = storage.join(storage.parent(item), "meta", "metadata")
  if not subtree or not storage.exists(meta):
    return None
  return json.loads(storage.read_bytes(meta))["config"]


def _weights_item(path: str, use=lambda item, subtree: (item, subtree)):
  """use(Orbax item directory, key of the params subtree in it or None) for an init_from path;
  by default that pair.

  On s3:// the item's directory is downloaded into the staging directory (once per process) and
  the local copy given; gs:// is read by Orbax directly. A run's workdir or checkpoints directory
  means its newest complete step (checkpoint_mirror.newest_step, the rule of export and
  generation too), which is read again from the then newest, once, when the run's retention
  removes it while it is downloaded or used (checkpoint_mirror.read_newest_step)."""
  if not storage.is_url(path):
    path = os.path.abspath(path)
  if storage.isdir(storage.join(path, WEIGHTS_ITEM)):
    item, subtree = storage.join(path, WEIGHTS_ITEM), None
  elif storage.isdir(storage.join(path, "state")):
    item, subtree = storage.join(path, "state"), "params"
  else:
    def read(step):
      item = storage.join(path, step, "state")
      return use(_staged_copy(item) if checkpoint_mirror.needs_mirror(item) else item, "params")
    step, result = checkpoint_mirror.read_newest_step(
        path, read, discard=lambda step: _discard_staged(storage.join(path, step, "state")))
    if step is None:
      raise ConfigError(f"checkpoint.init_from={path!r}: holds neither params/ (converted "
                        f"weights) nor a run's checkpoint (<step>/state); give a checkpoint step "
                        f"directory, a run's workdir, or a directory written by "
                        f"checkpoint.save_params")
    return result
  if checkpoint_mirror.needs_mirror(item):
    item = _staged_copy(item)
  return use(item, subtree)


_STAGED: dict[str, str] = {}


def _staged_copy(item_url: str) -> str:
  """A local copy of an Orbax item on s3:// (with its step's or weights directory's other files:
  meta/, config.py), made once per process in a directory of its own, so processes that share a
  host never write one copy together."""
  if item_url not in _STAGED:
    parent = storage.parent(item_url)
    local = storage.staging_path(parent, f"read-by-process-{jax.process_index()}")
    shutil.rmtree(local, ignore_errors=True)
    storage.download_dir(parent, local)
    _STAGED[item_url] = os.path.join(local, os.path.basename(item_url))
  return _STAGED[item_url]


def _discard_staged(item_url: str) -> None:
  """Forgets (and deletes) the local copy of an item whose step was removed while it was
  downloaded: it may lack files."""
  local = _STAGED.pop(item_url, None)
  if local:
    shutil.rmtree(os.path.dirname(local), ignore_errors=True)


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def optimizer_name(state_tree: Any) -> str:
  """"muon" where the train state's optimizer state has Muon's momentum (train/muon.py's
  ScaleByMuonState), else "adamw": the two optimizers' states are different trees."""
  paths = (_path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(state_tree))
  return "muon" if any(p.startswith("opt_state/") and "/momentum/" in p for p in paths) else "adamw"


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
