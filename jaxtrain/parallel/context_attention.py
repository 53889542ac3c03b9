"""Attention over a sequence split across the `context` mesh axis.

Each device of the `context` axis holds T/C queries, keys and values (in the layout of
context_parallel: contiguous parts, or the load-balanced dual chunk swap). Two strategies:

- `all_gather`: each device gathers the keys and values of the whole sequence and attends its
  own queries over them. One collective per layer (its transpose, a reduce-scatter of dK/dV, in
  the backward pass); cheap under grouped-query attention, where K and V are H/K times smaller
  than Q. Memory: the whole sequence's K/V per device for the duration of the layer.
- `ring`: keys and values travel around the ring of `context` devices with `ppermute`; at each of
  the C steps a device attends its queries over the part it holds, with an online softmax, and
  passes it on. Memory: two parts of K/V per device; the transfers overlap with the tiles'
  compute. The backward pass (a custom VJP) sends dK/dV around with their keys and home at the
  end.

Both compute tiles of attention_tiles, which skip tiles above the causal diagonal; with the
load-balanced layout every device then does the same work. With `kernels` (GPU: our Pallas
flash-attention kernels, jaxtrain.parallel.context_kernels) they call a kernel per pair of chunks instead. Shapes: q_BTHE, k_BTKE, v_BTKE are
the global arrays (T the whole sequence); inside shard_map `_l` marks a device's local part.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.ops import attention_tiles as tiles
from jaxtrain.parallel import context_kernels as ck
from jaxtrain.parallel.context_parallel import STRATEGIES, context_size, global_positions
from jaxtrain.parallel.mesh import logical_to_spec

AXIS = "context"


def context_attention(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT=None, *, strategy: str = "all_gather",
                      balanced: bool = True, causal: bool = True, sm_scale=None,
                      tile: int = tiles.DEFAULT_TILE, kernel_platform: str | None = None,
                      interpret: bool = False, block_q=None, block_k=None):
  """Causal attention within segments, the sequence split over the current mesh's `context`
  axis (in the layout `balanced` names); the same result as attention.xla_attention applied to
  the sequence in its original order.

  `kernel_platform="gpu"` runs our Pallas kernels per chunk pair (`interpret`: in the Pallas
  interpreter, any backend; `block_q`/`block_k`: their blocks); None: the jnp tiles.
  """
  if strategy not in STRATEGIES:
    raise ValueError(f"attention.context_parallel={strategy!r}: choose one of "
                     f"{', '.join(STRATEGIES)}")
  mesh = jax.sharding.get_abstract_mesh()
  shards = context_size(mesh)
  b, t, _, e = q_BTHE.shape
  sm_scale = float(e ** -0.5 if sm_scale is None else sm_scale)
  if segment_ids_BT is None:
    segment_ids_BT = jnp.zeros((b, t), jnp.int32)
  positions_CL = global_positions(t, shards, balanced)
  local = t // shards
  tile = tiles.fit_tile(tile, local)
  kernels = None
  if kernel_platform is not None and causal:
    chunks_Cn = ck.chunk_table(shards, balanced)
    kernels = ck.kernels_for(e, local // chunks_Cn.shape[1], sm_scale, platform=kernel_platform,
                             interpret=interpret, block_q=block_q, block_k=block_k)
  if kernels is not None and strategy == "all_gather":
    fn = functools.partial(_all_gather_kernels_local, chunks_Cn=chunks_Cn, kernels=kernels)
  elif kernels is not None:
    fn = functools.partial(_ring_kernels_local, chunks_Cn=chunks_Cn, shards=shards,
                           kernels=kernels)
  elif strategy == "all_gather":
    fn = functools.partial(_all_gather_local, positions_CL=positions_CL, causal=causal,
                           sm_scale=sm_scale, tile=tile)
  else:
    fn = functools.partial(_ring_local, positions_CL=positions_CL, shards=shards, causal=causal,
                           sm_scale=sm_scale, tile=tile)
  q_spec = logical_to_spec(("act_batch", "act_length", "act_heads", None))
  kv_spec = logical_to_spec(("act_batch", "act_length", "act_kv_heads", None))
  seg_spec = logical_to_spec(("act_batch", "act_length"))
  return jax.shard_map(fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec),
                       out_specs=q_spec, check_vma=False)(
                           q_BTHE, k_BTKE, v_BTKE, segment_ids_BT.astype(jnp.int32))


def _my_positions(positions_CL: np.ndarray) -> jax.Array:
  """This device's row of the layout table: the original index of each local position."""
  return jnp.asarray(positions_CL)[jax.lax.axis_index(AXIS)]


