"""Low-rank adapters: y = x @ W + (alpha / r) * ((dropout(x) @ A) @ B) on chosen projections.

Shape letters (beside model.py's): I the adapted weight's input dims (D; H·E for o; F for down),
O its output dims, R the rank. A [*I, R] starts uniform in +-1/sqrt(I) (Kaiming-uniform with
a=sqrt(5), PEFT's default, so learning rates carry over), B [R, *O] at zero: at init the model
is exactly its base. The update is two skinny matmuls; W + A @ B is formed only for export
(`delta_weight`).

A and B are float32 whatever model.param_dtype, which under LoRA is the frozen base's storage
dtype (e.g. bfloat16): they are the trained master weights, and small. They are `Adapter`
variables, a type of their own rather than nnx.LoRAParam: LoRAParam subclasses nnx.Param, so
every `nnx.Param` filter (export, optimizer masks, the plain model's checkpoint) would pick
adapters up as base weights. Their logical axes are the base weight's on the I and O dims and
`lora_rank` (replicated) on R, so they shard like the weight they adapt.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.config import BASE_QUANTIZATIONS, LORA_TARGETS
from jaxtrain.ops.projection import dense


class Adapter(nnx.Variable):
  """A LoRA factor (A or B): the only trainable variables of a LoRA model."""


class LoRA(nnx.Module):
  """The adapter of one projection weight `weight_name` [*I, *O] (a sibling attribute)."""

  def __init__(self, target: str, weight_name: str, shape, names, num_in: int, rank: int,
               alpha: float, dropout: float, param_dtype, rngs: nnx.Rngs):
    in_shape, out_shape = tuple(shape[:num_in]), tuple(shape[num_in:])
    bound = 1.0 / math.sqrt(math.prod(in_shape))
    a_IR = jax.random.uniform(rngs.params(), (*in_shape, rank), param_dtype, -bound, bound)
    self.a_IR = Adapter(a_IR, out_sharding=(*names[:num_in], "lora_rank"))
    self.b_RO = Adapter(jnp.zeros((rank, *out_shape), param_dtype),
                        out_sharding=("lora_rank", *names[num_in:]))
    self.target = target
    self.weight_name = weight_name
    self.in_shape, self.out_shape = in_shape, out_shape
    self.rank = rank
    self.scale = alpha / rank
    self.dropout = dropout

  def __call__(self, x_BTI: jax.Array, dtype, dropout_key: jax.Array | None = None):
    """The update [B, T, prod(O)] for input x [B, T, prod(I)], computed in `dtype`."""
    if dropout_key is not None and self.dropout > 0:
      # Each projection draws its own mask from the layer's key.
      key = jax.random.fold_in(dropout_key, LORA_TARGETS.index(self.target))
      x_BTI = _dropout(x_BTI, self.dropout, key)
    a_IR = self.a_IR[...].astype(dtype).reshape(-1, self.rank)
    b_RO = self.b_RO[...].astype(dtype).reshape(self.rank, -1)
    return _low_rank(x_BTI, a_IR, b_RO, self.scale)

  def delta_weight(self) -> jax.Array:
    """(alpha / r) * A @ B as [*lead, *I, *O] float32 (lead: stacked layers), for merging."""
    a, b = self.a_IR[...], self.b_RO[...]
    lead = a.shape[:a.ndim - len(self.in_shape) - 1]
    a_LIR = a.astype(jnp.float32).reshape(*lead, -1, self.rank)
    b_LRO = b.astype(jnp.float32).reshape(*lead, self.rank, -1)
    w_LIO = jnp.matmul(a_LIR, b_LRO, precision=jax.lax.Precision.HIGHEST) * self.scale
    return w_LIO.reshape(*lead, *self.in_shape, *self.out_shape)


class ExpertLoRA(nnx.Module):
  """The adapters of an MoE layer's stacked expert weight `weight_name` [X, I, O]: one LoRA per
  expert, A [X, I, R] and B [X, R, O] (initialized as LoRA's), applied to each row with its
  expert's pair by the same grouped matmul as the weight (models/moe.py)."""

  def __init__(self, target: str, weight_name: str, shape, names, rank: int, alpha: float,
               param_dtype, rngs: nnx.Rngs):
    x, i, o = shape
    bound = 1.0 / math.sqrt(i)
    a_XIR = jax.random.uniform(rngs.params(), (x, i, rank), param_dtype, -bound, bound)
    self.a_XIR = Adapter(a_XIR, out_sharding=(names[0], names[1], "lora_rank"))
    self.b_XRO = Adapter(jnp.zeros((x, rank, o), param_dtype),
                         out_sharding=(names[0], "lora_rank", names[2]))
    self.target = target
    self.weight_name = weight_name
    self.rank = rank
    self.scale = alpha / rank

  def delta_weight(self) -> jax.Array:
    """(alpha / r) * A @ B per expert as [*lead, X, I, O] float32, for merging."""
    return jnp.matmul(self.a_XIR[...].astype(jnp.float32), self.b_XRO[...].astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST) * self.scale


def expert_adapter(peft, rngs: nnx.Rngs, target: str, weight_name: str, shape,
                   names) -> ExpertLoRA | None:
  """The experts' adapters for projection `target` ("gate", "up", "down") when
  peft.lora_rank > 0 and it is a target, else None."""
  if peft.lora_rank == 0 or target not in peft.lora_targets:
    return None
  return ExpertLoRA(target, weight_name, shape, names, peft.lora_rank, peft.lora_alpha,
                    jnp.float32, rngs)


def _low_rank(x_BTI, a_IR, b_RO, scale):
  """(x @ A) @ B * scale, the second matmul with a size-1 batch dim that XLA removes.

  Why the batch dim: the `minimal` remat policies save every matmul output without batch dims
  (the projections), and the update [.., O] is as large as its projection's own output, so
  saving it would double what `minimal` keeps (4-layer D=256 QLoRA model, 2048 tokens: 270 ->
  196 MiB of temporaries for the gradient; the plain model needs 172).
  Recomputing it from the saved [.., R] costs 2RO flops per token: R/I of the projection's,
  0.4% at 8B with r=16.
  """
  h_BTR = dense(x_BTI, a_IR) * scale  # scale the skinny [.., R] side, not [.., O]
  h_1NR = h_BTR.reshape(1, -1, h_BTR.shape[-1])
  out_1NO = jax.lax.dot_general(h_1NR, b_RO[None], (((2,), (1,)), ((0,), (0,))))
  return out_1NO.reshape(*h_BTR.shape[:-1], b_RO.shape[-1])


def _dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
  """Inverted dropout: zero with probability `rate`, scale the rest by 1 / (1 - rate)."""
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def adapter(peft, rngs: nnx.Rngs, target: str, weight_name: str, shape, names,
            num_in: int = 1) -> LoRA | None:
  """The adapter for projection `target` when peft.lora_rank > 0 and it is a target, else None
  (`peft`: the model config's Adapters part)."""
  if peft.lora_rank == 0 or target not in peft.lora_targets:
    return None
  return LoRA(target, weight_name, shape, names, num_in, peft.lora_rank, peft.lora_alpha,
              peft.lora_dropout, jnp.float32, rngs)


def check_config(cfg, arch):
  """Raises ValueError for LoRA/QLoRA fields (`cfg`: a ModelConfig's Adapters part) that cannot
  build the model `arch`.

  config_checks.validate() checks the run config's `lora` group the same way; this catches a
  ModelConfig made by hand and the group size against the model's dims.
  """
  if cfg.lora_rank < 0:
    raise ValueError(f"lora.rank={cfg.lora_rank}: must be >= 0 (0: no adapters)")
  if cfg.base_quant not in BASE_QUANTIZATIONS:
    raise ValueError(f"lora.quantize_base={cfg.base_quant!r}: choose one of "
                     f"{', '.join(BASE_QUANTIZATIONS)}")
  if cfg.lora_rank == 0:
    if cfg.base_quant != "none":
      raise ValueError(f"lora.quantize_base={cfg.base_quant!r} needs lora.rank > 0: a "
                       f"quantized base is frozen and only adapters train")
    return
  unknown = [t for t in cfg.lora_targets if t not in LORA_TARGETS]
  if unknown or not cfg.lora_targets:
    raise ValueError(f"lora.targets={','.join(cfg.lora_targets)!r}: "
                     f"{'unknown ' + ', '.join(unknown) if unknown else 'empty'}; choose from "
                     f"{','.join(LORA_TARGETS)}")
  if cfg.base_quant == "none":
    return
  group = cfg.quant_group_size
  sizes = {"model.d_model": arch.d_model, "model.mlp_dim": arch.mlp_dim,
           "model.num_heads*model.head_dim": arch.num_heads * arch.head_dim}
  bad = {k: v for k, v in sizes.items() if group <= 0 or v % group}
  if group <= 0 or group % 2 or bad:
    fits = [g for g in (128, 64, 32, 16, 8) if all(v % g == 0 for v in sizes.values())]
    raise ValueError(f"lora.quant_group_size={group}: must be a positive even number dividing "
                     f"every projection's input size ({', '.join(f'{k}={v}' for k, v in sizes.items())})"
                     f"{'; e.g. ' + str(fits[0]) if fits else ''}")
