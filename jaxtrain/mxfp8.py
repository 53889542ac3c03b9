"""MXFP8 matmuls (`precision.matmul = "mxfp8"`): the OCP microscaling format Blackwell GPUs
multiply natively. Every 32 consecutive elements along a matmul's contracting dim share one
power-of-two scale (e8m0), and the elements are e4m3:

    y = sum over blocks b of (x_b / 2^e_xb)_e4m3 . (w_b / 2^e_wb)_e4m3 * 2^(e_xb + e_wb)

Each scale is the smallest power of two that brings its block's largest magnitude within e4m3's
448, so nothing saturates; a block's small values keep their precision because the block's
scale follows its own magnitude rather than the whole tensor's (the per-tensor `fp8`'s weak
spot). Gradients use e4m3 too: their range is what the block scales absorb.

Each of the three matmuls of a projection quantizes its operands along its own contracting dim
(the forward along the input features, the input gradient along the output features, the weight
gradient along the tokens), as the hardware requires, so the backward pass reads the inputs in
the compute dtype and quantizes them again. The products run through `jax.lax.scaled_dot`:
XLA's GPU compiler emits a block-scaled GEMM for Blackwell, XLA:CPU computes the same sums.

One device only, for now: JAX 0.10 cannot lower a block-scaled dot that carries any sharding,
automatic or manual (shard_map) alike ("failed to legalize operation 'mhlo.unknown'"), so a
multi-device mesh is refused before anything compiles (config_checks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

BLOCK = 32
E4M3 = jnp.float8_e4m3fn
E8M0 = jnp.float8_e8m0fnu
_E4M3_MAX = float(jnp.finfo(E4M3).max)


def quantize(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """(x in e4m3, the e8m0 scale of each 32-element block along `axis`): the scales' shape is
  x's with that dim divided by 32."""
  axis = axis % x.ndim
  size = x.shape[axis]
  if size % BLOCK:
    raise ValueError(f"mxfp8: a contracting dim of {size} is not a multiple of {BLOCK}")
  blocks = x.astype(jnp.float32).reshape(
      *x.shape[:axis], size // BLOCK, BLOCK, *x.shape[axis + 1:])
  amax = jnp.max(jnp.abs(blocks), axis=axis + 1, keepdims=True)
  # The smallest power of two s with amax / s <= 448; an all-zero block gets 1. Kept within
  # float32's normal range (2^-126 and up): XLA flushes subnormals to zero, and a zero scale
  # would divide 0 by 0.
  exponent = jnp.clip(jnp.ceil(jnp.log2(amax / _E4M3_MAX)), -126, 127)
  scale = jnp.where(amax > 0, jnp.exp2(exponent), 1.0)
  q = (blocks / scale).astype(E4M3).reshape(x.shape)
  return q, jnp.squeeze(scale, axis + 1).astype(E8M0)


def _scaled_dot(a, b, contract: tuple[int, int], out_dtype) -> jax.Array:
  """a @ b over one contracting dim of each, both quantized in blocks along it."""
  aq, a_scale = quantize(a, contract[0])
  bq, b_scale = quantize(b, contract[1])
  # scaled_dot returns bfloat16 or float32; the accumulation is float32 inside.
  wide = jnp.float32 if jnp.dtype(out_dtype) == jnp.float32 else jnp.bfloat16
  y = jax.lax.scaled_dot(aq, bq, lhs_scale=a_scale, rhs_scale=b_scale,
                         dimension_numbers=(((contract[0],), (contract[1],)), ((), ())),
                         preferred_element_type=wide)
  return y.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x_NI: jax.Array, w_IO: jax.Array, out_dtype) -> jax.Array:
  """x [N, I] @ w [I, O] in MXFP8 (see the module docstring), in `out_dtype`; gradients in x's
  and w's dtypes. N, I and O must be multiples of 32."""
  return _scaled_dot(x_NI, w_IO, (1, 0), out_dtype)


def _forward(x_NI, w_IO, out_dtype):
  return _scaled_dot(x_NI, w_IO, (1, 0), out_dtype), (x_NI, w_IO)


def _backward(out_dtype, residuals, g_NO):
  del out_dtype
  x_NI, w_IO = residuals
  dx_NI = _scaled_dot(g_NO, w_IO, (1, 1), jnp.float32)  # over O
  dw_IO = _scaled_dot(x_NI, g_NO, (0, 0), jnp.float32)  # over the tokens
  return dx_NI.astype(x_NI.dtype), dw_IO.astype(w_IO.dtype)


matmul.defvjp(_forward, _backward)

