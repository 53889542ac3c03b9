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
the compute dtype and quantizes them again. The products are cuDNN's block-scaled GEMM on NVIDIA
GPUs and XLA:CPU's converted sums elsewhere (`_block_scaled_dot`).

Over a mesh the product is a `custom_partitioning` op (`_partition`): XLA cannot carry an HLO
scaled-dot through its partitioner, and JAX's own rule for `scaled_matmul` gathers every token
for the weight gradient. Each device quantizes exactly the 32-blocks one device would (a split
contracting dim is only kept split in whole blocks), so a mesh changes only the order of sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

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


def _block_scaled_dot(a_MK: jax.Array, b_NK: jax.Array, wide) -> jax.Array:
  """a @ b^T on one device, both quantized in blocks along their last dim K. On NVIDIA GPUs
  through `jax.nn.scaled_matmul`, a custom call XLA rewrites into cuDNN's block-scaled GEMM
  (`__cudnn$blockScaledDot`, Blackwell's MX tensor cores); elsewhere through `lax.scaled_dot`,
  which XLA:CPU computes by converting. The GPU route exists because XLA cannot carry an HLO
  scaled-dot through its partitioner (the op has no MHLO form): any multi-device GPU compile of
  `lax.scaled_dot` fails with "failed to legalize operation 'mhlo.unknown'", manual regions
  included."""
  aq, a_scale = quantize(a_MK, 1)
  bq, b_scale = quantize(b_NK, 1)

  def on_gpu(aq, bq, a_scale, b_scale):
    return jax.nn.scaled_matmul(aq[None], bq[None], a_scale[None], b_scale[None],
                                preferred_element_type=wide)[0]

  def elsewhere(aq, bq, a_scale, b_scale):
    return jax.lax.scaled_dot(aq, bq, lhs_scale=a_scale, rhs_scale=b_scale,
                              dimension_numbers=(((1,), (1,)), ((), ())),
                              preferred_element_type=wide)

  return jax.lax.platform_dependent(aq, bq, a_scale, b_scale, cuda=on_gpu, default=elsewhere)


def _wide(out_dtype):
  # The block-scaled GEMMs return bfloat16 or float32; the accumulation is float32 inside.
  return jnp.float32 if jnp.dtype(out_dtype) == jnp.float32 else jnp.bfloat16


@functools.partial(custom_partitioning, static_argnums=(2,))
def _contract(a_MK: jax.Array, b_NK: jax.Array, out_dtype) -> jax.Array:
  """a [M, K] @ b [N, K]^T in MXFP8, in `out_dtype`. Partitioned by `_partition` over a mesh."""
  return _block_scaled_dot(a_MK, b_NK, _wide(out_dtype)).astype(out_dtype)


def _axes(spec_entry) -> tuple[str, ...]:
  if spec_entry is None:
    return ()
  return (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


def _entry(axes: tuple[str, ...]):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _plan(mesh, a_shape, b_shape, a_spec, b_spec):
  """(m, n, k) mesh axes of the per-device product: K stays split only where both operands split
  it the same way and each device's share is still whole 32-blocks (the partial products are
  then summed across those axes); otherwise K is gathered. N gives up the axes M or K use."""
  m = _axes(a_spec[0]) if len(a_spec) > 0 else ()
  k = _axes(a_spec[1]) if len(a_spec) > 1 else ()
  n = _axes(b_spec[0]) if len(b_spec) > 0 else ()
  k_b = _axes(b_spec[1]) if len(b_spec) > 1 else ()
  k_size = 1
  for axis in k:
    k_size *= mesh.shape[axis]
  if k != k_b or (a_shape[1] // k_size) % BLOCK:
    k = ()
  n = tuple(axis for axis in n if axis not in m and axis not in k)
  return m, n, k


def _specs(sharding, ndim):
  spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
  return spec + (None,) * (ndim - len(spec))


def _partition(out_dtype, mesh, arg_shapes, result_shape):
  a, b = arg_shapes
  m, n, k = _plan(mesh, a.shape, b.shape, _specs(a.sharding, 2), _specs(b.sharding, 2))

  def per_device(a_MK, b_NK):
    y = _block_scaled_dot(a_MK, b_NK, _wide(out_dtype))
    if k:
      y = jax.lax.psum(y, k)
    return y.astype(out_dtype)

  def sharding(*entries):
    return NamedSharding(mesh, P(*(_entry(e) for e in entries)))

  return mesh, per_device, sharding(m, n), (sharding(m, k), sharding(n, k))


def _infer(out_dtype, mesh, arg_shapes, result_shape):
  a, b = arg_shapes
  m, n, _ = _plan(mesh, a.shape, b.shape, _specs(a.sharding, 2), _specs(b.sharding, 2))
  return NamedSharding(mesh, P(_entry(m), _entry(n)))


_contract.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                        sharding_rule="m k, n k -> m n", reduction_factors=("k",))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x_NI: jax.Array, w_IO: jax.Array, out_dtype) -> jax.Array:
  """x [N, I] @ w [I, O] in MXFP8 (see the module docstring), in `out_dtype`; gradients in x's
  and w's dtypes. N, I and O must be multiples of 32."""
  return _contract(x_NI, w_IO.T, out_dtype)


def _forward(x_NI, w_IO, out_dtype):
  return _contract(x_NI, w_IO.T, out_dtype), (x_NI, w_IO)


def _backward(out_dtype, residuals, g_NO):
  del out_dtype
  x_NI, w_IO = residuals
  dx_NI = _contract(g_NO, w_IO, x_NI.dtype)  # over O
  dw_IO = _contract(x_NI.T, g_NO.T, jnp.float32)  # over the tokens
  return dx_NI, dw_IO.astype(w_IO.dtype)


matmul.defvjp(_forward, _backward)
