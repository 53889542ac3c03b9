"""Reward models as reward sources of GRPO and PPO's rollouts (`grpo.reward_models`).

Each entry is "PATH" or "PATH:WEIGHT" (comma-separated): a reward model's directory, as a run
of train.objective='reward' leaves it (its workdir, checkpoints/ or a step directory; a LoRA
run's adapters are merged into its base), a weights directory with config.py, or a Hugging Face
*ForSequenceClassification directory. It is loaded once, frozen, sharded over the run's mesh
like the policy, and scores every batch of rollouts on the devices in one jitted forward pass;
its weighted score is added to the reward functions' sum.

A completion is scored as the reward model was trained to score a response: the record's
prompt in the reward model's own tokenizer (`formats.prompt_ids`: BOS and raw text, or the
chat template with its generation prompt), then the completion's text, then EOS when the
completion ended with one (one cut off at grpo.max_new_tokens gets none: it is not a finished
answer). Rows are train.seq_len + EXTRA_TOKENS long (at most the reward model's positions);
a longer one keeps its start, as the reward model's training rows do (`preference.pair_rows`).

Each source, functions and models alike, is logged as reward_<name>_mean (its own value,
before the weight): a function by its function name, a model by its directory's name.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import ml_collections
import numpy as np
from flax import nnx

from jaxtrain.config import ConfigError
from jaxtrain.data import formats
from jaxtrain.data.documents import tokenizer_for
from jaxtrain.interop import run_weights
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import abstract_model
from jaxtrain.objectives.feeders import local_rows, to_global_batch
from jaxtrain.objectives.reward import loss as reward_lib
from jaxtrain.parallel.mesh import batch_sharding

# Tokens a scored row has beyond the policy's row (train.seq_len): the BOS the training row
# spends as its first input and the EOS appended to a finished completion, with room to spare.
EXTRA_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class RewardModelSpec:
  path: str
  weight: float


def parse_specs(text: str) -> list[RewardModelSpec]:
  """grpo.reward_models -> its entries; ConfigError (one line) for a weight that is no number."""
  specs = []
  for entry in (e.strip() for e in str(text).split(",")):
    if not entry:
      continue
    path, sep, weight = entry.rpartition(":")
    if not sep or "/" in weight or not path:  # no weight given (or the colon is the path's)
      specs.append(RewardModelSpec(entry, 1.0))
      continue
    try:
      value = float(weight)
    except ValueError:
      raise ConfigError(f"grpo.reward_models: {entry!r}: the weight after the last ':' is not "
                        f"a number; write PATH or PATH:WEIGHT, e.g. runs/reward_tiny:0.5"
                        ) from None
    if not np.isfinite(value):
      raise ConfigError(f"grpo.reward_models: {entry!r}: the weight must be finite")
    specs.append(RewardModelSpec(path, value))
  return specs


def source_names(fn_names: list[str], specs: list[RewardModelSpec]) -> list[str]:
  """The metric name of every reward source, functions first (reward_<name>_mean): a function's
  name ("module:function" -> function), a model's directory name (a step directory or
  checkpoints/ named by its run); letters, digits and '_' only, made unique with _2, _3..."""
  def model_name(path):
    parts = [p for p in os.path.abspath(path).split(os.sep) if p]
    while len(parts) > 1 and (parts[-1].isdigit() or parts[-1] in ("checkpoints", "state")):
      parts.pop()
    return parts[-1] if parts else "reward_model"
  raw = [n.rpartition(":")[2] for n in fn_names] + [model_name(s.path) for s in specs]
  names, seen = [], {}
  for name in raw:
    name = re.sub(r"[^A-Za-z0-9_]", "_", name) or "source"
    seen[name] = seen.get(name, 0) + 1
    names.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
  return names


def check(spec: RewardModelSpec, hf_dtype: str) -> ml_collections.ConfigDict:
  """The reward model's config, read without its weights; ConfigError (one line) when `spec`
  names no model or a model without a score head."""
  try:
    config, _ = run_weights.model_config(spec.path, hf_dtype=hf_dtype)
  except ConfigError as e:
    raise ConfigError(f"grpo.reward_models: {e}") from None
  if not (config.model.get("score_head") or config.train.objective == "reward"):
    raise ConfigError(f"grpo.reward_models: {spec.path!r} is a language model (no score head); "
                      f"give a reward model: a run of train.objective='reward', or a Hugging Face "
                      f"*ForSequenceClassification import")
  return config


def _for_scoring(config):
  """A reward model scores without gradients: nothing to rematerialize."""
  config.model.remat_policy = "none"


def weight_bytes(spec: RewardModelSpec, mesh, hf_dtype: str) -> int:
  """Per-device bytes of the reward model's weights sharded over `mesh`, exact, none read."""
  config = check(spec, hf_dtype)
  _for_scoring(config)
  with config.unlocked():
    config.lora.rank, config.lora.quantize_base = 0, "none"  # what load_model returns: merged
  _, abstract, _ = abstract_model(ModelConfig.from_config(config), mesh)
  return sum(int(np.prod(s.sharding.shard_shape(s.shape))) * np.dtype(s.dtype).itemsize
             for s in jax.tree.leaves(abstract))


