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

`precision="fp8"` (either route): each expert's weight and each group's rows are scaled to e4m3
on their own (float32 scales, one per group: [G] for the weights, [G] for the rows), every GEMM
multiplies FP8 operands, and the backward quantizes the output gradient to e5m2, again one
scale per group; the FP8 copies are what the backward reads. A scale per group rather than per
tensor (jaxtrain/ops/fp8.py's for one matmul): one expert with large weights or activations would
otherwise push the others' values into e4m3's subnormals. Both routes quantize a group's rows
alike (the blocked layout's padding rows are zeros, which change no amax). The scales multiply
the float32 block products (blocked) or the rows of the x-dtype product (ragged), in float32.
The ragged route's weight gradient is a ragged dot over the rows (`ragged_dot_general` with the
contracting dim ragged), one [D, F] block per group.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain.ops import fp8
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


def _row_groups(group_sizes_G, rows: int):
  """(group_R: each row's group, the last one for rows past the groups' total; in_groups_R)."""
  ends_G = jnp.cumsum(group_sizes_G)
  row_R = jnp.arange(rows, dtype=jnp.int32)
  group_R = jnp.minimum(jnp.searchsorted(ends_G, row_R, side="right"), group_sizes_G.shape[0] - 1)
  return group_R, row_R < ends_G[-1]


def _layout(group_sizes_G, rows: int, block_rows: int):
  """Where each row goes in the blocked layout, and which group each block belongs to.

  Returns (dest_R: the row's index in the padded layout, or past its end for rows in no group;
  block_group_N: each block's group; used: how many blocks hold rows; padded row count)."""
  groups = group_sizes_G.shape[0]
  # sum(ceil(n_g / b)) <= floor(R / b) + G: enough blocks for any sizes summing to <= R.
  num_blocks = rows // block_rows + groups
  starts_G = jnp.cumsum(group_sizes_G) - group_sizes_G
  padded_G = -(-group_sizes_G // block_rows) * block_rows
  padded_ends_G = jnp.cumsum(padded_G)
  row_R = jnp.arange(rows, dtype=jnp.int32)
  group_R, in_groups_R = _row_groups(group_sizes_G, rows)
  padded_rows = num_blocks * block_rows
  dest_R = jnp.where(in_groups_R, padded_ends_G[group_R] - padded_G[group_R] + row_R
                     - starts_G[group_R], padded_rows)
  block_starts_N = jnp.arange(num_blocks, dtype=jnp.int32) * block_rows
  block_group_N = jnp.minimum(jnp.searchsorted(padded_ends_G, block_starts_N, side="right"),
                              groups - 1)
  used = padded_ends_G[-1] // block_rows
  return dest_R, block_group_N, used, padded_rows


def _group_scales(amax_K, group_K, groups: int, dtype) -> jax.Array:
  """float32 [G]: each group's FP8 scale from the amax of its pieces (rows or blocks) and their
  groups (1 for a group with none)."""
  amax_G = jax.ops.segment_max(amax_K.astype(jnp.float32), group_K, num_segments=groups,
                               indices_are_sorted=True)  # rows and blocks come in group order
  return fp8.scale_from_amax(amax_G, dtype)


def _weight_fp8(w_GDF):
  """(w in e4m3, float32 [G] scales): one scale per expert's weight."""
  wq_GDF, s_G11 = fp8.quantize(w_GDF, fp8.E4M3, (1, 2))
  return wq_GDF, s_G11[:, 0, 0]


def _blocks_fp8(a_PD, block_group_N, groups: int, dtype):
  """(a in `dtype`, float32 [G] scales): the blocked layout's rows with one scale per group, the
  amax over the group's blocks (padding rows are zeros, which change no amax)."""
  a_NbD = a_PD.reshape(block_group_N.shape[0], -1, a_PD.shape[-1])
  s_G = _group_scales(jnp.max(jnp.abs(a_NbD), axis=(1, 2)), block_group_N, groups, dtype)
  return fp8.cast(a_NbD, s_G[block_group_N][:, None, None], dtype).reshape(a_PD.shape), s_G


def _rows_fp8(a_RD, group_R, in_groups_R, groups: int, dtype):
  """(a in `dtype`, float32 [G] scales): sorted rows with one scale per group; rows past the
  groups (whatever they hold) take no part in any amax."""
  amax_R = jnp.where(in_groups_R, jnp.max(jnp.abs(a_RD), axis=1), 0)
  s_G = _group_scales(amax_R, group_R, groups, dtype)
  return fp8.cast(a_RD, s_G[group_R][:, None], dtype), s_G


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
  groups = w_GDF.shape[0]
  dest_R, block_group_N, used, padded_rows = _layout(group_sizes_G, x_RD.shape[0], block_rows)
  x_PD = _to_blocks(x_RD, dest_R, padded_rows)
  # FP8: each group's rows and each expert's weight scaled to e4m3 on their own.
  s_x_G = s_w_G = jnp.ones((groups,), jnp.float32)
  xq_PD, wq_GDF = x_PD, w_GDF
  if in_fp8:
    xq_PD, s_x_G = _blocks_fp8(x_PD, block_group_N, groups, fp8.E4M3)
    wq_GDF, s_w_G = _weight_fp8(w_GDF)

  def body(i, y_PF):
    g = block_group_N[i]
    x_bD = jax.lax.dynamic_slice_in_dim(xq_PD, i * block_rows, block_rows)
    y_bF = jnp.dot(x_bD, wq_GDF[g], preferred_element_type=jnp.float32)
    if in_fp8:  # on the float32 block, which is small: the scale stays float32
      y_bF = y_bF * (s_x_G[g] * s_w_G[g])
    return jax.lax.dynamic_update_slice_in_dim(y_PF, y_bF.astype(y_PF.dtype), i * block_rows, 0)

  y_PF = jax.lax.fori_loop(0, used, body,
                           _zeros((padded_rows, w_GDF.shape[-1]), x_RD.dtype, x_PD, w_GDF))
  # Zero-size arrays carry the inputs' dtypes to the backward pass.
  dtypes = (jnp.zeros((0,), x_RD.dtype), jnp.zeros((0,), w_GDF.dtype))
  return _from_blocks(y_PF, dest_R), (xq_PD, s_x_G, wq_GDF, s_w_G, group_sizes_G, dtypes)


def _blocked_bwd(block_rows, in_fp8, residuals, dy_RF):
  xq_PD, s_x_G, wq_GDF, s_w_G, group_sizes_G, (x_dtype, w_dtype) = residuals
  dest_R, block_group_N, used, padded_rows = _layout(group_sizes_G, dy_RF.shape[0], block_rows)
  dy_PF = _to_blocks(dy_RF, dest_R, padded_rows)
  s_g_G = jnp.ones_like(s_x_G)
  if in_fp8:  # the output gradient in e5m2, one scale per group
    dy_PF, s_g_G = _blocks_fp8(dy_PF, block_group_N, wq_GDF.shape[0], fp8.E5M2)

  def body(i, carry):
    dx_PD, dw_GDF = carry
    g = block_group_N[i]
    x_bD = jax.lax.dynamic_slice_in_dim(xq_PD, i * block_rows, block_rows)
    dy_bF = jax.lax.dynamic_slice_in_dim(dy_PF, i * block_rows, block_rows)
    dx_bD = jnp.dot(dy_bF, wq_GDF[g].T, preferred_element_type=jnp.float32)
    dw_DF = jnp.dot(x_bD.T, dy_bF, preferred_element_type=jnp.float32)
    if in_fp8:
      dx_bD, dw_DF = dx_bD * (s_g_G[g] * s_w_G[g]), dw_DF * (s_x_G[g] * s_g_G[g])
    dx_PD = jax.lax.dynamic_update_slice_in_dim(dx_PD, dx_bD.astype(dx_PD.dtype),
                                                i * block_rows, 0)
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
  groups = w_GDF.shape[0]
  group_R, in_groups_R = _row_groups(group_sizes_G, x_RD.shape[0])
  xq_RD, s_x_G = _rows_fp8(x_RD, group_R, in_groups_R, groups, fp8.E4M3)
  wq_GDF, s_w_G = _weight_fp8(w_GDF)
  # The product in x's dtype (see grouped_matmul), each row scaled by its group's scales in
  # float32.
  y_RF = jax.lax.ragged_dot(xq_RD, wq_GDF, group_sizes_G, preferred_element_type=x_RD.dtype)
  dtypes = (jnp.zeros((0,), x_RD.dtype), jnp.zeros((0,), w_GDF.dtype))
  return (fp8.rescale(y_RF, (s_x_G * s_w_G)[group_R][:, None], x_RD.dtype),
          (xq_RD, s_x_G, wq_GDF, s_w_G, group_sizes_G, dtypes))


# Rows [R] contracted within each group: dw[g] = x[rows of g]^T dy[rows of g].
_ROWS_PER_GROUP = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def _ragged_fp8_bwd(residuals, dy_RF):
  xq_RD, s_x_G, wq_GDF, s_w_G, group_sizes_G, (x_dtype, w_dtype) = residuals
  group_R, in_groups_R = _row_groups(group_sizes_G, dy_RF.shape[0])
  gq_RF, s_g_G = _rows_fp8(dy_RF, group_R, in_groups_R, wq_GDF.shape[0], fp8.E5M2)
  dx_RD = jax.lax.ragged_dot(gq_RF, jnp.swapaxes(wq_GDF, 1, 2), group_sizes_G,
                             preferred_element_type=jnp.float32)
  dx_RD = dx_RD * (s_g_G * s_w_G)[group_R][:, None]
  dw_GDF = jax.lax.ragged_dot_general(xq_RD, gq_RF, group_sizes_G, _ROWS_PER_GROUP,
                                      preferred_element_type=jnp.float32)
  dw_GDF = dw_GDF * (s_x_G * s_g_G)[:, None, None]
  return dx_RD.astype(x_dtype.dtype), dw_GDF.astype(w_dtype.dtype), None


_ragged_fp8.defvjp(_ragged_fp8_fwd, _ragged_fp8_bwd)
