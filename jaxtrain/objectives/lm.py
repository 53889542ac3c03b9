"""Next-token language modelling (pre-training and SFT): the mean cross-entropy over the
loss-mask tokens of packed [B, T] rows."""

from __future__ import annotations

import jax.numpy as jnp

from jaxtrain import data
from jaxtrain.data.pipeline import BATCH_KEYS
from jaxtrain.objectives.base import Objective
from jaxtrain.objectives.forward import loss_sum_fn



class LanguageModel(Objective):
  name = "lm"

  def batch_shapes(self, config):
    b, t = config.train.global_batch_size, config.train.seq_len
    return {k: ((b, t), jnp.float32 if k == "loss_mask" else jnp.int32) for k in BATCH_KEYS}

  def loss_sums(self, graphdef, loss_chunk_size, *, training=True):
    def sums(params, frozen, batch, constants, dropout_key):
      del constants
      return loss_sum_fn(params, graphdef, batch, loss_chunk_size, frozen, dropout_key,
                         training=training)
    return (lambda params, frozen, batch: None), sums

  def data_module(self):
    return data

  def packing_efficiency(self, first_batch):
    return data.packing_stats([first_batch])["packing_efficiency"]
