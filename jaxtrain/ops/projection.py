"""One projection of the model: base weight (a Param, or quantized storage) plus an optional
LoRA adapter. The model calls `project` once per projection; with a plain Param and no adapter
it is exactly the model's matmul (same ops, bitwise the same numbers)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxtrain.ops import fp8, mxfp8
from jaxtrain.ops.quantize import QuantizedWeight
from jaxtrain.ops.weight_cast import to_compute_dtype


def dense(x_BTI: jax.Array, w_IO: jax.Array, explicit_transpose_for_dw: bool = False,
          precision: str = "none") -> jax.Array:
  """x [..., I] @ w [I, ...] as one 2-D matmul over the flattened tokens.

  Same math as the einsum; the flat form gives the weight gradient a single contracting dim
  (tokens) instead of two (batch, length), which XLA:CPU runs as one GEMM rather than
  transposing first: 94 -> 136 GFLOP/s for the MLP's forward + backward on 2 cores. Leading
  dims merge without a copy, and a batch sharded over the data axes stays sharded.

  `explicit_transpose_for_dw` (set on CPU, see ModelConfig): the backward pass computes the
  weight gradient from a materialized x^T, see `_matmul_explicit_dw`. `precision="fp8"` or
  "mxfp8": the matmul and its gradients in FP8 (jaxtrain/ops/fp8.py, jaxtrain/ops/mxfp8.py), the
  result in x's dtype.
  """
  out_shape = (*x_BTI.shape[:-1], *w_IO.shape[1:])
  x_NI = x_BTI.reshape(-1, x_BTI.shape[-1])
  w_IO = w_IO.reshape(w_IO.shape[0], -1)
  if precision == "fp8":
    y_NO = fp8.matmul(x_NI, w_IO, x_NI.dtype)
  elif precision == "mxfp8":
    y_NO = mxfp8.matmul(x_NI, w_IO, x_NI.dtype)
  elif explicit_transpose_for_dw:
    y_NO = _matmul_explicit_dw(x_NI, w_IO)
  else:
    y_NO = x_NI @ w_IO
  return y_NO.reshape(out_shape)


@jax.custom_vjp
def _matmul_explicit_dw(x_NI: jax.Array, w_IO: jax.Array) -> jax.Array:
  """x @ w whose weight gradient is (x^T, materialized) @ dy.

  Autodiff gives dW = dot(x, dy) contracting the token dim of both, i.e. a GEMM with a
  transposed left operand. XLA:CPU's fast GEMM path (YNNPACK fusions) does not take that form
  and Eigen runs it at 110-130 GFLOP/s on the 2-vCPU development VM; copying x^T first (1024 x
  512 floats: microseconds) and running the plain [I, N] @ [N, O] GEMM reaches 140-150 (the
  M benchmark's gate/up/down and head shapes). The optimization barrier keeps XLA from folding
  the transpose back into the dot. Values are the same up to summation order.
  """
  return x_NI @ w_IO


def _matmul_fwd(x_NI, w_IO):
  return x_NI @ w_IO, (x_NI, w_IO)


def _matmul_bwd(residuals, dy_NO):
  x_NI, w_IO = residuals
  dx_NI = (dy_NO @ w_IO.T.astype(dy_NO.dtype)).astype(x_NI.dtype)
  dw_IO = transposed_input_matmul(x_NI, dy_NO).astype(w_IO.dtype)
  return dx_NI, dw_IO


_matmul_explicit_dw.defvjp(_matmul_fwd, _matmul_bwd)


def transposed_input_matmul(x_NI: jax.Array, dy_NO: jax.Array,
                            preferred_element_type=None) -> jax.Array:
  """x^T @ dy [I, O] with x^T copied out first (see `_matmul_explicit_dw`)."""
  x_IN = jax.lax.optimization_barrier(x_NI.T)
  return jnp.dot(x_IN, dy_NO, preferred_element_type=preferred_element_type)


def weight_value(weight, dtype) -> jax.Array:
  """A projection's base weight [*I, *O] in the compute dtype (dequantized if stored so)."""
  if isinstance(weight, QuantizedWeight):
    return weight.dequantize(dtype)
  return to_compute_dtype(weight[...], dtype)


def project(x_BTI: jax.Array, weight, adapter=None, *, dtype, dropout_key=None,
            num_in: int = 1, explicit_transpose_for_dw: bool = False,
            precision: str = "none") -> jax.Array:
  """x [B, T, prod(I)] -> [B, T, *O] through weight [*I, *O] (its first `num_in` dims are
  the input) and, when given, its LoRA adapter (dropout on the adapter's input only; the
  adapter's matmuls stay in the compute dtype whatever `precision`)."""
  w = weight_value(weight, dtype)
  out_shape = (*x_BTI.shape[:-1], *w.shape[num_in:])
  y = dense(x_BTI, w.reshape(math.prod(w.shape[:num_in]), *w.shape[num_in:]),
            explicit_transpose_for_dw, precision).reshape(out_shape)
  if adapter is not None:
    y = y + adapter(x_BTI, dtype, dropout_key).reshape(out_shape)
  return y
