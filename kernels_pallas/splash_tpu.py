"""TPU route of `flash_attention`: jax's own splash attention kernel behind our signature.

Why not our kernel: Mosaic wants lane-dense (8 x 128) tiles for row statistics and segment ids,
which the Triton-shaped kernels do not use, and we have no TPU to validate a Mosaic port. Splash
attention is jax's hardware-tested TPU kernel (block-sparse forward, dq and dk/dv Pallas kernels
under its own custom_vjp), and it fits our contract without repeating K/V: its multi-query form
takes G query heads against one kv head, and we vmap it over batch and the K kv heads. Its dk/dv
kernel accumulates over the G query heads inside the kernel.

Adaptations:
- sm_scale: splash has no scale argument, so q is scaled beforehand (in float32, then cast back:
  for bf16 inputs the scaled q is rounded once more than in our GPU kernels).
- Layout: splash wants [heads, length, E], so q becomes [B, K, G, T, E] and k, v [B, K, S, E]:
  transposes through HBM that the GPU route does not pay.
- Causal: a static CausalMask with offset s - t (bottom-right aligned). Splash skips fully masked
  blocks from that static mask: neither loaded nor computed.
- Sliding window W: a LocalMask with window_size (W - 1, 0) and the same offset, which is causal
  and local in one mask (query i sees key j iff i + offset - (W - 1) <= j <= i + offset), so
  splash also skips the blocks behind every window. Padded query rows can then see no key at
  all; that is harmless: a q block holding a real row visits at least one kv block, where such
  rows average finite masked logits (splash's mask value is finite), and they are discarded.
- Padding T and S up to the block sizes. Causal without segments needs nothing more (padded keys
  lie past every real row's diagonal); otherwise segment ids cut padded keys off: real rows keep
  their ids, padded keys get an id no real row has (per batch row: max + 1, or min - 1 when max
  is the int32 maximum), padded query rows copy the row's last real id, so no row is entirely
  masked (splash's softmax would divide by zero there) and the discarded rows stay finite.

Untested here: only interpret mode (on CPU, numerics against the reference) and jax-level Mosaic
lowering of the forward, dq and dk/dv kernels ran; the Mosaic compiler, TPU execution,
performance and the block-size choices were never exercised on a TPU.
"""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask


@functools.lru_cache(maxsize=64)
def _mqa_kernel(t_pad: int, s_pad: int, groups: int, causal: bool, offset: int, block_q: int,
                block_k: int, interpret: bool, window: int | None = None):
  """Builds (once per static configuration) splash's multi-query kernel for one kv head."""
  if window is not None:
    # (left, right) = (W - 1, 0): the W - 1 keys before the diagonal and none after it.
    head_mask = splash_mask.LocalMask((t_pad, s_pad), window_size=(window - 1, 0), offset=offset)
  elif causal:
    head_mask = splash_mask.CausalMask((t_pad, s_pad), offset=offset)
  else:
    head_mask = splash_mask.FullMask((t_pad, s_pad))
  blocks = splash.BlockSizes(
      block_q=block_q, block_kv=block_k, block_kv_compute=block_k,
      block_q_dkv=block_q, block_kv_dkv=block_k, block_kv_dkv_compute=block_k,
      block_q_dq=block_q, block_kv_dq=block_k)
  # The kernel holds its block-sparsity tables as arrays; built under a jit trace they would be
  # tracers, and this cache would leak them into the next trace. Build them as concrete
  # constants in a fresh thread, whose JAX context has no trace and no mesh: the caller's mesh
  # may be a deviceless target's (a TPU topology compiled for from a CPU host), on which no
  # constant can be computed. They are computed on this process's own default device.
  def build():
    return splash.make_splash_mqa_single_device(
        splash_mask.MultiHeadMask([head_mask] * groups), block_sizes=blocks,
        interpret=interpret)

  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    return pool.submit(build).result()


def _padded_segment_ids(segment_ids_BT, t: int, s: int, t_pad: int, s_pad: int):
  """splash.SegmentIds ([B, T_pad], [B, S_pad]) hiding padded keys from every real query row."""
  ids_BT = segment_ids_BT.astype(jnp.int32)
  b = ids_BT.shape[0]
  hi_B, lo_B = ids_BT.max(axis=1), ids_BT.min(axis=1)
  unused_B = jnp.where(hi_B < jnp.iinfo(jnp.int32).max, hi_B + 1, lo_B - 1)
  qseg_BT = jnp.concatenate([ids_BT, jnp.broadcast_to(ids_BT[:, -1:], (b, t_pad - t))], axis=1)
  kseg_BS = jnp.concatenate([ids_BT, jnp.broadcast_to(unused_B[:, None], (b, s_pad - s))], axis=1)
  return splash.SegmentIds(q=qseg_BT, kv=kseg_BS)


def splash_attention(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT, *, causal: bool, sm_scale: float,
                     block_q: int, block_k: int, interpret: bool, window: int | None = None):
  """Attention through splash's MQA kernel, vmapped over batch and kv heads; [B, T, H, E].
  `window` (causal only): each query sees its `window` most recent keys, its own included."""
  b, t, h, e = q_BTHE.shape
  s, kh = k_BSKE.shape[1], k_BSKE.shape[2]
  g = h // kh
  t_pad, s_pad = -(-t // block_q) * block_q, -(-s // block_k) * block_k
  # Splash wants [heads, length, E] per call: q [B, K, G, T, E] and k/v [B, K, S, E].
  scaled_BTHE = (q_BTHE.astype(jnp.float32) * sm_scale).astype(q_BTHE.dtype)
  q_BKGTE = scaled_BTHE.reshape(b, t, kh, g, e).transpose(0, 2, 3, 1, 4)
  q_BKGTE = jnp.pad(q_BKGTE, ((0, 0), (0, 0), (0, 0), (0, t_pad - t), (0, 0)))
  k_BKSE, v_BKSE = (jnp.pad(x.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, s_pad - s), (0, 0)))
                    for x in (k_BSKE, v_BSKE))

  kernel = _mqa_kernel(t_pad, s_pad, g, causal, s - t, block_q, block_k, interpret, window)
  if segment_ids_BT is not None:
    ids, ids_axis = _padded_segment_ids(segment_ids_BT, t, s, t_pad, s_pad), 0
  elif s_pad != s and not causal:
    # One real segment (0) and padded keys (1); padded query rows stay 0 and see real keys.
    kv_ids_S = (jnp.arange(s_pad) >= s).astype(jnp.int32)
    ids, ids_axis = splash.SegmentIds(q=jnp.zeros((t_pad,), jnp.int32), kv=kv_ids_S), None
  else:
    # Causal without segments: real rows never reach padded keys (they lie past the diagonal).
    ids, ids_axis = None, None

  def one_kv_head(q_GTE, k_SE, v_SE, ids):
    return kernel(q_GTE, k_SE, v_SE, segment_ids=ids)

  per_batch = jax.vmap(one_kv_head, in_axes=(0, 0, 0, None))
  out_BKGTE = jax.vmap(per_batch, in_axes=(0, 0, 0, ids_axis))(q_BKGTE, k_BKSE, v_BKSE, ids)
  out_BTHE = out_BKGTE[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, h, e)
  return out_BTHE.astype(q_BTHE.dtype)
