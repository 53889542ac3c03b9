"""The decoder block: a pre-norm residual block around the attention sublayer (grouped-query,
layers.Attention, or multi-head latent, mla.LatentAttention) and the feed-forward one (layers.MLP
or the Mixture of Experts, layers.MoE). Its own module so that both attention kinds sit below
it: mla.py builds on layers.py's weight and norm helpers."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.layers import MLP, Attention, MoE, norm
from jaxtrain.models.mla import LatentAttention


def attention_class(arch):
  """The attention sublayer's class: multi-head latent attention (models/mla.py) when the
  architecture has a kv latent, else the shared multi-head / grouped-query one."""
  return LatentAttention if arch.kv_lora_rank else Attention


class Block(nnx.Module):
  """Pre-norm residual block; with sandwich norms (Gemma 3) each sublayer's output is normed too.
  `moe`: the feed-forward block is the Mixture of Experts. Calls return (x, router statistics),
  the statistics empty for a dense block."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, sliding: bool | None = False,
               moe: bool = False):
    d = cfg.arch.d_model
    sandwich = cfg.arch.features.sandwich_norms
    self.attn_norm = norm(cfg, d)
    self.attn = attention_class(cfg.arch)(cfg, rngs, sliding)
    self.post_attn_norm = norm(cfg, d) if sandwich else None
    self.mlp_norm = norm(cfg, d)
    self.mlp = MoE(cfg, rngs) if moe else MLP(cfg, rngs)
    self.post_mlp_norm = norm(cfg, d) if sandwich else None

  def _mlp_residual(self, x_BTD, mask_BT=None, dropout_key=None, routing_BTK=None):
    """(x + the feed-forward block's output, router statistics, the chosen experts [B, T, k]);
    the statistics empty and the experts None for a dense block."""
    if isinstance(self.mlp, MoE):
      if mask_BT is None:
        mask_BT = jnp.ones(x_BTD.shape[:2], bool)
      out_BTD, stats, experts_BTK = self.mlp(self.mlp_norm(x_BTD), mask_BT, routing_BTK)
    else:
      out_BTD, stats, experts_BTK = self.mlp(self.mlp_norm(x_BTD), dropout_key), {}, None
    if self.post_mlp_norm is not None:
      out_BTD = self.post_mlp_norm(out_BTD)
    return x_BTD + out_BTD, stats, experts_BTK

  def _attn_residual(self, x_BTD, out_BTD):
    if self.post_attn_norm is not None:
      out_BTD = self.post_attn_norm(out_BTD)
    return x_BTD + out_BTD

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None, sliding=None,
               routing=None):
    """(x_BTD, statistics: an MoE block's router ones, the attention's largest logits when the
    model tracks them); `routing` [B, T, k]: an MoE block's experts to replay."""
    out_BTD, attn_stats = self.attn.with_stats(self.attn_norm(x_BTD), positions_BT,
                                               segment_ids_BT, dropout_key, sliding)
    mask_BT = None if segment_ids_BT is None else segment_ids_BT > 0  # padding: not routed
    x_BTD, stats, _ = self._mlp_residual(self._attn_residual(x_BTD, out_BTD), mask_BT,
                                         dropout_key, routing)
    return x_BTD, {**stats, **attn_stats}

  def decode(self, x_BCD, positions_BC, cache, start_B, sliding=None):
    """(x_BCD, updated cache, the chosen experts [B, C, k] or None for a dense block)."""
    out_BCD, cache = self.attn.decode(self.attn_norm(x_BCD), positions_BC, cache, start_B,
                                      sliding)
    x_BCD, _, experts_BCK = self._mlp_residual(self._attn_residual(x_BCD, out_BCD))
    return x_BCD, cache, experts_BCK
