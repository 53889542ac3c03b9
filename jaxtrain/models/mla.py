"""Multi-head latent attention (MLA; DeepSeek-V2/V3): keys and values from one small latent.

Per token (shape letters as in layers.py, plus R the kv latent rank, Q the query rank, N the
no-RoPE part of a query/key head, P its RoPE part, so E = N + P, U the value head dim, and the
checkpoint's merged projections' widths A = R + P and B = N + U):

  queries  x_D -> q_a [D, Q] -> RMSNorm -> q_b [Q, H, E]    (q_lora_rank 0: one [D, H, E])
  latent   x_D -> kv_a [D, A] = (c_R, the RoPE key k_P shared by every head); c_R -> RMSNorm
  keys     (c_R -> kv_b [R, H, B])[:N] beside k_P
  values   (c_R -> kv_b)[N:]      [H, U]

RoPE turns only the P dims of queries and keys, in the rotate-half layout: the checkpoint's
interleaved P columns are permuted into it on import and back on export (hf_weights), which
leaves every score unchanged. The softmax scale is E**-0.5, times YaRN's
mscale(factor, mscale_all_dim)**2 when the RoPE is YaRN with that field set.

Training expands the keys and values and runs any attention kernel (U may be smaller than E:
attention.attention handles it). Generation caches c_R and the rotated RoPE key, R + P numbers
per token instead of 2 * H * E, and attends in the latent space: q_N @ kv_b's key part folds
into the query ([B, C, H, R]) and the value part is applied after the weighted sum, so the
cache is never expanded.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.layers import norm, projection_weight
from jaxtrain.models.rope import apply_rope, rope_attention_factor, rope_inv_freq, yarn_mscale
from jaxtrain.ops import attention as attention_lib
from jaxtrain.ops.max_logit import MAX_LOGIT, max_logit_per_head
from jaxtrain.ops.projection import project, weight_value
from jaxtrain.parallel.mesh import shard
from jaxtrain.peft import lora as lora_lib


def softmax_scale(cfg: ModelConfig) -> float:
  """E**-0.5, times mscale(factor, mscale_all_dim)**2 under a YaRN RoPE that sets
  mscale_all_dim (DeepSeek-V3's long-context softmax sharpening)."""
  a = cfg.arch
  scale = a.head_dim ** -0.5
  scaling = dict(a.rope_scaling) if a.rope_scaling else None
  if scaling and scaling["type"] == "yarn" and float(scaling["mscale_all_dim"]):
    scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
  return scale


class LatentAttention(nnx.Module):
  """MLA in the place of layers.Attention, with the same calls (`__call__`, `decode`) and a
  cache of {"latent": [B, S, R], "k_rope": [B, S, P]} per layer."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, sliding=False):
    del sliding  # MLA models have no sliding window (config checks refuse one)
    a = cfg.arch
    d, h, e, p, v = a.d_model, a.num_heads, a.head_dim, a.qk_rope_head_dim, a.v_head_dim
    r, q_rank = a.kv_lora_rank, a.q_lora_rank
    out_std = a.init_std / math.sqrt(2 * a.num_layers)
    if q_rank:
      self.wq_a_DQ = projection_weight(cfg, rngs, (d, q_rank), ("embed", "latent"), a.init_std)
      self.q_a_norm = norm(cfg, q_rank)
      self.wq_b_QHE = projection_weight(cfg, rngs, (q_rank, h, e),
                                        ("q_latent", "heads", "head_dim"),
                                        a.init_std)
    else:
      self.wq_DHE = projection_weight(cfg, rngs, (d, h, e), ("embed", "heads", "head_dim"),
                                      a.init_std)
    self.wkv_a_DA = projection_weight(cfg, rngs, (d, r + p), ("embed", "latent"), a.init_std)
    self.kv_a_norm = norm(cfg, r)
    self.wkv_b_RHB = projection_weight(cfg, rngs, (r, h, e - p + v),
                                       ("kv_latent", "heads", "head_dim"),
                                       a.init_std)
    o = (h, v, d), ("heads", "head_dim", "embed")
    self.wo_HUD = projection_weight(cfg, rngs, *o, out_std, num_in=2)
    self.lora_o = lora_lib.adapter(cfg.peft, rngs, "o", "wo_HUD", *o, num_in=2)
    self.rope = (p, a.rope_theta, a.rope_scaling)
    self.sm_scale = softmax_scale(cfg)
    self.impl = cfg.runtime.attention_impl
    block_q, block_k = cfg.runtime.attention_blocks
    self.attention_options = (("platform", cfg.runtime.platform),
                              ("interpret", cfg.runtime.attention_interpret),
                              ("block_q", block_q or None), ("block_k", block_k or None),
                              ("context_parallel", cfg.parallel.context_parallel),
                              ("load_balance", cfg.parallel.context_load_balance))
    self.dtype = jnp.dtype(cfg.runtime.dtype)
    self.explicit_transpose_for_dw = cfg.runtime.explicit_transpose_for_dw
    self.precision = cfg.runtime.matmul_precision
    self.track_max_logit = cfg.runtime.track_max_logit

  def _rope(self, x_BTNP, positions_BT):
    scaling = dict(self.rope[2]) if self.rope[2] else None
    return apply_rope(x_BTNP, positions_BT, rope_inv_freq(self.rope[0], self.rope[1], scaling),
                      rope_attention_factor(scaling))

  def _queries(self, x_BTD, positions_BT, proj):
    """(q_nope [B, T, H, N], q_rope [B, T, H, P], rotated)."""
    if hasattr(self, "wq_DHE"):
      q_BTHE = proj(x_BTD, self.wq_DHE)
    else:
      q_BTHE = proj(self.q_a_norm(proj(x_BTD, self.wq_a_DQ)), self.wq_b_QHE)
    n = q_BTHE.shape[-1] - self.rope[0]
    return q_BTHE[..., :n], self._rope(q_BTHE[..., n:], positions_BT)

  def _latent(self, x_BTD, positions_BT, proj):
    """(normed latent c [B, T, R], rotated RoPE key [B, T, P])."""
    kv_BTA = proj(x_BTD, self.wkv_a_DA)
    r = kv_BTA.shape[-1] - self.rope[0]
    k_rope_BTP = self._rope(kv_BTA[:, :, None, r:], positions_BT)[:, :, 0]
    return self.kv_a_norm(kv_BTA[..., :r]), k_rope_BTP

  def _nope_dim(self) -> int:
    return self.wq_b_QHE.shape[-1] - self.rope[0] if hasattr(self, "wq_b_QHE") else (
        self.wq_DHE.shape[-1] - self.rope[0])

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None, sliding=None):
    return self.with_stats(x_BTD, positions_BT, segment_ids_BT, dropout_key, sliding)[0]

  def with_stats(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None, sliding=None):
    """(the sublayer's output, {"attn_max_logit": [H]} when the model tracks its largest
    logits (runtime.track_max_logit; ops/max_logit.py), else {})."""
    del sliding
    proj = functools.partial(project, dtype=self.dtype, precision=self.precision,
                             dropout_key=dropout_key,
                             explicit_transpose_for_dw=self.explicit_transpose_for_dw)
    q_nope_BTHN, q_rope_BTHP = self._queries(x_BTD, positions_BT, proj)
    c_BTR, k_rope_BTP = self._latent(x_BTD, positions_BT, proj)
    kv_BTHB = proj(c_BTR, self.wkv_b_RHB)
    n = self._nope_dim()
    k_nope_BTHN, v_BTHU = kv_BTHB[..., :n], kv_BTHB[..., n:]
    heads = ("act_batch", "act_length", "act_heads", None)
    q_BTHE = checkpoint_name(shard(jnp.concatenate([q_nope_BTHN, q_rope_BTHP], -1), heads),
                             "query_proj")
    k_rope_BTHP = jnp.broadcast_to(k_rope_BTP[:, :, None], q_rope_BTHP.shape)
    k_BTHE = checkpoint_name(shard(jnp.concatenate([k_nope_BTHN, k_rope_BTHP], -1), heads),
                             "key_proj")
    v_BTHU = checkpoint_name(shard(v_BTHU, heads), "value_proj")
    stats = {}
    if self.track_max_logit:
      stats[MAX_LOGIT] = max_logit_per_head(q_BTHE, k_BTHE, positions_BT, segment_ids_BT,
                                            sm_scale=self.sm_scale)
    out_BTHU = attention_lib.attention(q_BTHE, k_BTHE, v_BTHU, segment_ids_BT,
                                       sm_scale=self.sm_scale, impl=self.impl,
                                       **dict(self.attention_options))
    b, t, h, u = out_BTHU.shape
    out_BTD = proj(out_BTHU.reshape(b, t, h * u), self.wo_HUD, self.lora_o, num_in=2)
    out_BTD = checkpoint_name(shard(out_BTD, ("act_batch", "act_length", "act_embed")),
                              "out_proj")
    return out_BTD, stats

  def decode(self, x_BCD, positions_BC, cache, start_B, sliding=None):
    """C new tokens per row against the latent cache: their latents and RoPE keys are written
    at [start, start + C), and each query attends over the cache up to its position in the
    latent space. Returns the sublayer's output and the updated cache."""
    del sliding
    proj = functools.partial(project, dtype=self.dtype, precision=self.precision)
    q_nope_BCHN, q_rope_BCHP = self._queries(x_BCD, positions_BC, proj)
    c_BCR, k_rope_BCP = self._latent(x_BCD, positions_BC, proj)
    write = jax.vmap(lambda cache, new, start: jax.lax.dynamic_update_slice(
        cache, new.astype(cache.dtype), (start, 0)))
    cache = {"latent": write(cache["latent"], c_BCR, start_B),
             "k_rope": write(cache["k_rope"], k_rope_BCP, start_B)}
    w_RHB = weight_value(self.wkv_b_RHB, self.dtype)
    n = self._nope_dim()
    # q_N . (c @ kv_b)_N = (q_N @ kv_b_N^T) . c: the query moves into the latent space.
    q_lat_BCHR = jnp.einsum("BCHN,RHN->BCHR", q_nope_BCHN, w_RHB[..., :n])
    out_lat_BCHR = latent_attention(q_lat_BCHR, q_rope_BCHP, cache["latent"], cache["k_rope"],
                                    positions_BC, self.sm_scale, self.dtype)
    out_BCHU = jnp.einsum("BCHR,RHU->BCHU", out_lat_BCHR, w_RHB[..., n:])
    b, c, h, u = out_BCHU.shape
    out_BCD = proj(out_BCHU.reshape(b, c, h * u), self.wo_HUD, self.lora_o, num_in=2)
    return out_BCD, cache

  @staticmethod
  def cache_shapes(arch, batch: int, length: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """{name: (shape, logical axes)} of one layer's cache."""
    return {"latent": ((batch, length, arch.kv_lora_rank), ("act_batch", None, None)),
            "k_rope": ((batch, length, arch.qk_rope_head_dim), ("act_batch", None, None))}


def latent_attention(q_lat_BCHR, q_rope_BCHP, c_BSR, k_rope_BSP, positions_BC, sm_scale,
                     dtype) -> jax.Array:
  """The weighted sums of cached latents [B, C, H, R] for C queries per row: scores are the
  latent part plus the RoPE part, each query seeing the cache at or before its position;
  float32 scores and softmax, the sum in `dtype`."""
  s = c_BSR.shape[1]
  logits_BHCS = (jnp.einsum("BCHR,BSR->BHCS", q_lat_BCHR, c_BSR.astype(dtype),
                            preferred_element_type=jnp.float32)
                 + jnp.einsum("BCHP,BSP->BHCS", q_rope_BCHP, k_rope_BSP.astype(dtype),
                              preferred_element_type=jnp.float32)) * sm_scale
  visible_BCS = positions_BC[:, :, None] >= jnp.arange(s)[None, None, :]
  logits_BHCS = jnp.where(visible_BCS[:, None], logits_BHCS, jnp.finfo(jnp.float32).min)
  probs_BHCS = jax.nn.softmax(logits_BHCS, axis=-1).astype(dtype)
  return jnp.einsum("BHCS,BSR->BCHR", probs_BHCS, c_BSR.astype(dtype))
