"""Flash-style attention in plain jnp: exact, with memory linear in the sequence length.

Keys and values are visited in blocks of C positions with an online softmax, and a custom VJP
saves only q, k, v, the output and the per-row log-sum-exp; the backward pass recomputes each
block's probabilities. No [T, S] score matrix ever exists, only [T, C] blocks, which is the memory
profile of fused attention kernels (cuDNN flash attention on GPU, Pallas kernels on TPU).

Why it exists: the dry run (`jaxtrain/dry_run.py`) compiles the train step for CPU, where those
kernels are unavailable; with `xla_attention` the CPU program would hold whole [B, H, T, S] score
tensors that the accelerator program never allocates (34 GB per layer for Llama 405B at T=8192).
It also runs anywhere, so it is tested against `attention.xla_attention` for values and grads.

Work is not skipped for causally masked blocks, so its FLOPs are those of full (non-causal)
attention. An optional sliding window W (causal only: query i sees key j iff
0 <= i + S - T - j < W) is only a mask too: each step scores one key block against all T
queries at once, and with S == T every key block is seen by some query (key j by query j).

Shapes: q_BTHE, k_BSKE, v_BSKE; H = K * G (grouped-query attention); C block length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain.ops.attention_tiles import tile_gradients
from kernels_pallas.flash_attention import check_window

DEFAULT_BLOCK = 128
_MASKED = jnp.finfo(jnp.float32).min  # as in xla_attention; finite, so max/exp never give NaN


def _blocks(x_BS, c: int, fill):
  """[B, S, ...] -> [N, B, C, ...], padded with `fill` to a multiple of C."""
  b, s = x_BS.shape[:2]
  pad = (-s) % c
  if pad:
    x_BS = jnp.pad(x_BS, [(0, 0), (0, pad)] + [(0, 0)] * (x_BS.ndim - 2), constant_values=fill)
  return x_BS.reshape(b, (s + pad) // c, c, *x_BS.shape[2:]).swapaxes(0, 1)


def _block_mask(q_seg_BT, k_seg_BC, k_pos_C, t: int, s: int, causal: bool, window):
  """Boolean [B, 1, 1, T, C]: same segment, key inside the sequence, causal and within the
  window (as xla_attention)."""
  q_pos_T = jnp.arange(t) + (s - t)  # queries are the last T of the S positions
  mask_TC = (k_pos_C[None, :] < s) & (k_pos_C[None, :] <= q_pos_T[:, None] if causal else True)
  if window is not None:
    mask_TC &= q_pos_T[:, None] - k_pos_C[None, :] < window
  mask_BTC = mask_TC[None] & (q_seg_BT[:, :, None] == k_seg_BC[:, None, :])
  return mask_BTC[:, None, None]


def _scores(q_BTKGE, k_BCKE, mask_B11TC, sm_scale):
  s_BKGTC = jnp.einsum("BTKGE,BCKE->BKGTC", q_BTKGE, k_BCKE,
                       preferred_element_type=jnp.float32) * sm_scale
  return jnp.where(mask_B11TC, s_BKGTC, _MASKED)


def _forward(q_BTHE, k_BSKE, v_BSKE, seg_BT, seg_BS, causal, sm_scale, block, window):
  b, t, h, e = q_BTHE.shape
  s, k = k_BSKE.shape[1], k_BSKE.shape[2]
  q_BTKGE = q_BTHE.reshape(b, t, k, h // k, e)
  xs = (_blocks(k_BSKE, block, 0), _blocks(v_BSKE, block, 0), _blocks(seg_BS, block, -1))

  # Under remat (or any linearization) JAX's scan partial evaluation would run the mask, which
  # depends only on integer inputs, in a separate loop and stack it for all blocks, [N, B, K, G,
  # T, C] booleans; a checkpointed step recomputes it with the block instead.
  @jax.checkpoint
  def step(carry, x):
    j, m_BKGT, l_BKGT, acc_BKGTE = carry
    k_BCKE, v_BCKE, kseg_BC = x
    kpos_C = j * block + jnp.arange(block)
    s_BKGTC = _scores(q_BTKGE, k_BCKE, _block_mask(seg_BT, kseg_BC, kpos_C, t, s, causal, window),
                      sm_scale)
    m_new = jnp.maximum(m_BKGT, s_BKGTC.max(-1))
    p_BKGTC = jnp.exp(s_BKGTC - m_new[..., None])
    correction = jnp.exp(m_BKGT - m_new)
    l_new = l_BKGT * correction + p_BKGTC.sum(-1)
    pv_BKGTE = jnp.einsum("BKGTC,BCKE->BKGTE", p_BKGTC.astype(v_BCKE.dtype), v_BCKE,
                          preferred_element_type=jnp.float32)
    return (j + 1, m_new, l_new, acc_BKGTE * correction[..., None] + pv_BKGTE), None

  g = h // k
  init = (jnp.zeros((), jnp.int32), jnp.full((b, k, g, t), _MASKED, jnp.float32),
          jnp.zeros((b, k, g, t), jnp.float32), jnp.zeros((b, k, g, t, e), jnp.float32))
  (_, m_BKGT, l_BKGT, acc_BKGTE), _ = jax.lax.scan(step, init, xs)
  out_BKGTE = acc_BKGTE / l_BKGT[..., None]
  out_BTHE = out_BKGTE.transpose(0, 3, 1, 2, 4).reshape(b, t, h, e).astype(q_BTHE.dtype)
  return out_BTHE, m_BKGT + jnp.log(l_BKGT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attention(q_BTHE, k_BSKE, v_BSKE, seg_BT, seg_BS, causal, sm_scale, block, window):
  return _forward(q_BTHE, k_BSKE, v_BSKE, seg_BT, seg_BS, causal, sm_scale, block, window)[0]


def _attention_fwd(q_BTHE, k_BSKE, v_BSKE, seg_BT, seg_BS, causal, sm_scale, block, window):
  out_BTHE, lse_BKGT = _forward(q_BTHE, k_BSKE, v_BSKE, seg_BT, seg_BS, causal, sm_scale, block,
                                window)
  return out_BTHE, (q_BTHE, k_BSKE, v_BSKE, seg_BT, seg_BS, out_BTHE, lse_BKGT)


def _attention_bwd(causal, sm_scale, block, window, residuals, dout_BTHE):
  q_BTHE, k_BSKE, v_BSKE, seg_BT, seg_BS, out_BTHE, lse_BKGT = residuals
  b, t, h, e = q_BTHE.shape
  s, k = k_BSKE.shape[1], k_BSKE.shape[2]
  g = h // k
  q_BTKGE = q_BTHE.reshape(b, t, k, g, e)
  dout_BTKGE = dout_BTHE.reshape(b, t, k, g, e)
  # D = rowsum(dO * O): the softmax backward's correction term, once per query row.
  d_BKGT = jnp.einsum("BTKGE,BTKGE->BKGT", dout_BTKGE.astype(jnp.float32),
                      out_BTHE.reshape(b, t, k, g, e).astype(jnp.float32))
  xs = (_blocks(k_BSKE, block, 0), _blocks(v_BSKE, block, 0), _blocks(seg_BS, block, -1))

  def step(carry, x):
    j, dq_BTKGE = carry
    k_BCKE, v_BCKE, kseg_BC = x
    kpos_C = j * block + jnp.arange(block)
    s_BKGTC = _scores(q_BTKGE, k_BCKE, _block_mask(seg_BT, kseg_BC, kpos_C, t, s, causal, window),
                      sm_scale)
    ddq_BTKGE, dk_BCKE, dv_BCKE = tile_gradients(s_BKGTC, lse_BKGT, d_BKGT, q_BTKGE, k_BCKE,
                                                  v_BCKE, dout_BTKGE, sm_scale)
    return (j + 1, dq_BTKGE + ddq_BTKGE), (dk_BCKE, dv_BCKE)

  (_, dq_BTKGE), (dk_NBCKE, dv_NBCKE) = jax.lax.scan(
      step, (jnp.zeros((), jnp.int32), jnp.zeros((b, t, k, g, e), jnp.float32)), xs)

  def unblock(x_NBCKE, like_BSKE):
    x_BSKE = x_NBCKE.swapaxes(0, 1).reshape(b, -1, k, e)[:, :s]
    return x_BSKE.astype(like_BSKE.dtype)

  return (dq_BTKGE.reshape(b, t, h, e).astype(q_BTHE.dtype), unblock(dk_NBCKE, k_BSKE),
          unblock(dv_NBCKE, v_BSKE), None, None)


# optimize_remat: under a remat policy the forward stays one opaque call, as a fused kernel is, so
# no policy (not even save_dots) saves its per-block scores; the backward re-runs it.
_attention.defvjp(_attention_fwd, _attention_bwd, optimize_remat=True)


def blockwise_attention(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT=None, *, causal=True,
                        sm_scale=None, block=DEFAULT_BLOCK, window=None):
  """Same result as `attention.xla_attention` (causal within segments, within the sliding
  `window` if given), in [T, block] pieces."""
  check_window(window, causal)
  window = None if window is None else int(window)  # a hashable static of the custom_vjp
  b, t, _, e = q_BTHE.shape
  s = k_BSKE.shape[1]
  if segment_ids_BT is None:
    seg_BT, seg_BS = jnp.zeros((b, t), jnp.int32), jnp.zeros((b, s), jnp.int32)
  else:
    seg_BT, seg_BS = segment_ids_BT[:, -t:], segment_ids_BT
  sm_scale = e ** -0.5 if sm_scale is None else float(sm_scale)
  return _attention(q_BTHE, k_BSKE, v_BSKE, seg_BT.astype(jnp.int32), seg_BS.astype(jnp.int32),
                    causal, sm_scale, min(block, s), window)
