"""Multi-token prediction (DeepSeek-V3, model.mtp_depth = D > 0): D extra modules, each
predicting one token further ahead.

Module k (1..D) at position t combines the previous depth's hidden state h^{k-1}_t (h^0: the
main model's last layer output, before its final norm) with the embedding of token t + k:

  h^k_t = Block_k(eh_proj [enorm(Emb(x_{t+k})); hnorm(h^{k-1}_t)])

and post_norm(h^k_t) goes through the shared output head to predict token t + k + 1 (the
target k places after the main model's). The embedding and the head are the main model's. The
loss of depth k is the mean cross-entropy over the positions whose target lies in the same
document; the objective adds mtp_loss_weight / D times their sum (objectives/forward.py: mtp_terms).

Inputs are shifted by k within the row; the block attends causally within the row's documents
as the main layers do (a constant shift of RoPE positions changes no score). The names follow
the checkpoint's: enorm, hnorm, eh_proj, the block, and shared_head.norm (post_norm).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.block import Block
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.layers import norm, param
from jaxtrain.parallel.mesh import shard

# What the language-model objective reports per step from the modules (metrics.jsonl).
METRIC_NAMES = ("mtp_loss",)


class PredictionModule(nnx.Module):
  """One depth of multi-token prediction: two norms, the [2D, D] projection, a decoder block
  (an MoE block when the model has experts, as DeepSeek-V3's), the norm before the head."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    a = cfg.arch
    d = a.d_model
    self.enorm = norm(cfg, d)
    self.hnorm = norm(cfg, d)
    # [embedding; hidden] -> D; the input dim is whole (it is two D halves), D sharded like
    # every weight's model dim.
    self.eh_proj_CD = param(rngs, (2 * d, d), ("mtp_in", "embed"), a.init_std,
                            jnp.dtype(cfg.runtime.param_dtype))
    self.block = Block(cfg, rngs, sliding=False, moe=bool(a.num_experts))
    self.post_norm = norm(cfg, d)
    self.dtype = cfg.runtime.dtype

  def __call__(self, h_BTD, emb_BTD, positions_BT, segment_ids_BT):
    """(h^k [B, T, D] before post_norm, the block's router statistics)."""
    dtype = self.dtype
    x_BTC = jnp.concatenate([self.enorm(emb_BTD), self.hnorm(h_BTD)], axis=-1)
    x_BTD = jnp.einsum("btc,cd->btd", x_BTC.astype(dtype), self.eh_proj_CD[...].astype(dtype))
    x_BTD = shard(x_BTD, ("act_batch", "act_length", "act_embed"))
    return self.block(x_BTD, positions_BT, segment_ids_BT)


def shift_left(x_BT: jax.Array, k: int, fill=0) -> jax.Array:
  """x[:, t + k] at t, `fill` past the row's end."""
  if k == 0:
    return x_BT
  pad = jnp.full((x_BT.shape[0], k, *x_BT.shape[2:]), fill, x_BT.dtype)
  return jnp.concatenate([x_BT[:, k:], pad], axis=1)


def depth_targets(targets_BT, loss_mask_BT, segment_ids_BT, k: int):
  """(targets, loss mask) of depth k: the main model's shifted k places, kept where the target
  is in the same document as position t."""
  mask_BT = shift_left(loss_mask_BT, k, 0).astype(loss_mask_BT.dtype)
  if segment_ids_BT is not None:
    same_BT = shift_left(segment_ids_BT, k, -1) == segment_ids_BT
    mask_BT = jnp.where(same_BT, mask_BT, jnp.zeros_like(mask_BT))
  return shift_left(targets_BT, k, 0), mask_BT
