"""The experts' grouped matmul: rows sorted by group, each group times its own weight.

    y_RF = grouped_matmul(x_RD, w_GDF, group_sizes_G)   # rows [s_g, s_g + n_g) use w_GDF[g]

Rows past sum(group_sizes) belong to no group and come out zero. Two routes:

- "ragged": `jax.lax.ragged_dot`. The TPU compiler lowers it to its own grouped-matmul kernel,
  which computes only the rows of each group. XLA:GPU (0.10) and XLA:CPU expand it into a dense
  product of every row with every group's weight, masked: G times the FLOPs.
- "blocked": the groups are laid out in blocks of `block_rows` rows, each block inside one group
  (a group's last block padded), and a loop runs one [block_rows, D] x [D, F] GEMM per block that
  holds rows: the FLOPs of the rows present plus at most G padded blocks, and a loop of GEMMs on
  GPU. The loop's trip count is the number of blocks in use (a traced value), so its gradient is
  written out (custom_vjp) rather than derived: the backward runs the same loop, dx and dw block
  by block.

`auto` picks "ragged" on TPU and "blocked" elsewhere (benchmarks/moe_throughput.py measures the
CPU side).

`precision="fp8"` (either route): the rows and the stacked weights are each scaled to e4m3 once
(per tensor, as jaxtrain/fp8.py does for one matmul), every GEMM multiplies FP8 operands, and
the backward quantizes the output gradient to e5m2; the FP8 copies are what the backward reads.
The ragged route's weight gradient is a ragged dot over the rows (`ragged_dot_general` with the
contracting dim ragged), one [D, F] block per group.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain import fp8
from jaxtrain.parallel.varying import vary_alike

IMPLS = ("auto", "ragged", "blocked")
BLOCK_ROWS = 128


def resolve_impl(impl: str, platform: str) -> str:
  if impl == "auto":
    return "ragged" if platform == "tpu" else "blocked"
  if impl not in IMPLS:
    raise ValueError(f"moe.grouped_matmul={impl!r}: choose one of {', '.join(IMPLS)}")
  return impl


def grouped_matmul(x_RD: jax.Array, w_GDF: jax.Array, group_sizes_G: jax.Array, *,
                   impl: str = "blocked", block_rows: int = BLOCK_ROWS,
                   precision: str = "none") -> jax.Array:
  """[R, D] rows sorted by group times their group's [D, F] weight: [R, F] in x's dtype, float32
  accumulation; rows past the groups' total are zero. `precision`: "none" or "fp8" (blocked)."""
  group_sizes_G = group_sizes_G.astype(jnp.int32)
  if precision not in ("none", "fp8"):
    raise ValueError(f"grouped_matmul precision={precision!r}: choose 'none' or 'fp8'")
  if impl == "ragged":
    # Output in x's dtype (the kernel accumulates in float32 inside): a float32 [R, F] result
    # would double the largest buffer of an expert-parallel layer.
    if precision == "fp8":
      y_RF = _ragged_fp8(*vary_alike(x_RD, w_GDF), group_sizes_G)
    else:
      y_RF = jax.lax.ragged_dot(x_RD, w_GDF, group_sizes_G, preferred_element_type=x_RD.dtype)
    in_groups_R = jnp.arange(x_RD.shape[0]) < jnp.sum(group_sizes_G)
    return jnp.where(in_groups_R[:, None], y_RF, 0)
  if impl != "blocked":
    raise ValueError(f"grouped_matmul impl={impl!r}: choose 'ragged' or 'blocked'")
  block_rows = max(8, min(block_rows, _round_up(x_RD.shape[0], 8)))
  x_RD, w_GDF = vary_alike(x_RD, w_GDF)
  return _blocked(x_RD, w_GDF, group_sizes_G, block_rows, precision == "fp8")


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _layout(group_sizes_G, rows: int, block_rows: int):
  """Where each row goes in the blocked layout, and which group each block belongs to.

  Returns (dest_R: the row's index in the padded layout, or past its end for rows in no group;
  block_group_N: each block's group; used: how many blocks hold rows; padded row count)."""
  groups = group_sizes_G.shape[0]
  # sum(ceil(n_g / b)) <= floor(R / b) + G: enough blocks for any sizes summing to <= R.
  num_blocks = rows // block_rows + groups
  ends_G = jnp.cumsum(group_sizes_G)
  starts_G = ends_G - group_sizes_G
  padded_G = -(-group_sizes_G // block_rows) * block_rows
  padded_ends_G = jnp.cumsum(padded_G)
  row_R = jnp.arange(rows, dtype=jnp.int32)
  group_R = jnp.minimum(jnp.searchsorted(ends_G, row_R, side="right"), groups - 1)
  in_groups_R = row_R < ends_G[-1]
  padded_rows = num_blocks * block_rows
  dest_R = jnp.where(in_groups_R, padded_ends_G[group_R] - padded_G[group_R] + row_R
                     - starts_G[group_R], padded_rows)
  block_starts_N = jnp.arange(num_blocks, dtype=jnp.int32) * block_rows
  block_group_N = jnp.minimum(jnp.searchsorted(padded_ends_G, block_starts_N, side="right"),
                              groups - 1)
  used = padded_ends_G[-1] // block_rows
  return dest_R, block_group_N, used, padded_rows


def _zeros(shape, dtype, *like):
  """Zeros that vary over the same manual mesh axes as `like` (inside shard_map a loop's
  carry must match its body's output, which varies wherever the operands do)."""
  # From one element of each: zeros_like(a, shape=()) of an eagerly sharded array would carry
  # its rank-N sharding over to the scalar.
  zero = sum(jnp.zeros_like(a[(0,) * a.ndim], dtype=dtype) for a in like)
  return jnp.broadcast_to(zero, shape)


def _to_blocks(a_R, dest_R, padded_rows):
  out = jnp.zeros((padded_rows,) + a_R.shape[1:], a_R.dtype)
  return out.at[dest_R].set(a_R, mode="drop", unique_indices=True)


def _from_blocks(a_P, dest_R):
  return jnp.take(a_P, dest_R, axis=0, mode="fill", fill_value=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _blocked(x_RD, w_GDF, group_sizes_G, block_rows, in_fp8):
  return _blocked_fwd(x_RD, w_GDF, group_sizes_G, block_rows, in_fp8)[0]


def _blocked_fwd(x_RD, w_GDF, group_sizes_G, block_rows, in_fp8):
  dest_R, block_group_N, used, padded_rows = _layout(group_sizes_G, x_RD.shape[0], block_rows)
  x_PD = _to_blocks(x_RD, dest_R, padded_rows)
  # Unit scales leave the operands as they are; FP8 scales each to e4m3 (rows past the groups
  # are zeros, which change no amax).
  one = jnp.ones((), jnp.float32)
  (xq_PD, s_x), (wq_GDF, s_w) = ((fp8.quantize(x_PD, fp8.E4M3), fp8.quantize(w_GDF, fp8.E4M3))
                                 if in_fp8 else ((x_PD, one), (w_GDF, one)))
  scale = (s_x * s_w).astype(x_RD.dtype)

  def body(i, y_PF):
    x_bD = jax.lax.dynamic_slice_in_dim(xq_PD, i * block_rows, block_rows)
    w_DF = wq_GDF[block_group_N[i]]
    if in_fp8:  # the product in x's dtype, scaled there (see fp8.py)
      y_bF = jnp.dot(x_bD, w_DF, preferred_element_type=y_PF.dtype) * scale
    else:
      y_bF = jnp.dot(x_bD, w_DF, preferred_element_type=jnp.float32)
    return jax.lax.dynamic_update_slice_in_dim(y_PF, y_bF.astype(y_PF.dtype), i * block_rows, 0)

  y_PF = jax.lax.fori_loop(0, used, body,
                           _zeros((padded_rows, w_GDF.shape[-1]), x_RD.dtype, x_PD, w_GDF))
  # Zero-size arrays carry the inputs' dtypes to the backward pass.
  dtypes = (jnp.zeros((0,), x_RD.dtype), jnp.zeros((0,), w_GDF.dtype))
  return _from_blocks(y_PF, dest_R), (xq_PD, s_x, wq_GDF, s_w, group_sizes_G, dtypes)


def _blocked_bwd(block_rows, in_fp8, residuals, dy_RF):
  xq_PD, s_x, wq_GDF, s_w, group_sizes_G, (x_dtype, w_dtype) = residuals
  dest_R, block_group_N, used, padded_rows = _layout(group_sizes_G, dy_RF.shape[0], block_rows)
  dy_PF = _to_blocks(dy_RF, dest_R, padded_rows)
  s_g = jnp.ones((), jnp.float32)
  if in_fp8:
    dy_PF, s_g = fp8.quantize(dy_PF, fp8.E5M2)

  def body(i, carry):
    dx_PD, dw_GDF = carry
    g = block_group_N[i]
    x_bD = jax.lax.dynamic_slice_in_dim(xq_PD, i * block_rows, block_rows)
    dy_bF = jax.lax.dynamic_slice_in_dim(dy_PF, i * block_rows, block_rows)
    dx_bD = jnp.dot(dy_bF, wq_GDF[g].T, preferred_element_type=jnp.float32) * (s_g * s_w)
    dx_PD = jax.lax.dynamic_update_slice_in_dim(dx_PD, dx_bD.astype(dx_PD.dtype),
                                                i * block_rows, 0)
    dw_DF = jnp.dot(x_bD.T, dy_bF, preferred_element_type=jnp.float32) * (s_x * s_g)
    return dx_PD, dw_GDF.at[g].add(dw_DF)

  like = (xq_PD, wq_GDF, dy_PF)
  dx_PD, dw_GDF = jax.lax.fori_loop(0, used, body, (_zeros(xq_PD.shape, x_dtype.dtype, *like),
                                                    _zeros(wq_GDF.shape, jnp.float32, *like)))
  return _from_blocks(dx_PD, dest_R), dw_GDF.astype(w_dtype.dtype), None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


@jax.custom_vjp
def _ragged_fp8(x_RD, w_GDF, group_sizes_G):
  return _ragged_fp8_fwd(x_RD, w_GDF, group_sizes_G)[0]


def _ragged_fp8_fwd(x_RD, w_GDF, group_sizes_G):
  xq_RD, s_x = fp8.quantize(x_RD, fp8.E4M3)
  wq_GDF, s_w = fp8.quantize(w_GDF, fp8.E4M3)
  y_RF = jax.lax.ragged_dot(xq_RD, wq_GDF, group_sizes_G, preferred_element_type=x_RD.dtype)
  dtypes = (jnp.zeros((0,), x_RD.dtype), jnp.zeros((0,), w_GDF.dtype))
  return (y_RF * (s_x * s_w).astype(x_RD.dtype),
          (xq_RD, s_x, wq_GDF, s_w, group_sizes_G, dtypes))


# Rows [R] contracted within each group: dw[g] = x[rows of g]^T dy[rows of g].
_ROWS_PER_GROUP = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def _ragged_fp8_bwd(residuals, dy_RF):
  xq_RD, s_x, wq_GDF, s_w, group_sizes_G, (x_dtype, w_dtype) = residuals
  gq_RF, s_g = fp8.quantize(dy_RF, fp8.E5M2)
  dx_RD = jax.lax.ragged_dot(gq_RF, jnp.swapaxes(wq_GDF, 1, 2), group_sizes_G,
                             preferred_element_type=jnp.float32) * (s_g * s_w)
  dw_GDF = jax.lax.ragged_dot_general(xq_RD, gq_RF, group_sizes_G, _ROWS_PER_GROUP,
                                      preferred_element_type=jnp.float32) * (s_x * s_g)
  return dx_RD.astype(x_dtype.dtype), dw_GDF.astype(w_dtype.dtype), None


_ragged_fp8.defvjp(_ragged_fp8_fwd, _ragged_fp8_bwd)