class RewardModelScorer:
  """One frozen reward model on the run's mesh: this process's rollouts -> their rewards."""

  def __init__(self, spec: RewardModelSpec, mesh, *, row_length: int, hf_dtype: str):
    check(spec, hf_dtype)
    self.spec, self.mesh = spec, mesh
    model, config = run_weights.load_model(spec.path, mesh, hf_dtype=hf_dtype,
                                           adjust=_for_scoring)
    self.graphdef, self.params = nnx.split(model)
    self.tokenizer = tokenizer_for(config.data.tokenizer)
    self.vocab_size = int(model.cfg.arch.vocab_size)
    self.length = min(row_length + EXTRA_TOKENS, int(model.cfg.arch.max_position_embeddings))
    graphdef, rows = self.graphdef, batch_sharding(mesh)

    def score(params, ids_BT, mask_BT):
      return reward_lib.sequence_rewards(nnx.merge(graphdef, params), ids_BT, mask_BT)
    self._score = jax.jit(score, in_shardings=(None, rows, rows),
                          out_shardings=batch_sharding(mesh, 1))

  def rows(self, records, completions: list[str], ended_B: np.ndarray):
    """(ids [B, L], mask [B, L]) of this process's rollouts, right-padded."""
    b, n = len(records), self.length
    ids_BL = np.zeros((b, n), np.int32)
    mask_BL = np.zeros((b, n), np.int32)
    eos = self.tokenizer.eos_id
    for i, (record, completion) in enumerate(zip(records, completions)):
      pieces = [formats.prompt_ids(self.tokenizer, record), self.tokenizer.encode(completion)]
      if ended_B[i] and eos is not None:
        pieces.append([eos])
      row = np.concatenate(pieces).astype(np.int32)[:n]
      if row.size and int(row.max()) >= self.vocab_size:
        raise ConfigError(f"grpo.reward_models: {self.spec.path!r}: token id {int(row.max())} "
                          f"of its tokenizer {self.tokenizer.name} is past its vocabulary "
                          f"({self.vocab_size})")
      ids_BL[i, :len(row)], mask_BL[i, :len(row)] = row, 1
    return ids_BL, mask_BL

  def __call__(self, records, completions: list[str], ended_B: np.ndarray) -> np.ndarray:
    """float64 [B]: the reward of each of this process's rollouts (every process calls it
    together: the forward pass runs over the whole global batch)."""
    ids_BL, mask_BL = self.rows(records, completions, ended_B)
    batch = to_global_batch({"ids": ids_BL, "mask": mask_BL}, self.mesh)
    with jax.set_mesh(self.mesh):
      scores = self._score(self.params, batch["ids"], batch["mask"])
    return local_rows(scores, self.mesh).astype(np.float64)
