"""The shared decoder layer, in Flax NNX: RMSNorm, attention, the gated MLP and the block.

Every family (models/features.py) is this layer with some switches on; each switch is read in
exactly one place below. Every parameter names its dims with logical axes (see
parallel/mesh.LOGICAL_RULES); activation constraints go through `mesh.shard`, a no-op without a
mesh. Shape letters: B batch, T length, C new tokens (decode), S cache length, D model dim,
H query heads, K kv heads, E head dim, F mlp dim (an expert's, in MoE), X experts.

Fine-tuning (jaxtrain/peft): with lora_rank > 0 each targeted projection gets a LoRA adapter
(`lora_<target>` beside its weight); with base_quant != "none" the seven projection weights are
stored quantized (`QuantizedWeight` in the weight's place). Each projection is one
`peft.project` call, which is the plain matmul when neither applies.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.models import moe as moe_lib
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.rope import apply_rope, rope_attention_factor, rope_inv_freq
from jaxtrain.models.variables import RouterBias
from jaxtrain.ops import attention as attention_lib
from jaxtrain.ops.grouped_matmul import resolve_impl
from jaxtrain.ops.max_logit import MAX_LOGIT, max_logit_per_head
from jaxtrain.ops.projection import project, weight_value
from jaxtrain.ops.quantize import QuantizedWeight
from jaxtrain.parallel.mesh import shard
from jaxtrain.peft import lora as lora_lib

_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def param(rngs: nnx.Rngs, shape, names, std, dtype, variable=nnx.Param) -> nnx.Param:
  init = jax.nn.initializers.normal(stddev=std)
  return variable(init(rngs.params(), shape, dtype), out_sharding=names)


def projection_weight(cfg: ModelConfig, rngs: nnx.Rngs, shape, names, std, num_in: int = 1,
                      in_axis: int = 0):
  """A projection weight [*in, *out] (or with its input dim at `in_axis`, as the experts'
  [X, I, O]): a Param, or its frozen quantized storage under QLoRA."""
  w = param(rngs, shape, names, std, jnp.dtype(cfg.runtime.param_dtype))
  if cfg.peft.base_quant == "none":
    return w
  return QuantizedWeight(w[...], names, cfg.peft.base_quant, cfg.peft.quant_group_size, num_in,
                         in_axis)


def _bias(cfg: ModelConfig, shape, names) -> nnx.Param:
  return nnx.Param(jnp.zeros(shape, jnp.dtype(cfg.runtime.param_dtype)), out_sharding=names)


class RMSNorm(nnx.Module):
  """x / rms(x) * w over the last dim, in float32; `plus_one`: times (1 + w), w starting at 0."""

  def __init__(self, dim: int, eps: float, param_dtype, plus_one: bool = False):
    self.eps = eps
    self.plus_one = plus_one
    init = jnp.zeros if plus_one else jnp.ones
    self.scale = nnx.Param(init((dim,), param_dtype), out_sharding=("norm",))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...].astype(jnp.float32)
    return (y * (1.0 + scale if self.plus_one else scale)).astype(x.dtype)


def norm(cfg: ModelConfig, dim: int) -> RMSNorm:
  return RMSNorm(dim, cfg.arch.norm_eps, jnp.dtype(cfg.runtime.param_dtype),
                 cfg.arch.features.norm_plus_one)


def _scaling_dict(scaling) -> dict | None:
  return dict(scaling) if scaling else None


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, sliding: bool | None = False):
    """`sliding`: whether this layer attends within the window; None: decided per call (a
    stacked layer whose type the layer loop passes in)."""
    a, features = cfg.arch, cfg.arch.features
    d, h, k, e = a.d_model, a.num_heads, a.num_kv_heads, a.head_dim
    out_std = a.init_std / math.sqrt(2 * a.num_layers)  # residual branches sum over 2L
    q = (d, h, e), ("embed", "heads", "head_dim")
    kv = (d, k, e), ("embed", "kv_heads", "head_dim")
    o = (h, e, d), ("heads", "head_dim", "embed")
    self.wq_DHE = projection_weight(cfg, rngs, *q, a.init_std)
    self.wk_DKE = projection_weight(cfg, rngs, *kv, a.init_std)
    self.wv_DKE = projection_weight(cfg, rngs, *kv, a.init_std)
    self.wo_HED = projection_weight(cfg, rngs, *o, out_std, num_in=2)
    # Qwen2.5's biases; Qwen3's and Gemma 3's per-head norms. None where the family has none.
    with_bias = features.qkv_bias
    self.bq_HE = _bias(cfg, (h, e), ("heads", "head_dim")) if with_bias else None
    self.bk_KE = _bias(cfg, (k, e), ("kv_heads", "head_dim")) if with_bias else None
    self.bv_KE = _bias(cfg, (k, e), ("kv_heads", "head_dim")) if with_bias else None
    self.q_norm = norm(cfg, e) if features.qk_norm else None
    self.k_norm = norm(cfg, e) if features.qk_norm else None
    # LoRA adapters: None unless lora_rank > 0 and the projection is in lora_targets.
    self.lora_q = lora_lib.adapter(cfg.peft, rngs, "q", "wq_DHE", *q)
    self.lora_k = lora_lib.adapter(cfg.peft, rngs, "k", "wk_DKE", *kv)
    self.lora_v = lora_lib.adapter(cfg.peft, rngs, "v", "wv_DKE", *kv)
    self.lora_o = lora_lib.adapter(cfg.peft, rngs, "o", "wo_HED", *o, num_in=2)
    # Static (hashable) so it stays out of the param state; inv_freq is a trace-time constant.
    # Sliding layers may have a RoPE of their own (Gemma 3's local base, without scaling).
    self.rope = (e, a.rope_theta, a.rope_scaling)
    self.local_rope = (e, a.local_rope_theta, None) if a.local_rope_theta else self.rope
    self.window = a.sliding_window
    self.sliding = sliding if a.sliding_window else False
    # None keeps the kernels' own head_dim ** -0.5 (bit for bit the former model).
    self.sm_scale = a.sm_scale if a.query_pre_attn_scalar else None
    self.impl = cfg.runtime.attention_impl
    block_q, block_k = cfg.runtime.attention_blocks
    # A tuple, not a dict: NNX keeps static attributes in the graph definition, which must hash.
    self.attention_options = (("platform", cfg.runtime.platform),
                              ("interpret", cfg.runtime.attention_interpret),
                              ("block_q", block_q or None), ("block_k", block_k or None),
                              ("context_parallel", cfg.parallel.context_parallel),
                              ("load_balance", cfg.parallel.context_load_balance))
    self.dtype = jnp.dtype(cfg.runtime.dtype)
    self.explicit_transpose_for_dw = cfg.runtime.explicit_transpose_for_dw
    self.precision = cfg.runtime.matmul_precision
    self.track_max_logit = cfg.runtime.track_max_logit

  def _is_sliding(self, sliding):
    """This call's layer type: the layer's own, else the one passed in (a traced bool scalar
    for stacked layers of mixed types, a Python bool for unrolled ones)."""
    return self.sliding if self.sliding is not None else sliding

  def _inv_freq(self, sliding):
    """(inverse frequencies, YaRN's attention factor) of this call's layer type."""
    scaling = _scaling_dict(self.rope[2])
    inv_global = rope_inv_freq(self.rope[0], self.rope[1], scaling)
    factor_global = rope_attention_factor(scaling)
    if self.local_rope == self.rope or sliding is False:
      return inv_global, factor_global
    inv_local = rope_inv_freq(self.local_rope[0], self.local_rope[1], None)
    if sliding is True:
      return inv_local, 1.0
    return (jnp.where(sliding, inv_local, inv_global),
            factor_global if factor_global == 1.0 else jnp.where(sliding, 1.0, factor_global))

  def _qkv(self, x_BTD, positions_BT, proj, sliding, *, training: bool):
    """Queries, keys and values [B, T, heads, E], RoPE applied. `training`: with the
    activation shardings and the checkpoint names the remat policies save by."""
    q_BTHE = proj(x_BTD, self.wq_DHE, self.lora_q)
    k_BTKE = proj(x_BTD, self.wk_DKE, self.lora_k)
    v_BTKE = proj(x_BTD, self.wv_DKE, self.lora_v)
    if self.bq_HE is not None:
      q_BTHE = q_BTHE + self.bq_HE[...].astype(q_BTHE.dtype)
      k_BTKE = k_BTKE + self.bk_KE[...].astype(k_BTKE.dtype)
      v_BTKE = v_BTKE + self.bv_KE[...].astype(v_BTKE.dtype)
    if training:
      q_BTHE = checkpoint_name(shard(q_BTHE, ("act_batch", "act_length", "act_heads", None)),
                               "query_proj")
      k_BTKE = checkpoint_name(shard(k_BTKE, ("act_batch", "act_length", "act_kv_heads", None)),
                               "key_proj")
      v_BTKE = checkpoint_name(shard(v_BTKE, ("act_batch", "act_length", "act_kv_heads", None)),
                               "value_proj")
    if self.q_norm is not None:
      q_BTHE, k_BTKE = self.q_norm(q_BTHE), self.k_norm(k_BTKE)
    inv_freq, factor = self._inv_freq(sliding)
    return (apply_rope(q_BTHE, positions_BT, inv_freq, factor),
            apply_rope(k_BTKE, positions_BT, inv_freq, factor), v_BTKE)

  def _attend(self, q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, sliding):
    attend = functools.partial(attention_lib.attention, impl=self.impl, sm_scale=self.sm_scale,
                               **dict(self.attention_options))
    if sliding is False:
      return attend(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT)
    if sliding is True:
      return attend(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, window=self.window)
    # Stacked layers of both types: one branch each, compiled once (the kernels need a static
    # window). Under pipeline stages' vmap the cond becomes a select that runs both.
    return jax.lax.cond(sliding, functools.partial(attend, window=self.window), attend,
                        q_BTHE, k_BTKE, v_BTKE, segment_ids_BT)

  def decode(self, x_BCD, positions_BC, cache, start_B, sliding=None):
    """C new tokens per row with a KV cache ({"k", "v"}: [B, S, K, E] each; generation): their
    keys and values are written at [start, start + C) and each query attends over the cache up
    to its position (and within the window on sliding layers). Returns the sublayer's output
    and the updated cache."""
    sliding = self._is_sliding(sliding)
    proj = functools.partial(project, dtype=self.dtype, precision=self.precision)
    q_BCHE, k_BCKE, v_BCKE = self._qkv(x_BCD, positions_BC, proj, sliding, training=False)
    write = jax.vmap(lambda cache, new, start: jax.lax.dynamic_update_slice(
        cache, new.astype(cache.dtype), (start, 0, 0)))
    cache = {"k": write(cache["k"], k_BCKE, start_B), "v": write(cache["v"], v_BCKE, start_B)}
    window = None
    if sliding is True:
      window = self.window
    elif sliding is not False:
      window = jnp.where(sliding, self.window, 0)  # <= 0: no window
    out_BCHE = attention_lib.cached_attention(q_BCHE, cache["k"], cache["v"], positions_BC,
                                              self.dtype, window=window, sm_scale=self.sm_scale)
    b, c, h, e = out_BCHE.shape
    out_BCD = proj(out_BCHE.reshape(b, c, h * e), self.wo_HED, self.lora_o, num_in=2)
    return out_BCD, cache

  @staticmethod
  def cache_shapes(arch, batch: int, length: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """{name: (shape, logical axes)} of one layer's cache: keys and values."""
    kv = ((batch, length, arch.num_kv_heads, arch.head_dim),
          ("act_batch", None, "act_kv_heads", None))
    return {"k": kv, "v": kv}

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None, sliding=None):
    return self.with_stats(x_BTD, positions_BT, segment_ids_BT, dropout_key, sliding)[0]

  def with_stats(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None, sliding=None):
    """(the sublayer's output, {"attn_max_logit": [H]} when the model tracks its largest
    logits (runtime.track_max_logit; ops/max_logit.py), else {})."""
    sliding = self._is_sliding(sliding)
    proj = functools.partial(project, dtype=self.dtype, precision=self.precision,
                             dropout_key=dropout_key,
                             explicit_transpose_for_dw=self.explicit_transpose_for_dw)
    q_BTHE, k_BTKE, v_BTKE = self._qkv(x_BTD, positions_BT, proj, sliding, training=True)
    stats = {}
    if self.track_max_logit:
      window = None if sliding is False else (
          self.window if sliding is True else jnp.where(sliding, self.window, 0))
      stats[MAX_LOGIT] = max_logit_per_head(q_BTHE, k_BTKE, positions_BT, segment_ids_BT,
                                            sm_scale=self.sm_scale, window=window)
    out_BTHE = self._attend(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, sliding)
    b, t, h, e = out_BTHE.shape
    out_BTD = proj(out_BTHE.reshape(b, t, h * e), self.wo_HED, self.lora_o, num_in=2)
    out_BTD = checkpoint_name(shard(out_BTD, ("act_batch", "act_length", "act_embed")),
                              "out_proj")
    return out_BTD, stats