def _all_gather_local(q_BLHE, k_BLKE, v_BLKE, seg_BL, *, positions_CL, causal, sm_scale, tile):
  gather = lambda x: jax.lax.all_gather(x, AXIS, axis=1, tiled=True)
  k_BTKE, v_BTKE, seg_BT = gather(k_BLKE), gather(v_BLKE), gather(seg_BL)
  kidx_T = jnp.asarray(positions_CL.reshape(-1))  # gathered in device order
  return tiles.tiled_attention(q_BLHE, k_BTKE, v_BTKE, seg_BL, seg_BT,
                               _my_positions(positions_CL), kidx_T, causal, sm_scale, tile, tile)


def _ring_local(q_BLHE, k_BLKE, v_BLKE, seg_BL, *, positions_CL, shards, causal, sm_scale, tile):
  return _ring(q_BLHE, k_BLKE, v_BLKE, seg_BL, jnp.asarray(positions_CL), shards, causal,
               sm_scale, tile)


def _send_on(xs, shards: int):
  """Every device passes `xs` to the next one on the ring (i -> i+1 mod C)."""
  return jax.lax.ppermute(xs, AXIS, [(i, (i + 1) % shards) for i in range(shards)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _ring(q_BLHE, k_BLKE, v_BLKE, seg_BL, positions_CL, shards, causal, sm_scale, tile):
  return _ring_fwd(q_BLHE, k_BLKE, v_BLKE, seg_BL, positions_CL, shards, causal, sm_scale,
                   tile)[0]


def _ring_fwd(q_BLHE, k_BLKE, v_BLKE, seg_BL, positions_CL, shards, causal, sm_scale, tile):
  me = jax.lax.axis_index(AXIS)
  qidx_L = positions_CL[me]
  stats = tiles.init_stats(q_BLHE, k_BLKE.shape[2], tile)
  k, v, kseg = k_BLKE, v_BLKE, seg_BL
  # Unrolled (C is small): XLA overlaps each step's transfer with the next step's compute.
  for step in range(shards):
    kidx_L = positions_CL[(me - step) % shards]  # whose part this device holds now
    stats = tiles.accumulate(stats, q_BLHE, k, v, seg_BL, kseg, qidx_L, kidx_L, causal=causal,
                             sm_scale=sm_scale, tile_q=tile, tile_k=tile)
    if step < shards - 1:
      k, v, kseg = _send_on((k, v, kseg), shards)
  out_BLHE, lse = tiles.finalize(stats, q_BLHE.dtype)
  return out_BLHE, (q_BLHE, k_BLKE, v_BLKE, seg_BL, positions_CL, out_BLHE, lse)


def _ring_bwd(shards, causal, sm_scale, tile, residuals, dout_BLHE):
  q_BLHE, k_BLKE, v_BLKE, seg_BL, positions_CL, out_BLHE, lse = residuals
  me = jax.lax.axis_index(AXIS)
  qidx_L = positions_CL[me]
  d = tiles.row_dot(out_BLHE, dout_BLHE, k_BLKE.shape[2], tile)
  dq = jnp.zeros(q_BLHE.shape, jnp.float32)
  dk = jnp.zeros(k_BLKE.shape, jnp.float32)
  dv = jnp.zeros(v_BLKE.shape, jnp.float32)
  k, v, kseg = k_BLKE, v_BLKE, seg_BL
  for step in range(shards):
    kidx_L = positions_CL[(me - step) % shards]
    dq_part, dk_part, dv_part = tiles.gradients(
        q_BLHE, k, v, seg_BL, kseg, qidx_L, kidx_L, dout_BLHE, lse, d, causal=causal,
        sm_scale=sm_scale, tile_q=tile, tile_k=tile)
    dq, dk, dv = dq + dq_part, dk + dk_part, dv + dv_part
    if step < shards - 1:
      # dK/dV of a part travel with it, collecting each device's share on the way.
      k, v, kseg, dk, dv = _send_on((k, v, kseg, dk, dv), shards)
  # After C-1 hops each device holds the gradients of the part owned by its successor: one more
  # hop takes them home.
  dk, dv = _send_on((dk, dv), shards)
  return (dq.astype(q_BLHE.dtype), dk.astype(k_BLKE.dtype), dv.astype(v_BLKE.dtype), None,
          None)


_ring.defvjp(_ring_fwd, _ring_bwd, optimize_remat=True)


# ----------------------------------------------------------------- Pallas kernels per chunk pair


def _all_gather_kernels_local(q_BLHE, k_BLKE, v_BLKE, seg_BL, *, chunks_Cn, kernels):
  gather = lambda x: jax.lax.all_gather(x, AXIS, axis=1, tiled=True)
  table = jnp.asarray(chunks_Cn)
  return _kernel_attention(q_BLHE, gather(k_BLKE), gather(v_BLKE), seg_BL, gather(seg_BL),
                           table[jax.lax.axis_index(AXIS)], table.reshape(-1), kernels)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _kernel_attention(q_BLHE, k_BSKE, v_BSKE, qseg_BL, kseg_BS, my_chunks, their_chunks, kernels):
  return _kernel_attention_fwd(q_BLHE, k_BSKE, v_BSKE, qseg_BL, kseg_BS, my_chunks, their_chunks,
                               kernels)[0]


def _kernel_attention_fwd(q_BLHE, k_BSKE, v_BSKE, qseg_BL, kseg_BS, my_chunks, their_chunks,
                          kernels):
  acc = ck.absorb(kernels, ck.empty(q_BLHE, my_chunks.shape[0]), q_BLHE, qseg_BL, my_chunks,
                  k_BSKE, v_BSKE, kseg_BS, their_chunks)
  out_BLHE, lses = ck.finish(acc, q_BLHE.dtype)
  return out_BLHE, (q_BLHE, k_BSKE, v_BSKE, qseg_BL, kseg_BS, my_chunks, their_chunks, out_BLHE,
                    lses)


def _kernel_attention_bwd(kernels, residuals, dout_BLHE):
  q_BLHE, k_BSKE, v_BSKE, qseg_BL, kseg_BS, my_chunks, their_chunks, out_BLHE, lses = residuals
  dq, dk, dv = ck.gradients(kernels, q_BLHE, qseg_BL, my_chunks, out_BLHE, lses, dout_BLHE,
                            k_BSKE, v_BSKE, kseg_BS, their_chunks)
  return (dq.astype(q_BLHE.dtype), dk.astype(k_BSKE.dtype), dv.astype(v_BSKE.dtype), None, None,
          None, None)


_kernel_attention.defvjp(_kernel_attention_fwd, _kernel_attention_bwd, optimize_remat=True)


def _ring_kernels_local(q_BLHE, k_BLKE, v_BLKE, seg_BL, *, chunks_Cn, shards, kernels):
  return _kernel_ring(q_BLHE, k_BLKE, v_BLKE, seg_BL, jnp.asarray(chunks_Cn), shards, kernels)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _kernel_ring(q_BLHE, k_BLKE, v_BLKE, seg_BL, table_Cn, shards, kernels):
  return _kernel_ring_fwd(q_BLHE, k_BLKE, v_BLKE, seg_BL, table_Cn, shards, kernels)[0]


def _kernel_ring_fwd(q_BLHE, k_BLKE, v_BLKE, seg_BL, table_Cn, shards, kernels):
  me = jax.lax.axis_index(AXIS)
  my_chunks = table_Cn[me]
  absorb = lambda step, acc, k, v, kseg: ck.absorb(
      kernels, acc, q_BLHE, seg_BL, my_chunks, k, v, kseg, table_Cn[(me - step) % shards])

  # A loop over the ring's steps (each absorbs the keys it holds, then passes them on), the
  # last one outside it as it passes nothing: two kernel call sites however many shards.
  def step_and_send(step, carry):
    acc, k, v, kseg = carry
    return (absorb(step, acc, k, v, kseg), *_send_on((k, v, kseg), shards))

  acc, k, v, kseg = jax.lax.fori_loop(0, shards - 1, step_and_send,
                                      (ck.empty(q_BLHE, table_Cn.shape[1]), k_BLKE, v_BLKE,
                                       seg_BL))
  out_BLHE, lses = ck.finish(absorb(shards - 1, acc, k, v, kseg), q_BLHE.dtype)
  return out_BLHE, (q_BLHE, k_BLKE, v_BLKE, seg_BL, table_Cn, out_BLHE, lses)


def _kernel_ring_bwd(shards, kernels, residuals, dout_BLHE):
  q_BLHE, k_BLKE, v_BLKE, seg_BL, table_Cn, out_BLHE, lses = residuals
  me = jax.lax.axis_index(AXIS)
  grads = lambda step, k, v, kseg: ck.gradients(kernels, q_BLHE, seg_BL, table_Cn[me], out_BLHE,
                                                lses, dout_BLHE, k, v, kseg,
                                                table_Cn[(me - step) % shards])

  def step_and_send(step, carry):  # the keys travel on with the gradients they have collected
    dq, k, v, kseg, dk, dv = carry
    dq_part, dk_part, dv_part = grads(step, k, v, kseg)
    return (dq + dq_part, *_send_on((k, v, kseg, dk + dk_part, dv + dv_part), shards))

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  dq, k, v, kseg, dk, dv = jax.lax.fori_loop(
      0, shards - 1, step_and_send,
      (zeros(q_BLHE), k_BLKE, v_BLKE, seg_BL, zeros(k_BLKE), zeros(v_BLKE)))
  dq_part, dk_part, dv_part = grads(shards - 1, k, v, kseg)
  dk, dv = _send_on((dk + dk_part, dv + dv_part), shards)  # home, as in _ring_bwd
  return ((dq + dq_part).astype(q_BLHE.dtype), dk.astype(k_BLKE.dtype), dv.astype(v_BLKE.dtype),
          None, None)


_kernel_ring.defvjp(_kernel_ring_fwd, _kernel_ring_bwd, optimize_remat=True)
