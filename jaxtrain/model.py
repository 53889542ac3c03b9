"""Llama 3.x decoder in Flax NNX, free of parallelism code.

Every parameter names its dims with logical axes (see parallel/mesh.LOGICAL_RULES); the few
activation constraints go through `mesh.shard`, a no-op without a mesh. Layers are stacked on a
leading `layers` axis (or kept as a list) and run by `parallel/layer_stack.run_layers`: scanned or
unrolled under remat with a named policy, or as pipeline stages. The model also owns its decode
step with a KV cache (`forward_with_cache`), which generation and the GRPO rollouts call. Shape
letters: B batch, T length, D model dim, H query heads, K kv heads, E head dim, F mlp dim,
V vocab, L layers.

Fine-tuning (jaxtrain/peft): with lora_rank > 0 each targeted projection gets a LoRA adapter
(`lora_<target>` beside its weight); with base_quant != "none" the seven projection weights are
stored quantized (`QuantizedWeight` in the weight's place). Each projection is one
`peft.project` call, which is the plain matmul when neither applies.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain import attention as attention_lib
from jaxtrain.config import lora_targets as config_lora_targets, resolve_compute_dtype
from jaxtrain.parallel import context_parallel, layer_stack
from jaxtrain.parallel.mesh import platform_of_backend, shard
from jaxtrain.peft import lora as lora_lib
from jaxtrain.peft.projection import project
from jaxtrain.peft.quantize import QuantizedWeight


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  norm_eps: float = 1e-5
  rope_theta: float = 500000.0
  rope_scaling: tuple[tuple[str, Any], ...] | None = None  # llama3 fields, hashable
  max_position_embeddings: int = 8192
  tie_embeddings: bool = False
  init_std: float = 0.02
  scan_layers: bool = True
  remat_policy: str = "minimal"
  attention_impl: str = "xla"
  attention_interpret: bool = False  # pallas: run the kernels in the Pallas interpreter
  attention_blocks: tuple[int, int] = (0, 0)  # pallas: (block_q, block_k); 0 = the default
  # Under a mesh with a `context` axis > 1 (jaxtrain.parallel.context_parallel): how attention crosses
  # the split sequence, and whether the sequence is in the load-balanced layout.
  context_parallel: str = "all_gather"
  context_load_balance: bool = True
  # Under a mesh with a `stage` axis > 1 (jaxtrain.parallel.pipeline): microbatches per pass (0: as many
  # as stages) and circular repeats.
  pipeline_microbatches: int = 0
  pipeline_repeats: int = 1
  pipeline_gather_weights_once: bool = False
  param_dtype: str = "float32"
  dtype: str = "float32"
  # LoRA / QLoRA (the run config's `lora` group; rank 0 = the plain model, bit for bit).
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_dropout: float = 0.0  # on the adapters' inputs, only when a dropout key is given
  lora_targets: tuple[str, ...] = ()  # subset of config.LORA_TARGETS
  base_quant: str = "none"  # "none" | "int8" | "int4" | "nf4": storage of the frozen projections
  quant_group_size: int = 64  # input elements per quantization scale
  # Weight gradients of the projections and the head from an explicitly transposed input
  # (peft.projection.dense): faster GEMMs on XLA:CPU. from_config sets it for the CPU platform
  # only; on accelerators XLA picks operand layouts itself.
  explicit_transpose_for_dw: bool = False
  # What the model compiles for ("cpu", "gpu", "tpu"): it picks the attention kernel's route.
  # The mesh's devices decide it (train_setup.build), not the process's default backend, so a
  # CPU process compiles the GPU or TPU program for a deviceless target.
  platform: str = "cpu"

  @classmethod
  def from_config(cls, config, platform: str | None = None) -> "ModelConfig":
    """From the ml-collections run config (its `model` and `attention` groups).

    `platform` ("cpu", "gpu", "tpu"; default: this process's JAX backend) is what the model
    compiles for: it resolves `model.dtype="auto"` (bfloat16 compute on accelerators, float32 on
    CPU) and the attention kernel's route.
    """
    m = config.model
    platform = platform_of_backend(platform or jax.default_backend())
    lora = {}
    # Rank 0 maps to the default fields, so a plain run config gives the plain ModelConfig.
    if "lora" in config and config.lora.rank > 0:
      lora = dict(lora_rank=config.lora.rank, lora_alpha=float(config.lora.alpha),
                  lora_dropout=float(config.lora.dropout),
                  lora_targets=config_lora_targets(config), base_quant=config.lora.quantize_base,
                  quant_group_size=config.lora.quant_group_size)
    scaling = None
    if m.rope_scaling.type == "llama3":
      scaling = tuple(sorted((k, v) for k, v in m.rope_scaling.to_dict().items() if k != "type"))
    return cls(vocab_size=m.vocab_size, num_layers=m.num_layers, d_model=m.d_model,
               num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
               mlp_dim=m.mlp_dim, norm_eps=m.norm_eps, rope_theta=m.rope_theta,
               rope_scaling=scaling, max_position_embeddings=m.max_position_embeddings,
               tie_embeddings=m.tie_embeddings, init_std=m.init_std, scan_layers=m.scan_layers,
               remat_policy=m.remat_policy, attention_impl=config.attention.impl,
               attention_interpret=config.attention.interpret,
               attention_blocks=(config.attention.block_q, config.attention.block_k),
               context_parallel=config.attention.context_parallel,
               context_load_balance=bool(config.attention.load_balance),
               pipeline_microbatches=config.pipeline.microbatches,
               pipeline_repeats=config.pipeline.repeats,
               pipeline_gather_weights_once=config.pipeline.gather_weights_once,
               param_dtype=m.param_dtype,
               dtype=resolve_compute_dtype(m.dtype, platform),
               explicit_transpose_for_dw=platform == "cpu", platform=platform, **lora)


_QKV_NAMES = ("query_proj", "key_proj", "value_proj")
# Every weight projection's output, named with checkpoint_name: what `minimal` saves, by name.
_PROJ_NAMES = _QKV_NAMES + ("out_proj", "mlp_gate", "mlp_up", "mlp_down")
# Where offload policies move saved activations: from accelerator memory to page-locked host
# memory, which the device reads back over PCIe / the host link in the backward pass.
_SRC, _DST = "device", "pinned_host"
_TO_HOST = dict(offload_src=_SRC, offload_dst=_DST)


def _offload_all_dots(prim, *_, **__):
  """save_dots with every saved matmul output moved to host memory instead of kept on device."""
  if prim is jax.lax.dot_general_p:
    return jax.ad_checkpoint.Offloadable(src=_SRC, dst=_DST)
  return jax.ad_checkpoint.Recompute


def remat_policy(name: str, *, by_name: bool = False):
  """Named remat policies (config.REMAT_POLICIES). Returns None for `none` (no remat at all).

  full: save only each layer's input; recompute the whole layer in the backward pass.
  minimal: save the outputs of matmuls without dot_general batch dims, i.e. the weight
    projections (q/k/v/o, gate/up/down); recompute attention scores and elementwise work.
  save_dots: save every matmul output (most memory of the remat policies, least recompute).
  save_qkv_proj: save only the q/k/v projections (named with checkpoint_name), recompute the rest.
  *_offload: the same values saved, but in pinned host memory rather than device memory; the
    backward pass copies them back. Device memory of `full`, recompute of the base policy, plus
    host-link traffic (which XLA overlaps with compute where it can).

  `by_name`: the same choices made by the values' checkpoint names rather than by matmul shapes,
  for layers run under a vmap (pipeline stages), where every matmul gains a batch dim and a
  shape-based `minimal` would save nothing. There `save_dots` saves the projections too (the
  attention matmuls it adds have no names; flash kernels have none to save either way).
  """
  policies = jax.checkpoint_policies
  if by_name and name in ("minimal", "save_dots", "minimal_offload", "save_dots_offload"):
    if name.endswith("_offload"):
      return policies.save_and_offload_only_these_names(
          names_which_can_be_saved=(), names_which_can_be_offloaded=_PROJ_NAMES, **_TO_HOST)
    return policies.save_only_these_names(*_PROJ_NAMES)
  return {
      "none": None,
      "full": policies.nothing_saveable,
      "minimal": policies.dots_with_no_batch_dims_saveable,
      "save_dots": policies.dots_saveable,
      "save_qkv_proj": policies.save_only_these_names(*_QKV_NAMES),
      "minimal_offload": policies.offload_dot_with_no_batch_dims(**_TO_HOST),
      "save_dots_offload": _offload_all_dots,
      "save_qkv_proj_offload": policies.save_and_offload_only_these_names(
          names_which_can_be_saved=(), names_which_can_be_offloaded=_QKV_NAMES, **_TO_HOST),
  }[name]


def stack_options(cfg: ModelConfig) -> layer_stack.StackOptions:
  """How `cfg`'s layers run (parallel/layer_stack.py): loop, remat policy, pipeline schedule."""
  remat = cfg.remat_policy != "none"
  return layer_stack.StackOptions(
      scan_layers=cfg.scan_layers, remat=remat,
      policy=remat_policy(cfg.remat_policy) if remat else None,
      stage_policy=remat_policy(cfg.remat_policy, by_name=True) if remat else None,
      pipeline_microbatches=cfg.pipeline_microbatches, pipeline_repeats=cfg.pipeline_repeats,
      pipeline_gather_weights_once=cfg.pipeline_gather_weights_once)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
  """Inverse frequencies [E/2], with Llama 3's frequency-dependent scaling when given.

  Llama 3 leaves high frequencies (short wavelengths) alone, divides low frequencies by `factor`,
  and interpolates smoothly in between, so long contexts stretch only the slow rotations.
  """
  inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  if not scaling:
    return inv_freq.astype(np.float32)
  factor = scaling["factor"]
  low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
  old_len = scaling["original_max_position_embeddings"]
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_BTNE: jax.Array, positions_BT: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotates pairs (i, i + E/2) by position * frequency (the Hugging Face Llama layout)."""
  angles_BTF = positions_BT[..., None].astype(jnp.float32) * inv_freq
  cos_BT1F = jnp.cos(angles_BTF)[:, :, None]
  sin_BT1F = jnp.sin(angles_BTF)[:, :, None]
  x1, x2 = jnp.split(x_BTNE.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos_BT1F - x2 * sin_BT1F, x2 * cos_BT1F + x1 * sin_BT1F], axis=-1)
  return out.astype(x_BTNE.dtype)


def _param(rngs: nnx.Rngs, shape, names, std, dtype) -> nnx.Param:
  init = jax.nn.initializers.normal(stddev=std)
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names)


def _weight(cfg: ModelConfig, rngs: nnx.Rngs, shape, names, std, num_in: int = 1):
  """A projection weight [*in, *out]: a Param, or its frozen quantized storage under QLoRA."""
  w = _param(rngs, shape, names, std, jnp.dtype(cfg.param_dtype))
  if cfg.base_quant == "none":
    return w
  return QuantizedWeight(w[...], names, cfg.base_quant, cfg.quant_group_size, num_in)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, param_dtype):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=("norm",))

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    x32 = x_BTD.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x_BTD.dtype)


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, h, k, e = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)  # residual branches sum over 2L
    q = (d, h, e), ("embed", "heads", "head_dim")
    kv = (d, k, e), ("embed", "kv_heads", "head_dim")
    o = (h, e, d), ("heads", "head_dim", "embed")
    self.wq_DHE = _weight(cfg, rngs, *q, cfg.init_std)
    self.wk_DKE = _weight(cfg, rngs, *kv, cfg.init_std)
    self.wv_DKE = _weight(cfg, rngs, *kv, cfg.init_std)
    self.wo_HED = _weight(cfg, rngs, *o, out_std, num_in=2)
    # LoRA adapters: None unless lora_rank > 0 and the projection is in lora_targets.
    self.lora_q = lora_lib.adapter(cfg, rngs, "q", "wq_DHE", *q)
    self.lora_k = lora_lib.adapter(cfg, rngs, "k", "wk_DKE", *kv)
    self.lora_v = lora_lib.adapter(cfg, rngs, "v", "wv_DKE", *kv)
    self.lora_o = lora_lib.adapter(cfg, rngs, "o", "wo_HED", *o, num_in=2)
    # Static (hashable) so it stays out of the param state; inv_freq is a trace-time constant.
    self.rope = (e, cfg.rope_theta, cfg.rope_scaling)
    self.impl = cfg.attention_impl
    block_q, block_k = cfg.attention_blocks
    # A tuple, not a dict: NNX keeps static attributes in the graph definition, which must hash.
    self.attention_options = (("platform", cfg.platform), ("interpret", cfg.attention_interpret),
                              ("block_q", block_q or None), ("block_k", block_k or None),
                              ("context_parallel", cfg.context_parallel),
                              ("load_balance", cfg.context_load_balance))
    self.dtype = jnp.dtype(cfg.dtype)
    self.explicit_transpose_for_dw = cfg.explicit_transpose_for_dw

  def _qkv(self, x_BTD, positions_BT, proj, *, training: bool):
    """Queries, keys and values [B, T, heads, E], RoPE applied. `training`: with the
    activation shardings and the checkpoint names the remat policies save by."""
    q_BTHE = proj(x_BTD, self.wq_DHE, self.lora_q)
    k_BTKE = proj(x_BTD, self.wk_DKE, self.lora_k)
    v_BTKE = proj(x_BTD, self.wv_DKE, self.lora_v)
    if training:
      q_BTHE = checkpoint_name(shard(q_BTHE, ("act_batch", "act_length", "act_heads", None)),
                               "query_proj")
      k_BTKE = checkpoint_name(shard(k_BTKE, ("act_batch", "act_length", "act_kv_heads", None)),
                               "key_proj")
      v_BTKE = checkpoint_name(shard(v_BTKE, ("act_batch", "act_length", "act_kv_heads", None)),
                               "value_proj")
    head_dim, theta, scaling = self.rope
    inv_freq = rope_inv_freq(head_dim, theta, dict(scaling) if scaling else None)
    return (apply_rope(q_BTHE, positions_BT, inv_freq), apply_rope(k_BTKE, positions_BT, inv_freq),
            v_BTKE)

  def decode(self, x_BCD, positions_BC, cache_k_BSKE, cache_v_BSKE, start_B):
    """C new tokens per row with a KV cache (generation): their keys and values are written at
    [start, start + C) and each query attends over the cache up to its position. Returns the
    sublayer's output and the updated cache."""
    proj = functools.partial(project, dtype=self.dtype)
    q_BCHE, k_BCKE, v_BCKE = self._qkv(x_BCD, positions_BC, proj, training=False)
    write = jax.vmap(lambda cache, new, start: jax.lax.dynamic_update_slice(
        cache, new.astype(cache.dtype), (start, 0, 0)))
    cache_k_BSKE = write(cache_k_BSKE, k_BCKE, start_B)
    cache_v_BSKE = write(cache_v_BSKE, v_BCKE, start_B)
    out_BCHE = attention_lib.cached_attention(q_BCHE, cache_k_BSKE, cache_v_BSKE, positions_BC,
                                              self.dtype)
    b, c, h, e = out_BCHE.shape
    out_BCD = proj(out_BCHE.reshape(b, c, h * e), self.wo_HED, self.lora_o, num_in=2)
    return out_BCD, cache_k_BSKE, cache_v_BSKE

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None):
    proj = functools.partial(project, dtype=self.dtype, dropout_key=dropout_key,
                             explicit_transpose_for_dw=self.explicit_transpose_for_dw)
    q_BTHE, k_BTKE, v_BTKE = self._qkv(x_BTD, positions_BT, proj, training=True)
    out_BTHE = attention_lib.attention(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, impl=self.impl,
                                       **dict(self.attention_options))
    b, t, h, e = out_BTHE.shape
    out_BTD = proj(out_BTHE.reshape(b, t, h * e), self.wo_HED, self.lora_o, num_in=2)
    return checkpoint_name(shard(out_BTD, ("act_batch", "act_length", "act_embed")), "out_proj")