class MLP(nnx.Module):
  """Gated MLP: down(act(x @ gate) * (x @ up)); act is silu (SwiGLU) or tanh-GELU (GeGLU).
  `mlp_dim`: its hidden size, model.mlp_dim unless given (an MoE block's shared experts)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, mlp_dim: int | None = None):
    a = cfg.arch
    d, f = a.d_model, mlp_dim or a.mlp_dim
    out_std = a.init_std / math.sqrt(2 * a.num_layers)
    up = (d, f), ("embed", "mlp")
    down = (f, d), ("mlp", "embed")
    self.w_gate_DF = projection_weight(cfg, rngs, *up, a.init_std)
    self.w_up_DF = projection_weight(cfg, rngs, *up, a.init_std)
    self.w_down_FD = projection_weight(cfg, rngs, *down, out_std)
    self.lora_gate = lora_lib.adapter(cfg.peft, rngs, "gate", "w_gate_DF", *up)
    self.lora_up = lora_lib.adapter(cfg.peft, rngs, "up", "w_up_DF", *up)
    self.lora_down = lora_lib.adapter(cfg.peft, rngs, "down", "w_down_FD", *down)
    self.activation = a.features.mlp_activation
    self.dtype = jnp.dtype(cfg.runtime.dtype)
    self.explicit_transpose_for_dw = cfg.runtime.explicit_transpose_for_dw
    self.precision = cfg.runtime.matmul_precision

  def __call__(self, x_BTD, dropout_key=None):
    proj = functools.partial(project, dtype=self.dtype, precision=self.precision,
                             dropout_key=dropout_key,
                             explicit_transpose_for_dw=self.explicit_transpose_for_dw)
    gate_BTF = checkpoint_name(proj(x_BTD, self.w_gate_DF, self.lora_gate), "mlp_gate")
    up_BTF = checkpoint_name(proj(x_BTD, self.w_up_DF, self.lora_up), "mlp_up")
    act = _ACTIVATIONS[self.activation]
    h_BTF = shard(act(gate_BTF) * up_BTF, ("act_batch", "act_length", "act_mlp"))
    out_BTD = proj(h_BTF, self.w_down_FD, self.lora_down)
    return checkpoint_name(shard(out_BTD, ("act_batch", "act_length", "act_embed")), "mlp_down")


class MoE(nnx.Module):
  """Mixture of Experts in the MLP's place (models/moe.py): a router [D, X] and X gated MLPs
  stored as [X, D, F] / [X, F, D] stacks, run by moe.moe_layer. Under LoRA each targeted
  projection of the experts gets per-expert adapters; under QLoRA the experts are stored
  quantized (groups along each expert's input dim), the router stays as it is."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    a, rt = cfg.arch, cfg.runtime
    d, f, x = a.d_model, a.expert_dim, a.num_experts
    out_std = a.init_std / math.sqrt(2 * a.num_layers)
    # The router stays in the param dtype: its logits are computed in float32.
    self.router_DX = param(rngs, (d, x), ("embed", None), a.init_std,
                           jnp.dtype(rt.param_dtype))
    # DeepSeek's correction bias: chooses experts, moved by the load balancing, not trained.
    self.router_bias_X = (RouterBias(jnp.zeros((x,), jnp.float32), out_sharding=(None,))
                          if a.router_bias else None)
    # Shared experts (DeepSeek): one gated MLP of their summed width that every token passes.
    self.shared = (MLP(cfg, rngs, a.num_shared_experts * f) if a.num_shared_experts else None)
    up, down = (x, d, f), (x, f, d)
    names = moe_lib.WEIGHT_NAMES
    self.w_gate_XDF = projection_weight(cfg, rngs, up, names["gate"], a.init_std, in_axis=1)
    self.w_up_XDF = projection_weight(cfg, rngs, up, names["up"], a.init_std, in_axis=1)
    self.w_down_XFD = projection_weight(cfg, rngs, down, names["down"], out_std, in_axis=1)
    self.lora_gate = lora_lib.expert_adapter(cfg.peft, rngs, "gate", "w_gate_XDF", up,
                                             names["gate"])
    self.lora_up = lora_lib.expert_adapter(cfg.peft, rngs, "up", "w_up_XDF", up, names["up"])
    self.lora_down = lora_lib.expert_adapter(cfg.peft, rngs, "down", "w_down_XFD", down,
                                             names["down"])
    self.routing = moe_lib.Routing(
        num_experts=x, top_k=a.experts_per_token, norm_topk_prob=a.norm_topk_prob,
        capacity_factor=rt.moe_capacity_factor, activation=a.features.mlp_activation,
        matmul_impl=resolve_impl(rt.moe_grouped_matmul, rt.platform), dtype=rt.dtype,
        lora_scale=cfg.peft.lora_alpha / cfg.peft.lora_rank if cfg.peft.lora_rank else 0.0,
        score=a.router_score, n_group=a.n_group, topk_group=a.topk_group,
        scaling_factor=a.routed_scaling_factor,
        sequence_balance=rt.moe_seq_aux_loss_coef > 0, precision=rt.matmul_precision)

  def __call__(self, x_BTD, mask_BT, routing_BTK=None):
    """(out_BTD, the layer's router statistics, the chosen experts [B, T, k]); `mask_BT`: the
    tokens routed and counted (padding, False, is not: its routed output is 0);
    `routing_BTK`: experts to replay instead of choosing them."""
    dtype = self.routing.dtype
    experts = {}
    for name, weight, lora in (("gate", self.w_gate_XDF, self.lora_gate),
                               ("up", self.w_up_XDF, self.lora_up),
                               ("down", self.w_down_XFD, self.lora_down)):
      experts[name] = weight_value(weight, dtype)
      if lora is not None:
        experts[name + "_a"] = lora.a_XIR[...].astype(dtype)
        experts[name + "_b"] = lora.b_XRO[...].astype(dtype)
    router = {"weight": self.router_DX[...]}
    if self.router_bias_X is not None:
      router["bias"] = self.router_bias_X[...]
    out_BTD, stats, experts_BTK = moe_lib.moe_layer(x_BTD, mask_BT, router, experts,
                                                    self.routing, routing_BTK)
    if self.shared is not None:
      out_BTD = out_BTD + self.shared(x_BTD)
    return checkpoint_name(shard(out_BTD, ("act_batch", "act_length", "act_embed")),
                           "mlp_down"), stats, experts_BTK
