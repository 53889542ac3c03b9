"""Next-token language modelling (pre-training and SFT): the mean cross-entropy over the
loss-mask tokens of packed [B, T] rows."""

from __future__ import annotations

import jax.numpy as jnp

from jaxtrain.objectives.base import Objective

# The language-model batch (see jaxtrain.train_step), [B, T] each.
BATCH_KEYS = ("inputs", "targets", "loss_mask", "segment_ids", "positions")


class LanguageModel(Objective):
  name = "lm"

  def batch_shapes(self, config):
    b, t = config.train.global_batch_size, config.train.seq_len
    return {k: ((b, t), jnp.float32 if k == "loss_mask" else jnp.int32) for k in BATCH_KEYS}

  def loss_sums(self, graphdef, loss_chunk_size, *, training=True):
    from jaxtrain.train_step import loss_sum_fn  # pylint: disable=import-outside-toplevel

    def sums(params, frozen, batch, constants, dropout_key):
      del constants
      return loss_sum_fn(params, graphdef, batch, loss_chunk_size, frozen, dropout_key,
                         training=training)
    return (lambda params, frozen, batch: None), sums

  def data_module(self):
    from jaxtrain import data  # pylint: disable=import-outside-toplevel
    return data

  def packing_efficiency(self, first_batch):
    from jaxtrain import data  # pylint: disable=import-outside-toplevel
    return data.packing_stats([first_batch])["packing_efficiency"]