class MLP(nnx.Module):
  """SwiGLU: down(silu(x @ gate) * (x @ up))."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f = cfg.d_model, cfg.mlp_dim
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    up = (d, f), ("embed", "mlp")
    down = (f, d), ("mlp", "embed")
    self.w_gate_DF = _weight(cfg, rngs, *up, cfg.init_std)
    self.w_up_DF = _weight(cfg, rngs, *up, cfg.init_std)
    self.w_down_FD = _weight(cfg, rngs, *down, out_std)
    self.lora_gate = lora_lib.adapter(cfg, rngs, "gate", "w_gate_DF", *up)
    self.lora_up = lora_lib.adapter(cfg, rngs, "up", "w_up_DF", *up)
    self.lora_down = lora_lib.adapter(cfg, rngs, "down", "w_down_FD", *down)
    self.dtype = jnp.dtype(cfg.dtype)
    self.explicit_transpose_for_dw = cfg.explicit_transpose_for_dw

  def __call__(self, x_BTD, dropout_key=None):
    proj = functools.partial(project, dtype=self.dtype, dropout_key=dropout_key,
                             explicit_transpose_for_dw=self.explicit_transpose_for_dw)
    gate_BTF = checkpoint_name(proj(x_BTD, self.w_gate_DF, self.lora_gate), "mlp_gate")
    up_BTF = checkpoint_name(proj(x_BTD, self.w_up_DF, self.lora_up), "mlp_up")
    h_BTF = shard(jax.nn.silu(gate_BTF) * up_BTF, ("act_batch", "act_length", "act_mlp"))
    out_BTD = proj(h_BTF, self.w_down_FD, self.lora_down)
    return checkpoint_name(shard(out_BTD, ("act_batch", "act_length", "act_embed")), "mlp_down")


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    pd = jnp.dtype(cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None):
    x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), positions_BT, segment_ids_BT, dropout_key)
    return x_BTD + self.mlp(self.mlp_norm(x_BTD), dropout_key)

  def decode(self, x_BCD, positions_BC, cache_k_BSKE, cache_v_BSKE, start_B):
    out_BCD, cache_k_BSKE, cache_v_BSKE = self.attn.decode(
        self.attn_norm(x_BCD), positions_BC, cache_k_BSKE, cache_v_BSKE, start_B)
    x_BCD = x_BCD + out_BCD
    return x_BCD + self.mlp(self.mlp_norm(x_BCD)), cache_k_BSKE, cache_v_BSKE


class Llama(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    lora_lib.check_config(cfg)
    self.cfg = cfg
    pd = jnp.dtype(cfg.param_dtype)
    self.embed_VD = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                           cfg.init_std, pd)
    if cfg.scan_layers:
      @nnx.split_rngs(splits=cfg.num_layers)
      @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
      def make_stack(rngs):
        return Block(cfg, rngs)
      self.layers = make_stack(rngs)
    else:
      self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
    if not cfg.tie_embeddings:
      self.head_DV = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                            cfg.init_std, pd)

  def head_weights(self) -> jax.Array:
    """Output projection [D, V] in the compute dtype (the embedding table when tied)."""
    w_DV = self.embed_VD[...].T if self.cfg.tie_embeddings else self.head_DV[...]
    return w_DV.astype(self.cfg.dtype)

  def sequence_layout(self, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The [B, T] arrays of `batch` in the order `hidden_states` expects under the current mesh:
    unchanged, unless a `context` axis > 1 splits the sequence in the load-balanced layout
    (jaxtrain.parallel.context_parallel). Any per-token arrays (targets, loss masks) go through together,
    so per-token losses pair up as before."""
    return context_parallel.to_layout(batch, context_parallel.context_size(),
                                      self.cfg.context_load_balance)

  def hidden_states(self, tokens_BT, positions_BT=None, segment_ids_BT=None, *,
                    dropout_key=None) -> jax.Array:
    """Final-normed hidden states [B, T, D]; the loss applies the head in chunks.

    Under a mesh whose `context` axis splits the sequence, the inputs must already be in its
    layout (`sequence_layout`; positions given), and the outputs are in that layout too.

    `dropout_key`: LoRA dropout (training); None (eval, generation) runs without. Each layer
    gets its own key from it, and each adapter folds in its projection's index.
    """
    cfg = self.cfg
    b, t = tokens_BT.shape
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    # Gather the table whole (in the compute dtype) before the lookup, as FSDP does for every
    # weight: a gather from a vocab-sharded table makes XLA replicate the result instead.
    table_VD = shard(self.embed_VD[...].astype(cfg.dtype), (None, None))
    x_BTD = jnp.take(table_VD, tokens_BT, axis=0)
    x_BTD = shard(x_BTD, ("act_batch", "act_length", "act_embed"))
    layer_keys = None
    if dropout_key is not None and cfg.lora_rank > 0 and cfg.lora_dropout > 0:
      layer_keys = jax.random.split(dropout_key, cfg.num_layers)

    x_BTD = layer_stack.run_layers(self.layers, x_BTD, positions_BT, segment_ids_BT,
                                   layer_keys, stack_options(cfg))
    return self.final_norm(x_BTD)

  def empty_cache(self, batch: int, length: int) -> dict[str, jax.Array]:
    """A KV cache for `batch` rows of `length` positions: {"k", "v"}, [L, B, S, K, E] each."""
    cfg = self.cfg
    shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
    # Under a mesh (the GRPO rollouts) rows follow the batch's data-parallel split and heads the
    # tensor axis, like the activations; a no-op without one. The cache is made inside the jit
    # and carried through the decode loop, so XLA updates it in place (no copy per token).
    names = (None, "act_batch", None, "act_kv_heads", None)
    return {"k": shard(jnp.zeros(shape, cfg.dtype), names),
            "v": shard(jnp.zeros(shape, cfg.dtype), names)}

  def forward_with_cache(self, tokens_BC, start_B, cache):
    """(float32 logits [B, C, V], updated cache) for C new tokens per row at positions
    start_B + [0, C): the decode step of generation and the GRPO rollouts."""
    cfg = self.cfg
    positions_BC = start_B[:, None] + jnp.arange(tokens_BC.shape[1], dtype=jnp.int32)[None]
    x_BCD = jnp.take(self.embed_VD[...].astype(cfg.dtype), tokens_BC, axis=0)
    if cfg.scan_layers:
      @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0), out_axes=(nnx.Carry, 0, 0),
                transform_metadata={nnx.PARTITION_NAME: "layers"})
      def run_stack(x_BCD, block, cache_k, cache_v):
        return block.decode(x_BCD, positions_BC, cache_k, cache_v, start_B)

      x_BCD, new_k, new_v = run_stack(x_BCD, self.layers, cache["k"], cache["v"])
    else:
      ks, vs = [], []
      for i, block in enumerate(self.layers):
        x_BCD, k_i, v_i = block.decode(x_BCD, positions_BC, cache["k"][i], cache["v"][i],
                                       start_B)
        ks.append(k_i)
        vs.append(v_i)
      new_k, new_v = jnp.stack(ks), jnp.stack(vs)
    x_BCD = self.final_norm(x_BCD)
    logits_BCV = jnp.einsum("BCD,DV->BCV", x_BCD, self.head_weights(),
                            preferred_element_type=jnp.float32)
    return logits_BCV, {"k": new_k, "v": new_v}

  def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None, *,
               dropout_key=None) -> jax.Array:
    """Logits [B, T, V] in float32 (for generation and interop; training uses the chunked loss),
    in the order of the inputs whatever the mesh."""
    b, t = tokens_BT.shape
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    inputs = {"tokens": tokens_BT, "positions": positions_BT}
    if segment_ids_BT is not None:
      inputs["segment_ids"] = segment_ids_BT
    inputs = self.sequence_layout(inputs)
    x_BTD = self.hidden_states(inputs["tokens"], inputs["positions"], inputs.get("segment_ids"),
                               dropout_key=dropout_key)
    logits_BTV = jnp.einsum("BTD,DV->BTV", x_BTD, self.head_weights(),
                            preferred_element_type=jnp.float32)
    logits_BTV = context_parallel.from_layout(logits_BTV, context_parallel.context_size(),
                                              self.cfg.context_load_balance)
    return shard(logits_BTV, ("act_batch", "act_length", "act_vocab"))
