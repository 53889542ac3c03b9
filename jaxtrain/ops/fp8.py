"""FP8 matmuls with per-tensor current scaling (`precision.matmul = "fp8"`).

Each operand is divided by its own scale, amax / (the format's largest finite value), so that
its largest magnitude lands on the format's largest value, cast to FP8, multiplied with float32
accumulation, and the product multiplied back by both scales:

    y = (x / s_x)_e4m3 @ (w / s_w)_e4m3 * (s_x * s_w)

The forward operands are e4m3 (3 mantissa bits, largest 448): activations and weights need the
precision. The output gradient is e5m2 (2 mantissa bits, largest 57344): gradients span a wider
range. The backward pass reuses the forward's FP8 copies:

    dx = (g / s_g)_e5m2 @ w_e4m3^T * (s_g * s_w)        dw = x_e4m3^T @ (g / s_g)_e5m2 * (s_x * s_g)

so what the step keeps between forward and backward is the FP8 copies and two scalars (a quarter
of float32's bytes, half of bfloat16's). "Current" scaling: each scale comes from the tensor at
hand, so no amax history lives in the train state. A scale is a reduction over the whole
(sharded) tensor, which the compiler turns into one scalar all-reduce. Scales stay float32 and
multiply the product in float32 (`rescale`). A stack of experts' matmuls (`batched_matmul`, and
jaxtrain/ops/grouped_matmul.py) takes one scale per expert for each operand instead of one per
tensor: one expert with large weights would otherwise set every expert's scale.

The dots are plain `dot_general`s of FP8 operands: XLA:GPU runs them as FP8 GEMMs (a Triton GEMM
fusion or cuBLASLt, its choice), the TPU compiler as f8 dots, and XLA:CPU by converting, which is
slow but exact for the products (float32 accumulation either way).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain.parallel.varying import vary_alike

E4M3 = jnp.float8_e4m3fn  # forward: activations and weights
E5M2 = jnp.float8_e5m2  # backward: the output gradient


def scale_from_amax(amax: jax.Array, dtype) -> jax.Array:
  """float32 scales s with amax / s = the largest finite value of `dtype`, elementwise (1 where
  amax is 0, an all-zero tensor or an empty group, which then casts to zeros exactly)."""
  amax = amax.astype(jnp.float32)
  return jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), jnp.float32(1))


def scale_of(x: jax.Array, dtype, axes: tuple[int, ...] | None = None) -> jax.Array:
  """float32 scale of x for `dtype`: one scalar, or with `axes` one per index of the other dims
  (the reduced dims kept as size 1, so it broadcasts against x)."""
  return scale_from_amax(jnp.max(jnp.abs(x), axis=axes, keepdims=axes is not None), dtype)


def cast(x: jax.Array, s: jax.Array, dtype) -> jax.Array:
  """x / s in `dtype`, s a float32 scale that broadcasts against x."""
  top = float(jnp.finfo(dtype).max)
  # The division can round a hair past the largest value; e4m3fn has no infinity to saturate to.
  return jnp.clip(x.astype(jnp.float32) / s, -top, top).astype(dtype)


def quantize(x: jax.Array, dtype, axes: tuple[int, ...] | None = None
             ) -> tuple[jax.Array, jax.Array]:
  """(x / s cast to `dtype`, s): the FP8 copy of x and its float32 scale (see `scale_of`)."""
  s = scale_of(x, dtype, axes)
  return cast(x, s, dtype), s


def rescale(y: jax.Array, s: jax.Array, out_dtype) -> jax.Array:
  """y * s in float32, in `out_dtype`: the scale is never rounded to the output's dtype (a
  bfloat16 scale, 8 significant bits, would move every element of the product by the same
  factor, up to 0.2%)."""
  return (y.astype(jnp.float32) * s).astype(out_dtype)


def _dot(a, b, contract: tuple[int, int], out_dtype=jnp.float32) -> jax.Array:
  """a @ b over one contracting dim of each (the GEMM accumulates in float32), in `out_dtype`."""
  return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                             preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x_NI: jax.Array, w_IO: jax.Array, out_dtype) -> jax.Array:
  """x [N, I] @ w [I, O] in FP8 (see the module docstring), returned in `out_dtype`; gradients
  in x's and w's dtypes."""
  return _forward(x_NI, w_IO, out_dtype)[0]


def _forward(x_NI, w_IO, out_dtype):
  xq_NI, s_x = quantize(x_NI, E4M3)
  wq_IO, s_w = quantize(w_IO, E4M3)
  # The product leaves the GEMM in the output dtype (a float32 product would be what the remat
  # policies save, twice bfloat16's bytes) and is scaled in float32 (`rescale`).
  y_NO = rescale(_dot(xq_NI, wq_IO, (1, 0), out_dtype), s_x * s_w, out_dtype)
  # Zero-size arrays carry the inputs' dtypes to the backward pass (residuals must be arrays).
  dtypes = (jnp.zeros((0,), x_NI.dtype), jnp.zeros((0,), w_IO.dtype))
  return y_NO, (xq_NI, s_x, wq_IO, s_w, dtypes)


def _backward(out_dtype, residuals, g_NO):
  del out_dtype
  xq_NI, s_x, wq_IO, s_w, (x_dtype, w_dtype) = residuals
  gq_NO, s_g = quantize(g_NO, E5M2)
  dx_NI = _dot(gq_NO, wq_IO, (1, 1)) * (s_g * s_w)
  dw_IO = _dot(xq_NI, gq_NO, (0, 0)) * (s_x * s_g)
  return dx_NI.astype(x_dtype.dtype), dw_IO.astype(w_dtype.dtype)


matmul.defvjp(_forward, _backward)


# The same for a stack of matmuls sharing a leading batch dim G (the experts' [G, C, D] buffers
# in capacity mode): one scale per expert for each operand (its weight, its buffer of rows, its
# output gradient), so one expert's large weights or activations leave the others' precision as
# it is; a shared scale would push a small expert's values into e4m3's subnormals (or to zero).
_BATCH = ((0,), (0,))
_PER_G = (1, 2)  # the dims each [G, ., .] scale reduces over


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _batched_matmul(x_GNI: jax.Array, w_GIO: jax.Array, out_dtype) -> jax.Array:
  return _batched_forward(x_GNI, w_GIO, out_dtype)[0]


def batched_matmul(x_GNI: jax.Array, w_GIO: jax.Array, out_dtype) -> jax.Array:
  """x [G, N, I] @ w [G, I, O] per g in FP8 (as `matmul`, with a scale per g), in `out_dtype`;
  gradients in x's and w's dtypes. Works inside shard_map (the expert-parallel layer): see
  parallel/varying.py."""
  return _batched_matmul(*vary_alike(x_GNI, w_GIO), out_dtype)


def _batched_forward(x_GNI, w_GIO, out_dtype):
  xq_GNI, s_x_G11 = quantize(x_GNI, E4M3, _PER_G)
  wq_GIO, s_w_G11 = quantize(w_GIO, E4M3, _PER_G)
  y_GNO = jax.lax.dot_general(xq_GNI, wq_GIO, (((2,), (1,)), _BATCH),
                              preferred_element_type=out_dtype)
  dtypes = (jnp.zeros((0,), x_GNI.dtype), jnp.zeros((0,), w_GIO.dtype))
  return (rescale(y_GNO, s_x_G11 * s_w_G11, out_dtype),
          (xq_GNI, s_x_G11, wq_GIO, s_w_G11, dtypes))


def _batched_backward(out_dtype, residuals, g_GNO):
  del out_dtype
  xq_GNI, s_x_G11, wq_GIO, s_w_G11, (x_dtype, w_dtype) = residuals
  gq_GNO, s_g_G11 = quantize(g_GNO, E5M2, _PER_G)
  f32 = jnp.float32
  dx_GNI = jax.lax.dot_general(gq_GNO, wq_GIO, (((2,), (2,)), _BATCH),
                               preferred_element_type=f32) * (s_g_G11 * s_w_G11)
  dw_GIO = jax.lax.dot_general(xq_GNI, gq_GNO, (((1,), (1,)), _BATCH),
                               preferred_element_type=f32) * (s_x_G11 * s_g_G11)
  return dx_GNI.astype(x_dtype.dtype), dw_GIO.astype(w_dtype.dtype)


_batched_matmul.defvjp(_batched_forward, _batched_backward)
