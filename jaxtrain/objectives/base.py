"""What a training objective is to the rest of the trainer: one object per objective.

The train step, setup, loop, run table and dry run ask the run's objective (`get(config)`) what
its batch holds, how to sum its loss, whether it needs frozen reference weights, how many FLOPs
a step costs and which metrics it reports; none of them branches on the objective's name.
"""

from __future__ import annotations

import abc
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxtrain.config import ConfigError
from jaxtrain.models import cost
from jaxtrain.models.config import architecture_of
from jaxtrain.objectives.feeders import Feeder
from jaxtrain.objectives.forward import merge_model
from jaxtrain.parallel.mesh import batch_sharding

# (constants(params, frozen, batch), loss_sums(params, frozen, batch, constants, dropout_key)
#  -> (loss sum, count, {metric: sum})): see Objective.loss_sums.
LossSums = tuple[Callable, Callable]


class Objective(abc.ABC):
  """Shared defaults (a loss over tokens of [B, T] rows); each objective defines its batch, loss
  and data, and overrides what else differs."""

  name: str = ""
  # Metrics the step returns beside the loss, as sums over the objective's units (the loop
  # divides by the count): logged per step and, as eval_<name>, per eval.
  metric_names: tuple[str, ...] = ()
  # Whether the loss compares against frozen reference weights (a copy of the initial params
  # under full fine-tuning; the base with adapters off under LoRA).
  uses_reference: bool = False
  # What the loss is a mean over ("tokens", "pairs"): the run table's words.
  unit: str = "tokens"

  def row_length(self, seq_len: int) -> int:
    """Tokens in one row of its batches (what attention and context parallelism see)."""
    return seq_len

  def check(self, config) -> None:
    """ConfigError (one line) for settings this objective cannot train with."""
    if config.data.format == "preference":
      raise ConfigError(f"data.format='preference': preference pairs train only with "
                        f"train.objective='dpo' or 'reward', not {self.name!r}")

  def describe_row(self, seq_len: int) -> str:
    """One row of its batches in words, for config errors about lengths."""
    return f"a row of {self.row_length(seq_len)} tokens"

  @abc.abstractmethod
  def batch_shapes(self, config) -> dict[str, tuple[tuple[int, ...], Any]]:
    """{key: (global shape, dtype)} of one global batch."""

  def batch_shardings(self, config, mesh) -> dict[str, Any]:
    """{key: sharding}: every [B, ...] array of its batch split over the data-parallel axes."""
    return {k: batch_sharding(mesh, len(shape))
            for k, (shape, _) in self.batch_shapes(config).items()}

  def abstract_batch(self, config, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    shardings = self.batch_shardings(config, mesh)
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[k])
            for k, (shape, dtype) in self.batch_shapes(config).items()}

  def make_feeder(self, config, setup, workdir):
    """What the loop asks for each step's device batch and each eval
    (jaxtrain.objectives.feeders)."""
    del config, workdir
    return Feeder(setup)

  def rows_per_step(self, config) -> int:
    """Rows of one global batch (what the data-parallel axes and accumulation split)."""
    return config.train.global_batch_size

  def describe_rows(self, config) -> str:
    return f"{self.rows_per_step(config)} rows"

  def tokens_per_step(self, config) -> int:
    """Tokens one step trains on (the throughput meter's tokens)."""
    return config.train.global_batch_size * self.row_length(config.train.seq_len)

  def flops_per_step(self, config, model_config=None) -> float:
    """Analytic FLOPs of one step: 6 per parameter-matmul weight and token plus attention
    (models/cost.py: flops_per_token), over `tokens_per_step`; one definition for the meter, the run
    table and the dry run. `model_config` (a ModelConfig) defaults to the config's model."""
    arch = architecture_of(config) if model_config is None else model_config.arch
    per_token = cost.flops_per_token(arch, self.row_length(config.train.seq_len))
    return per_token * self.tokens_per_step(config)

  def flops_per_token(self, config, model_config=None) -> float:
    """`flops_per_step` per trained token: what MFU and the run table use."""
    return self.flops_per_step(config, model_config) / self.tokens_per_step(config)

  def flops_note(self) -> str:
    """What `flops_per_step` adds to 6·N per token, for the dry run's FLOPs row ('' if none)."""
    return ""

  def resident_bytes(self, config, mesh) -> int:
    """Per-device bytes of weights the run keeps on the devices beside its train state (GRPO's
    reward models), exact from their shardings over `mesh`: the dry run counts them."""
    del config, mesh
    return 0

  @abc.abstractmethod
  def loss_sums(self, graphdef, loss_chunk_size: int, *, training: bool = True) -> LossSums:
    """(`constants(params, frozen, batch)`, `loss_sums(params, frozen, batch, constants,
    dropout_key) -> (loss sum, count, {metric: sum})`). `training`: the loss that is
    differentiated (with an MoE model's router losses), else the one evals report.

    `constants` is what the loss needs but never differentiates (e.g. a reference's
    log-probs), computed outside the differentiated function. Sums are over the objective's
    units, so microbatches add up to the full batch and one division gives the mean."""

  @abc.abstractmethod
  def data_module(self):
    """The module whose `make_train_iterator(config, ...)` and `make_eval_batches(config, ...)`
    give its batches."""

  def batch_rows(self, config, model_cfg, per_device: float) -> list[tuple[str, str]] | None:
    """Run-table rows that replace the language-model batch rows (None: keep them)."""
    del config, model_cfg, per_device
    return None

  def packing_efficiency(self, first_batch) -> float | None:
    """The share of non-padding tokens in a batch, for objectives that pack documents."""
    del first_batch
    return None


def zeros_like_params(params):
  """Adapters of zero: the base alone (LoRA adds exactly 0), the reference under LoRA."""
  return jax.tree.map(jnp.zeros_like, params)


def reference_model(graphdef, params, frozen):
  """The frozen reference policy: the initial params under full fine-tuning (frozen.reference),
  the base with adapters off under LoRA."""
  if frozen is not None and frozen.reference is not None:
    return merge_model(graphdef, frozen.reference, frozen)
  return merge_model(graphdef, zeros_like_params(params), frozen)
